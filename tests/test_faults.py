"""Integrity, untrusted checkpoints, crashes and faults: nothing committed is ever lost."""

from __future__ import annotations

import os
import pickle
import random
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import crash
import distckpt
from dist_harness import run_ranks
from distckpt.integrity.manifest import MANIFEST_NAME, step_dir
from models import assert_same, full_model_state, make_model, make_optimizer, train_steps, wrap

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def test_sigkill_at_random_points_never_loses_a_committed_checkpoint(tmp_path):
    # Kill points are chosen by observed progress (see crash.trial), so every trial asserts
    # that what had committed before the kill survives, whatever the machine's speed.
    rng = random.Random(20261121)
    root = str(tmp_path / "ck")
    phases = set()
    for _ in range(12):  # each trial starts a process (~3 s here); the soak is tests/crash.py
        before, target, after = crash.trial(root, rng)
        phases.add((target - (before or 0) - 1, after is not None and after >= target))
    assert len(phases) >= 3, f"the seeded trials should kill at varied points, got {sorted(phases)}"


def _flip(path: str, offset: int = -100) -> None:
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _corruption_body(rank: int, world: int, root: str, damage: str) -> str:
    model = wrap(make_model(0), "fsdp", world)
    ckpt = distckpt.Checkpointer(root)
    if damage == "save":
        ckpt.save(1, {"model": model})
        return ""
    try:
        ckpt.load({"model": model})
    except distckpt.IntegrityError as exc:
        return str(exc)
    return "loaded without error"


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "metadata"])
def test_damaged_file_is_named_on_every_rank(tmp_path, damage):
    root = str(tmp_path / "ck")
    run_ranks(_corruption_body, 2, tmp_path, root, "save")
    victim = os.path.join(root, step_dir(1), "__1_0.distcp")
    if damage == "flip":
        _flip(victim)
    elif damage == "truncate":
        data = open(victim, "rb").read()
        open(victim, "wb").write(data[:-10])
    elif damage == "missing":
        os.remove(victim)
    else:
        victim = os.path.join(root, step_dir(1), ".metadata")
        _flip(victim, offset=len(open(victim, "rb").read()) // 2)
    messages = run_ranks(_corruption_body, 2, tmp_path, root, damage)
    for msg in messages:
        assert os.path.basename(victim) in msg, msg
    assert messages[0] == messages[1]


def test_flipped_byte_is_silent_in_plain_dcp_but_caught_here(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = nn.Linear(64, 64)
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"model": model})
    data_file = os.path.join(tmp_path, step_dir(1), "__0_0.distcp")
    _flip(data_file, offset=-2000)
    sd = {"model": nn.Linear(64, 64).state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(tmp_path, step_dir(1)))  # DCP: no error
    assert not torch.equal(sd["model"]["weight"], model.weight) or not torch.equal(sd["model"]["bias"], model.bias)
    with pytest.raises(distckpt.IntegrityError, match="__0_0.distcp.*corrupted"):
        ckpt.load({"model": nn.Linear(64, 64)})
    off = nn.Linear(64, 64)
    distckpt.Checkpointer(tmp_path, verify=False).load({"model": off})
    # Switched off, the flipped byte reaches the model, as with plain DCP.
    assert torch.equal(off.weight, sd["model"]["weight"]) and torch.equal(off.bias, sd["model"]["bias"])


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvilStateful:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def state_dict(self):
        return {"payload": _Evil(self.marker)}

    def load_state_dict(self, sd):
        pass


