"""``save_pretrained`` replaces only what distckpt wrote (issue #28).

A Hugging Face folder is shared with the user (``tokenizer.json``, ``README.md``, a ``config.json``
they wrote, sub-folders): a publish writes its shard files, index and record
(``.distckpt-publish.json``, naming the files it wrote) and, with ``overwrite=True``, replaces
only the files its previous publish recorded. A file it did not write is replaced only when
named in ``replace=``. Same rules on a local disk, ``memory://`` and S3 (the moto server of
``tests/conftest.py``). Single process, except the crash cases (a rank killed half-way).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from torch import nn

import distckpt
from distckpt.tools import hf
from distckpt.tools.safetensors_io import INDEX_NAME

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")
SHARD = 3000  # bytes: the model below publishes as 3 shard files
RECORD = ".distckpt-publish.json"
USER_FILES = {"tokenizer.json": b'{"version": "1.0"}', "README.md": b"# my model\n", "notes/train.log": b"step 1 loss 2.3\n"}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def _loads_exactly(url: str, model: nn.Module, opts: dict | None = None) -> bool:
    fresh = _model(99)
    hf.load_pretrained(fresh, url, storage_options=opts)
    return all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


class Folder:
    """A publish target on one kind of storage, read and written behind distckpt's back (fsspec)."""

    def __init__(self, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.opts: dict = {}
        self.kind = kind
        if kind == "local":
            self.fs, self.base = fsspec.filesystem("file"), str(tmp_path / "pub")
            self.url = self.base
        elif kind == "memory":
            self.fs, self.base = fsspec.filesystem("memory"), f"/own-{uuid.uuid4().hex[:8]}/pub"
            self.url = f"memory://{self.base}"
        else:
            server = request.getfixturevalue("s3_server")
            self.opts = server.storage_options
            self.fs = fsspec.filesystem("s3", **self.opts)
            self.base = f"{request.getfixturevalue('s3_bucket')}/pub"
            self.url = f"s3://{self.base}"

    def write(self, name: str, data: bytes) -> None:
        if self.kind == "local":
            os.makedirs(os.path.dirname(f"{self.base}/{name}"), exist_ok=True)
        self.fs.pipe_file(f"{self.base}/{name}", data)

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(f"{self.base}/{name}")

    def files(self) -> set[str]:
        """Every file under the folder (sub-folders included), relative names."""
        self.fs.invalidate_cache()
        prefix = self.fs._strip_protocol(self.base).rstrip("/") + "/"
        return {p[len(prefix):] for p in self.fs.find(self.base)}

    def publish(self, model: nn.Module, **kw) -> dict:
        return hf.save_pretrained(model, self.url, storage_options=self.opts or None, **kw)


@pytest.fixture(params=["local", "memory", "s3"])
def folder(request, tmp_path) -> Folder:
    return Folder(request.param, tmp_path, request)


class _Config:
    """What ``config=`` takes: an object with ``to_json_string()`` (a transformers config)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def to_json_string(self) -> str:
        return self.text


def test_overwrite_replaces_only_what_distckpt_wrote(folder):
    m0, m1, m2 = _model(0), _model(1), _model(2)
    folder.publish(m0, max_shard_size=SHARD)
    for name, data in USER_FILES.items():  # the user adds files beside the weights
        folder.write(name, data)
    folder.write("config.json", b'{"written_by": "the user"}')

    folder.publish(m1, max_shard_size=SHARD, overwrite=True)
    for name, data in {**USER_FILES, "config.json": b'{"written_by": "the user"}'}.items():
        assert folder.read(name) == data, f"{name} was changed or deleted by an overwrite"
    assert _loads_exactly(folder.url, m1, folder.opts)

    # The user's config.json is not distckpt's to replace: refused, naming it, until named.
    with pytest.raises(FileExistsError, match=r"config\.json.*replace="):
        folder.publish(m2, max_shard_size=SHARD, overwrite=True, config=_Config('{"written_by": "distckpt"}'))
    assert folder.read("config.json") == b'{"written_by": "the user"}'
    assert _loads_exactly(folder.url, m1, folder.opts), "a refused publish changed nothing"
    folder.publish(m2, max_shard_size="1MB", overwrite=True, config=_Config('{"written_by": "distckpt"}'), replace=["config.json"])
    assert folder.read("config.json") == b'{"written_by": "distckpt"}'
    assert _loads_exactly(folder.url, m2, folder.opts)
    for name, data in USER_FILES.items():
        assert folder.read(name) == data
    # Exactly the new publish beside the user's files: the 3 shards of the earlier ones are gone.
    assert folder.files() == set(USER_FILES) | {"config.json", "model.safetensors", INDEX_NAME, RECORD}


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_folder_that_never_held_a_checkpoint_is_not_emptied(kind, tmp_path, request):
    folder = Folder(kind, tmp_path, request)
    for name, data in USER_FILES.items():
        folder.write(name, data)
    model = _model(0)
    folder.publish(model, max_shard_size=SHARD, overwrite=True)
    for name, data in USER_FILES.items():
        assert folder.read(name) == data, f"{name} was deleted by a publish into a folder without a checkpoint"
    assert _loads_exactly(folder.url, model, folder.opts)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name], "no temporary directory left"


def test_second_and_third_publish_leave_exactly_the_latest(folder):
    for name, data in USER_FILES.items():
        folder.write(name, data)
    models = [_model(i) for i in range(3)]
    expected_files = []
    for i, (model, size) in enumerate(zip(models, [SHARD, "1MB", 6400])):
        summary = folder.publish(model, max_shard_size=size, overwrite=i > 0)
        expected_files.append(set(summary["files"]))
        assert folder.files() == set(USER_FILES) | set(summary["files"]) | {INDEX_NAME, RECORD}, f"publish {i + 1}"
        assert _loads_exactly(folder.url, model, folder.opts), f"publish {i + 1}"
        record = json.loads(folder.read(RECORD))
        assert sorted(f["name"] for f in record["files"]) == sorted(set(summary["files"]) | {INDEX_NAME}) and record["complete"] is True
    assert [len(f) for f in expected_files] == [3, 1, 2]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        folder.publish(models[0])  # without overwrite: distckpt's own checkpoint is not replaced either


def _foreign_checkpoint(folder: Folder, model: nn.Module) -> None:
    """A checkpoint distckpt did not write: a single file, as transformers writes small models."""
    from safetensors.torch import save

    folder.write("model.safetensors", save({k: v.contiguous() for k, v in model.state_dict().items()}))
    folder.write("config.json", b'{"model_type": "user"}')


def test_weights_distckpt_did_not_write_are_replaced_only_when_named(folder):
    old, new = _model(0), _model(1)
    _foreign_checkpoint(folder, old)
    for name, data in USER_FILES.items():
        folder.write(name, data)
    for kw in ({}, {"overwrite": True}, {"overwrite": True, "replace": ["model.safetensor"]}, {"replace": "*.bin"}):
        with pytest.raises(FileExistsError, match=r"model\.safetensors.*replace="):
            folder.publish(new, max_shard_size=SHARD, **kw)  # a typo names nothing that is there
    # Paths are not file names of the folder; a bare string is one name, not its letters.
    for bad, error in ((["../model.safetensors"], ValueError), (["sub/x"], ValueError), ([""], ValueError),
                       ([5], TypeError), (5, TypeError)):  # fmt: skip
        with pytest.raises(error, match="replace"):
            folder.publish(new, max_shard_size=SHARD, replace=bad)
    assert _loads_exactly(folder.url, old, folder.opts), "refused publishes changed nothing"
    folder.publish(new, max_shard_size=SHARD, replace="model.safetensors")
    # Sharded now: the replaced single file is gone (it would make the folder ambiguous), the
    # user's config.json (not written by this publish, which got no config) and files are kept.
    assert folder.files() == set(USER_FILES) | {"config.json", INDEX_NAME, RECORD} | {
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    }
    assert folder.read("config.json") == b'{"model_type": "user"}'
    assert _loads_exactly(folder.url, new, folder.opts)


# an attacker's (or a careless user's) record ---------------------------------------------------------
def _record(files: list, **kw) -> bytes:
    return json.dumps({"format": "distckpt-hf-publish", "version": 1, "complete": True, "files": files, **kw}).encode()


def _entries(folder: Path) -> list:
    return json.loads((folder / RECORD).read_bytes())["files"]


RECORD_CASES = {
    # What the record claims -> the outcome of an overwrite (an error class, or "ok").
    "parent path": (lambda d, out: (d / RECORD).write_bytes(_record([{"name": "../outside.safetensors", "size": 4}])), distckpt.UnsafeCheckpointError),
    "absolute path": (lambda d, out: (d / RECORD).write_bytes(_record([{"name": str(out / "outside.safetensors"), "size": 4}])), distckpt.UnsafeCheckpointError),
    "a user file": (lambda d, out: (d / RECORD).write_bytes(_record(_entries(d) + [{"name": "tokenizer.json", "size": 18}])), distckpt.IntegrityError),
    "a sub-folder": (lambda d, out: (d / RECORD).write_bytes(_record(_entries(d) + [{"name": "notes", "size": 0}])), distckpt.IntegrityError),
    "not JSON": (lambda d, out: (d / RECORD).write_bytes(b"\x00\xff{garbage"), distckpt.IntegrityError),
    "cut short": (lambda d, out: (d / RECORD).write_bytes((d / RECORD).read_bytes()[:25]), distckpt.IntegrityError),
    "wrong types": (lambda d, out: (d / RECORD).write_bytes(_record([{"name": 5, "size": "x"}])), distckpt.IntegrityError),
    "stamp not text": (lambda d, out: (d / RECORD).write_bytes(_record([{**e, "stamp": 7} for e in _entries(d)])), distckpt.IntegrityError),
    "stamp too long": (lambda d, out: (d / RECORD).write_bytes(_record([{**e, "stamp": "x" * 201} for e in _entries(d)])), distckpt.IntegrityError),
    "another format": (lambda d, out: (d / RECORD).write_bytes(json.dumps({"format": "x", "files": []}).encode()), distckpt.IntegrityError),
    "a symbolic link": (lambda d, out: ((out / "crafted.json").write_bytes(_record([{"name": "../outside.safetensors", "size": 4}])),
                                        (d / RECORD).unlink(), os.symlink(out / "crafted.json", d / RECORD)), distckpt.UnsafeCheckpointError),
    "a directory": (lambda d, out: ((d / RECORD).unlink(), (d / RECORD).mkdir()), distckpt.UnsafeCheckpointError),
    # A shard the record names, replaced by a link out of the folder: not distckpt's file any
    # more (the link is never followed): refused as a file it did not write.
    "shard became a link": (lambda d, out: ((d / "model-00002-of-00003.safetensors").unlink(),
                                            os.symlink(out / "outside.safetensors", d / "model-00002-of-00003.safetensors")), FileExistsError),
    # The user rewrote a file distckpt once wrote: it is theirs now (the record's size is stale).
    "user rewrote config": (lambda d, out: (d / "config.json").write_bytes(b'{"edited": "by the user", "more": 1}'), "ok"),
    "record deleted": (lambda d, out: (d / RECORD).unlink(), FileExistsError),
    "shard deleted": (lambda d, out: (d / "model-00001-of-00003.safetensors").unlink(), "ok"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(RECORD_CASES))
def test_a_crafted_or_broken_record_never_touches_other_files(case, tmp_path):
    d, outside = tmp_path / "pub", tmp_path / "outside"
    outside.mkdir()
    (outside / "outside.safetensors").write_bytes(b"keep")
    hf.save_pretrained(_model(0), str(d), max_shard_size=SHARD, config=_Config('{"a": 1}'))
    for name, data in USER_FILES.items():
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_bytes(data)
    mutate, outcome = RECORD_CASES[case]
    mutate(d, outside)
    before = {p: p.read_bytes() for p in [*d.rglob("*"), *outside.rglob("*")] if p.is_file() and not p.is_symlink()}
    keep = {p: data for p, data in before.items() if p.parent == outside or p.name in ("tokenizer.json", "README.md", "train.log")}
    if case == "user rewrote config":
        keep[d / "config.json"] = (d / "config.json").read_bytes()
    new = _model(1)
    if outcome == "ok":
        hf.save_pretrained(new, str(d), max_shard_size="1MB", overwrite=True)
        assert _loads_exactly(str(d), new)
    else:
        with pytest.raises(outcome, match=RECORD if outcome is not FileExistsError else "replace="):
            hf.save_pretrained(new, str(d), max_shard_size="1MB", overwrite=True)
    for p, data in keep.items():
        assert p.is_file() and p.read_bytes() == data, f"{p} was changed or deleted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "pub"], "no temporary directory left"


# a crash half-way -----------------------------------------------------------------------------------
def _publish_and_die(rank: int, world: int, url: str, opts: dict | None, point: str) -> None:
    """Publish, and kill this process at ``point``: after the 2nd shard file was written, or
    just before the index (the commit) is written."""
    from distckpt.storage.base import Storage

    classes = {type(Storage(url, opts))}
    if point == "shards":
        for cls in classes:
            original = cls.open

            def open_(self, rel, mode="rb", _original=original):
                if "w" in mode and rel.startswith("model-00003"):
                    os._exit(9)
                return _original(self, rel, mode)

            cls.open = open_
    else:
        for cls in classes:
            original = cls.write_bytes

            def write_bytes(self, data, *parts, _original=original, **kw):
                if parts and parts[-1] == INDEX_NAME:
                    os._exit(9)
                return _original(self, data, *parts, **kw)

            cls.write_bytes = write_bytes
    hf.save_pretrained(_model(1), url, storage_options=opts, max_shard_size=SHARD, overwrite=True)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_publish_killed_half_way_is_replaced_by_the_next(kind, tmp_path, request):
    from dist_harness import run_ranks

    folder = Folder(kind, tmp_path, request)
    for name, data in USER_FILES.items():
        folder.write(name, data)
    folder.publish(_model(0), max_shard_size="1MB")  # one file: the killed publishes write 3
    for point in ("shards", "index"):
        run_ranks(_publish_and_die, 1, tmp_path, folder.url, folder.opts or None, point, expect_dead=frozenset({0}))
        for name, data in USER_FILES.items():
            assert folder.read(name) == data
        with pytest.raises(FileExistsError, match="overwrite=True"):
            folder.publish(_model(2), max_shard_size=6400)
    final = _model(2)
    summary = folder.publish(final, max_shard_size=6400, overwrite=True)
    assert len(summary["files"]) == 2
    # The killed publishes' shards were recorded before they were written: all replaced.
    assert folder.files() == set(USER_FILES) | set(summary["files"]) | {INDEX_NAME, RECORD}
    assert _loads_exactly(folder.url, final, folder.opts)
    # Locally, the killed publish's partial staging directory beside the folder (pub.tmp-...)
    # is removed by the next publish: it stayed for good (found by a helper, 2026-12-07).
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_users_file_put_where_a_killed_publish_left_its_claim_is_theirs(kind, tmp_path, request):
    """A killed publish's record (``complete: false``) claimed its files by name whatever their
    size: the user's own ``model.safetensors``, put there after the crash, was replaced by the
    next ``overwrite=True`` without ``replace=``. Local folders and object stores never hold a
    cut-short file (renames, atomic uploads): the size must match there. Found by a helper."""
    from dist_harness import run_ranks

    folder = Folder(kind, tmp_path, request)
    folder.publish(_model(0), max_shard_size="1MB")  # model.safetensors
    run_ranks(_publish_and_die, 1, tmp_path, folder.url, folder.opts or None, "index", expect_dead=frozenset({0}))
    own = b"the user's own weights, downloaded again" * 10
    folder.write("model.safetensors", own)
    with pytest.raises(FileExistsError, match="model.safetensors was not written by distckpt"):
        folder.publish(_model(2), overwrite=True)
    assert folder.read("model.safetensors") == own
    folder.publish(_model(2), overwrite=True, replace=["model.safetensors"])  # named: replaced
    assert folder.read("model.safetensors") != own


def test_a_folder_reached_through_a_link_stays_a_link(tmp_path):
    real, link = tmp_path / "data" / "pub", tmp_path / "pub"
    real.mkdir(parents=True)
    os.symlink(real, link)
    models = [_model(0), _model(1)]
    hf.save_pretrained(models[0], str(link), max_shard_size=SHARD)  # an empty folder behind a link
    (real / "README.md").write_bytes(b"# mine\n")
    hf.save_pretrained(models[1], str(link), max_shard_size="1MB", overwrite=True)
    assert link.is_symlink() and (real / "README.md").read_bytes() == b"# mine\n"
    assert sorted(p.name for p in real.iterdir()) == sorted(["README.md", "model.safetensors", INDEX_NAME, RECORD])
    assert _loads_exactly(str(link), models[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "pub"] and os.listdir(tmp_path / "data") == ["pub"]


def _publish_from_two_ranks(rank: int, world: int, out: str) -> str:
    hf.save_pretrained(_model(0), out, max_shard_size=SHARD)  # 3 shard files over 2 writer ranks
    hf.save_pretrained(_model(1), out, max_shard_size=6400, overwrite=True)
    try:  # the user's config.json: refused alike on every rank
        hf.save_pretrained(_model(2), out, overwrite=True, config=_Config("{}"))
    except FileExistsError as exc:
        return str(exc).split("\n")[0]
    return "published"


def test_two_ranks_publish_into_a_folder_they_share_with_the_user(tmp_path):
    from dist_harness import run_ranks

    out = tmp_path / "pub"
    for name, data in {**USER_FILES, "config.json": b"{}"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    outcomes = run_ranks(_publish_from_two_ranks, 2, tmp_path, str(out))
    assert outcomes[0] == outcomes[1] and "config.json" in outcomes[0] and "replace=" in outcomes[0], outcomes
    assert {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} == set(USER_FILES) | {
        "config.json", INDEX_NAME, RECORD, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    }
    for name, data in {**USER_FILES, "config.json": b"{}"}.items():
        assert (out / name).read_bytes() == data
    assert _loads_exactly(str(out), _model(1))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "no temporary directory left"


def test_config_takes_a_dict_and_names_anything_else(tmp_path):
    """``config={...}`` (a config read with ``json.load``) failed with a bare ``AttributeError``
    ('dict' object has no attribute 'to_json_string'). Found by a helper (2026-12-07)."""
    out = tmp_path / "hf"
    hf.save_pretrained(_model(0), str(out), config={"model_type": "llama", "hidden_size": 8})
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama", "hidden_size": 8}
    deep: dict = {}
    for _ in range(5000):
        deep = {"x": deep}
    for bad, match in (
        ("llama", "takes a transformers config .* got str"),
        ({"x": float("nan")}, "JSON values only"),
        ({0: "NEG", "x": "POS"}, "keys of one type"),  # (review: a bare "'<' not supported")
        (deep, "nested too deeply"),  # (review: a bare RecursionError)
    ):
        with pytest.raises(TypeError, match=match):
            hf.save_pretrained(_model(0), str(tmp_path / "other"), config=bad)
        assert not (tmp_path / "other").exists()


def test_a_shard_the_user_rewrote_at_the_same_size_is_theirs(folder):
    """The record kept only the size of a shard: the user's own weights of the same model
    written over ``model-00001-...`` (same size) were replaced by ``overwrite=True``, though the
    README says a file the record names that you rewrote is yours again. Each shard's version
    stamp (inode and mtime; an object's ETag) is recorded now. Found by a helper (2026-12-07)."""
    folder.publish(_model(0), max_shard_size=SHARD)
    shard = sorted(n for n in folder.files() if n.startswith("model-00001-of-"))[0]
    data = bytearray(folder.read(shard))
    data[-1] ^= 0xFF  # the user's weights: same header, same size, other values
    folder.write(shard, bytes(data))
    with pytest.raises(FileExistsError, match=f"{shard} was not written by distckpt.*replace="):
        folder.publish(_model(1), max_shard_size=SHARD, overwrite=True)
    assert folder.read(shard) == bytes(data)
    folder.publish(_model(1), max_shard_size=SHARD, overwrite=True, replace=[shard])
    assert _loads_exactly(folder.url, _model(1), folder.opts)
    # distckpt's own publish, untouched, is still replaced with overwrite=True.
    folder.publish(_model(2), max_shard_size=SHARD, overwrite=True)
    assert _loads_exactly(folder.url, _model(2), folder.opts)


def test_only_staging_directories_of_dead_processes_of_this_host_are_removed(tmp_path):
    """A publish removes the staging directories a killed publish of this folder left beside it;
    never those of a live process (a publish in progress), of another host (a pid means nothing
    there) or of another folder, nor anything else."""
    import subprocess
    import sys

    from distckpt.storage import local

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    tag = local._host_tag()
    names = {
        f"pub.tmp-{tag}-{dead.stdout.strip()}-0123abcd": False,  # removed
        f"pub.tmp-{tag}-{os.getppid()}-0123abcd": True,  # live
        f"pub.tmp-{'0' * 8 if tag != '0' * 8 else '1' * 8}-{dead.stdout.strip()}-0123abcd": True,  # another host
        f"other.tmp-{tag}-{dead.stdout.strip()}-0123abcd": True,  # another folder
        "pub.tmp-0123abcd": True,  # an older distckpt's (no owner in the name)
        f"pub.tmp-{tag}-{dead.stdout.strip()}-notmine!": True,
        f"pub.tmp-{tag}-{'9' * 20}-0123abcd": True,  # no such pid (it crashed every publish: review)
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model-00001-of-00003.safetensors").write_bytes(b"x")
    hf.save_pretrained(_model(0), str(tmp_path / "pub"), max_shard_size=SHARD)
    assert {n for n in names if (tmp_path / n).exists()} == {n for n, kept in names.items() if kept}
    assert _loads_exactly(str(tmp_path / "pub"), _model(0))


def test_files_appearing_in_a_new_folder_during_the_publish_are_named_and_kept(tmp_path, monkeypatch):
    """The folder did not exist when the publish began; another process wrote a tokenizer there
    while the shards were written. The publish said "exists and is not empty (pass
    overwrite=True)", with overwrite=True given. It names what appeared now, keeps it, and
    leaves nothing of its own. Found by a helper (2026-12-07)."""
    out = tmp_path / "hf"
    real = hf._write_shards

    def and_a_tokenizer(*args, **kwargs):
        digests = real(*args, **kwargs)
        out.mkdir(exist_ok=True)
        (out / "tokenizer.json").write_text("the user's tokenizer")
        return digests

    monkeypatch.setattr(hf, "_write_shards", and_a_tokenizer)
    with pytest.raises(FileExistsError, match=r"files appeared there while this publish was written \(tokenizer\.json\).*publish again"):
        hf.save_pretrained(_model(0), str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    # A folder alone is named too (the message listed nothing: review).
    other = tmp_path / "hf2"

    def and_a_folder(*args, **kwargs):
        digests = real(*args, **kwargs)
        (other / "tokenizer").mkdir(parents=True)
        return digests

    monkeypatch.setattr(hf, "_write_shards", and_a_folder)
    with pytest.raises(FileExistsError, match=r"written \(tokenizer/\)"):
        hf.save_pretrained(_model(0), str(other), overwrite=True)
    assert [p.name for p in other.iterdir()] == ["tokenizer"]
    monkeypatch.undo()
    hf.save_pretrained(_model(0), str(out))  # the next one publishes beside it
    assert (out / "tokenizer.json").read_text() == "the user's tokenizer" and _loads_exactly(str(out), _model(0))


def test_distckpts_publish_copied_or_touched_is_still_distckpts(folder):
    """Review (2026-12-07): with version stamps alone, distckpt's own publish copied to another
    folder (cp -a, rsync, a server-side copy; an S3 copy changes a multipart ETag), moved to
    another filesystem or touched counted as the user's, and ``overwrite=True`` refused it. A
    shard whose stamp changed is read and compared with the CRC-32C the record holds."""
    folder.publish(_model(0), max_shard_size=SHARD)
    src = folder.base
    dst = f"{src}-copy"
    folder.fs.invalidate_cache()
    if folder.kind == "local":
        os.makedirs(dst)
    for name in sorted(folder.files()):
        folder.fs.copy(f"{src}/{name}", f"{dst}/{name}")
    if folder.kind == "local":
        for name in os.listdir(src):
            os.utime(f"{src}/{name}")  # touched, same bytes
    folder.base, folder.url = dst, folder.url.replace(src, dst)
    folder.publish(_model(1), max_shard_size=SHARD, overwrite=True)  # the copy: refused before
    assert _loads_exactly(folder.url, _model(1), folder.opts)
    folder.base, folder.url = src, folder.url.replace(dst, src)
    folder.publish(_model(2), max_shard_size=SHARD, overwrite=True)  # touched: refused before
    assert _loads_exactly(folder.url, _model(2), folder.opts)
