"""verify_staging: every async save proves that what its writer serialized is the state at the
save call. A wrong staged copy (one element off in one staged buffer, injected into the real
staging path) fails the save on every rank, nothing is committed and the previous step loads;
which tensors are digested follows the option; states holding NaN, infinities and negative zero
are saved bit-exactly and pass (the GPU probe that reported corruption compared such states with
``torch.equal``, for which NaN never equals itself)."""

from __future__ import annotations

import os

import pytest
import torch

import crash
import distckpt
from dist_harness import run_ranks
from distckpt.errors import StagingMismatchError
from models import assert_same, full_model_state, full_optim_state, make_model, make_optimizer, train_steps, wrap

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _break_one_staged_copy(rank_to_break: int, rank: int) -> list[str]:
    """The next weight ``rank_to_break`` stages gets one element off by one ulp after its copy
    (the real staging path runs first). Returns the list the broken key is added to."""
    from distckpt.save import staging

    broken: list[str] = []
    original = staging.Stager._copy

    def copy(self, key, src):
        buf = original(self, key, src)
        if rank == rank_to_break and key.endswith("weight") and not broken:
            flat = buf.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
            broken.append(key)
        return buf

    staging.Stager._copy = copy
    return broken


def _injected_fault(rank: int, world: int, root: str, parallel: str, mode: str) -> dict:
    model = wrap(make_model(seed=1), parallel, world)
    optim = make_optimizer(model, parallel)
    train_steps(model, optim, range(2), rank, world)
    state = {"model": model, "optim": optim, "step": 2}
    ckpt = distckpt.Checkpointer(root, async_mode=mode, verify_staging=True)
    ckpt.save(2, state, blocking=False)
    ckpt.wait()
    good_model, good_optim = full_model_state(model), full_optim_state(model, optim)
    train_steps(model, optim, range(2, 3), rank, world)
    broken = _break_one_staged_copy(world - 1, rank)
    ckpt.save(3, state, blocking=False)  # staging succeeds; the fault surfaces when writing
    error = None
    try:
        ckpt.wait()
    except StagingMismatchError as exc:
        error = str(exc)
    steps = ckpt.steps()
    ckpt.close()
    # The previous step is the newest and loads exactly.
    fresh = wrap(make_model(seed=9), parallel, world)
    fresh_optim = make_optimizer(fresh, parallel)
    train_steps(fresh, fresh_optim, range(1), rank, world)
    back = {"model": fresh, "optim": fresh_optim, "step": 0}
    with distckpt.Checkpointer(root) as again:
        loaded = again.load(back)
    assert_same(good_model, full_model_state(fresh), "model")
    assert_same(good_optim, full_optim_state(fresh, fresh_optim), "optimizer")
    return {"error": error, "steps": steps, "loaded": loaded, "broken": broken}


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_wrong_staged_copy_fails_the_save_at_world_size_1(tmp_path, mode):
    out = run_ranks(_injected_fault, 1, tmp_path, str(tmp_path / "ck"), "plain", mode)[0]
    assert out["broken"] and out["error"] is not None
    assert out["broken"][0] in out["error"] and "nothing was committed" in out["error"]
    assert out["steps"] == [2] and out["loaded"] == 2


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_wrong_staged_copy_on_one_rank_fails_the_save_on_every_rank(tmp_path, mode):
    out = run_ranks(_injected_fault, 2, tmp_path, str(tmp_path / "ck"), "ddp", mode)
    assert not out[0]["broken"] and out[1]["broken"]
    for o in out:
        assert o["error"] is not None and "rank 1" in o["error"] and out[1]["broken"][0] in o["error"], o["error"]
        assert o["steps"] == [2] and o["loaded"] == 2


def _fsdp_fault(rank: int, world: int, root: str) -> dict:
    model = wrap(make_model(seed=1), "fsdp", world)
    optim = make_optimizer(model, "fsdp")
    train_steps(model, optim, range(2), rank, world)
    ckpt = distckpt.Checkpointer(root, async_mode="thread", verify_staging=True)
    broken = _break_one_staged_copy(0, rank)
    ckpt.save(1, {"model": model, "optim": optim}, blocking=False)
    try:
        ckpt.wait()
        error = None
    except StagingMismatchError as exc:
        error = str(exc)
    steps = ckpt.steps()
    ckpt.close()
    return {"error": error, "steps": steps, "broken": broken}


