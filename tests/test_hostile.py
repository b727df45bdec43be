"""Hostile and careless input: a checkpoint root that is tampered with or symlinked never loses data,
never escapes the root, and always gives a named error."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import distckpt
import forge
from cli_runner import run_cli as _cli
from distckpt.integrity.manifest import MANIFEST_NAME, step_dir

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))


def _save(root: Path, step: int, seed: int, **kw) -> nn.Module:
    model = _model(seed)
    distckpt.Checkpointer(root, **kw).save(step, {"model": model})
    return model




# symlinks -----------------------------------------------------------------------------------------
def test_retention_and_cleanup_never_follow_symlinks_out_of_the_root(tmp_path):
    other, root = tmp_path / "other", tmp_path / "root"
    _save(other, 1, 0)
    (other / step_dir(7)).mkdir()  # another run's directory without a manifest
    root.mkdir()
    os.symlink(other / step_dir(1), root / step_dir(1))  # a committed step of another run
    os.symlink(other / step_dir(7), root / step_dir(5))  # an "incomplete" one
    ckpt = distckpt.Checkpointer(root, keep_last=1)
    with pytest.warns(UserWarning, match="symbolic link"):
        for step in (2, 3, 4):
            ckpt.save(step, {"model": _model(step)})
        assert ckpt.steps() == [4]
    assert (other / step_dir(1) / MANIFEST_NAME).exists(), "retention deleted outside the root"
    assert (other / step_dir(7)).is_dir(), "cleanup deleted outside the root"
    assert os.path.islink(root / step_dir(1)) and os.path.islink(root / step_dir(5))


def test_loads_refuse_symlinked_files_and_step_directories(tmp_path):
    foreign = _save(tmp_path / "foreign", 1, 0)
    root = tmp_path / "root"
    _save(root, 1, 1, checksum=None)
    _save(root, 2, 2, checksum=None)
    d = root / step_dir(1)
    for name in os.listdir(d):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(d / name)
            os.symlink(tmp_path / "foreign" / step_dir(1) / name, d / name)
    ckpt = distckpt.Checkpointer(root)
    with pytest.raises(distckpt.UnsafeCheckpointError, match=r"symbolic link"):
        ckpt.load({"model": _model(5)}, step=1)
    done = _cli("verify", str(d))
    assert done.returncode != 0 and "symbolic link" in done.stderr and "OK" not in done.stdout
    for cmd in (["inspect", str(d)], ["convert", str(d), "--to", "safetensors", str(tmp_path / "x.safetensors")]):
        done = _cli(*cmd)
        assert done.returncode == 1 and "symbolic link" in done.stderr, (cmd, done.stderr)
    # the step directory itself a link to another run's committed step
    shutil.rmtree(root / step_dir(2))
    os.symlink(tmp_path / "foreign" / step_dir(1), root / step_dir(2))
    with pytest.raises(distckpt.UnsafeCheckpointError, match=r"symbolic link"):
        ckpt.load({"model": _model(5)}, step=2)
    assert foreign is not None


@pytest.mark.timeout(120)
def test_a_named_pipe_in_a_step_is_refused_not_waited_on(tmp_path):
    """A FIFO named like a checkpoint file (planted, or left by a tool) blocked open() until a
    writer came: load, convert and inspect hung for ever. Every read opens without blocking and
    refuses what is not a regular file, by name."""
    root = tmp_path / "root"
    _save(root, 1, 1)
    d = root / step_dir(1)
    data = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]
    os.remove(d / data)
    os.mkfifo(d / data)
    with pytest.raises(distckpt.UnsafeCheckpointError, match=rf"{data} is not a regular file"):
        distckpt.Checkpointer(root).load({"model": _model(5)}, step=1)
    done = _cli("convert", str(d), "--to", "safetensors", str(tmp_path / "x.safetensors"))
    assert done.returncode == 1 and "is not a regular file" in done.stderr, done.stderr
    os.remove(d / ".metadata")
    os.mkfifo(d / ".metadata")
    done = _cli("inspect", str(d))
    assert done.returncode == 1 and ".metadata is not a regular file" in done.stderr, done.stderr


def test_an_export_never_replaces_a_link_a_pipe_or_a_device_at_its_output(tmp_path):
    """Exports are written beside their output and renamed into place: over a symbolic link the
    link itself was replaced (the user's latest.pt -> real_model.pt became a plain file, the
    target untouched), over a named pipe or a device the entry too (/dev/null, as root, became a
    regular file). Such outputs are refused by name; nothing is written."""
    root = tmp_path / "root"
    _save(root, 1, 1)
    (tmp_path / "real_model.pt").write_bytes(b"the user's model")
    os.symlink("real_model.pt", tmp_path / "latest.pt")
    os.mkfifo(tmp_path / "pipe")
    for out, what in (("latest.pt", "is a symbolic link"), ("pipe", "is not a regular file")):
        for to in ("torch", "safetensors"):
            done = _cli("convert", str(root), "--to", to, str(tmp_path / out))
            assert done.returncode == 1 and f"{out} {what}" in done.stderr and "refusing to replace it" in done.stderr, (out, to, done.stderr)
    assert os.path.islink(tmp_path / "latest.pt") and (tmp_path / "real_model.pt").read_bytes() == b"the user's model"
    assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)
    assert sorted(os.listdir(tmp_path)) == ["latest.pt", "pipe", "real_model.pt", "root"]


# manifest -----------------------------------------------------------------------------------------
def test_manifest_is_bound_to_its_directory(tmp_path):
    _save(tmp_path, 1, 1)
    _save(tmp_path, 2, 2)
    shutil.copy(tmp_path / step_dir(1) / MANIFEST_NAME, tmp_path / step_dir(2) / MANIFEST_NAME)
    with pytest.raises(distckpt.IntegrityError, match=r"step_000000002.*'step' is 1"):
        distckpt.Checkpointer(tmp_path).load({"model": _model(0)}, step=2)


@pytest.mark.parametrize(
    "field,value",
    [("files", []), ("step", "1"), ("world_size", 0), ("entries", [1]), ("created_unix", "yesterday"),
     ("checksum_algorithm", "md5"), ("extra", 3)],
)  # fmt: skip
def test_wrong_typed_manifest_fields_are_named(tmp_path, field, value):
    _save(tmp_path, 1, 1)
    _save(tmp_path, 2, 2)
    path = tmp_path / step_dir(2) / MANIFEST_NAME
    raw = json.loads(path.read_text())
    raw[field] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(distckpt.IntegrityError, match=rf"manifest.json.*{field}"):
        distckpt.Checkpointer(tmp_path).load({"model": _model(0)}, step=2)
    done = _cli("ls", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["step"]: r for r in json.loads(done.stdout)["steps"]}
    assert rows[1]["status"] == "committed" and rows[2]["status"] == "bad manifest" and field in rows[2]["error"]


def test_deeply_nested_manifest_is_an_integrity_error(tmp_path):
    _save(tmp_path, 1, 1)
    path = tmp_path / step_dir(1) / MANIFEST_NAME
    path.write_text('{"extra": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(distckpt.IntegrityError, match="manifest.json"):
        distckpt.Checkpointer(tmp_path).load({"model": _model(0)})


# .metadata ----------------------------------------------------------------------------------------
def _reseal(step_path: Path, metadata) -> None:
    """Rewrite .metadata and its size/checksum in the manifest, as an attacker would."""
    forge.reseal(step_path, ".metadata", pickle.dumps(metadata))


@pytest.mark.parametrize("fault", ["outside", "gap", "overlap"])
def test_chunks_must_cover_each_tensor_exactly_once(tmp_path, fault):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    _save(tmp_path, 1, 1)
    d = tmp_path / step_dir(1)
    md = pickle.loads((d / ".metadata").read_bytes())
    key = "model.0.weight"
    tmd = md.state_dict_metadata[key]
    (chunk,) = tmd.chunks
    if fault == "outside":  # an offset moved outside the tensor
        moved = ChunkStorageMetadata(torch.Size([100, 0]), chunk.sizes)
        md.storage_data[MetadataIndex(key, moved.offsets)] = md.storage_data.pop(MetadataIndex(key, chunk.offsets))
        tmd.chunks = [moved]
    elif fault == "gap":  # a larger tensor declared than the chunks cover
        tmd.size = torch.Size([16, 6])
    else:
        tmd.chunks = [chunk, ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 6]))]
        tmd.size = torch.Size([12, 6])
        md.storage_data[MetadataIndex(key, torch.Size([4, 0]))] = md.storage_data[MetadataIndex(key, chunk.offsets)]
    _reseal(d, md)
    with pytest.raises(distckpt.IntegrityError, match=key):
        distckpt.Checkpointer(tmp_path).load({"model": _model(0)})
    for cmd in (["verify", str(d)], ["convert", str(d), "--to", "torch", str(tmp_path / "o.pt")]):
        done = _cli(*cmd)
        assert done.returncode == 1 and key in done.stderr, (cmd, done.stderr)
    assert not (tmp_path / "o.pt").exists()


def test_dcp_metadata_pickled_by_python_3_11_2_loads(tmp_path):
    """CPython 3.11.0-3.11.2 pickle enum members as getattr(cls, name); later versions as cls(value)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from distckpt.integrity.safe_pickle import load_metadata

    _save(tmp_path, 1, 1)
    md = pickle.loads((tmp_path / step_dir(1) / ".metadata").read_bytes())

    class GetattrForm(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, _MEM_FORMAT_ENCODING):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    for protocol in (2, 4, 5):
        buf = io.BytesIO()
        GetattrForm(buf, protocol=protocol).dump(md)
        assert b"getattr" in buf.getvalue()
        loaded = load_metadata(buf.getvalue(), "test")
        assert loaded.state_dict_metadata.keys() == md.state_dict_metadata.keys()
        loaded = load_metadata(pickle.dumps(md, protocol=protocol), "test")  # the value form
        assert loaded.state_dict_metadata.keys() == md.state_dict_metadata.keys()

    # getattr on anything else (another class, or a non-member attribute) is refused
    for owner, name in ((torch.Size, "__reduce__"), (_MEM_FORMAT_ENCODING, "__class__"), (_MEM_FORMAT_ENCODING, "_missing_")):

        class Evil(pickle.Pickler):
            def reducer_override(self, obj):
                if isinstance(obj, _MEM_FORMAT_ENCODING):
                    return getattr, (owner, name)
                return NotImplemented

        buf = io.BytesIO()
        Evil(buf, protocol=2).dump(md)
        with pytest.raises(distckpt.UnsafeCheckpointError, match="getattr"):
            load_metadata(buf.getvalue(), "test")


