"""The read phase of a load (distckpt.load.phases.read): each rank plans and reads on its own, one
collective of O(1) per rank agrees on the outcome, and a failure on one rank fails every rank alike;
the state check after it (distckpt.load.verify) gathers no rank's fingerprint parts."""

from __future__ import annotations

import pickle

import pytest
from torch import nn

import distckpt
from dist_harness import run_ranks
from models import make_model, wrap


# torch.distributed's object collectives (DCP's collective load uses them) and distckpt's own
# (distckpt._dist.Group), each with the position of the argument each rank sends.
_TORCH = (("all_gather_object", 1), ("gather_object", 0), ("scatter_object_list", 1), ("broadcast_object_list", 0))
_OURS = (("all_gather", 1), ("gather", 1), ("scatter", 1), ("broadcast", 1))


def _counting_collectives(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Count object collectives: name -> pickled size of each call's input (torch's under their
    names, distckpt's ``Group`` methods as ``Group.<name>``)."""
    import torch.distributed as dist

    from distckpt._dist import Group

    seen: dict[str, list[int]] = {}

    def counted(owner: object, name: str, arg: int, label: str):
        real = getattr(owner, name)

        def call(*args, **kwargs):
            obj = args[arg] if len(args) > arg else next(iter(kwargs.values()))
            seen.setdefault(label, []).append(len(pickle.dumps(obj)))
            return real(*args, **kwargs)

        return call

    for name, arg in _TORCH:
        monkeypatch.setattr(dist, name, counted(dist, name, arg, name))
    for name, arg in _OURS:
        monkeypatch.setattr(Group, name, counted(Group, name, arg, f"Group.{name}"))
    return seen


def _load_body(rank: int, world: int, root: str, parallel: str) -> dict:
    out = {}
    for tensors in (4, 64):
        model = wrap(nn.Sequential(*[nn.Linear(10, 10) for _ in range(tensors // 2)]), parallel, world)
        ckpt = distckpt.Checkpointer(f"{root}-{tensors}", save_rng=False)
        ckpt.save(1, {"model": model})
        ckpt.load({"model": model})  # first-call costs
        for checked in (False, True):
            with pytest.MonkeyPatch.context() as mp:
                seen = _counting_collectives(mp)
                ckpt.load({"model": model}, verify_state=checked)
            out[tensors, checked] = seen
        ckpt.close()
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_load_gathers_no_plans_and_sends_the_same_bytes_for_4_or_64_tensors(tmp_path, parallel):
    res = run_ranks(_load_body, 2, tmp_path, str(tmp_path / "ck"), parallel)
    for rank, per_size in enumerate(res):
        for checked in (False, True):
            small, large = per_size[4, checked], per_size[64, checked]
            for seen in (small, large):
                # DCP's collective load gathers every rank's read items on the coordinator and
                # scatters them back, then all-gathers the outcome: none of torch's object
                # collectives runs, nor a gather or scatter of distckpt's.
                assert not set(seen) & {name for name, _ in _TORCH}, seen
                assert "Group.gather" not in seen and "Group.scatter" not in seen, seen
            # Views (digests), the read's outcome, the apply's (after every rank has read: see
            # test_a_read_failing_on_one_rank_applies_the_state_on_none), and with the state
            # check its error agreement (its sums travel in all-reduces of O(keys), not gathers
            # of every rank's parts): O(1) per rank, whatever the number of tensors.
            assert len(small["Group.all_gather"]) == len(large["Group.all_gather"]) == 3 + checked, small
            assert large["Group.all_gather"] == small["Group.all_gather"], (rank, checked, small, large)


def _failure_body(rank: int, world: int, root: str, where: str) -> str:
    import distckpt.load.run
    from distckpt.load import reader

    model = wrap(make_model(0), "ddp", world)
    ckpt = distckpt.Checkpointer(root, save_rng=False)
    if where == "save":
        ckpt.save(1, {"model": model})
        return ""
    with pytest.MonkeyPatch.context() as mp:
        if rank == 1 and where == "read":

            def unreadable(self, plan, planner):
                raise distckpt.IntegrityError("rank 1 could not read __9_9.distcp")

            mp.setattr(reader.CheckpointReader, "read_data", unreadable)
        if rank == 0 and where == "apply":

            def refused(*args):
                raise ValueError("rank 0's objects refused their state")

            mp.setattr(distckpt.load.run, "apply_load", refused)
        try:
            ckpt.load({"model": model})
        except (distckpt.CheckpointError, ValueError) as exc:
            return f"{type(exc).__name__}|{sorted(getattr(exc, 'failures', {}))}|{exc}"
    return "loaded"


def test_a_read_or_apply_failure_on_one_rank_is_the_same_error_on_every_rank(tmp_path):
    root = str(tmp_path / "ck")
    run_ranks(_failure_body, 2, tmp_path, root, "save")
    read = run_ranks(_failure_body, 2, tmp_path, root, "read")
    assert read[0] == read[1], read
    kind, ranks, text = read[0].split("|", 2)
    assert kind == "IntegrityError" and ranks == "[1]" and "__9_9.distcp" in text and "reading" in text, read[0]
    apply = run_ranks(_failure_body, 2, tmp_path, root, "apply")
    kinds = {r.split("|", 1)[0] for r in apply}
    # One rank's caller mistake keeps its builtin type on every rank (as all_ranks does).
    assert kinds == {"ValueError"} and all("refused their state" in r for r in apply), apply


def _interrupted_read(rank: int, world_size: int, root: str, how: str) -> dict:
    """Rank 1 is interrupted (Ctrl-C, or a SIGTERM handler's sys.exit) at its second file read;
    then every rank loads again in the same processes."""
    import os
    import signal
    import sys

    import torch

    from distckpt.load import reader as R

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (inherited as ignored where the suite runs as a background job)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    distckpt.Checkpointer(root, thread_count=1).save(7, {"model": model, "step": 7})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(100 + rank)
    fresh = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    state = {"model": fresh, "step": 0}
    ck = distckpt.Checkpointer(root, thread_count=1)
    if how == "exit":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    real = R.CheckpointReader._read_file
    reads = [0]

    def read_file(self, *args, **kwargs):
        reads[0] += 1
        if rank == 1 and reads[0] == 2:
            os.kill(os.getpid(), signal.SIGINT if how == "ctrl-c" else signal.SIGTERM)
        return real(self, *args, **kwargs)

    R.CheckpointReader._read_file = read_file
    out: dict = {}
    try:
        ck.load(state)
        out["first"] = "loaded"
    except BaseException as exc:  # noqa: BLE001 - what each rank gets is the point
        out["first"] = f"{type(exc).__name__}: {exc}"
    R.CheckpointReader._read_file = real
    ck.load(state)
    out["equal"] = all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items()) and state["step"] == 7
    ck.close()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["ctrl-c", "exit"])
def test_an_interrupt_during_the_read_is_raised_as_itself(tmp_path, how):
    """A Ctrl-C (or a SIGTERM handler's sys.exit) that landed while a load read was caught and
    raised as a CheckpointError on every rank, the interrupted one too: `except KeyboardInterrupt`
    never saw it, and `except Exception` around the load kept a preempted job running. Found by
    a helper (2026-12-07)."""
    got = run_ranks(_interrupted_read, 2, tmp_path, str(tmp_path / "ck"), how)
    expect = "KeyboardInterrupt" if how == "ctrl-c" else "SystemExit: 143"
    assert got[1]["first"].startswith(expect), got
    assert got[0]["first"].startswith("Interrupted: reading ") and "rank 1: " + ("KeyboardInterrupt" if how == "ctrl-c" else "SystemExit") in got[0]["first"], got
    assert all(r["equal"] for r in got), got


def _one_rank_fails_its_read(rank: int, world_size: int, root: str) -> dict:
    import torch

    from distckpt.load import reader as R

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
    distckpt.Checkpointer(root).save(7, {"model": model, "optim": optim, "step": 7})
    torch.manual_seed(100 + rank)
    fresh = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    state = {"model": fresh, "optim": fresh_optim, "step": 0}
    real = R.CheckpointReader._open
    opened = [0]

    def open_(self, name):
        opened[0] += 1
        if rank == 1 and opened[0] == 2:
            raise OSError(5, "Input/output error (injected)", name)
        return real(self, name)

    R.CheckpointReader._open = open_
    ck = distckpt.Checkpointer(root)
    try:
        ck.load(state)
        first = "loaded"
    except distckpt.CheckpointError as exc:
        first = str(exc)
    R.CheckpointReader._open = real
    after = {"step": state["step"], "optim_state": len(fresh_optim.state)}
    ck.load(state)
    ck.close()
    return {"first": first, "after_failure": after, "after_retry": {"step": state["step"], "optim_state": len(fresh_optim.state)}}


@pytest.mark.timeout(200)
def test_a_read_failing_on_one_rank_applies_the_state_on_none(tmp_path):
    """The ranks whose own read succeeded applied the whole loaded state (step, optimizer state,
    data position) before learning that a peer's read failed: after the error rank 0 and 2 were at
    step 7, rank 1 at step 0, so a job starting fresh on a failed load ran ranks at different
    steps. Found by a helper (2026-12-07)."""
    got = run_ranks(_one_rank_fails_its_read, 3, tmp_path, str(tmp_path / "ck"))
    for r in got:
        assert "rank 1: " in r["first"] and "Input/output error (injected)" in r["first"], got
        assert r["after_failure"] == {"step": 0, "optim_state": 0}, got
        assert r["after_retry"]["step"] == 7 and r["after_retry"]["optim_state"] > 0, got


def _dies_while_reading(rank: int, world_size: int, root: str) -> str:
    import os

    import torch

    from distckpt.load import reader as R

    model = nn.Linear(16, 16)
    distckpt.Checkpointer(root).save(1, {"model": model})
    real = R.CheckpointReader._read_file

    def read_file(self, *args, **kwargs):
        if rank == 1:
            os._exit(3)
        return real(self, *args, **kwargs)

    R.CheckpointReader._read_file = read_file
    try:
        distckpt.Checkpointer(root).load({"model": nn.Linear(16, 16)})
    except distckpt.CheckpointError as exc:
        return str(exc)
    del torch
    return "loaded"


@pytest.mark.timeout(200)
def test_a_peer_dying_while_reading_says_the_state_may_be_partly_loaded(tmp_path):
    """A peer that died mid-read left the survivors' tensors loaded (read in place) with an error
    that only said a peer died, not that the state now mixes old and loaded values."""
    from distckpt.load.phases import PARTLY_LOADED

    got = run_ranks(_dies_while_reading, 2, tmp_path, str(tmp_path / "ck"), expect_dead=frozenset({1}), pg_timeout=20)
    assert "a peer rank probably died" in got[0] and got[0].endswith(PARTLY_LOADED), got


def _interrupted_then_saved(rank: int, world_size: int, root: str, where: str) -> list:
    """Rank 1 is interrupted (Ctrl-C) at ``where`` of a load; every rank then saves (the usual
    emergency save of a preempted job)."""
    import os
    import signal

    import torch

    import distckpt.load.run as RUN
    from distckpt.load import reader as R

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (inherited as ignored where the suite runs as a background job)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    ck = distckpt.Checkpointer(root, thread_count=1)
    ck.save(7, {"model": model, "step": 7})
    ck.save(8, {"model": model, "step": 8})
    state = {"model": nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]), "step": 0}
    owner, name = (R.CheckpointReader, "_read_file") if where == "read, step deleted" else (RUN, {"plan": "plan_load", "apply": "apply_load"}[where])
    real = getattr(owner, name)
    calls = [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if rank == 1 and calls[0] == 1:
            if where == "read, step deleted":  # the retention of another job, at that moment
                os.remove(os.path.join(root, "step_000000008", "manifest.json"))
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    setattr(owner, name, interrupted)
    try:
        ck.load(state)
        got = ["loaded", state["step"]]
    except BaseException as exc:  # noqa: BLE001 - what each rank gets is the point
        got = [f"{type(exc).__name__}: {exc}"]
    finally:
        setattr(owner, name, real)
    ck.save(99, state)
    ck.close()
    return got + ["saved"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["plan", "apply", "read, step deleted"])
def test_an_interrupt_anywhere_in_a_load_leaves_every_rank_alike(tmp_path, where):
    """Found by a reviewer (2026-12-07, /tmp/attack118): a Ctrl-C in the planning or the apply
    escaped bare on its rank while its peers waited in the collective that followed, so an
    emergency save paired its collectives with theirs (bare TypeErrors, a hang); one during a
    read whose step another job's retention deleted was taken for the deletion, and the load
    went on to the newest step, the interrupt lost."""
    got = run_ranks(_interrupted_then_saved, 2, tmp_path, str(tmp_path / "ck"), where, pg_timeout=30)
    assert got[1][0].startswith("KeyboardInterrupt") and got[1][-1] == "saved", got
    assert got[0][0].startswith("Interrupted: ") and "interrupted on rank(s) [1]" in got[0][0] and got[0][-1] == "saved", got


def _save_interrupted(rank: int, world_size: int, root: str, point: str) -> list:
    """Rank 1 is interrupted at ``point`` of a sync save; every rank then tries the emergency
    save on the same checkpointer, and after an error closes it and saves with a new one."""
    import importlib
    import os
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (inherited as ignored where the suite runs as a background job)
    module, attr = point.split(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    real = getattr(owner, name)
    calls = [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if rank == 1 and calls[0] == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    state = {"model": nn.Linear(8, 8), "step": 1}
    ck = distckpt.Checkpointer(root, timeout=60)
    ck.save(1, state)
    setattr(owner, name, interrupted)
    got = []
    try:
        ck.save(5, state)
        got.append("saved")
    except BaseException as exc:  # noqa: BLE001 - what each rank gets is the point
        got.append(type(exc).__name__)
        setattr(owner, name, real)
        try:
            ck.save(5, state)  # the usual emergency save, on the same checkpointer
            got.append("emergency saved")
        except distckpt.CheckpointError as again:
            got.append("refused" if "close() it and make a new Checkpointer" in str(again) else f"other: {again}")
        ck.close()
        ck = distckpt.Checkpointer(root, timeout=60)
        if 5 not in ck.steps():
            ck.save(5, state)
        got.append("new checkpointer saved")
    finally:
        setattr(owner, name, real)
    ck.close()
    return got


@pytest.mark.timeout(200)
@pytest.mark.parametrize("point", ["distckpt.save.protocol:SaveRun.finish", "distckpt.storage.local:LocalStorage.sync_file"])
def test_a_checkpointer_an_interrupt_left_out_of_step_refuses_its_next_call(tmp_path, point):
    """Found by a helper (2026-12-07, /tmp/attack120): after a Ctrl-C left a save on one rank
    between its collectives, that rank's emergency save on the same checkpointer paired its
    collectives with the ones its peers still waited in: gloo aborted the peer's process
    (SIGABRT), or the peer took the rank's arguments for its data and returned normally. Its
    next call now fails on that rank before any collective (README: close it and make a new one)."""
    got = run_ranks(_save_interrupted, 2, tmp_path, str(tmp_path / "ck"), point, pg_timeout=60)
    assert got[1][:2] == ["KeyboardInterrupt", "refused"] and got[1][-1] == "new checkpointer saved", got
    assert got[0][0] in ("CheckpointError", "saved") and got[0][-1] in ("new checkpointer saved", "saved"), got


def _publish_interrupted(rank: int, world_size: int, out: str) -> list:
    import os
    import signal

    from distckpt.tools import hf

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (inherited as ignored where the suite runs as a background job)
    real = hf.DigestingFile.write
    calls = [0]

    def write(self, data):
        calls[0] += 1
        if rank == 1 and calls[0] == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, data)

    torch_model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    hf.DigestingFile.write = write
    got = []
    try:
        distckpt.save_pretrained(torch_model, out, max_shard_size="400B")
        got.append("published")
    except BaseException as exc:  # noqa: BLE001 - what each rank gets is the point
        got.append(f"{type(exc).__name__}: {exc}")
    finally:
        hf.DigestingFile.write = real
    distckpt.save_pretrained(torch_model, out, max_shard_size="400B")  # the retry
    got.append("published")
    return got


@pytest.mark.timeout(200)
def test_an_interrupted_publish_leaves_every_rank_alike(tmp_path):
    """A Ctrl-C in an owner's shard writes escaped on its rank while the others waited in the
    outcome exchange: the retry's collectives paired with theirs (bare ValueErrors on both),
    on the job's own process group, where there is no checkpointer to close."""
    got = run_ranks(_publish_interrupted, 2, tmp_path, str(tmp_path / "hf"), pg_timeout=60)
    assert got[1][0].startswith("KeyboardInterrupt") and got[1][-1] == "published", got
    assert got[0][0].startswith("Interrupted: save_pretrained to ") and "interrupted on rank(s) [1]" in got[0][0], got
    assert got[0][-1] == "published", got


def _interrupted_outside_the_collectives(rank: int, world_size: int, root: str, point: str) -> list:
    """Rank 1 is interrupted where the ranks stay in step: in a save's wait for the previous
    async save, or after a blocking save's commit; it saves again on the same checkpointer."""
    import os
    import signal

    from distckpt.save.run import SaveDriver

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (inherited as ignored where the suite runs as a background job)
    name = {"wait": "wait", "report": "_report"}[point]
    real = getattr(SaveDriver, name)
    armed = [False]

    def interrupted(self, *args, **kwargs):
        if rank == 1 and armed[0]:
            armed[0] = False
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)

    setattr(SaveDriver, name, interrupted)
    state = {"model": nn.Linear(8, 8), "step": 1}
    ck = distckpt.Checkpointer(root, timeout=60, async_mode="thread")
    blocking = point == "report"
    ck.save(1, state, blocking=blocking)
    armed[0] = True
    got = []
    try:
        ck.save(2, state, blocking=blocking)
        got.append("saved")
    except KeyboardInterrupt:
        got.append("KeyboardInterrupt")
        if point == "wait":
            ck.save(2, state, blocking=blocking)  # the emergency save: the ranks were in step
            got.append("saved again")
    setattr(SaveDriver, name, real)
    ck.save(3, state, blocking=blocking)
    ck.close()
    return got + [distckpt.Checkpointer(root).steps()]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("point", ["wait", "report"])
def test_an_interrupt_that_leaves_the_ranks_in_step_keeps_the_checkpointer_usable(tmp_path, point):
    """Found by a reviewer (2026-12-07, /tmp/attack121): the out-of-step mark took an interrupt in
    a save's wait for the previous async save (which keeps that save running, in step) or after
    a blocking save's commit for one left in the middle of its collectives: the next call was
    refused, and close() then dropped a save in flight without a word."""
    got = run_ranks(_interrupted_outside_the_collectives, 2, tmp_path, str(tmp_path / "ck"), point, pg_timeout=60)
    if point == "wait":
        assert got[1][:2] == ["KeyboardInterrupt", "saved again"] and got[0][0] == "saved", got
    else:
        assert got[1][0] == "KeyboardInterrupt" and got[0][0] == "saved", got
    assert got[0][-1] == got[1][-1] == [1, 2, 3], got


def _interrupted_at_the_edges(rank: int, world_size: int, root: str, point: str, who: int, blocking: bool, tier: str | None) -> list:
    """Rank ``who`` is interrupted when ``point`` is first called during save(2); then every
    rank saves again on the same checkpointer, or (refused) closes it and saves with a new one."""
    import importlib
    import os
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (inherited as ignored where the suite runs as a background job)
    if tier is not None:
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # two nodes of one rank
    module, attr = point.split(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    real = getattr(owner, name)
    armed = [False]

    def interrupted(*args, **kwargs):
        if rank == who and armed[0]:
            armed[0] = False
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    setattr(owner, name, interrupted)
    kwargs = {"timeout": 60, "async_mode": "thread", "keep_last": 1}
    if tier is not None:
        kwargs["local_dir"] = f"{tier}/node{rank}"
    state = {"model": nn.Linear(8, 8), "step": 1}
    ck = distckpt.Checkpointer(root, **kwargs)
    ck.save(1, state, blocking=blocking)
    ck.wait()
    armed[0] = True
    got = []
    try:
        ck.save(2, state, blocking=blocking)
        ck.wait()
        got.append("saved")
    except BaseException as exc:  # noqa: BLE001 - what each rank gets is the point
        got.append(type(exc).__name__)
    setattr(owner, name, real)
    reported = ck.last_save.step if ck.last_save is not None else None  # (recorded: handed to a replica)
    try:
        ck.save(3, state, blocking=blocking)
        ck.wait()
        got.append("saved on the same checkpointer")
    except distckpt.CheckpointError as exc:
        got.append("refused" if "close() it and make a new Checkpointer" in str(exc) else "peer failed")
        ck.close()
        ck = distckpt.Checkpointer(root, **kwargs)
        if 3 not in ck.steps():
            ck.save(3, state)
        got.append("saved on a new checkpointer")
    steps = ck.steps()
    ck.close()
    return got, reported, steps


@pytest.mark.timeout(200)
@pytest.mark.parametrize("point,who,blocking,tier,marked", [
    # After the last collective: the ranks are in step, the checkpointer stays usable.
    ("distckpt.storage.local_tier:LocalTier.retain", 1, True, "tier", False),
    ("distckpt.save.phases:apply_retention", 0, True, None, False),
    # An async save's job not yet published: its peers' background collectives are not met.
    ("distckpt.save.run:_InFlight", 1, False, None, True),
])  # fmt: skip
def test_the_out_of_step_mark_follows_the_last_collective(tmp_path, point, who, blocking, tier, marked):
    """Found by a reviewer (2026-12-07, /tmp/attack122): the mark missed an interrupt after an
    async save's staging but before its background job existed (the rank's retry then paired
    with its peers' background collectives, and step 2 was lost), and took one in the retention
    of the local tier or of the root (after the commit: the ranks in step) for one in the middle."""
    results = run_ranks(_interrupted_at_the_edges, 2, tmp_path, str(tmp_path / "ck"), point, who, blocking,
                        str(tmp_path / "tier") if tier else None, pg_timeout=60)  # fmt: skip
    got = [r[0] for r in results]
    assert got[who][0] == "KeyboardInterrupt", got
    # keep_last=1: every rank's save returned with the older step retired (a reviewer found
    # retention moved after the outcome's broadcast: rank 1 saw [1, 2])
    if not marked:  # (a new checkpointer is a new job: it retires none of the first one's steps)
        assert all(r[2] == [3] for r in results), results
        # the committed step was recorded (reported, handed to a replica) before the interrupt was raised
        assert [r[1] for r in results] == [2, 2], results
    if marked:
        assert got[who][1:] == ["refused", "saved on a new checkpointer"], got
    else:
        assert got[who][1:] == ["saved on the same checkpointer"] and got[1 - who] == ["saved", "saved on the same checkpointer"], got
