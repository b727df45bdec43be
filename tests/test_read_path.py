"""The one verified read path (distckpt.integrity.stepfiles): load, verify, inspect and convert open a step
the same way, read each file once, and check what they read, wherever the directory lies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import distckpt
from distckpt.load.reader import checkpoint_reader
from cli_runner import run_cli as _cli
from direct_reads import count_direct_reads
from distckpt.integrity.manifest import MANIFEST_NAME, step_dir

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))




def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _largest_data_file(d: Path) -> Path:
    return max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)


# a committed step under another name (G3) ---------------------------------------------------------
def test_a_step_directory_copied_under_another_name_is_verified_against_its_manifest(tmp_path):
    model = _model(1)
    distckpt.Checkpointer(tmp_path / "run").save(7, {"model": model, "epoch": 3})
    best = tmp_path / "best"
    shutil.copytree(tmp_path / "run" / step_dir(7), best)
    from distckpt.tools.catalog import locate

    found = locate(str(best))
    assert found.step == 7 and found.manifest is not None and not found.unverified
    with pytest.raises(ValueError, match="contradicts"):
        locate(str(best), step=8)

    done = _cli("verify", str(best))
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
    done = _cli("inspect", str(best), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["step"] == 7 and json.loads(done.stdout)["verified"]
    out = tmp_path / "ok.pt"
    assert _cli("convert", str(best), "--to", "torch", str(out), "--model-only").returncode == 0
    got = torch.load(out, weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())

    victim = _largest_data_file(best)
    _flip(victim)
    done = _cli("verify", str(best))
    assert done.returncode == 1 and victim.name in done.stderr and "corrupted" in done.stderr, done.stderr
    assert "no distckpt manifest" not in done.stderr
    for to in ("torch", "safetensors"):
        out = tmp_path / f"bad.{to}"
        done = _cli("convert", str(best), "--to", to, str(out))
        assert done.returncode == 1 and victim.name in done.stderr and "corrupted" in done.stderr, done.stderr
        assert not out.exists()


def test_the_manifest_still_binds_a_step_named_directory(tmp_path):
    """The step comes from the manifest only for directories not named step_N."""
    from distckpt.tools.catalog import locate

    distckpt.Checkpointer(tmp_path).save(1, {"model": _model(1)})
    shutil.copytree(tmp_path / step_dir(1), tmp_path / step_dir(2))
    with pytest.raises(distckpt.IntegrityError, match="directory of step 2"):
        locate(str(tmp_path / step_dir(2)))
    done = _cli("convert", str(tmp_path / step_dir(2)), "--to", "torch", str(tmp_path / "o.pt"))
    assert done.returncode == 1 and "directory of step 2" in done.stderr


def test_a_plain_dcp_directory_is_readable_and_reported_unverified(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12.0).reshape(3, 4)}
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    done = _cli("inspect", str(tmp_path / "plain"))
    assert done.returncode == 0 and "UNVERIFIED" in done.stdout, done.stdout
    out = tmp_path / "o.pt"
    done = _cli("convert", str(tmp_path / "plain"), "--to", "torch", str(out), "--json")
    assert done.returncode == 0 and "unverified" in done.stderr and json.loads(done.stdout)["unverified"], done.stderr
    assert torch.equal(torch.load(out, weights_only=True)["w"], state["w"])
    done = _cli("verify", str(tmp_path / "plain"))
    assert done.returncode == 1 and "no distckpt manifest" in done.stderr


# one read, checked as read -------------------------------------------------------------------------
def test_convert_reads_each_data_file_once(tmp_path, monkeypatch):
    """Exports used to check every file whole and then read it again unverified; now each byte
    is read once, hashed on its way, and every file is checked before the output appears."""
    from distckpt.integrity import stepfiles as _stepfiles
    from distckpt.tools.catalog import locate
    from distckpt.tools.convert import export_safetensors, export_torch

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    distckpt.Checkpointer(tmp_path, save_rng=False).save(1, {"model": model, "epoch": 3})
    d = tmp_path / step_dir(1)
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
    for export in (lambda: export_torch(locate(str(d)), str(tmp_path / "o.pt")),
                   lambda: export_safetensors(locate(str(d)), str(tmp_path / "o.st"))):  # fmt: skip
        passes.clear()
        export()
        # Every file read whole, once, in one front-to-back pass (the model-only safetensors
        # export reads the value's file too: it shares files with tensors).
        assert passes == sizes and not extra, (passes, sizes, extra)
    got = torch.load(tmp_path / "o.pt", weights_only=True)
    assert all(torch.equal(got["model"][k], v) for k, v in model.state_dict().items()) and got["epoch"] == 3


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_load_reads_each_file_once_in_order_and_every_tensor_straight_into_place(tmp_path, monkeypatch, where):
    """Loads parse each record's layout from its head as the pass goes by (no peek handle, no
    read aside, no second pass), on a local disk and on an fsspec store (where a random read is a request),
    and read every tensor into its destination without an intermediate copy."""
    import uuid

    import torch.distributed.checkpoint as dcp

    from distckpt.integrity import stepfiles as _stepfiles
    from distckpt.integrity.manifest import read_manifest

    root = str(tmp_path) if where == "local" else f"memory://distckpt-{uuid.uuid4().hex[:8]}/run"
    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(n) for i, n in enumerate([1, 7, 900, 1023, 1024, 1025, 5000, 70000])}
    tensors["bf16"] = torch.randn(33, 17).bfloat16()
    tensors["empty"] = torch.zeros(0, 4)
    ckpt = distckpt.Checkpointer(root, save_rng=False)
    ckpt.save(1, {"w": tensors})
    assert type(ckpt.storage).__name__ == ("LocalStorage" if where == "local" else "FsspecStorage")
    manifest = read_manifest(ckpt.storage, 1)
    sizes = {name: r.size for name, r in manifest.files.items() if name != ".metadata"}
    File = _stepfiles.VerifiedFile
    passes: dict[str, int] = {}
    real_consumed = File._consumed

    def consumed(self, view, start):
        name = self.rel.rsplit("/", 1)[-1]
        passes[name] = passes.get(name, 0) + len(view)
        return real_consumed(self, view, start)

    monkeypatch.setattr(File, "_consumed", consumed)
    monkeypatch.setattr(File, "_peek_into", lambda self, *a: pytest.fail("peek"))
    monkeypatch.setattr(File, "_read_aside", lambda self, *a: pytest.fail("read aside"))
    monkeypatch.setattr(File, "_second_pass", lambda self: pytest.fail("second pass"))
    dest = {k: torch.full_like(v, 7) for k, v in tensors.items()}
    direct = count_direct_reads(monkeypatch)
    reader = checkpoint_reader(ckpt.storage, step_dir(1), files=manifest.files, checksum=manifest.checksum_algorithm)
    dcp.load({"w": dest}, storage_reader=reader, no_dist=True)
    assert direct.count == len(tensors) - 1  # all but the empty one (no bytes: DCP's path)
    assert {k: v for k, v in passes.items() if k in sizes} == sizes  # each data file once, whole
    assert all(torch.equal(dest[k], v) for k, v in tensors.items())


def test_a_file_changed_between_two_reads_is_caught(tmp_path):
    """A read served out of order is confirmed by the pass over the file: if the bytes differ
    (the file was replaced in between), it is an IntegrityError, even though the file the pass
    saw matches the manifest."""
    from distckpt.integrity.stepfiles import StepFiles

    distckpt.Checkpointer(tmp_path, save_rng=False).save(1, {"model": _model(1)})
    step = StepFiles.open(distckpt.Storage(tmp_path), step_dir(1))
    name = _largest_data_file(tmp_path / step_dir(1)).name
    path = tmp_path / step_dir(1) / name
    good = path.read_bytes()

    f = step.file(name)
    assert f.read_range(100, 50) == good[100:150]  # the pass is now at 150
    bad = bytearray(good)
    bad[20] ^= 1
    path.write_bytes(bytes(bad))
    assert f.read_range(10, 20) == bytes(bad[10:30])  # behind the pass: read aside, remembered
    path.write_bytes(good)  # put back: the pass and the second pass see intact bytes
    with pytest.raises(distckpt.IntegrityError, match=r"bytes \[10, 30\) changed while being read"):
        f.finish()

    f = step.file(name)  # the same reads with nothing changed pass
    assert f.read_range(100, 50) == good[100:150] and f.read_range(10, 20) == good[10:30]
    f.finish()


@pytest.mark.parametrize("extra", [1, 9 * 1024 * 1024 + 3])
def test_a_data_file_longer_than_its_manifest_record_is_refused_whole(tmp_path, extra):
    """The end of a verified pass reads what is left with a buffer sized to what the manifest
    says is left: bytes appended beyond it (one, or more than a full chunk) are still read to the
    end and refused by size, and the file's own bytes still load."""
    model = _model(1)
    distckpt.Checkpointer(tmp_path, save_rng=False).save(1, {"model": model})
    path = _largest_data_file(tmp_path / step_dir(1))
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x00" * extra)
    with pytest.raises(distckpt.IntegrityError, match=rf"{size + extra} bytes, manifest says {size}"):
        distckpt.Checkpointer(tmp_path).load({"model": _model(2)})
    with open(path, "r+b") as f:
        f.truncate(size)
    fresh = _model(2)
    distckpt.Checkpointer(tmp_path).load({"model": fresh})
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_a_peek_ahead_is_confirmed_by_the_pass(tmp_path):
    from distckpt.integrity.stepfiles import StepFiles

    distckpt.Checkpointer(tmp_path, save_rng=False).save(1, {"model": _model(1)})
    step = StepFiles.open(distckpt.Storage(tmp_path), step_dir(1))
    name = _largest_data_file(tmp_path / step_dir(1)).name
    path = tmp_path / step_dir(1) / name
    good = path.read_bytes()
    f = step.file(name)
    peek = f.peek(200, 100)
    peek.seek(10)
    assert peek.read(5) == good[210:215]
    bad = bytearray(good)
    bad[212] ^= 1
    path.write_bytes(bytes(bad))  # the pass reads the changed byte; the checksum alone would say
    f.close()  # "corrupted", the confirmation names the bytes that were read twice: the peek
    # fetched its whole slice (up to PEEK_WINDOW bytes) in one read
    with pytest.raises(distckpt.IntegrityError, match=r"bytes \[200, 300\) changed"):
        f.finish()