def test_weights_only_refusal_is_an_unsafe_checkpoint_error(tmp_path):
    """A tensor record whose pickle needs arbitrary globals is refused, naming the key."""
    _save(tmp_path, 1, 1, checksum=None)
    d = tmp_path / step_dir(1)
    md = pickle.loads((d / ".metadata").read_bytes())
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = md.storage_data[MetadataIndex("model.1.bias", torch.Size([0]))]
    data = bytearray((d / info.relative_path).read_bytes())
    record = io.BytesIO()
    torch.save(torch.nn.Linear(1, 1), record)  # needs torch.nn classes: refused by weights_only
    blob = record.getvalue()
    new = bytes(data[: info.offset]) + blob + bytes(data[info.offset + info.length :])
    (d / info.relative_path).write_bytes(new)
    delta = len(blob) - info.length
    for i in md.storage_data.values():
        if i.relative_path == info.relative_path and i.offset > info.offset:
            i.offset += delta
    info.length = len(blob)
    _reseal(d, md)
    raw = json.loads((d / MANIFEST_NAME).read_text())
    raw["files"][info.relative_path]["size"] = len(new)
    (d / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(distckpt.UnsafeCheckpointError, match="model.1.bias"):
        distckpt.Checkpointer(tmp_path).load({"model": _model(0)})


def test_verify_says_when_there_is_nothing_to_verify(tmp_path):
    _save(tmp_path, 1, 1, checksum=None)
    d = str(tmp_path / step_dir(1))
    done = _cli("verify", d)
    assert done.returncode == 1 and "UNVERIFIED" in done.stderr and "OK" not in done.stdout
    done = _cli("verify", d, "--allow-unverified")
    assert done.returncode == 0 and "WARNING" in done.stderr and "unverified" in done.stderr and "OK" not in done.stdout
    raw = json.loads((tmp_path / step_dir(1) / MANIFEST_NAME).read_text())
    _save(tmp_path, 2, 2)
    raw2 = json.loads((tmp_path / step_dir(2) / MANIFEST_NAME).read_text())
    del raw2["files"][".metadata"]
    (tmp_path / step_dir(2) / MANIFEST_NAME).write_text(json.dumps(raw2))
    done = _cli("verify", str(tmp_path / step_dir(2)))
    assert done.returncode == 1 and ".metadata is not listed" in done.stderr
    assert raw["checksum_algorithm"] is None


# convert reads through the same checks as load -------------------------------------------------
@pytest.mark.parametrize("to", ["torch", "safetensors", "hf"])
def test_convert_refuses_a_flipped_byte_and_leaves_no_output(tmp_path, to):
    _save(tmp_path, 1, 1)
    d = tmp_path / step_dir(1)
    victim = sorted(d.glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    out = tmp_path / ("out" if to == "hf" else f"out.{to}")
    done = _cli("convert", str(d), "--to", to, str(out))
    assert done.returncode == 1, done.stderr
    assert victim.name in done.stderr and "corrupted" in done.stderr, done.stderr
    assert not out.exists() and not list(tmp_path.glob("out*")), list(tmp_path.iterdir())


_FAILING_EXPORT = r"""
import sys, torch, distckpt
from distckpt.integrity import shards
from distckpt.tools import convert
from distckpt.tools.catalog import locate
found = locate(sys.argv[1])
real = shards.CheckpointSource.read_tensor
calls = []
def failing(self, key, dtype=None):
    calls.append(key)
    if len(calls) == 2:  # the first tensor is written, then a read fails mid-file
        raise OSError(5, "Input/output error", key)
    return real(self, key, dtype)
shards.CheckpointSource.read_tensor = failing
try:
    convert.export_torch(found, sys.argv[2])
except OSError as exc:
    print("raised", exc.errno)
held = exc if "exc" in dir() else None  # a caught error kept alive, as user code does
"""


def test_export_torch_read_failure_raises_without_aborting_the_interpreter(tmp_path):
    """PyTorchFileWriter finishes its zip in its destructor; after a failed read that used to
    write to a closed file inside C++ and kill the process with SIGABRT."""
    _save(tmp_path, 1, 1)
    out = tmp_path / "o.pt"
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _FAILING_EXPORT, str(tmp_path / step_dir(1)), str(out)],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
        assert done.returncode == 0 and "raised 5" in done.stdout, (done.returncode, done.stderr)
        assert not out.exists() and not list(tmp_path.glob("o.pt*"))


# a full disk --------------------------------------------------------------------------------------
def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if sys.platform != "linux" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True).returncode == 0


