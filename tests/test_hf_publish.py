"""Publishing Hugging Face checkpoints is atomic: a publish that fails part-way (here: the N-th
shard file cannot be created) leaves the previous checkpoint (local) or nothing loadable (object
stores, where the index is the commit), never a mix of new and old shards and no temporary
directory. Single process; the S3 cases run against the local moto server."""

from __future__ import annotations

import contextlib
import errno
import os

import pytest
import torch
from torch import nn

import distckpt
from distckpt.tools import hf, hf_convert, hf_publish

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")
SHARD = 3000  # bytes: the model below publishes as 3 shard files


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@contextlib.contextmanager
def _failing_put(monkeypatch, cls: type, n: int):
    """``cls.open`` refuses the ``n``-th file opened for writing (counted as the publish goes)."""
    original = cls.open
    puts = []

    @contextlib.contextmanager
    def open_(self, rel, mode="rb"):
        if "w" in mode:
            puts.append(rel)
            if len(puts) == n:
                raise OSError(errno.EIO, "injected failure", rel)
        with original(self, rel, mode) as f:
            yield f

    monkeypatch.setattr(cls, "open", open_)
    try:
        yield puts
    finally:
        monkeypatch.setattr(cls, "open", original)


def test_failed_local_publish_keeps_the_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    from distckpt.storage.local import LocalStorage

    out = tmp_path / "pub"
    old, new = _model(0), _model(1)
    assert len(hf.save_pretrained(old, str(out), max_shard_size=SHARD)["files"]) == 3
    with _failing_put(monkeypatch, LocalStorage, 2) as puts, pytest.raises((OSError, distckpt.CheckpointError)):
        hf.save_pretrained(new, str(out), max_shard_size=SHARD, overwrite=True)
    assert len(puts) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pub"], "no temporary or backup directory left"
    fresh = _model(5)
    hf.load_pretrained(fresh, str(out))
    assert _equal(fresh, old), "the previous checkpoint is intact"
    # A first publish that fails leaves nothing at all.
    with _failing_put(monkeypatch, LocalStorage, 3), pytest.raises((OSError, distckpt.CheckpointError)):
        hf.save_pretrained(new, str(tmp_path / "first"), max_shard_size=SHARD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pub"]


def test_failed_s3_overwrite_leaves_no_mix_of_shards(s3_server, s3_bucket, monkeypatch):
    import fsspec

    from distckpt.storage.objectstore import FsspecStorage

    opts = s3_server.storage_options
    url = f"s3://{s3_bucket}/pub"
    fs = fsspec.filesystem("s3", **opts)
    old, new = _model(0), _model(1)
    hf.save_pretrained(old, url, storage_options=opts, max_shard_size=SHARD)
    with _failing_put(monkeypatch, FsspecStorage, 2) as puts, pytest.raises((OSError, distckpt.CheckpointError)):
        hf.save_pretrained(new, url, storage_options=opts, max_shard_size=SHARD, overwrite=True)
    assert len(puts) == 2
    fs.invalidate_cache()
    left = [p.rsplit("/", 1)[1] for p in fs.glob(f"{s3_bucket}/pub/*") if p.endswith(".safetensors")]
    assert left == [], f"the failed publish left shard files behind: {left}"
    fresh = _model(5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises((distckpt.IntegrityError, FileNotFoundError)):
        hf.load_pretrained(fresh, url, storage_options=opts)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    # A later overwrite with fewer files commits and removes the old checkpoint's stale shards.
    hf.save_pretrained(new, url, storage_options=opts, max_shard_size="1MB", overwrite=True)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.glob(f"{s3_bucket}/pub/*")) == [
        hf_publish.RECORD_NAME, "model.safetensors", "model.safetensors.index.json"
    ]
    hf.load_pretrained(fresh, url, storage_options=opts)
    assert _equal(fresh, new)


def test_shards_without_their_index_are_refused(tmp_path):
    from distckpt.tools.safetensors_io import INDEX_NAME

    model = _model(0)
    hf.save_pretrained(model, str(tmp_path / "sharded"), max_shard_size=SHARD)
    (tmp_path / "sharded" / INDEX_NAME).unlink()
    with pytest.raises(distckpt.IntegrityError, match=f"3 safetensors files .*no {INDEX_NAME}"):
        hf.load_pretrained(_model(5), str(tmp_path / "sharded"))
    # A single file needs no index (what transformers writes for small models).
    hf.save_pretrained(model, str(tmp_path / "single"))
    (tmp_path / "single" / INDEX_NAME).unlink()
    fresh = _model(5)
    hf.load_pretrained(fresh, str(tmp_path / "single"))
    assert _equal(fresh, model)


# offline export (``distckpt convert CKPT --to hf``) ------------------------------------------------
def _mixed_sizes(seed: int) -> nn.Module:
    # Tensors of very different sizes: DCP stores them largest first, not in key order.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(64, 64), nn.Linear(8, 8), nn.Linear(32, 48), nn.Linear(48, 2))


def test_export_hf_reads_each_data_file_once_in_disk_order(tmp_path, monkeypatch):
    from distckpt.integrity import stepfiles as _stepfiles
    from distckpt.tools.catalog import locate
    from distckpt.integrity.manifest import MANIFEST_NAME, step_dir

    model = _mixed_sizes(0)
    distckpt.Checkpointer(tmp_path / "ck", save_rng=False).save(1, {"model": model, "epoch": 3})
    d = tmp_path / "ck" / step_dir(1)
    sizes = {p.name: p.stat().st_size for p in d.iterdir() if p.name != MANIFEST_NAME}
    File = _stepfiles.VerifiedFile
    passes: dict[str, int] = {}
    extra: list[str] = []
    real_consumed = File._consumed

    def consumed(self, view, start):  # every byte the pass reads goes by here
        name = self.rel.rsplit("/", 1)[-1]
        passes[name] = passes.get(name, 0) + len(view)
        return real_consumed(self, view, start)

    monkeypatch.setattr(File, "_consumed", consumed)
    monkeypatch.setattr(File, "_read_aside", lambda self, *a: extra.append(self.rel) or pytest.fail("read aside"))
    monkeypatch.setattr(File, "_second_pass", lambda self: extra.append(self.rel) or pytest.fail("second pass"))
    summary = hf_convert.export_hf(locate(str(d)), str(tmp_path / "hf"), max_shard_size=8000)
    # Every file read whole, once, in one front-to-back pass, whatever order the keys have.
    assert passes == sizes and not extra, (passes, sizes, extra)
    assert len(summary["files"]) > 1
    monkeypatch.undo()
    fresh = _mixed_sizes(5)
    hf.load_pretrained(fresh, str(tmp_path / "hf"))
    assert _equal(fresh, model)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_export_hf_of_a_damaged_checkpoint_publishes_nothing(tmp_path, where):
    """A checkpoint whose data fails its checksum is refused before the export commits, and the
    shards already written are removed (locally the temporary directory, in place on object
    stores, where a single shard would otherwise load without its index)."""
    import fsspec

    from distckpt.tools.catalog import locate
    from distckpt.integrity.manifest import step_dir

    model = _mixed_sizes(1)
    distckpt.Checkpointer(tmp_path / "ck", save_rng=False).save(1, {"model": model, "epoch": 3})
    d = tmp_path / "ck" / step_dir(1)
    data = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40  # the last bytes: past every tensor the export reads first
    data.write_bytes(bytes(raw))
    out = str(tmp_path / "hf") if where == "local" else f"memory://{tmp_path.name}-hf/out"
    for shard in (8000, "1GB"):  # several shard files, and one (which needs no index)
        with pytest.raises(distckpt.IntegrityError):
            hf_convert.export_hf(locate(str(d)), out, max_shard_size=shard)
        if where == "local":
            assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], "no output or temporary directory left"
        else:
            fs = fsspec.filesystem("memory")
            assert not fs.exists(out) or fs.ls(out) == [], fs.ls(out)