def test_a_records_layout_is_peeked_in_one_read_at_its_head(tmp_path, monkeypatch):
    """A record's layout comes from one window at its head, where a front-to-back pass is
    anyway: no read of its central directory at the record's end (a seek per record ahead of
    the data on a cold disk), and the window is confirmed by the pass."""
    from distckpt.integrity import stepfiles
    from distckpt.integrity.torchfile import raw_layout

    distckpt.Checkpointer(tmp_path, save_rng=False).save(1, {"model": nn.Linear(64, 64)})  # 16 KiB weight
    step = stepfiles.StepFiles.open(distckpt.Storage(tmp_path), step_dir(1))
    meta = step.metadata()
    fqn, info = next((i.fqn, v) for i, v in meta.storage_data.items() if v.length > 2 * stepfiles.PEEK_WINDOW)
    f = step.file(info.relative_path)
    reads = []
    inner = f._peek_into
    monkeypatch.setattr(f, "_peek_into", lambda at, view: reads.append((at, len(view))) or inner(at, view))
    layout = raw_layout(f.peek(info.offset, info.length))
    assert layout is not None and layout.nbytes == meta.state_dict_metadata[fqn].size.numel() * 4
    assert reads == [(info.offset, stepfiles.PEEK_WINDOW)], reads
    f.finish()  # the window is confirmed by the pass


