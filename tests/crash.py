"""Crash trials: SIGKILL a process that is saving, then check nothing committed was lost.

Used by tests/test_faults.py (a few seeded trials) and runnable as a soak script::

    python tests/crash.py --trials 200 --seed 1

Each trial forks a saver that writes steps 1, 2, 3 ... (alternating sync and async saves, with
``keep_last=2``) of a state whose every value encodes its step, and kills it with SIGKILL at a
seeded random point of its progress: while step ``s`` writes its data files, once its
``.metadata`` exists, or once it committed. The kill is timed by what the parent *observes* on
disk, never by a wall-clock delay, so a slow or busy machine changes nothing. The parent then
checks: the newest committed step loads and holds exactly that step's values, it is at least
as new as the progress observed before the kill; no incomplete step is listed; the next save
cleans up and commits; nothing of the saver lives on (its async saves' writer process exits,
its staging memory has no name left in ``/dev/shm``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

import distckpt

SHAPES = [(256, 1024), (1024, 7), (3, 5), (4096,)]


def make_state(step: int) -> dict:
    return {
        "weights": {f"t{i}": torch.full(shape, float(step)) for i, shape in enumerate(SHAPES)},
        "step": step,
    }


def _saver(root: str, start: int) -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled", category=UserWarning)
    ckpt = distckpt.Checkpointer(root, keep_last=2)
    step = start
    while True:
        ckpt.save(step, make_state(step), blocking=bool(step % 2))
        step += 1


def check(root: str) -> int | None:
    """Verify the root after a crash; returns the newest committed step (None if none)."""
    ckpt = distckpt.Checkpointer(root, keep_last=2)
    steps = ckpt.steps()
    for name in os.listdir(root) if os.path.isdir(root) else []:
        s = distckpt.integrity.manifest.parse_step_dir(name)
        if s is not None and s not in steps:
            assert not (Path(root) / name / "manifest.json").exists()
    if not steps:
        return None
    latest = steps[-1]
    state = make_state(-1)
    assert ckpt.load(state) == latest
    assert state["step"] == latest, (state["step"], latest)
    for name, t in state["weights"].items():
        assert torch.equal(t, torch.full_like(t, float(latest))), f"{name} of step {latest} is wrong"
    return latest


_CTX = None


def _context():
    # A fork server that imported torch but never ran an op forks savers in milliseconds; a
    # plain fork of a process whose OpenMP pool is running can deadlock in the child.
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "distckpt", "crash"])
    return _CTX


PHASES = ("data", "metadata", "committed")


def _reached(root: str, step: int, phase: str) -> bool:
    """Has the saver reached ``phase`` of ``step`` (or gone past the step altogether)?"""
    here = Path(root) / distckpt.integrity.manifest.step_dir(step)
    if phase == "data" and here.is_dir() and any(p.suffix == ".distcp" for p in here.iterdir()):
        return True
    if phase == "metadata" and (here / ".metadata").exists():
        return True
    if (here / "manifest.json").exists():
        return True
    # Retention may already have removed ``step``: a newer step directory means it is past it.
    names = os.listdir(root) if os.path.isdir(root) else []
    return any((s := distckpt.integrity.manifest.parse_step_dir(n)) is not None and s > step for n in names)


def _writers(pid: int) -> list:
    """The async-save writer processes of process ``pid`` (psutil handles: they survive pid reuse)."""
    import psutil

    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if "distckpt.save.background" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # exited meanwhile
            pass
    return found


def _assert_nothing_left(pid: int, writers: list, timeout: float) -> None:
    """After SIGKILL of saver ``pid``: its writers exit (whatever they were doing; a zombie
    counts, its parent is dead) and no staging file of it is left in /dev/shm."""
    import psutil

    from distckpt.save.shared_arena import PREFIX, _shm_dir

    deadline = time.monotonic() + timeout
    for writer in writers:
        while True:
            try:
                if not writer.is_running() or writer.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            if time.monotonic() > deadline:
                writer.kill()
                raise AssertionError(f"the killed saver's writer process {writer.pid} outlived it by {timeout:.0f}s")
            time.sleep(0.01)
    left = [n for n in os.listdir(_shm_dir()) if n.startswith(f"{PREFIX}{pid}-")]
    assert not left, f"the killed saver left its staging memory in {_shm_dir()}: {left}"


def trial(root: str, rng: random.Random, timeout: float = 120.0) -> tuple[int | None, int, int | None]:
    """One crash: returns (newest step before the kill, step killed, newest step after recovery).

    The saver starts at ``before + 1`` and is killed once it reached a random phase of a random
    one of its first three steps (observed on disk; polling only decides *how soon* after that
    point the kill lands, never whether the point was reached).
    """
    before = check(root)
    start = (before or 0) + 1
    target, phase = start + rng.randrange(3), rng.choice(PHASES)
    ctx = _context()
    proc = ctx.Process(target=_saver, args=(root, start), daemon=True)
    proc.start()
    deadline = time.monotonic() + timeout
    while not _reached(root, target, phase):
        if not proc.is_alive():
            raise AssertionError(f"the saver died by itself (exit code {proc.exitcode}) before step {target}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the saver did not reach {phase} of step {target} within {timeout:.0f}s")
        time.sleep(0.002)
    writers = _writers(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    _assert_nothing_left(proc.pid, writers, timeout)
    after = check(root)
    # Step ``target`` began only after ``target - 1`` committed (async saves commit before the
    # next save starts), and a "committed" kill came after ``target`` itself committed.
    floor = target if phase == "committed" else target - 1
    if floor >= start:
        assert after is not None and after >= floor, (
            f"killed at {phase} of step {target}: step {floor} had committed, but the newest "
            f"committed step after the kill is {after} (a committed checkpoint was lost)"
        )
    assert after is None or before is None or after >= before, "a committed checkpoint was lost"
    # The next save works and removes what the killed one left behind.
    ckpt = distckpt.Checkpointer(root, keep_last=2)
    nxt = (after or 0) + 1000
    ckpt.save(nxt, make_state(nxt))
    ckpt.close()  # retired steps' files are unlinked in the background; close() waits for that
    leftovers = [n for n in os.listdir(root) if distckpt.integrity.manifest.parse_step_dir(n) not in ckpt.steps()]
    assert not leftovers, f"incomplete checkpoints not cleaned up: {leftovers}"
    return before, target, after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    import tempfile

    root = args.dir or tempfile.mkdtemp(prefix="distckpt-soak-")
    rng = random.Random(args.seed)
    for i in range(args.trials):
        before, target, after = trial(os.path.join(root, "ck"), rng)
        print(f"trial {i}: newest committed before {before}, killed in step {target}, after {after}", flush=True)
    print(f"{args.trials} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