def _file_size_limit(limit: int):
    """A child process whose writes fail past ``limit`` bytes per file (EFBIG), as on a full disk."""

    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with an error instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return apply


_SAVE_BIG = r"""
import sys, torch, distckpt
torch.manual_seed(0)
ck = distckpt.Checkpointer(sys.argv[1], thread_count=3)
try:
    ck.save(1, {"model": torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])})
except distckpt.CheckpointError as exc:
    print("ERROR", exc)
"""


@pytest.mark.parametrize("full", ["file-size-limit", "tmpfs"])
def test_a_full_disk_names_the_cause_and_path_and_leaves_nothing(tmp_path, full):
    """torch.save turned ENOSPC into "enforce fail ... unexpected pos", DCP's writer threads
    printed "Exception in thread" tracebacks, the CLI kept a first line without the cause, and
    convert --to torch aborted the interpreter."""
    src = tmp_path / "src"
    _save(src, 1, 1)
    if full == "tmpfs":
        disk = tmp_path / "disk"
        if not _mount_tmpfs(disk, "64k"):
            pytest.skip("cannot mount a small tmpfs here (needs root); the file-size-limit case covers it")
        expected, preexec = "No space left on device", None
        (disk / "filler").write_bytes(b"\0" * 40_000)
    else:
        disk = tmp_path / "disk"
        disk.mkdir()
        expected, preexec = "File too large", _file_size_limit(4096)
    # The checkpoint is bigger than what fits.
    big = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    distckpt.Checkpointer(src, keep_last=None).save(2, {"model": big})
    torch.save(big.state_dict(), tmp_path / "m.pt")
    try:
        runs = {
            "save": [sys.executable, "-c", _SAVE_BIG, str(disk / "root")],
            "export torch": [sys.executable, "-m", "distckpt", "convert", str(src), "--to", "torch", str(disk / "o.pt")],
            "export safetensors": [sys.executable, "-m", "distckpt", "convert", str(src), "--to", "safetensors", str(disk / "o.st")],
            "export hf": [sys.executable, "-m", "distckpt", "convert", str(src), "--to", "hf", str(disk / "hf")],
            "import": [sys.executable, "-m", "distckpt", "convert", str(tmp_path / "m.pt"), "--to", "dcp", str(disk / "imp")],
        }
        if full == "tmpfs":  # the same paths as above; two suffice to show the real errno
            runs = {k: runs[k] for k in ("save", "export torch")}
        for what, cmd in runs.items():
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, preexec_fn=preexec)
            out = done.stdout + done.stderr
            assert done.returncode in (0, 1), (what, done.returncode, out)  # never a signal
            assert expected in out and str(disk) in out, (what, out)
            assert "Exception in thread" not in out and "Traceback" not in out, (what, out)
            left = [p for p in disk.rglob("*") if p.is_file() and p.name != "filler"]
            assert not left, (what, left)  # a failed save or export leaves no data behind
    finally:
        if full == "tmpfs":
            subprocess.run(["umount", str(disk)], capture_output=True)


