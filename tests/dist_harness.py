"""Run a function on N real processes (gloo, CPU) from a pytest test.

* Rendezvous through a FileStore under the test's tmp dir: no TCP ports, so parallel xdist
  workers never collide.
* Every rank writes its traceback to a file; a failure reports all of them (the first process
  to die is often a peer complaining about a closed connection, not the culprit).
* Bounded: a short process-group timeout and a join deadline after which every rank is killed,
  so a hang fails one test instead of the CI run.
* Cheap to start: ranks fork from a forkserver that imported torch and distckpt once per pytest
  worker (a fresh interpreter pays ~3 s of CPU for those imports, which on 2 cores was most of the
  suite's time). The forkserver has run no torch code, so no threads or process groups are
  inherited; each rank takes the calling test's environment and working directory, as a spawned
  process would.

The rank body must be a module-level function ``fn(rank, world_size, *args)``; its return value
(picklable) comes back in a list indexed by rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "distckpt"]


def _entry(
    fn: Callable, rank: int, world_size: int, store_path: str, out_dir: str, args: tuple, pg_timeout: float,
    env: dict[str, str], cwd: str, backend: str = "gloo",
) -> None:  # fmt: skip
    # The forkserver's environment is the one it started with; the test's may have changed since.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        store = dist.FileStore(store_path, world_size)
        if "cuda" in backend or backend == "nccl":
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
        result = fn(rank, world_size, *args)
        (out / f"result{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(0)


def _ephemeral_ports() -> range | None:
    """The kernel's ephemeral port range (Linux), or None where it cannot be read."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for servers and c10d rendezvous in tests).

    The caller binds it later, in another process (a torchrun agent, a moto server): a port the
    kernel hands out for ``bind(0)`` can be taken in that gap by any of the suite's many ephemeral
    binds (gloo pairs, standalone torchrun stores, outgoing connections), and the two agents of a
    two-node test then rendezvous with a stranger and time out. So, on Linux, the port is drawn at
    random below the ephemeral range, where only another explicit choice can land, and checked
    bindable; elsewhere (or if no such port binds) it falls back to ``bind(0)``."""
    import random
    import socket

    ephemeral = _ephemeral_ports()
    if ephemeral is not None and ephemeral.start > 12000:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randrange(10000, ephemeral.start)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RanksFailed(AssertionError):
    pass


def run_ranks(
    fn: Callable,
    world_size: int,
    tmp_path: Path,
    *args: Any,
    timeout: float = 150.0,
    pg_timeout: float = 60.0,
    expect_dead: frozenset[int] = frozenset(),
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    Ranks in ``expect_dead`` are meant to die (a crash test); their result is ``None``.
    ``backend``: of the default process group (``"cpu:gloo,cuda:nccl"`` for GPU tests: each
    rank then uses GPU ``rank``).
    """
    run_dir = Path(tmp_path) / f"ranks-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    store = str(run_dir / "store")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    env, cwd = dict(os.environ), os.getcwd()
    # Not daemonic: ranks may start processes of their own (DataLoader workers). They are killed
    # at the deadline below instead.
    procs = [
        ctx.Process(
            target=_entry, args=(fn, r, world_size, store, str(run_dir), args, pg_timeout, env, cwd, backend), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    except BaseException:
        # Interrupted (Ctrl-C, a benchmark's SIGTERM): the ranks go too. Left running, they
        # wrote on into a run folder being removed, and the interpreter's exit waited for them.
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        raise
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = {
        r: (run_dir / f"error{r}.txt").read_text()
        for r in range(world_size)
        if (run_dir / f"error{r}.txt").exists() and r not in expect_dead
    }
    bad_exit = any(p.exitcode != 0 for r, p in enumerate(procs) if r not in expect_dead)
    if hung or errors or bad_exit:
        parts = [f"{fn.__name__} on {world_size} ranks failed"]
        if hung:
            parts.append(f"ranks {hung} still running after {timeout:.0f}s and were killed (hang)")
        for r, p in enumerate(procs):
            if p.exitcode not in (0, None) and r not in errors and r not in expect_dead:
                parts.append(f"rank {r} exited with code {p.exitcode} without a traceback")
        for r, tb in sorted(errors.items()):
            parts.append(f"--- rank {r} ---\n{tb}")
        raise RanksFailed("\n".join(parts))
    return [
        pickle.loads((run_dir / f"result{r}.pkl").read_bytes()) if (run_dir / f"result{r}.pkl").exists() else None
        for r in range(world_size)
    ]