def _memory_at_two(rank: int, world_size: int, base: str, local: str) -> list[str]:
    got = []
    model = nn.Linear(4, 4)
    for what, call in (
        ("save", lambda: distckpt.Checkpointer(f"memory://{base}/ck").save(1, {"m": model})),
        ("load", lambda: distckpt.Checkpointer(f"memory://{base}/ck").load({"m": model})),
        ("replica", lambda: distckpt.Checkpointer(local, replicate_to=f"memory://{base}/r").save(1, {"m": model})),
        ("save_pretrained", lambda: distckpt.save_pretrained(model, f"memory://{base}/hf")),
        ("chain", lambda: distckpt.Checkpointer(f"simplecache::memory://{base}/c").save(1, {"m": model})),
    ):
        try:
            call()
            got.append(f"{what}: done")
        except ValueError as exc:
            got.append(f"{what}: {exc}")
    return got


def test_memory_locations_are_refused_for_several_ranks(tmp_path):
    """memory:// lives in one process: at 2 ranks a save, a publish or a replica there reported
    success on every rank while the coordinator committed a manifest or index naming files only
    the other process held (README lists memory:// for one process)."""
    from dist_harness import run_ranks

    got = run_ranks(_memory_at_two, 2, tmp_path, f"mem-{tmp_path.name}", str(tmp_path / "root"))
    for rank in got:
        assert len(rank) == 5 and all("lives in this process's memory (memory://)" in g and "1 rank(s)" in g for g in rank), got
    assert [g.split(":")[0] for g in got[0]] == ["save", "load", "replica", "save_pretrained", "chain"]