# async saves behave like sync saves ---------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:.*quantize:UserWarning")
@pytest.mark.parametrize("blocking", [True, False])
def test_unusual_tensors_save_or_fail_the_same_sync_and_async(tmp_path, blocking):
    """Async staging used to fail with raw copy errors (a torch INTERNAL ASSERT for quantized)."""
    refused = {
        "sparse": (torch.eye(3).to_sparse(), "sparse_coo tensors are not supported"),
        "meta": (torch.empty(3, device="meta"), "meta tensor"),
        # DCP failed on it in a writer thread: "torch.iinfo() requires an integer input", no key
        "bits": (torch.zeros(2, dtype=torch.uint8).view(torch.bits8), "cannot write torch.bits8"),
    }
    ckpt = distckpt.Checkpointer(tmp_path / "refused")
    for name, (value, why) in refused.items():
        with pytest.raises(TypeError, match=f"'{name}'.*{why}"):
            ckpt.save(1, {"model": _model(0), name: value}, blocking=blocking)
        ckpt.wait()
        assert ckpt.steps() == []
    q = torch.quantize_per_tensor(torch.arange(6.0) / 10, 0.1, 3, torch.quint8)
    ckpt = distckpt.Checkpointer(tmp_path / "quantized")
    for step in (1, 2):  # the second save reuses the stager
        ckpt.save(step, {"q": q}, blocking=blocking)
        ckpt.wait()
    out = {"q": torch.quantize_per_tensor(torch.zeros(6), 0.1, 3, torch.quint8)}
    ckpt.load(out)
    assert torch.equal(out["q"].int_repr(), q.int_repr()) and out["q"].q_zero_point() == 3
    # Into a tensor quantized otherwise (a fresh one's scale): its integers under that scale
    # were other values, silently ([0.6, 0.3] came back as [4.5, 3.0]). Found by a helper (2026-12-06).
    for other in (torch.quantize_per_tensor(torch.zeros(6), 0.5, 0, torch.quint8),
                  torch.quantize_per_channel(torch.zeros(6), torch.ones(6), torch.zeros(6, dtype=torch.long), 0, torch.quint8)):  # fmt: skip
        with pytest.raises(distckpt.CheckpointError, match=r"'q' was saved quantized as .*0\.1, 3\).* cannot change its quantization"):
            ckpt.load({"q": other})
    ckpt.close()


