"""Process-level concerns of a checkpointer: its own process group, the cyclic garbage collector
paused while it works, the niceness and count of its background threads, and what happens to
checkpointers still open when the interpreter exits.

Not collective, except :meth:`GroupHolder.get` the first time (it creates distckpt's group, which
every rank of the job must do together).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread
import gc
import logging
import os
import socket
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol, TypeVar

import torch.distributed as dist

from distckpt._compat import group_is_registered
from distckpt._dist import Group
from distckpt.errors import CheckpointError

log = logging.getLogger("distckpt")


class GroupHolder:
    """distckpt's process group for one checkpointer, created on first use and destroyed by
    :meth:`release`.

    Args:
        user_pg: a group the caller passed (used as is, never destroyed here); ``None``: distckpt
            creates its own over all ranks, so that its collectives (background ones too) never
            interleave with training collectives on the default group (sharing one deadlocks).
        backend: the backend of distckpt's own group (``"gloo"``: CPU collectives, safe beside NCCL).
        timeout: the timeout of its collectives.
        agree: options every rank must pass alike (name -> a comparable value): checked when the
            group is created, in the collective that exists anyway (see :meth:`get`).
    """

    def __init__(
        self, user_pg: dist.ProcessGroup | None, backend: str | None, timeout: timedelta, agree: Mapping[str, object] | None = None
    ) -> None:
        self.user_pg = user_pg
        self.backend = backend
        self.timeout = timeout
        self.agree = dict(agree or {})
        self.group: Group | None = None
        self.local_ranks = 1  # ranks of the group on this host (known once the group exists)
        self._disagreement: ValueError | None = None
        self._lone = False  # the group was made without torch.distributed (one process)
        self._job_world = 1  # the most ranks a group of this checkpointer spanned
        self.generation = 0  # counts the groups made: what was made for an earlier one is stale

    def get(self, save: bool = False) -> Group:
        """(all ranks, collective the first time) The group; a single-process one without
        ``torch.distributed``. Made again where the job's process group changed since: destroyed
        (then a group of this process, or of the job's new process group), or initialised after
        a single-process group was made (distckpt's own group then: never the default group,
        whose collectives training uses).

        Args:
            save: for a save: a save after the job's process group was destroyed is refused (each
                process would save its share as the whole step).

        Raises:
            ValueError: on every rank, this time and every later one, where the ranks passed
                different values of an ``agree`` option (naming each, with the ranks of each value).
            CheckpointError: ``save``, and the job's process group was destroyed (not made again).
        """
        if self._disagreement is not None:
            raise self._disagreement
        up = dist.is_available() and dist.is_initialized()
        if self.group is not None:
            group = self.group
            if group.gone or (up and (self._lone or (group.pg is not None and not group_is_registered(group.pg)))):
                self._job_world = max(self._job_world, group.world_size)
                self.group = None
        if not up and save and self._job_world > 1:  # (also once a load made a group of this process)
            raise CheckpointError(
                f"save: this checkpointer saved and loaded as a job of {self._job_world} ranks, whose process group was "
                "destroyed (torch.distributed.destroy_process_group()); each process would save its share as the whole "
                "step. Save before destroying the process group, or init_process_group() again"
            )
        if self.group is None:
            self._lone = not up
            self.generation += 1
            if not up:
                self.group = Group(None)
            elif self.user_pg is not None:
                # Used as given: creating a group over a subset would need every rank of the
                # job, members or not, to call new_group, and non-members never get here.
                if not group_is_registered(self.user_pg):
                    # (torch's "Group ... is not registered, please create group with new_group")
                    raise CheckpointError(
                        "the process_group given to this Checkpointer was destroyed (destroy_process_group()); "
                        "make a new Checkpointer with the job's new group"
                    )
                self.group = Group(self.user_pg)
            else:
                try:
                    pg = dist.new_group(backend=self.backend, timeout=self.timeout)
                except Exception as exc:  # e.g. "Wait timeout": a peer died or never called us
                    where = f"creating distckpt's process group (rank {dist.get_rank()} of {dist.get_world_size()})"
                    if not _a_peers_doing(exc):  # (a backend this build lacks: MPI, NCCL on a CPU build)
                        raise CheckpointError(
                            f"{where} with backend {self.backend!r} failed on this rank ({type(exc).__name__}: {exc}); "
                            "pass a backend this build of torch has (backend='gloo')"
                        ) from exc
                    raise CheckpointError(
                        f"{where} failed: a peer rank died or did not call save/load within {self.timeout} "
                        f"({type(exc).__name__}: {exc})"
                    ) from exc
                self.group = Group(pg)
            if self.group.enabled:
                # One gather for both: the ranks on each host, and the options that must agree.
                seen = self.group.all_gather((socket.gethostname(), self.agree))
                hosts = [h for h, _ in seen]
                self.local_ranks = hosts.count(hosts[self.group.rank])
                self._disagreement = disagreement([a for _, a in seen], OPTIONS_DIFFER)
                if self._disagreement is not None:
                    raise self._disagreement
        return self.group

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank is the group's coordinator (``True`` before the group exists)."""
        return self.group.is_coordinator if self.group is not None else True

    def release(self) -> None:
        """Destroy distckpt's own process group while Python still runs.

        A group that lives on into interpreter finalisation (a module-level Checkpointer, an
        error kept in a variable) has its backend threads torn down there, where one that needs
        the GIL aborts the process (SIGABRT) although the job succeeded. A group the caller
        passed in is the caller's to destroy.
        """
        group, self.group = self.group, None
        if group is None or group.pg is None or self.user_pg is not None:
            return
        pg, group.pg = group.pg, None  # frames and errors that still hold the Group lose the pg
        group.released = True  # (and raise if they use it, instead of using the default group)
        try:
            if dist.is_initialized() and group_is_registered(pg):
                dist.destroy_process_group(pg)
            else:
                pg.shutdown()  # destroy_process_group() already ran: make sure its threads end
        except Exception as exc:  # noqa: BLE001 - never fail a close over this
            log.debug("releasing distckpt's process group: %s", exc)