def test_crafted_checkpoint_does_not_run_code(tmp_path, monkeypatch):
    from distckpt.state import encoded

    marker = str(tmp_path / "pwned")
    ckpt = distckpt.Checkpointer(tmp_path / "ck")
    # A value whose unpickling would run a command: a save refuses it (a load could not read it)...
    with pytest.raises(TypeError, match="obj.payload"):
        ckpt.save(1, {"obj": _EvilStateful(marker), "model": nn.Linear(2, 2)})
    # ... and one written anyway (by an older distckpt, or an attacker: DCP stores it with
    # torch.save) is refused by a load, which runs nothing.
    monkeypatch.setattr(encoded, "encode_for_save", lambda state_dict, safe_types=None: state_dict)
    ckpt.save(1, {"obj": _EvilStateful(marker), "model": nn.Linear(2, 2)})
    monkeypatch.undo()
    with pytest.raises(distckpt.UnsafeCheckpointError, match="obj.payload"):
        ckpt.load({"obj": _EvilStateful(marker), "model": nn.Linear(2, 2)})
    # A crafted .metadata.
    ckpt.save(2, {"model": nn.Linear(2, 2)})
    meta = os.path.join(tmp_path, "ck", step_dir(2), ".metadata")
    open(meta, "wb").write(pickle.dumps(_Evil(marker)))
    with pytest.raises(distckpt.UnsafeCheckpointError, match="posix.system|os.system"):
        distckpt.Checkpointer(tmp_path / "ck", verify=False).load({"model": nn.Linear(2, 2)}, step=2)
    assert not os.path.exists(marker), "code from the checkpoint ran"


def test_metadata_path_escaping_the_directory_is_refused(tmp_path):
    from distckpt.integrity.safe_pickle import load_metadata

    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"model": nn.Linear(2, 2)})
    meta = os.path.join(tmp_path, step_dir(1), ".metadata")
    md = load_metadata(open(meta, "rb").read(), meta)
    for info in md.storage_data.values():
        info.relative_path = "../../outside.distcp"
    open(meta, "wb").write(pickle.dumps(md))
    with pytest.raises(distckpt.UnsafeCheckpointError, match="outside the checkpoint directory"):
        distckpt.Checkpointer(tmp_path, verify=False).load({"model": nn.Linear(2, 2)})


def test_failing_writer_thread_is_not_committed(tmp_path, monkeypatch):
    from distckpt.save import writer as _writer

    orig = _writer._ChecksumStream.write
    state = {"w": {f"t{i}": torch.randn(64, 64) for i in range(8)}}

    def write(self, b):
        if getattr(self._raw, "name", "").endswith("__0_1.distcp"):
            raise OSError(28, "No space left on device")
        return orig(self, b)

    ckpt = distckpt.Checkpointer(tmp_path, thread_count=2)
    ckpt.save(1, state)
    monkeypatch.setattr(_writer._ChecksumStream, "write", write)
    with pytest.raises(distckpt.CheckpointError, match="No space left"):
        ckpt.save(2, state)
    monkeypatch.undo()
    assert ckpt.steps() == [1]
    ckpt.save(2, state)
    assert ckpt.steps() == [1, 2]


def _rank_dies_body(rank: int, world: int, root: str) -> dict:
    from distckpt.save import writer as _writer

    model = wrap(make_model(0), "ddp", world)
    optim = make_optimizer(model, "ddp")
    train_steps(model, optim, range(2), rank, world)
    ckpt = distckpt.Checkpointer(root, timeout=20)
    ckpt.save(1, {"model": model, "optim": optim})
    expected = full_model_state(model)
    train_steps(model, optim, range(2, 3), rank, world)
    if rank == 1:

        def die(self, b):
            os.kill(os.getpid(), signal.SIGKILL)

        _writer._ChecksumStream.write = die
    try:
        ckpt.save(2, {"model": model, "optim": optim})
        return {"error": None, "expected": expected}
    except distckpt.CheckpointError as exc:
        return {"error": str(exc), "expected": expected}


def _check_body(rank: int, world: int, root: str) -> dict:
    model = wrap(make_model(3), "fsdp", world)
    ckpt = distckpt.Checkpointer(root)
    step = ckpt.load({"model": model}, strict=False)
    return {"steps": ckpt.steps(), "step": step, "model": full_model_state(model)}