def test_resealed_metadata_pointing_one_tensor_at_anothers_bytes_is_caught_everywhere(tmp_path):
    """Two tensors of one shape with their storage entries swapped and .metadata re-sealed: sizes,
    checksums and coverage are all fine, only the fingerprints recorded at save can tell."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    distckpt.Checkpointer(tmp_path).save(1, {"model": model})
    d = tmp_path / step_dir(1)
    md = pickle.loads((d / ".metadata").read_bytes())
    a, b = MetadataIndex("model.0.weight", torch.Size([0, 0])), MetadataIndex("model.1.weight", torch.Size([0, 0]))
    md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]
    _reseal(d, md)
    with pytest.raises(distckpt.StateDivergedError, match="model.0.weight, model.1.weight"):
        distckpt.Checkpointer(tmp_path, verify_state=True).load({"model": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))})
    for to in ("torch", "safetensors", "hf"):
        out = tmp_path / f"out-{to}"
        done = _cli("convert", str(d), "--to", to, str(out))
        assert done.returncode == 1 and "fingerprint" in done.stderr and "model.0.weight" in done.stderr, (to, done.stderr)
        assert not out.exists()


@pytest.mark.parametrize("elements", [2**40, 2**26])
def test_an_oversized_consistent_declaration_is_refused_before_anything_is_allocated(tmp_path, elements):
    """A tensor and its one chunk both declared larger (consistent, so coverage holds), re-sealed:
    the stored item cannot hold that many bytes, which is an IntegrityError before any reader
    allocates the declared shape (2^40 elements used to reach the allocator; 2^26 allocated
    256 MiB first)."""
    model = _save(tmp_path, 1, 1)
    d = tmp_path / step_dir(1)
    md = pickle.loads((d / ".metadata").read_bytes())
    key = "model.1.bias"
    tmd = md.state_dict_metadata[key]
    tmd.size = torch.Size([elements])
    tmd.chunks[0].sizes = torch.Size([elements])
    _reseal(d, md)
    from distckpt.tools.catalog import locate
    from distckpt.tools.convert import export_safetensors, export_torch

    calls = {
        "load": lambda: distckpt.Checkpointer(tmp_path).load({"model": model}),
        "torch": lambda: export_torch(locate(str(d)), str(tmp_path / "o.pt")),
        "safetensors": lambda: export_safetensors(locate(str(d)), str(tmp_path / "o.st")),
    }
    for name, call in calls.items():
        with pytest.raises(distckpt.IntegrityError, match=f"{key}.*stored item holds only") as info:
            call()
        assert ".metadata" in str(info.value), name
    done = _cli("verify", "--state", str(d))
    assert done.returncode == 1 and key in done.stderr and "stored item" in done.stderr, done.stderr
    assert not list(tmp_path.glob("o.*"))


def test_two_stored_items_sharing_bytes_are_refused(tmp_path):
    """One tensor's storage entry pointed at another's bytes (re-sealed): DCP writes every item
    once, so items that overlap in a file are an IntegrityError before anything is read."""
    import copy

    from torch.distributed.checkpoint.metadata import MetadataIndex

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    distckpt.Checkpointer(tmp_path).save(1, {"model": model})
    d = tmp_path / step_dir(1)
    md = pickle.loads((d / ".metadata").read_bytes())
    a, b = MetadataIndex("model.0.weight", torch.Size([0, 0])), MetadataIndex("model.1.weight", torch.Size([0, 0]))
    md.storage_data[b] = copy.copy(md.storage_data[a])
    _reseal(d, md)
    with pytest.raises(distckpt.IntegrityError, match="share bytes"):
        distckpt.Checkpointer(tmp_path).load({"model": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))})
    done = _cli("convert", str(d), "--to", "safetensors", str(tmp_path / "o.st"))
    assert done.returncode == 1 and "share bytes" in done.stderr and "model.0.weight" in done.stderr, done.stderr


def _value_only_file(d: Path) -> Path:
    """A data file of step directory ``d`` that holds plain values and no tensor."""
    md = pickle.loads((d / ".metadata").read_bytes())
    files: dict[str, set[bool]] = {}
    for index, info in md.storage_data.items():
        files.setdefault(info.relative_path, set()).add(index.fqn in md.state_dict_metadata and index.offset is None)
    (name,) = [n for n, kinds in sorted(files.items()) if kinds == {True}][:1]
    return d / name


@pytest.mark.parametrize("damage", ["flip", "resealed"])
def test_full_torch_export_fails_on_a_damaged_or_altered_value(tmp_path, damage):
    """``convert --to torch`` (values included) used to list an unreadable value under "skipped"
    and exit 0; a value that fails its checks must fail the export, as it fails a load."""
    from distckpt.integrity.manifest import digest_of

    torch.manual_seed(0)
    model = nn.Linear(4, 4)  # two tensors for four files: two files hold only values
    state = {"model": model, "epoch": 3, "note": "hello world", "a": 1, "b": 2, "c": [1, 2]}
    distckpt.Checkpointer(tmp_path, thread_count=4, save_rng=False).save(1, state)
    d = tmp_path / step_dir(1)
    if damage == "flip":  # a file holding only values (thread_count=4 writes such files)
        victim = _value_only_file(d)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 1
        victim.write_bytes(bytes(data))
        expected = [victim.name, "corrupted"]
    else:  # a value changed in place and its file re-sealed in the manifest: load refuses it
        raw = json.loads((d / MANIFEST_NAME).read_text())
        for victim in d.glob("*.distcp"):
            data = victim.read_bytes()
            if b"distckpt-json:3" in data:
                data = data.replace(b"distckpt-json:3", b"distckpt-json:7")
                victim.write_bytes(data)
                raw["files"][victim.name]["checksum"] = digest_of(data, raw["checksum_algorithm"])
        (d / MANIFEST_NAME).write_text(json.dumps(raw))
        expected = ["epoch", "sha256"]
        with pytest.raises(distckpt.IntegrityError, match="epoch"):
            distckpt.Checkpointer(tmp_path).load(dict(state, model=nn.Linear(4, 4)))
    out = tmp_path / "o.pt"
    done = _cli("convert", str(d), "--to", "torch", str(out))
    assert done.returncode == 1 and all(e in done.stderr for e in expected), done.stderr
    assert "skipped" not in done.stderr and not out.exists() and not list(tmp_path.glob("o.pt*"))
    # The same checkpoint undamaged exports every value (nothing skipped).
    distckpt.Checkpointer(tmp_path / "good", thread_count=4, save_rng=False).save(1, state)
    done = _cli("convert", str(tmp_path / "good" / step_dir(1)), "--to", "torch", str(out), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["skipped"] == [], done.stdout
    got = torch.load(out, weights_only=True)
    assert {k: got[k] for k in ("epoch", "note", "a", "b", "c")} == {"epoch": 3, "note": "hello world", "a": 1, "b": 2, "c": [1, 2]}


def _adamw_state(lr0: float, lr1: float) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    optim = torch.optim.AdamW([{"params": model[0].parameters(), "lr": lr0}, {"params": model[1].parameters(), "lr": lr1}])
    return {"model": model, "optim": optim, "sched": torch.optim.lr_scheduler.StepLR(optim, 5), "epoch": 3}


@pytest.mark.parametrize(
    "a, b",
    [
        ("optim.param_groups.0.weight.lr", "optim.param_groups.1.weight.lr"),  # the two groups' lr
        ("sched.last_epoch", "sched._step_count"),  # two scheduler fields
    ],
)
def test_resealed_metadata_swapping_two_non_tensor_items_is_refused_everywhere(tmp_path, monkeypatch, a, b):
    """Hyper-parameters and scheduler fields are BYTE_IO records with no tensor fingerprint: with
    their storage entries swapped and .metadata re-sealed, sizes, checksums and coverage all hold.
    The manifest's value_digests (sha256 of each item's stored bytes) must catch it in load,
    ``verify --state`` and ``convert``, naming the key and its file."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    state = _adamw_state(0.1, 0.01)
    state["model"](torch.randn(4, 6)).sum().backward()
    state["optim"].step()
    state["sched"].step()
    distckpt.Checkpointer(tmp_path).save(1, state)
    d = tmp_path / step_dir(1)
    assert {a, b} <= set(json.loads((d / MANIFEST_NAME).read_text())["value_digests"])
    md = pickle.loads((d / ".metadata").read_bytes())
    ia, ib = MetadataIndex(a), MetadataIndex(b)
    md.storage_data[ia], md.storage_data[ib] = md.storage_data[ib], md.storage_data[ia]
    _reseal(d, md)

    with pytest.raises(distckpt.IntegrityError, match=r"non-tensor item '(optim|sched)\.[\w.]+'") as info:
        distckpt.Checkpointer(tmp_path).load(_adamw_state(0.5, 0.5))
    assert (a in str(info.value) or b in str(info.value)) and ".distcp" in str(info.value), str(info.value)
    done = _cli("verify", "--state", str(d))
    assert done.returncode == 1 and (a in done.stderr or b in done.stderr) and "OK" not in done.stdout, done.stderr
    out = tmp_path / "o.pt"
    done = _cli("convert", str(d), "--to", "torch", str(out))
    assert done.returncode == 1 and (a in done.stderr or b in done.stderr) and "value_digests" in done.stderr, done.stderr
    assert not out.exists()

    # Control: without the check the swap loads silently, with the two values exchanged (the
    # check of changed optimizer groups off too: it catches this swap within group 0).
    monkeypatch.setattr(distckpt.state.values, "check_item", lambda *args, **kw: None)
    monkeypatch.setattr(distckpt.state.entries, "check_param_groups", lambda *args, **kw: None)
    fresh = _adamw_state(0.5, 0.5)
    distckpt.Checkpointer(tmp_path).load(fresh)
    got = {"optim.param_groups.0.weight.lr": fresh["optim"].param_groups[0]["lr"],
           "optim.param_groups.1.weight.lr": fresh["optim"].param_groups[1]["lr"],
           "sched.last_epoch": fresh["sched"].last_epoch, "sched._step_count": fresh["sched"]._step_count}  # fmt: skip
    saved = {"optim.param_groups.0.weight.lr": 0.1, "optim.param_groups.1.weight.lr": 0.01, "sched.last_epoch": 1, "sched._step_count": 2}
    assert (got[a], got[b]) == (saved[b], saved[a])