@pytest.mark.parametrize("config", [{"eps": 2e-5}, None])
def test_a_publish_cut_short_never_shows_new_weights_beside_the_old_config(tmp_path, monkeypatch, config):
    """A lone model.safetensors needs no index: from its rename into the folder it is what
    transformers and load_pretrained read, and the config this publish replaced (or removes) was
    changed only after it. Cut short there, the folder held the new weights and the old config,
    looking whole."""
    import json

    out = tmp_path / "hf"
    distckpt.save_pretrained(_mixed_sizes(1), str(out), config={"eps": 1e-5})
    real = hf_publish.os.replace

    def cut_short(a, b):
        real(a, b)
        if str(b).endswith(".safetensors"):
            raise KeyboardInterrupt  # (the process dies right after the new weights are in)

    monkeypatch.setattr(hf_publish.os, "replace", cut_short)
    with pytest.raises(KeyboardInterrupt):
        distckpt.save_pretrained(_mixed_sizes(2), str(out), config=config, overwrite=True)
    monkeypatch.setattr(hf_publish.os, "replace", real)
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "model.safetensors.index.json" not in names, names
    assert "config.json" not in names, json.loads((out / "config.json").read_text())  # not the old one
    m = _mixed_sizes(0)
    distckpt.load_pretrained(m, str(out))
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), _mixed_sizes(2).state_dict().values()))
    # The next publish finishes the folder.
    distckpt.save_pretrained(_mixed_sizes(3), str(out), config={"eps": 3e-5}, overwrite=True)
    assert json.loads((out / "config.json").read_text()) == {"eps": 3e-5}


def test_a_failed_publish_in_place_keeps_your_config_it_was_allowed_to_replace(tmp_path, monkeypatch):
    """Where shards are written in place (object stores, memory://), a config.json of yours that
    replace= allows was removed before the shards were written: a publish failing there left
    the folder without it and with nothing in its place (README: "your files kept")."""
    import fsspec

    fs = fsspec.filesystem("memory")
    out = f"memory://{tmp_path.name}-cfg/pub"
    mine = b'{"model_type": "mine"}'
    fs.pipe(out + "/config.json", mine)

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_publish.DigestingFile, "write", full)
    with pytest.raises(OSError, match="No space left"):
        hf.save_pretrained(nn.Linear(6, 4), out, config={"model_type": "new"}, replace=["config.json"])
    assert fs.cat(out + "/config.json") == mine