def test_rank_killed_mid_save_fails_the_others_and_keeps_the_last_commit(tmp_path):
    root = str(tmp_path / "ck")
    results = run_ranks(_rank_dies_body, 2, tmp_path, root, expect_dead=frozenset({1}), timeout=120)
    assert results[1] is None
    assert results[0]["error"] is not None, "rank 0 must get an error, not hang or succeed"
    assert not os.path.exists(os.path.join(root, step_dir(2), MANIFEST_NAME))
    after = run_ranks(_check_body, 1, tmp_path, root)[0]
    assert after["steps"] == [1] and after["step"] == 1
    assert_same(results[0]["expected"], after["model"], "step 1 intact")


def _bad_state_on_one_rank(rank: int, world: int, root: str) -> str:
    model = nn.Linear(2, 2)
    state = {"model": model, "note": "ok" if rank == 0 else object()}
    try:
        distckpt.Checkpointer(root).save(1, state)
    except (TypeError, ValueError, distckpt.CheckpointError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_bad_input_on_one_rank_raises_on_every_rank(tmp_path):
    out = run_ranks(_bad_state_on_one_rank, 2, tmp_path, str(tmp_path / "ck"))
    assert out[0] == out[1] and "note" in out[0] and out[0] != "saved", out


def _planning_fails_on_rank_1(rank: int, world: int, root: str) -> dict:
    from distckpt.save.planner import DistckptSavePlanner

    model = wrap(make_model(0), "ddp", world)
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, {"model": model})
    orig = DistckptSavePlanner.create_local_plan
    if rank == 1:
        def broken(self):
            raise RuntimeError("planner exploded on purpose")

        DistckptSavePlanner.create_local_plan = broken
    try:
        # A new entry changes the structure: step 2 plans again (an unchanged one reuses step 1's plans).
        ckpt.save(2, {"model": model, "epoch": 2})
        err = None
    except distckpt.CheckpointError as exc:
        err = (type(exc).__name__, str(exc), dict(exc.failures))
    DistckptSavePlanner.create_local_plan = orig
    ckpt.save(3, {"model": model})  # the fault is gone: the next save works
    return {"err": err, "steps": ckpt.steps()}


def test_one_rank_failing_while_planning_fails_every_rank_alike(tmp_path):
    out = run_ranks(_planning_fails_on_rank_1, 2, tmp_path, str(tmp_path / "ck"))
    assert out[0]["err"] is not None and out[0]["err"] == out[1]["err"]
    assert 1 in out[0]["err"][2] and "planner exploded" in out[0]["err"][2][1]
    assert out[0]["steps"] == [1, 3]


def _mismatch_body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = wrap(make_model(0), "fsdp", world)
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, {"model": model, "epoch": 1})
    other = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 11), nn.Linear(11, 2))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(other, mesh=mesh)
    try:
        ckpt.load({"model": other})
        return {"err": None}
    except distckpt.StateMismatchError as exc:
        strict = (exc.missing, exc.unexpected, sorted(exc.mismatched.items()))
    state = {"model": other, "epoch": 0}
    ckpt.load(state, strict=False)
    report = ckpt.last_load_report
    return {
        "err": strict,
        "report": (report.missing, report.unexpected, sorted(report.mismatched)),
        "epoch": state["epoch"],
        "layer4": full_model_state(other)["4.weight"],
        "saved4": full_model_state(model)["4.weight"],
    }


def test_shape_and_key_mismatch_reported_identically_on_every_rank(tmp_path):
    out = run_ranks(_mismatch_body, 2, tmp_path, str(tmp_path / "ck"))
    missing, unexpected, mismatched = out[0]["err"]
    assert missing == ["model.5.bias", "model.5.weight"]
    assert unexpected == ["epoch"]
    assert dict(mismatched)["model.0.weight"] == ((7, 10), (8, 10))
    assert out[0]["err"] == out[1]["err"]
    assert out[0]["report"][0] == missing and "model.0.weight" in out[0]["report"][2]
    assert out[0]["epoch"] == 1  # strict=False loaded what matched
    assert torch.equal(out[0]["layer4"], out[0]["saved4"])  # same shape in both models: loaded