def test_manifests_without_value_digests_still_load(tmp_path):
    """Manifests written before value_digests existed load and export as before (their
    non-tensor items are then unverified, as documented in distckpt.integrity.manifest)."""
    state = _adamw_state(0.1, 0.01)
    distckpt.Checkpointer(tmp_path).save(1, state)
    d = tmp_path / step_dir(1)
    raw = json.loads((d / MANIFEST_NAME).read_text())
    del raw["value_digests"]
    (d / MANIFEST_NAME).write_text(json.dumps(raw))
    fresh = _adamw_state(0.5, 0.5)
    distckpt.Checkpointer(tmp_path).load(fresh)
    assert [g["lr"] for g in fresh["optim"].param_groups] == [0.1, 0.01] and fresh["epoch"] == 3
    assert _cli("convert", str(d), "--to", "torch", str(tmp_path / "o.pt")).returncode == 0
    done = _cli("verify", "--state", str(d))
    assert done.returncode == 0 and "predates value digests" in done.stderr and "non-tensor" not in done.stdout, done.stderr
    fresh_root = tmp_path / "new"
    distckpt.Checkpointer(fresh_root).save(1, state)
    done = _cli("verify", "--state", str(fresh_root / step_dir(1)))
    assert done.returncode == 0 and "non-tensor items" in done.stdout and not done.stderr.strip(), (done.stdout, done.stderr)


