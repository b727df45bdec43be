"""distckpt's process group across the job's own: made before ``init_process_group``, after
``destroy_process_group`` (a save done, or a load for an export at the end), and after a new
``init_process_group``. A group that spanned ranks never turns into a group of one rank under a
running save (tests/test_exit.py), and these flows, which worked, keep working."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import distckpt
from dist_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _state(rank: int) -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(4, 4), "r": distckpt.PerRank(torch.full((2,), float(rank)))}


def _lifecycle_body(rank: int, world: int, base: str) -> dict:
    out = {}
    store = dist.FileStore  # (the harness initialised a group; each phase below makes its own)
    # Every rank has finished connecting before any rank tears the group down: gloo connects its
    # pairs while init_process_group returns, and a peer destroying its side first made the other's
    # init fail ('Connection closed by peer', seen once in CI under torch 2.11).
    dist.barrier()
    dist.destroy_process_group()
    # 1. Made, and first used (a resume attempt), before init_process_group: it committed step 1
    #    as a job of one rank (world_size 1, the other rank's per-rank value missing); then it ran
    #    its collectives on the default group, beside training's (a hang); its local tier kept the
    #    nodes of one process (IndexError on rank 1).
    ckpt = distckpt.Checkpointer(f"{base}/root", async_mode="thread", timeout=timedelta(seconds=30),
                                 replicate_to=f"{base}/replica", local_dir=f"{base}/tier{rank}")  # fmt: skip
    try:
        ckpt.load(_state(rank))
    except FileNotFoundError:
        pass
    dist.init_process_group("gloo", store=store(f"{base}/store1", world), rank=rank, world_size=world, timeout=timedelta(seconds=30))
    ckpt.save(1, _state(rank))
    out["world_of_1"] = ckpt.manifest(1).world_size
    # 2. An async save beside training's own collectives on the default group; done, then
    #    destroy_process_group() and close(): close raised "not committed" and the upload to the
    #    replica was never queued.
    ckpt.save(2, _state(rank), blocking=False)
    for _ in range(20):
        dist.all_reduce(torch.ones(4))
    ckpt.wait()
    dist.destroy_process_group()
    # A save after the destroy (also after a load there, which made a group of this process):
    # each process would commit its share as the whole step.
    for load_first in (False, True):
        if load_first:
            ckpt.load(_state(rank), step=1, strict=False)
        try:
            ckpt.save(3, _state(rank))
            out["save_after_destroy"] = "saved"
        except distckpt.CheckpointError as exc:
            out["save_after_destroy"] = "refused" if "was destroyed" in str(exc) else str(exc)
        if out["save_after_destroy"] != "refused":
            break
    ckpt.close()
    # (the coordinator's close waited for its uploads; another rank's has none to wait for, and
    # with the group gone there is no barrier: it may look before the upload of step 2 ended)
    out["replica"] = distckpt.Checkpointer(f"{base}/replica").steps() if rank == 0 else "coordinator's"
    # 3. A load after destroy_process_group() (an export at the end): one process's load.
    ckpt = distckpt.Checkpointer(f"{base}/root")
    state = _state(rank)
    out["load_after_destroy"] = ckpt.load(state, step=2, strict=False)
    ckpt.close()
    # 4. A new init_process_group: a checkpointer of the first one saves again, as a job of two.
    again = distckpt.Checkpointer(f"{base}/root2", timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store(f"{base}/store2", world), rank=rank, world_size=world, timeout=timedelta(seconds=30))
    again.save(1, _state(rank))
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store(f"{base}/store3", world), rank=rank, world_size=world, timeout=timedelta(seconds=30))
    again.save(2, _state(rank))
    out["world_after_reinit"] = again.manifest(2).world_size
    again.close()
    return out


def test_the_group_before_init_after_destroy_and_after_a_new_init(tmp_path):
    out = run_ranks(_lifecycle_body, 2, tmp_path, str(tmp_path), timeout=200)
    for rank, got in enumerate(out):
        assert got == {"world_of_1": 2, "save_after_destroy": "refused", "replica": [1, 2] if rank == 0 else "coordinator's",
                       "load_after_destroy": 2, "world_after_reinit": 2}, out  # fmt: skip


def _user_group_body(rank: int, world: int, base: str) -> dict:
    out = {}
    group = dist.new_group(ranks=list(range(world)), timeout=timedelta(seconds=30))
    # timeout= and backend= shape distckpt's own group only: beside a group of the user's they
    # were ignored (a wiring mistake then hung for the group's 30 minutes, not timeout=10).
    for kwargs in ({"timeout": 10}, {"backend": "nccl"}):
        try:
            distckpt.Checkpointer(f"{base}/root", process_group=group, **kwargs)
            out[str(kwargs)] = "accepted"
        except ValueError as exc:
            out[str(kwargs)] = "refused" if "apply to distckpt's own process group" in str(exc) else str(exc)
    ckpt = distckpt.Checkpointer(f"{base}/root", process_group=group)
    ckpt.save(1, _state(rank))
    # The job's groups destroyed and made again: the checkpointer's group is gone (torch's
    # "Group ... is not registered, please create group with new_group" reached the user).
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(f"{base}/store2", world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))  # fmt: skip
    dist.barrier()  # (every pair connected before any rank can tear down: see _lifecycle_body)
    try:
        ckpt.save(2, _state(rank))
        out["after_reinit"] = "saved"
    except distckpt.CheckpointError as exc:
        out["after_reinit"] = "refused" if "make a new Checkpointer" in str(exc) else str(exc)
    ckpt.close()
    with distckpt.Checkpointer(f"{base}/root", process_group=dist.new_group(ranks=list(range(world)))) as again:
        out["new"] = again.load(_state(rank))
    return out


def test_a_users_group_takes_no_timeout_or_backend_and_is_named_once_destroyed(tmp_path):
    out = run_ranks(_user_group_body, 2, tmp_path, str(tmp_path), timeout=150)
    for got in out:
        assert got == {"{'timeout': 10}": "refused", "{'backend': 'nccl'}": "refused", "after_reinit": "refused", "new": 1}, out


def _destroyed_under_async_body(rank: int, world: int, base: str, mode: str) -> dict:
    import time

    pg = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    ckpt = distckpt.Checkpointer(f"{base}/root", process_group=pg, async_mode=mode, replicate_to=f"{base}/replica")
    state = {"big": torch.randn(1_000_000), "pr": distckpt.PerRank(torch.full((2,), float(rank)))}
    ckpt.save(1, state)
    ckpt.save(2, state, blocking=False)
    if mode == "thread":  # destroyed once step 2 is committed (observed), before wait()/close()
        deadline = time.monotonic() + 60
        while 2 not in distckpt.Checkpointer(f"{base}/root").steps():
            assert time.monotonic() < deadline, "step 2 never committed"
            time.sleep(0.01)
    dist.destroy_process_group(pg)
    try:
        ckpt.close()
        outcome = "ok"
    except distckpt.CheckpointError as exc:
        outcome = f"CheckpointError: {exc}"[:800]
    dist.barrier()
    steps = distckpt.Checkpointer(f"{base}/root").steps()
    replica = distckpt.Checkpointer(f"{base}/replica").steps()
    return outcome, steps, replica


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_users_group_destroyed_under_an_async_save(tmp_path, mode):
    """The caller's ``process_group`` destroyed while an async save on it is in flight (the
    default group up): ``get_rank`` of it raised a bare ``ValueError`` ("not registered") from
    wait()/close(), after the commit too, and the committed step never went to the replica.
    Committed by the coordinator: no error there, and uploaded (even where the group went before
    the other ranks heard it). Not committed: a CheckpointError on every rank."""
    res = run_ranks(_destroyed_under_async_body, 2, tmp_path, str(tmp_path), mode, timeout=150)
    steps, replica = res[0][1], res[0][2]
    if mode == "thread":
        assert steps == [1, 2], res  # (destroyed once step 2 was committed)
    if steps == [1, 2]:
        # The coordinator committed it: recorded and uploaded there, whether or not the group
        # carried the outcome to rank 1 first (which then says it cannot tell, never "not committed").
        assert res[0][0] == "ok" and replica == [1, 2], res
        assert res[1][0] == "ok" or "did not complete on this rank" in res[1][0], res
    else:
        assert steps == [1] and all("is gone" in o and "did not complete on this rank" in o for o, _, _ in res), res


def _missing_backend_body(rank: int, world: int, base: str) -> str:
    ckpt = distckpt.Checkpointer(f"{base}/root", backend="mpi", timeout=30)
    try:
        ckpt.save(1, {"w": torch.ones(3)})
    except distckpt.CheckpointError as exc:
        return str(exc)
    finally:
        ckpt.close()
    return "saved"


@pytest.mark.timeout(150)
def test_a_backend_this_build_lacks_is_named_not_blamed_on_peers(tmp_path):
    """backend='mpi' on a build without MPI (or NCCL on a CPU build) failed the first save with
    "a peer rank died or did not call save/load within 0:10:00"."""
    if dist.is_mpi_available():
        pytest.skip("this build of torch has MPI")
    res = run_ranks(_missing_backend_body, 2, tmp_path, str(tmp_path), timeout=120)
    for text in res:
        assert "with backend 'mpi' failed on this rank" in text and "peer" not in text, res


def test_a_peers_failure_is_never_blamed_on_this_ranks_backend():
    """Gloo reports a dead peer in a plain RuntimeError, in words of its own ("No route to host",
    "Broken pipe"): only the failures known to be this rank's own name the backend."""
    from distckpt._process import _a_peers_doing

    for text in ("[pair.cc:144] connect [10.1.2.3]:41234: No route to host", "writev [10.1.2.3]:41234: Broken pipe",
                 "Network is unreachable", "Connection closed by peer", "Wait timeout"):  # fmt: skip
        assert _a_peers_doing(RuntimeError(text)), text
    assert not _a_peers_doing(RuntimeError("Distributed package doesn't have NCCL built in"))