def _bad_step_on_one_rank(rank: int, world: int, root: str) -> str:
    try:
        distckpt.Checkpointer(root).save(3 if rank == 0 else -1, {"model": nn.Linear(2, 2)})
    except (ValueError, distckpt.CheckpointError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_bad_step_on_one_rank_raises_on_every_rank(tmp_path):
    out = run_ranks(_bad_step_on_one_rank, 2, tmp_path, str(tmp_path / "ck"), timeout=60)
    assert out[0] == out[1] and "step must be a non-negative int, got -1" in out[0], out


def _peer_gone_before_the_group_body(rank: int, world: int, root: str) -> str:
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        # Not before rank 0 has joined the job too: leaving while its default group still
        # connected failed the job's own init_process_group on rank 0 (a flaky test, not this case).
        store.wait(["rank 0 joined"], timedelta(seconds=60))
        os._exit(0)  # leaves right after joining the job, before distckpt's group exists
    store.set("rank 0 joined", "1")
    try:
        distckpt.Checkpointer(root, timeout=3).save(1, {"model": nn.Linear(2, 2)})
    except distckpt.CheckpointError as exc:
        return f"CheckpointError: {exc}"
    return "saved"


def test_peer_dead_before_distckpts_group_exists_is_a_checkpoint_error(tmp_path):
    """A raw ``RuntimeError: Wait timeout`` from new_group used to reach the user."""
    out = run_ranks(_peer_gone_before_the_group_body, 2, tmp_path, str(tmp_path / "ck"), expect_dead=frozenset({1}), timeout=90)
    assert out[0].startswith("CheckpointError: creating distckpt's process group (rank 0 of 2) failed"), out[0]


def test_retrying_a_step_whose_release_could_not_reach_the_store_is_not_refused(tmp_path, monkeypatch):
    """A save failing while the object store is down: its release could not remove the step
    folder nor mark its record released, and the retry of that step by the same process (the
    store back) was refused for lease_s as "being written by another writer ... two jobs".
    Found by a helper (2026-12-06)."""
    from distckpt.save import phases
    from distckpt.storage import ownership
    from distckpt.storage.base import Storage

    real_write, real_read = phases.write, Storage.read_bytes

    def store_down(*args, **kwargs):
        def down(self, *parts):
            raise OSError("connection refused (the object store is down)")

        monkeypatch.setattr(Storage, "read_bytes", down)
        monkeypatch.setattr(ownership, "remove_uncommitted", lambda *a, **k: (_ for _ in ()).throw(OSError("down")))
        monkeypatch.setattr(ownership, "_write_record", lambda *a, **k: (_ for _ in ()).throw(OSError("down")))
        raise OSError("connection refused (the object store is down)")

    monkeypatch.setattr(phases, "write", store_down)
    root = tmp_path / "root"
    with distckpt.Checkpointer(root) as ckpt:
        with pytest.raises(Exception, match="object store is down"):
            ckpt.save(1, {"w": torch.arange(4.0)})
        assert (root / step_dir(1)).exists()  # left behind, its record still live-looking
        monkeypatch.undo()
        assert Storage.read_bytes is real_read and phases.write is real_write
        ckpt.save(1, {"w": torch.arange(4.0)})  # the retry, the store back
        assert ckpt.steps() == [1]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_failing_right_after_its_claim_releases_the_step(tmp_path, monkeypatch, blocking):
    """Ctrl-C (or a failure) after the coordinator had claimed the step directory, before the
    write began: the lease stayed held, its thread refreshed it for the life of the process and
    the step folder stayed "being written", so the retry of that save was refused as another
    writer's. Found by a helper (2026-12-06)."""
    import threading

    from distckpt.storage.local_tier import LocalTier

    def interrupted(self, group, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalTier, "open_step", interrupted)
    root = tmp_path / "root"
    ckpt = distckpt.Checkpointer(root, local_dir=tmp_path / "tier", async_mode="thread")
    state = {"w": torch.arange(16.0)}
    try:
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(1, state, blocking=blocking)
            ckpt.wait()
        assert ckpt._saver.lease is None
        assert not [t for t in threading.enumerate() if t.name.startswith("distckpt-lease")]
        assert not (root / step_dir(1)).exists()
        monkeypatch.undo()
        ckpt.save(1, state, blocking=blocking)  # the retry
        ckpt.wait()
        assert ckpt.steps() == [1]
    finally:
        ckpt.close()


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("warnings_as_errors", [False, True])
def test_retention_failing_after_the_commit_never_fails_the_save(tmp_path, monkeypatch, blocking, warnings_as_errors):
    """Retention runs after the manifest committed the step. A listing of the root that fails
    there (an object store's transient error) was raised as the save's error: a committed step
    reported failed, never copied to the local tier or the replica, and its retry refused as
    existing. It is a warning (a log line where warnings are errors); the next save retries."""
    import warnings

    from distckpt.storage import retention

    real = retention.committed_steps
    failing = {"on": True}

    def listing(storage):
        if failing["on"]:
            raise OSError("listing failed (transient)")
        return real(storage)

    monkeypatch.setattr(retention, "committed_steps", listing)
    root, replica, tier = tmp_path / "root", tmp_path / "replica", tmp_path / "tier"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error" if warnings_as_errors else "always")
        with distckpt.Checkpointer(root, keep_last=1, replicate_to=str(replica), local_dir=tier, local_peers=0, save_rng=False) as ckpt:
            ckpt.save(1, {"w": torch.ones(3)}, blocking=blocking)
            ckpt.wait()
            assert ckpt.steps() == [1]
            failing["on"] = False
            ckpt.save(2, {"w": torch.ones(3) * 2}, blocking=blocking)
            ckpt.wait()
            assert ckpt.steps() == [2]  # the next save's retention did retire step 1
    if not warnings_as_errors:
        assert any("retention on" in str(w.message) and "listing failed" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert (tier / step_dir(1) / MANIFEST_NAME).is_file() or (tier / step_dir(2) / MANIFEST_NAME).is_file()
    assert (replica / step_dir(2) / MANIFEST_NAME).is_file()
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        fresh = {"w": torch.zeros(3)}
        assert ckpt.load(fresh) == 2 and torch.equal(fresh["w"], torch.ones(3) * 2)


def test_load_after_a_failed_async_save_raises_its_error_then_loads(tmp_path, monkeypatch):
    """(README, "Asynchronous saves") ``load`` waits for the in-flight save: a save that failed in
    the background is raised there, once, and nothing is loaded; the next ``load`` loads."""
    from distckpt.save import writer as _writer

    orig = _writer._ChecksumStream.write

    def write(self, b):
        raise OSError(28, "No space left on device")

    state = {"w": torch.ones(16)}
    with distckpt.Checkpointer(tmp_path, async_mode="thread") as ckpt:
        ckpt.save(1, state)
        monkeypatch.setattr(_writer._ChecksumStream, "write", write)
        ckpt.save(2, {"w": torch.full((16,), 2.0)}, blocking=False)
        fresh = {"w": torch.zeros(16)}
        with pytest.raises(distckpt.CheckpointError, match="No space left"):
            ckpt.load(fresh)
        assert torch.equal(fresh["w"], torch.zeros(16))
        monkeypatch.setattr(_writer._ChecksumStream, "write", orig)
        assert ckpt.load(fresh) == 1 and torch.equal(fresh["w"], torch.ones(16))
        assert ckpt.steps() == [1]