def test_load_and_verify_use_the_same_reader(tmp_path):
    """A load is served by CheckpointReader over StepFiles, and a corrupted file is named alike
    by load and verify."""
    model = _model(1)
    distckpt.Checkpointer(tmp_path).save(1, {"model": model})
    victim = _largest_data_file(tmp_path / step_dir(1))
    _flip(victim)
    with pytest.raises(distckpt.CheckpointError, match=f"{victim.name}.*corrupted"):
        distckpt.Checkpointer(tmp_path).load({"model": _model(0)})
    done = _cli("verify", str(tmp_path))
    assert done.returncode == 1 and f"{victim.name}: crc32c" in done.stderr and "corrupted" in done.stderr


def test_reads_after_a_file_was_checked_are_checked_again(tmp_path):
    """A file checked whole (its last expected entry read) and read again starts a new pass:
    the next finish() checks what that read used."""
    from distckpt.integrity.stepfiles import StepFiles

    distckpt.Checkpointer(tmp_path, save_rng=False).save(1, {"model": _model(1)})
    step = StepFiles.open(distckpt.Storage(tmp_path), step_dir(1))
    name = _largest_data_file(tmp_path / step_dir(1)).name
    path = tmp_path / step_dir(1) / name
    f = step.file(name)
    f.read_range(0, 10)
    f.finish()
    _flip(path)
    f.read_range(0, 10)
    with pytest.raises(distckpt.IntegrityError, match="corrupted"):
        f.finish()