# the encoded form of non-tensor values (distckpt.state.encoded) --------------------------------------
def _forge_item(d: Path, key: str, value: object) -> None:
    """Store ``value`` (torch.save'd, as DCP's writer stores an item) as item ``key`` and re-seal
    the item's file, ``.metadata`` and the manifest, value digest included: an attacker who
    controls the whole directory."""
    buf = io.BytesIO()
    torch.save(value, buf)
    forge.replace_item(d, key, buf.getvalue())


class _Touch:
    """Unpickling this would run a shell command that creates a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _forged(kind: str, touched: Path) -> tuple:
    """A forged encoded value (``touched``: the file planted code would create)."""
    marker = "__distckpt_value__"
    return {
        "enum naming os.system": (marker, "enum", ("os:system", "x")),
        "dataclass naming subprocess.Popen": (marker, "dataclass", ("subprocess:Popen", (("args", f"touch {touched}"),))),
        "planted pickle in a payload": (marker, "deque", ([_Touch(str(touched))], None)),
        "huge array": (marker, "numpy.ndarray", ("<f8", (2**40, 2**40), torch.zeros(8, dtype=torch.uint8))),
        "missing fields": (marker, "path"),
    }[kind]


@pytest.mark.parametrize(
    "kind, error, words",
    [
        ("enum naming os.system", distckpt.UnsafeCheckpointError, ["os:system", "not registered", "safe_types=["]),
        ("dataclass naming subprocess.Popen", distckpt.UnsafeCheckpointError, ["subprocess:Popen", "safe_types=["]),
        ("planted pickle in a payload", distckpt.UnsafeCheckpointError, ["needs posix.system", "do not load"]),
        ("huge array", distckpt.IntegrityError, ["malformed", "does not hold"]),
        ("missing fields", distckpt.IntegrityError, ["malformed", "kind, payload"]),
    ],
)
def test_a_forged_encoded_value_is_refused_by_name_and_runs_nothing(tmp_path, kind, error, words):
    """A checkpoint's encoded values name no code that a load runs: a marker naming
    ``os.system`` or ``subprocess.Popen`` as its class, a planted pickle inside a marker's
    payload, a huge array or missing fields fail the load with a documented error naming the key
    (and, for classes, how to register one), even with every checksum and digest re-sealed."""
    import numpy as np

    touched = tmp_path / "TOUCHED"
    model = _model(0)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    optim.param_groups[0]["lr"] = np.float64(0.1)
    distckpt.Checkpointer(tmp_path / "ck").save(1, {"model": model, "optim": optim})
    _forge_item(tmp_path / "ck" / step_dir(1), "optim.param_groups.0.weight.lr", _forged(kind, touched))
    fresh = _model(1)
    with pytest.raises(error) as info:
        distckpt.Checkpointer(tmp_path / "ck").load({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=1.0)})
    message = str(info.value)
    assert "'optim.param_groups.0.weight.lr'" in message and all(w in message for w in words), message
    assert not touched.exists()


def test_a_refusal_keeps_its_hint_in_the_per_rank_error():
    """distckpt's errors keep every line when gathered from a rank (the hint after the first
    line used to be cut off); a foreign exception keeps its first line, as before."""
    from distckpt.errors import cause_of, from_causes

    ours = distckpt.UnsafeCheckpointError("refusing to load 'x': needs y\nIf you trust it, register y: safe_types=[Y]")
    theirs = ValueError("first line\nTraceback-like noise")
    err = from_causes({0: cause_of(ours), 1: cause_of(theirs)}, "reading step 1")
    assert "  rank 0: UnsafeCheckpointError: refusing to load 'x': needs y\n    If you trust it, register y: safe_types=[Y]" in str(err)
    assert "rank 1: ValueError: first line" in str(err) and "noise" not in str(err)