def _interrupted_then_new(rank: int, world_size: int, root: str, mode: str) -> object:
    from distckpt.save import phases

    ckpt = distckpt.Checkpointer(root, async_mode=mode)
    state = {"w": torch.arange(1000.0) + rank, "step": 1}
    ckpt.save(1, state)
    if rank == 1:
        real = phases.stage

        def interrupted(*args, **kwargs):
            phases.stage = real
            raise KeyboardInterrupt  # (Ctrl-C while this rank copies; rank 0 waits in the next collective)

        phases.stage = interrupted
    seen = []
    state["step"] = 2
    try:
        ckpt.save(2, state, blocking=False)
        ckpt.wait()
    except KeyboardInterrupt:
        seen.append("interrupted")
    except distckpt.CheckpointError:
        seen.append("error")
    ckpt.close()  # as the README says: its group goes (rank 0's pending collective fails at once)
    ckpt = distckpt.Checkpointer(root, async_mode=mode)
    state["step"] = 3
    ckpt.save(3, state, blocking=False)
    ckpt.wait()
    steps = ckpt.steps()
    ckpt.close()
    return seen, steps


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_after_an_interrupted_save_a_new_checkpointer_is_in_step(tmp_path, mode):
    """Ctrl-C in the blocked part of an async save on one rank leaves the other waiting in a
    collective; the README's recovery (close, then a new Checkpointer on every rank) ends that
    wait with an error at once and the next save commits on every rank."""
    got = run_ranks(_interrupted_then_new, 2, tmp_path, str(tmp_path / "ck"), mode, pg_timeout=60)
    assert got == [(["error"], [1, 3]), (["interrupted"], [1, 3])], got


def test_an_async_save_published_but_never_started_is_started_by_wait():
    """An interrupt landing between an async save's publication and its thread's start left a
    job whose done event nobody would set: every later wait(), save() or close() blocked."""
    import threading

    from distckpt.save.run import SaveStats, _InFlight

    job = _InFlight(2, SaveStats(2, 0.0))
    ran = []

    def run():
        ran.append(1)
        job.done.set()

    job.thread = threading.Thread(target=run, daemon=True)
    waiter = threading.Thread(target=job.wait, daemon=True)
    waiter.start()
    waiter.join(30)  # (bounded: without the start it waits forever)
    assert not waiter.is_alive() and ran == [1] and not job.running