def test_a_wrong_copy_of_a_dtensor_shard_is_caught(tmp_path):
    out = run_ranks(_fsdp_fault, 2, tmp_path, str(tmp_path / "ck"))
    assert out[0]["broken"]
    for o in out:
        assert o["error"] is not None and out[0]["broken"][0] in o["error"] and o["steps"] == []


def _count_digests(monkeypatch) -> list[str]:
    from distckpt.save import staging

    seen: list[str] = []
    original = staging.Stager.stage

    def stage(self, state_dict, skip=frozenset(), verify=None):
        out = original(self, state_dict, skip, verify)
        seen.extend(out.digests)
        return out

    monkeypatch.setattr(staging.Stager, "stage", stage)
    return seen


@pytest.mark.parametrize("mode,expected", [("auto", 0), (True, 3), (False, 0)])
def test_which_tensors_are_digested(tmp_path, monkeypatch, mode, expected):
    # "auto" digests accelerator tensors only (none here: the CPU state costs nothing extra),
    # True every tensor written, False none.
    seen = _count_digests(monkeypatch)
    state = {"w": torch.randn(20, 3), "b": torch.randn(3), "i": torch.arange(4)}
    with distckpt.Checkpointer(str(tmp_path), verify_staging=mode, async_mode="thread", save_rng=False) as ckpt:
        ckpt.save(1, state, blocking=False)
        stats = ckpt.wait()
    assert len(seen) == expected
    assert ("verify_staging" in stats.phases) == bool(expected)