def _drifted_publish(rank: int, world_size: int, out: str, policy: str) -> dict:
    import warnings

    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with torch.no_grad():  # what unsynced buffers (FSDP2) or DDP(broadcast_buffers=False) leave
        model[0].bias.fill_(float(rank))
        model[1].running_mean.fill_(float(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            distckpt.save_pretrained(model, f"{out}/{policy}", max_shard_size="100B", on_replica_drift=policy)
        except distckpt.ReplicaDriftError as exc:
            return {"error": str(exc), "written": sorted(os.listdir(out)) if os.path.isdir(out) else []}
    files = sorted(f for f in os.listdir(f"{out}/{policy}") if f.endswith(".safetensors"))
    values = {k: v.tolist() for f in files for k, v in load_file(f"{out}/{policy}/{f}").items()}
    return {"warnings": [str(w.message) for w in caught if "drifted" in str(w.message)], "values": values}


@pytest.mark.timeout(200)
def test_drifted_replicas_are_named_at_publish(tmp_path):
    """Copies of a plain parameter or buffer that differ between ranks were published without a
    word, each file holding its writer rank's copy (ranks mixed across one checkpoint), where
    Checkpointer.save names them."""
    import os

    from dist_harness import run_ranks

    out = str(tmp_path / "hf")
    for policy in ("warn", "ignore", "error"):
        got = run_ranks(_drifted_publish, 3, tmp_path, out, policy)
        if policy == "warn":
            for rank in got:
                assert len(rank["warnings"]) == 1, rank
                message = rank["warnings"][0]
                assert "0.bias (ranks [0] vs [1] vs [2])" in message and "1.running_mean (ranks [0] vs [1] vs [2])" in message, message
                assert "0.weight" not in message and "each file holds its writer rank's copy" in message
        elif policy == "ignore":
            assert all(rank["warnings"] == [] for rank in got), got
        else:
            for rank in got:
                assert "0.bias (ranks [0] vs [1] vs [2])" in rank["error"], rank
            assert not os.path.exists(f"{out}/error"), "refused before anything is written"


def test_on_replica_drift_is_checked(tmp_path):
    with pytest.raises(ValueError, match="on_replica_drift must be one of"):
        distckpt.save_pretrained(nn.Linear(2, 2), str(tmp_path / "hf"), on_replica_drift="warm")


def test_a_cast_beyond_the_dtypes_range_is_named_at_publish(tmp_path):
    """save_pretrained(dtype=torch.float16) of a weight of 1e6 wrote inf without a word, where
    the export (convert --to hf --dtype fp16) and load_pretrained name it."""
    from safetensors.torch import load_file

    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(1e6)
        model.bias.fill_(1.0)
    with pytest.warns(UserWarning, match=r"save_pretrained to .*: 1 tensor\(s\) hold values beyond the range of torch.float16.*: weight$") as seen:
        summary = distckpt.save_pretrained(model, str(tmp_path / "hf"), dtype=torch.float16)
    assert seen[0].filename == __file__, seen[0].filename  # (the caller's line, not contextlib's)
    assert summary["beyond_range"] == ["weight"]
    assert torch.isinf(load_file(str(tmp_path / "hf" / "model.safetensors"))["weight"]).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cast within range warns nothing
        assert distckpt.save_pretrained(model, str(tmp_path / "hf32"), dtype=torch.float32)["beyond_range"] == []


def test_a_model_on_the_meta_device_is_refused_by_key(tmp_path):
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"cannot publish tensors on the meta device .*'weight', 'bias'.*to_empty"):
        distckpt.save_pretrained(model, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def _bad_policy_on_one_rank(rank: int, world_size: int, out: str) -> str:
    try:
        distckpt.save_pretrained(nn.Linear(2, 2), out, on_replica_drift="warm" if rank == 0 else "warn")
    except ValueError as exc:
        return str(exc)
    return "published"


@pytest.mark.timeout(200)
def test_a_bad_on_replica_drift_on_one_rank_fails_every_rank(tmp_path):
    """Checked before the exchange, a bad value on one rank raised there while the others waited
    in the exchange until the group's timeout. Found by a reviewer (2026-12-07)."""
    from dist_harness import run_ranks

    got = run_ranks(_bad_policy_on_one_rank, 2, tmp_path, str(tmp_path / "hf"), pg_timeout=60)
    assert all("on_replica_drift must be one of" in g for g in got), got