#: The largest process id any supported OS hands out (``pid_t`` is a 32-bit int).
_PID_MAX = 2**31 - 1


#: Signals a program's own handlers may catch (Ctrl-C, a scheduler's SIGTERM, SIGUSR1 ...).
_HELD = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")


@contextmanager
def signals_held() -> Iterator[None]:
    """(main thread) Hold the program's Python signal handlers while the block runs: a signal
    arriving meanwhile is raised again right after it (its handler runs, a Ctrl-C raises). For
    a few steps that must not be cut in the middle nor re-entered by a handler (a handler's own
    wait() while a non-reentrant lock is held, a step queued half). Python runs handlers in the
    main thread whichever thread the signal reached, so the handlers themselves are swapped for
    one that notes the signal (blocking the signal in this thread would not do). Signals left to
    their default action run no Python code and are left alone. Elsewhere (another thread) a
    plain block."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for name in _HELD:
        number = getattr(signal, name, None)
        handler = signal.getsignal(number) if number is not None else None
        if callable(handler):
            previous[number] = handler
            signal.signal(number, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in caught:
            signal.raise_signal(number)


def parse_pid(text: str) -> int | None:
    """The process id a file or directory name spells (``"1234"``), or ``None`` if ``text`` is not
    one: only ASCII digits (``str.isdigit`` also takes ``"²"``, which ``int`` refuses) of a value
    a process could have. Names in ``/dev/shm`` or a checkpoint root can be anybody's."""
    if not (text.isascii() and text.isdigit()) or len(text) > 10:
        return None
    pid = int(text)
    return pid if 0 < pid <= _PID_MAX else None


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` exists (in this pid namespace). True when that cannot be told:
    another user's process, or a value no process can have (``pid <= 0`` names process groups
    for ``kill``, larger than ``pid_t`` overflows): callers keep what a live process may own."""
    if not 0 < pid <= _PID_MAX:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process
        return True
    return True


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity; else the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


OPTIONS_DIFFER = (
    "distckpt: the ranks created their Checkpointer with different options (every rank must pass the same: "
    "these change which collectives a save or load takes, or what a committed step records)"
)


def disagreement(per_rank: list[dict[str, object]], what: str = OPTIONS_DIFFER) -> ValueError | None:
    """(pure: every rank alike) The error (``what: ...``) naming every value that differs between
    ranks, with the ranks that passed each; ``None`` where all agree."""
    lines = []
    for name in sorted({n for options in per_rank for n in options}):
        ranks: dict[str, list[int]] = {}
        for rank, options in enumerate(per_rank):
            ranks.setdefault(repr(options.get(name)), []).append(rank)
        if len(ranks) > 1:
            lines.append(f"{name}: " + "; ".join(f"{value} on ranks {_span(rs)}" for value, rs in ranks.items()))
    if not lines:
        return None
    return ValueError(f"{what}: " + " | ".join(lines))


def refuse_different_arguments(call: str, per_rank: list[dict[str, object]]) -> None:
    """(pure: every rank alike) ``ValueError`` where the ranks passed ``call`` different
    arguments (``per_rank``: each rank's, gathered), naming each and the ranks of each value."""
    error = disagreement(per_rank, f"distckpt: the ranks called {call} with different arguments")
    if error is not None:
        raise error


def same_arguments(group: Group, call: str, arguments: Mapping[str, object]) -> None:
    """(all ranks, one collective) :func:`refuse_different_arguments` for ``arguments`` (those
    that change which collectives ``call`` takes or what it does on every rank), gathered in a
    collective of its own: only where no collective the call takes anyway can carry them."""
    if group.enabled:
        refuse_different_arguments(call, group.all_gather(dict(arguments)))


def _span(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` (ascending) as ``0-2, 5``: a thousand ranks stay one short line."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def background_threads(thread_count: int, local_ranks: int) -> int:
    """Writer threads of an async save: ``thread_count``, but no more than this host's cores per
    co-located rank. A background writer competes with training for memory bandwidth and
    caches, which niceness does not share out (``benchmarks/README.md`` has the measurements)."""
    return max(1, min(thread_count, host_cores() // max(1, local_ranks)))


def has_spare_cores(threads: int, local_ranks: int | None = None) -> bool:
    """Whether this host has a core for a helper thread beside each of ``threads`` busy threads
    of every co-located rank (``local_ranks``; without it ``LOCAL_WORLD_SIZE``, torchrun's, else
    1). Work moved to a helper thread (a checksum beside its write) only shortens a save where
    such a core is idle;
    on a host whose cores the writers already fill it only adds thread switches (and takes
    cores from training beside an async save)."""
    if local_ranks is not None:
        local = max(1, local_ranks)
    else:
        try:
            local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local = 1
    return host_cores() >= 2 * max(1, threads) * local


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a save or load runs in the caller's
    thread (torch's state-dict helpers do the same, ``_gc_context``). Their bursts of
    allocations (metadata, plans, state-dict entries) would otherwise trigger collections that
    scan the whole process's heap, each a noticeable part of a small save; what they leave
    behind is freed by reference counting, and anything cyclic is collected afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def lower_priority(nice: int) -> None:
    """Make the calling thread (and the threads it starts, which inherit it) nicer by ``nice``."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


class Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()


def close_at_exit(obj: Closable) -> None:
    """Close ``obj`` at interpreter exit if it is still open then (:func:`closed` forgets it)."""
    _open.add(obj)


def closed(obj: Closable) -> None:
    _open.discard(obj)


def _forget_all() -> None:
    # A child forked from a process using distckpt (a DataLoader worker, an eval fork) inherits
    # its checkpointers: they are the parent's (their save threads do not exist here, their
    # writers serve the parent), so the child's exit must not wait for or close them.
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)


T = TypeVar("T")
R = TypeVar("R")


def pools_refuse(exc: RuntimeError) -> bool:
    """Whether ``exc`` (from ``ThreadPoolExecutor.submit``) says thread pools refuse new work
    because the interpreter is shutting down: so they do in the close at exit (atexit runs after
    concurrent.futures shut down), where the work is then done in the calling thread."""
    return "interpreter shutdown" in str(exc)


def map_in_threads(fn: Callable[[T], R], items: Iterable[T], workers: int, name: str) -> list[R]:
    """``[fn(item) for item in items]``, on up to ``workers`` threads named ``name``; in the
    calling thread once pools refuse work (:func:`pools_refuse`: the close at interpreter exit,
    whose uploads each failed with "cannot schedule new futures after interpreter shutdown")."""
    items = list(items)
    futures: list[Future[R]] = []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items))), thread_name_prefix=name) as pool:
        for item in items:
            try:
                futures.append(pool.submit(fn, item))
            except RuntimeError as exc:
                if not pools_refuse(exc):
                    raise
                break
        done = [f.result() for f in futures]
    return done + [fn(item) for item in items[len(futures) :]]


def _close_before_pools_stop() -> None:
    """At the start of threading's shutdown (before thread pools refuse work: s3fs opens its
    connections through asyncio's pool, so an upload left to atexit failed with "cannot schedule
    new futures after interpreter shutdown"): the close at exit, unless threads of the user's
    still run (the interpreter joins them after this; one may still save): then atexit's."""
    workers = set(getattr(concurrent.futures.thread, "_threads_queues", {}))  # pools' idle threads
    me = threading.current_thread()
    if any(t is not me and not t.daemon and t not in workers and t.is_alive() for t in threading.enumerate()):
        return
    try:
        _close_all()
    except BaseException:  # noqa: BLE001 - (a warning turned error): threading's shutdown must go on; atexit's retries
        pass


@atexit.register
def _close_all() -> None:
    # An async save still in flight at interpreter exit is finished, not silently dropped.
    for obj in list(_open):
        try:
            obj.close()
        except BaseException as exc:  # noqa: BLE001
            warnings.warn(f"distckpt: in-flight save failed at exit: {exc}", stacklevel=1)


try:  # (called before concurrent.futures' own: see above)
    threading._register_atexit(_close_before_pools_stop)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # (no such hook, or distckpt first imported at shutdown)
    pass


def _a_peers_doing(exc: BaseException) -> bool:
    """Whether a failure to create a process group may be a peer's doing (a timeout, a broken
    connection, an unreachable host, the store): all but the failures known to be this rank's
    own (a backend this build of torch lacks, or one it does not know)."""
    text = str(exc).lower()
    return not any(w in text for w in ("built in", "unknown backend", "invalid backend", "is not available"))