def test_peeks_return_the_files_bytes_for_any_reads(tmp_path):
    """Seeded random seeks and reads of a peek (straddling, inside and between its windows, past
    its end) return exactly the file's bytes, and the pass confirms every one of them."""
    import random

    from distckpt.integrity import stepfiles

    distckpt.Checkpointer(tmp_path, save_rng=False).save(1, {"model": nn.Linear(96, 96)})  # 36 KiB weight
    name = _largest_data_file(tmp_path / step_dir(1)).name
    good = (tmp_path / step_dir(1) / name).read_bytes()
    rng = random.Random(0)
    window = stepfiles.PEEK_WINDOW
    for case in range(60):
        step = stepfiles.StepFiles.open(distckpt.Storage(tmp_path), step_dir(1))
        f = step.file(name)
        offset = rng.randrange(0, len(good) // 2)
        length = rng.choice([rng.randrange(1, 3 * window), len(good) - offset, rng.randrange(window, 2 * window)])
        peek = f.peek(offset, length)
        for _ in range(12):
            pos = rng.choice([rng.randrange(0, length + 8), length - rng.randrange(0, window + 8), window - rng.randrange(1, 16)])
            n = rng.choice([rng.randrange(1, 64), rng.randrange(window - 32, window + 32), rng.randrange(1, 2 * window)])
            peek.seek(max(0, pos))
            at = peek.tell()
            got = peek.read(n)
            assert got == good[offset + at : offset + min(length, at + n)], (case, offset, length, at, n)
        f.finish()


def test_tensors_whose_records_span_one_to_two_peek_windows_load_exactly(tmp_path, monkeypatch):
    """Records a little shorter and longer than the peek window (their head and tail windows
    overlap or touch) are all read straight into their destination, bit for bit."""
    import torch.distributed.checkpoint as dcp

    from distckpt.integrity.manifest import read_manifest
    from distckpt.integrity.stepfiles import PEEK_WINDOW

    sizes = list(range(PEEK_WINDOW // 4 - 300, 2 * PEEK_WINDOW // 4 + 40, 37))  # fp32 elements
    torch.manual_seed(0)
    saved = {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}
    ckpt = distckpt.Checkpointer(tmp_path, save_rng=False)
    ckpt.save(1, {"w": saved})
    manifest = read_manifest(ckpt.storage, 1)
    dest = {k: torch.zeros_like(v) for k, v in saved.items()}
    direct = count_direct_reads(monkeypatch)
    reader = checkpoint_reader(ckpt.storage, step_dir(1), files=manifest.files, checksum=manifest.checksum_algorithm)
    dcp.load({"w": dest}, storage_reader=reader, no_dist=True)
    assert direct.count == len(sizes)  # every layout was parsed from the peek windows
    assert all(torch.equal(saved[k], dest[k]) for k in saved)


@pytest.mark.parametrize("per_thread, threads", [(None, 1), (1, 2)])
def test_reader_threads_are_used_where_the_bytes_pay_for_them(tmp_path, monkeypatch, per_thread, threads):
    """A small local load reads its files in one thread (a second one only contends for the
    GIL); with enough bytes per thread, files are read side by side, and both load exactly."""
    import threading

    import torch.distributed.checkpoint as dcp

    from distckpt.integrity.manifest import read_manifest
    from distckpt.load import reader as _reader

    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(3000 + i) for i in range(8)}
    ckpt = distckpt.Checkpointer(tmp_path, save_rng=False, thread_count=2)
    ckpt.save(1, {"w": tensors})
    assert len(list((tmp_path / step_dir(1)).glob("*.distcp"))) == 2  # one per thread: the barrier below pairs them
    if per_thread is not None:
        monkeypatch.setattr(ckpt.storage, "read_bytes_per_thread", per_thread)
    seen: set[str] = set()
    real = _reader.CheckpointReader._read_file
    # Two threads must be reading side by side: each waits for the other (a pool thread that
    # finished its file early could otherwise take the second one too on a busy machine).
    both = threading.Barrier(threads, timeout=60)

    def read_file(self, *args):
        seen.add(threading.current_thread().name)
        both.wait()
        return real(self, *args)

    monkeypatch.setattr(_reader.CheckpointReader, "_read_file", read_file)
    manifest = read_manifest(ckpt.storage, 1)
    dest = {k: torch.zeros_like(v) for k, v in tensors.items()}
    reader = checkpoint_reader(ckpt.storage, step_dir(1), files=manifest.files, checksum=manifest.checksum_algorithm, thread_count=2)
    dcp.load({"w": dest}, storage_reader=reader, no_dist=True)
    assert len(seen) == threads and all(n.startswith("distckpt-read") for n in seen) == (threads > 1), seen
    assert all(torch.equal(dest[k], v) for k, v in tensors.items())


def _row_shards(rank: int, world: int, root: str) -> dict:
    """Load a checkpoint saved whole by one process into row-sharded DTensors (what FSDP2 at
    another world size asks for), counting what was read straight into place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    direct = count_direct_reads()  # this rank's process ends with the test
    mesh = init_device_mesh("cpu", (world,))
    full = torch.load(f"{root}/full.pt")
    dest = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.load({"w": dest})
    same = all(torch.equal(dest[k].full_tensor(), v) for k, v in full.items())
    return {"same": same, "fast": direct.count, "tensors": len(full)}


def test_row_shards_of_a_stored_tensor_are_read_straight_into_place(tmp_path):
    # Resharded loads (FSDP2 rows at another world size) read the rows each rank needs into its
    # shard, without deserializing the record and copying it (the requested rows are contiguous
    # bytes of the stored tensor); 7 rows over 3 ranks gives uneven and empty shards.
    from dist_harness import run_ranks

    full = {"a": torch.randn(7, 5), "b": torch.randn(10, 3, 2).bfloat16(), "c": torch.arange(12, dtype=torch.int64)}
    torch.save(full, tmp_path / "full.pt")
    with distckpt.Checkpointer(str(tmp_path), save_rng=False) as ckpt:
        ckpt.save(1, {"w": full})
    out = run_ranks(_row_shards, 3, tmp_path, str(tmp_path))
    assert all(o["same"] for o in out)
    # every non-empty shard of every tensor came straight from the file
    assert [o["fast"] for o in out] == [3, 3, 3]