def test_verify_staging_is_validated(tmp_path):
    for bad in ("on", 1, None, "Auto"):
        with pytest.raises(ValueError, match="verify_staging"):
            distckpt.Checkpointer(str(tmp_path), verify_staging=bad)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_states_with_nan_inf_and_negative_zero_are_saved_bit_exactly(tmp_path):
    # NaN payloads of both signs, infinities, -0.0 and subnormals: what an overflowing run holds.
    # Compared bit by bit: torch.equal calls any tensor holding a NaN unequal to itself.
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 3.0])
    payload = torch.tensor([0x7FC00001, 0x7F800001, -0x400000, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    state = {
        "f32": torch.cat([special, payload]).repeat(50),
        "bf16": special.to(torch.bfloat16).repeat(30),
        "f64": special.double(),
    }
    assert not torch.equal(state["f32"], state["f32"].clone())
    for mode in ("process", "thread"):
        with distckpt.Checkpointer(str(tmp_path / mode), verify_staging=True, async_mode=mode) as ckpt:
            for step in range(3):  # the buffers of later saves are reused ones
                ckpt.save(step, state, blocking=False)
                ckpt.wait()
            back = {k: torch.zeros_like(v) for k, v in state.items()}
            ckpt.load(back, verify_state=True)
        for k in state:
            assert torch.equal(_bits(back[k]), _bits(state[k])), (mode, k)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_prepare_staging_allocates_before_the_first_save(tmp_path, monkeypatch, mode):
    # Checkpointer.prepare_staging(state) reserves the staging memory in the background: the
    # first async save then allocates nothing while training waits, and saves exactly; a save
    # of another structure still allocates what it needs.
    from distckpt.save import shared_arena

    made = []
    real_arena = shared_arena.SharedArena.__init__

    def arena(self, *a, **k):
        made.append("arena")
        real_arena(self, *a, **k)

    monkeypatch.setattr(shared_arena.SharedArena, "__init__", arena)
    model = make_model(seed=3)
    optim = make_optimizer(model, "plain")
    train_steps(model, optim, range(1), 0, 1)
    state = {"model": model, "optim": optim}
    with distckpt.Checkpointer(str(tmp_path), async_mode=mode) as ckpt:
        ckpt.prepare_staging(state)
        ckpt._saver.stager._await_reserve()  # what the first save would wait for
        reserved = dict(ckpt._saver.stager._buffers)
        made_before = list(made)
        ckpt.save(1, state, blocking=False)
        ckpt.wait()
        assert made == made_before  # no arena made by the save
        assert all(ckpt._saver.stager._buffers[k] is b for k, b in reserved.items())  # the reserved buffers were used
        expected = full_model_state(model)
        back = make_model(seed=8)
        ckpt.load({"model": back, "optim": make_optimizer(back, "plain")})
        assert_same(expected, full_model_state(back), "model")
        bigger = {"model": model, "optim": optim, "extra": torch.randn(33)}
        ckpt.save(2, bigger, blocking=False)  # another structure: staged into new buffers
        ckpt.wait()
        assert ckpt.steps() == [1, 2]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_prepare_staging_starts_the_writer_process(tmp_path, mode):
    # The writer process of async_mode="process" starts at prepare_staging (its interpreter's
    # start-up, seconds on a GPU machine, then delays no save's commit), and the first async
    # save is written by that same process; async_mode="thread" starts none.
    # (This test process may hold other tests' children: only the new ones count.)
    before = _writers()
    state = {"w": torch.randn(256), "step": 3}
    with distckpt.Checkpointer(str(tmp_path), async_mode=mode) as ckpt:
        ckpt.prepare_staging(state)
        started = _writers() - before
        assert len(started) == (1 if mode == "process" else 0), started
        ckpt.prepare_staging(state)  # a second call starts no other one
        assert _writers() - before == started
        for step in (1, 2):
            ckpt.save(step, state, blocking=False)
            ckpt.wait()
            assert _writers() - before == started
        back = {"w": torch.zeros(256), "step": 0}
        ckpt.load(back)
        assert torch.equal(back["w"], state["w"]) and back["step"] == 3
    assert not (_writers() & started)  # close() reaps it


def _writers() -> set[int]:
    """The pids of this process's live async-save writer processes."""
    return {p.pid for p in crash._writers(os.getpid())}


def test_a_writer_killed_after_prepare_staging_is_replaced_at_the_first_save(tmp_path):
    # prepare_staging starts the writer process before any save: killed while it waits (the OOM
    # killer, a stray pkill), the first async save replaces it (one warning naming its exit
    # code) and commits, as after a writer killed between two saves (tests/test_writer_restart.py;
    # that save used to fail).
    import signal

    import psutil

    state = {"w": torch.randn(300), "n": 1}
    before = _writers()
    with distckpt.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.prepare_staging(state)
        (pid,) = _writers() - before
        writer = psutil.Process(pid)
        os.kill(pid, signal.SIGKILL)
        psutil.wait_procs([writer], timeout=30)
        # (psutil reaped it above: Popen then reads its exit code as 0; -9 otherwise)
        with pytest.warns(UserWarning, match=r"writer process of rank 0 \(exit code -?\d+\) has exited"):
            ckpt.save(1, state, blocking=False)
        ckpt.wait()
        assert ckpt.steps() == [1]
        assert pid not in _writers() and len(_writers() - before) == 1  # a new writer
        state["w"].add_(1)
        ckpt.save(2, state, blocking=False)
        ckpt.wait()
        assert ckpt.steps() == [1, 2]
        back = {"w": torch.zeros(300), "n": 0}
        ckpt.load(back)
        assert torch.equal(back["w"], state["w"]) and back["n"] == 1


def _failed_reservation(rank: int, world: int, root: str) -> dict:
    """Rank 1's background reservation fails; the next prepare_staging must say so on both ranks
    (raised on rank 1 alone, rank 0 would wait in its next collective until the timeout)."""
    from distckpt.save import staging

    if rank == 1:
        def broke(*args, **kwargs):
            raise MemoryError("no pinned memory left (injected)")

        staging.Stager._prepare_arena = broke
        staging.Stager._buffer = broke
    state = {"w": torch.randn(64), "b": torch.randn(7)}
    out = {}
    with distckpt.Checkpointer(root, async_mode="thread") as ckpt:
        ckpt.prepare_staging(state)  # rank 1's allocation fails in the background
        try:
            ckpt.prepare_staging(state)
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_failed_reservation_is_raised_on_every_rank(tmp_path):
    out = run_ranks(_failed_reservation, 2, tmp_path, str(tmp_path / "ck"), timeout=120)
    assert all("no pinned memory left" in o.get("error", "") for o in out), out


def test_digests_run_on_their_own_side_stream_beside_the_copies(monkeypatch):
    """(structure; CUDA streams faked on the CPU) Each device's staging copies are issued on its
    copy stream and the verify_staging digests on a digest stream of their own, both made to
    follow the caller's stream, and both synchronized before ``stage`` returns."""
    import contextlib

    from distckpt.save import staging

    class Stream:
        def __init__(self, use):
            self.use, self.synced, self.followed = use, 0, 0

        def synchronize(self):
            self.synced += 1

    streams = {"copy": Stream("copy"), "digest": Stream("digest")}
    current = [None]

    def side_stream(self, device, use="copy"):
        streams[use].followed += 1
        return streams[use]

    @contextlib.contextmanager
    def on_stream(stream):
        before, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = before

    issued = []
    real_copy, real_digest = staging.Stager._copy, staging.staging_digest

    def copy(self, key, src):
        issued.append(("copy", key, current[0].use))
        return real_copy(self, key, src)

    def digest(t):
        issued.append(("digest", None, current[0].use))
        return real_digest(t)

    monkeypatch.setattr(staging.Stager, "_side_stream", side_stream)
    monkeypatch.setattr(staging, "_on_stream", on_stream)
    monkeypatch.setattr(staging.Stager, "_copy", copy)
    monkeypatch.setattr(staging, "staging_digest", digest)
    state = {"a": torch.randn(10), "b": torch.arange(6), "c": "text"}
    staged = staging.Stager().stage(state, verify=lambda key, value: True)
    assert sorted(k for kind, k, _ in issued if kind == "copy") == ["a", "b"]
    assert {(kind, use) for kind, _, use in issued} == {("copy", "copy"), ("digest", "digest")}
    assert [s.followed for s in streams.values()] == [1, 1] and [s.synced for s in streams.values()] == [1, 1]
    assert set(staged.digests) == {"a", "b"}
    assert staged.digests["a"] == real_digest(state["a"])
    assert torch.equal(staged.state_dict["a"], state["a"]) and staged.state_dict["c"] == "text"


def test_each_device_has_a_copy_and_a_digest_stream_that_follow_the_callers(monkeypatch):
    # The real Stager._side_stream with torch's CUDA stream objects faked: two distinct streams per
    # device (one per use), each made to wait for the caller's current stream at every call,
    # kept for the next save.
    from distckpt.save import staging

    made, waits = [], []

    class FakeStream:
        def __init__(self, device=None):
            self.device = device
            made.append(self)

        def wait_stream(self, other):
            waits.append((self, other))

    caller = object()
    monkeypatch.setattr(staging.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(staging.torch.cuda, "current_stream", lambda device=None: caller)
    stager = staging.Stager()
    dev = torch.device("cuda", 0)
    copy, digest = stager._side_stream(dev, "copy"), stager._side_stream(dev, "digest")
    assert copy is not digest and len(made) == 2
    assert stager._side_stream(dev) is copy and stager._side_stream(dev, "digest") is digest  # reused
    assert stager._side_stream(torch.device("cuda", 1), "digest") not in (copy, digest)  # per device
    assert waits[:4] == [(copy, caller), (digest, caller), (copy, caller), (digest, caller)]
    assert stager._side_stream(torch.device("cpu")) is None


def test_a_failing_digest_still_synchronizes_the_copies_issued(monkeypatch):
    # No copy may still be landing in the staging buffers when stage raises (they may be reused
    # or unmapped next).
    import contextlib

    from distckpt.save import staging

    class Stream:
        def __init__(self):
            self.synced = 0

        def synchronize(self):
            self.synced += 1

    streams = {"copy": Stream(), "digest": Stream()}
    monkeypatch.setattr(staging.Stager, "_side_stream", lambda self, device, use="copy": streams[use])
    monkeypatch.setattr(staging, "_on_stream", lambda stream: contextlib.nullcontext())

    def digest(t):
        raise torch.OutOfMemoryError("no memory for the digest's temporaries")

    monkeypatch.setattr(staging, "staging_digest", digest)
    with pytest.raises(torch.OutOfMemoryError):
        staging.Stager().stage({"a": torch.randn(10), "b": torch.randn(3)}, verify=lambda key, value: True)
    assert streams["copy"].synced == 1 and streams["digest"].synced == 1
