"""The README's promises about options and guarantees, each tested so that it fails without them.

Async timing is checked through a *gated* fsspec filesystem (registered as ``gated://``, a
memory filesystem whose data-file writes wait for the test to open a gate): the test observes
where the save is instead of assuming how long it takes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn

import distckpt
from dist_harness import run_ranks
from distckpt.state import rng
from distckpt.integrity.manifest import step_dir

REPO = Path(__file__).resolve().parents[1]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# checksums ----------------------------------------------------------------------------------------
def _reference_digest(algorithm: str, data: bytes) -> str:
    import zlib

    import crc32c

    if algorithm == "crc32c":
        return f"{crc32c.crc32c(data):08x}"
    if algorithm == "crc32":
        return f"{zlib.crc32(data):08x}"
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("algorithm", [None, "crc32", "sha256"])  # None: the default, crc32c
def test_checksum_is_recorded_and_verified(tmp_path, algorithm):
    model = _model(0)
    ckpt = distckpt.Checkpointer(tmp_path, **({"checksum": algorithm} if algorithm else {}))
    ckpt.save(1, {"model": model})
    manifest = ckpt.manifest(1)
    algorithm = algorithm or "crc32c"
    assert manifest.checksum_algorithm == algorithm
    directory = tmp_path / step_dir(1)
    for name, record in manifest.files.items():
        assert record.checksum == _reference_digest(algorithm, (directory / name).read_bytes()), name
    assert set(manifest.files) >= {".metadata"} and len(manifest.files) >= 2
    fresh = _model(1)
    ckpt.load({"model": fresh})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    data = next(p for p in directory.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(distckpt.IntegrityError, match=data.name):
        ckpt.load({"model": _model(2)})


def test_checksum_none_records_sizes_only_and_still_loads(tmp_path):
    model = _model(0)
    ckpt = distckpt.Checkpointer(tmp_path, checksum=None)
    ckpt.save(1, {"model": model})
    manifest = ckpt.manifest(1)
    assert manifest.checksum_algorithm is None
    assert manifest.files and all(r.checksum is None for r in manifest.files.values())
    fresh = _model(1)
    ckpt.load({"model": fresh})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    # Sizes are still checked: a truncated data file is refused.
    data = next(p for p in (tmp_path / step_dir(1)).iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(distckpt.IntegrityError, match=data.name):
        ckpt.load({"model": _model(2)})


# RNG ----------------------------------------------------------------------------------------------
def _draw() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_restore_rng_false_leaves_the_generators_alone(tmp_path):
    models = [_model(0) for _ in range(4)]  # built first: _model seeds torch
    ckpt = distckpt.Checkpointer(tmp_path)
    _seed_all(1)
    ckpt.save(1, {"model": models[0]})
    saved_draws = _draw()
    _seed_all(2)
    expected = _draw()
    _seed_all(2)
    ckpt.load({"model": models[1]}, restore_rng=False)
    assert _draw() == expected
    _seed_all(2)
    ckpt.load({"model": models[2]})  # the default restores: the draws continue from the save
    assert _draw() == saved_draws


def _rng_body(rank: int, world: int, root: str) -> dict:
    models = [_model(0), _model(0)]
    _seed_all(100 + rank)
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(5, {"model": models[0]})
    expected = _draw()
    _seed_all(999)
    ckpt.load({"model": models[1]})
    return {"expected": expected, "restored": _draw(), "torch_state": torch.get_rng_state()}


def test_rng_restored_per_rank_and_reseeded_at_another_world_size(tmp_path):
    root = str(tmp_path / "ck")
    results = run_ranks(_rng_body, 2, tmp_path, root)
    for r, res in enumerate(results):
        assert res["restored"] == res["expected"], f"rank {r}: Python/NumPy/torch draws after load"
    assert results[0]["expected"] != results[1]["expected"], "each rank has its own streams"
    # Loaded by one process (world size 1 != 2): the documented reseed rule.
    ckpt = distckpt.Checkpointer(root)
    saved = ckpt.manifest(5)
    assert saved.world_size == 2
    rank0_state = _saved_torch_state(root, 5)
    model = _model(0)
    ckpt.load({"model": model})
    after_load = _draw()
    rng.reseed(rng.derived_seed(rank0_state, 5, 0))
    assert after_load == _draw()
    assert after_load != results[0]["expected"]


def _saved_torch_state(root: str, step: int) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    holder = {rng.NAMESPACE: {"rank_0": {"torch": torch.empty_like(torch.get_rng_state())}}}
    dcp.load(holder, checkpoint_id=os.path.join(root, step_dir(step)), no_dist=True)
    return holder[rng.NAMESPACE]["rank_0"]["torch"]


# async: returns before writing; background_nice ----------------------------------------------------
class GatedFS(MemoryFileSystem):
    """``gated://``: writes of data files wait until :attr:`gate` is set, recording the niceness
    of the thread that writes."""

    protocol = "gated"
    gate = threading.Event()
    writing = threading.Event()
    nice: list[int] = []

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode and str(path).endswith(".distcp"):
            GatedFS.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            GatedFS.writing.set()
            if not GatedFS.gate.wait(120):
                raise TimeoutError("the test never opened the gate")
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def gated():
    import fsspec

    fsspec.register_implementation("gated", GatedFS, clobber=True)
    GatedFS.gate.clear()
    GatedFS.writing.clear()
    GatedFS.nice.clear()
    yield f"gated://run-{uuid.uuid4().hex[:8]}"
    GatedFS.gate.set()


@pytest.mark.parametrize("nice", [10, 0])
def test_async_save_returns_before_writing_and_writes_at_background_nice(gated, nice):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ckpt = distckpt.Checkpointer(gated, background_nice=nice, thread_count=1)
    weights = {"w": torch.arange(1000, dtype=torch.float32)}
    ckpt.save(1, {"weights": weights}, blocking=False)
    # save() returned although no data file can be written yet: only staging blocked.
    assert ckpt.in_flight and ckpt.steps() == []
    weights["w"].add_(1)  # training goes on; the checkpoint keeps the values as of save()
    assert GatedFS.writing.wait(120), "the background save never started writing"
    GatedFS.gate.set()
    stats = ckpt.wait()
    assert stats is not None and stats.blocking_s <= stats.total_s
    assert ckpt.steps() == [1] and not ckpt.in_flight
    assert GatedFS.nice and all(n == min(19, base + nice) for n in GatedFS.nice), (base, GatedFS.nice)
    loaded = {"weights": {"w": torch.zeros(1000)}}
    ckpt.load(loaded)
    assert torch.equal(loaded["weights"]["w"], torch.arange(1000, dtype=torch.float32))
    ckpt.close()


def test_async_save_in_a_writer_process_returns_before_writing_at_background_nice(tmp_path):
    """async_mode="process" (the default): the writer is a niced process of its own; while it is
    stopped (SIGSTOP), save() still returns after staging and the step stays invisible."""
    import signal

    import psutil

    import crash

    def writers() -> set[int]:
        # (an earlier test's writer may exit while this looks at it: crash._writers skips it)
        return {p.pid for p in crash._writers(os.getpid())}

    before = writers()  # other tests' checkpointers in this process may still hold theirs
    ckpt = distckpt.Checkpointer(tmp_path, background_nice=7)
    assert ckpt.async_mode == "process"
    weights = {"w": torch.arange(1000, dtype=torch.float32)}
    ckpt.save(1, {"weights": weights}, blocking=False)
    ckpt.wait()
    (pid,) = writers() - before
    writer = psutil.Process(pid)
    assert writer.nice() == min(19, psutil.Process().nice() + 7)
    # A process group of its own (signals sent to the job's group miss it), but scheduled with
    # the job: Linux's autogroups share the CPU equally between sessions whatever the niceness
    # inside them, so a writer in an autogroup of its own that is not niced competes with the
    # whole training job as an equal.
    assert os.getpgid(pid) == pid != os.getpgid(0)
    from distckpt.save import background

    mine, its = background._autogroup("self"), background._autogroup(pid)
    if mine is not None and its is not None:  # Linux with autogroup scheduling
        assert its[0] == mine[0] or its[1] == min(19, mine[1] + 7), (mine, its)
    writer.send_signal(signal.SIGSTOP)
    try:
        ckpt.save(2, {"weights": weights}, blocking=False)
        assert ckpt.in_flight and ckpt.steps() == [1]  # returned; nothing of step 2 committed
        weights["w"].add_(1)  # training goes on; the checkpoint keeps the values as of save()
    finally:
        writer.send_signal(signal.SIGCONT)
    stats = ckpt.wait()
    assert stats is not None and stats.step == 2 and ckpt.steps() == [1, 2]
    loaded = {"weights": {"w": torch.zeros(1000)}}
    ckpt.load(loaded, step=2)
    assert torch.equal(loaded["weights"]["w"], torch.arange(1000, dtype=torch.float32))
    ckpt.close()
    assert not writer.is_running() or writer.status() == psutil.STATUS_ZOMBIE, "close() ends the writer"


# ZeRO ---------------------------------------------------------------------------------------------
def _zero_body(rank: int, world: int, root: str) -> list[str]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    problems = []
    model = DDP(_model(0))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    ckpt = distckpt.Checkpointer(root)
    # Never stepped: saving must not create state (a zero-grad step would).
    ckpt.save(1, {"model": model, "optim": zero})
    if zero.optim.state:
        problems.append("saving a never-stepped ZeRO optimizer created optimizer state")
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        zero.step()
        zero.zero_grad()
    before = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in zero.optim.state.items()}
    params = [p.detach().clone() for p in model.parameters()]
    ckpt.save(2, {"model": model, "optim": zero})
    for p, s in zero.optim.state.items():
        for k, v in s.items():
            old = before[id(p)][k]
            if not (torch.equal(v, old) if torch.is_tensor(v) else v == old):
                problems.append(f"saving changed optimizer state {k}")
    if not all(torch.equal(a, b) for a, b in zip(params, model.parameters())):
        problems.append("saving changed the parameters")
    return problems


def test_saving_never_changes_a_zero_optimizer(tmp_path):
    for r, problems in enumerate(run_ranks(_zero_body, 2, tmp_path, str(tmp_path / "ck"))):
        assert problems == [], f"rank {r}: {problems}"


# CLI from a URL -----------------------------------------------------------------------------------
def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distckpt", *args], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )


def test_import_and_inspect_from_an_s3_url(s3_server, s3_bucket, tmp_path):
    import fsspec

    model = _model(3)
    opts = s3_server.storage_options
    fs = fsspec.filesystem("s3", **opts)
    local = tmp_path / "m.pt"
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 4}, local)
    fs.put_file(str(local), f"{s3_bucket}/in/m.pt")
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    root = f"s3://{s3_bucket}/imported"
    done = _cli("convert", f"s3://{s3_bucket}/in/m.pt", "--to", "dcp", root, "-q", *flags)
    assert done.returncode == 0, done.stderr
    shown = _cli("inspect", root, "--json", *flags)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["step"] == 4
    assert {r["key"] for r in info["entries"] if r["kind"] == "tensor"} == {f"model.{k}" for k in model.state_dict()}
    fresh = _model(9)
    distckpt.Checkpointer(root, storage_options=opts).load({"model": fresh, "epoch": 0})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


# launch scripts -----------------------------------------------------------------------------------
def test_run_local_sh_trains_saves_and_resumes(tmp_path):
    ckpt_dir = tmp_path / "run"
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # CPU, on GPU machines too
    tiny = ["--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--seq-len", "8", "--vocab", "16",
            "--num-samples", "64", "--global-batch", "4", "--parallel", "ddp", "--save-every", "2",
            "--ckpt-dir", str(ckpt_dir), "--log-file", str(log)]  # fmt: skip
    first = subprocess.run(["bash", str(REPO / "launch" / "run_local.sh"), "2", "--steps", "4", *tiny],
                           capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert distckpt.Checkpointer(str(ckpt_dir)).latest_step() == 4
    second = subprocess.run(["bash", str(REPO / "launch" / "run_local.sh"), "1", "--steps", "6", *tiny],
                            capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert distckpt.Checkpointer(str(ckpt_dir)).latest_step() == 6
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    # The second run resumed after step 4 at one rank instead of starting over.
    assert [(r["step"], r["world_size"]) for r in records] == [(1, 2), (2, 2), (3, 2), (4, 2), (5, 1), (6, 1)], records
