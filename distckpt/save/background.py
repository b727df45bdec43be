"""Background writer processes: asynchronous saves written outside the training process.

A thread in the training process would compete with training for the GIL: DCP's planning,
torch.save's pickling of every record, checksums of small items and fingerprints all hold it.
So every rank of an async save hands its staged state to a writer process of its own:

* the state is staged into a :class:`~distckpt.save.shared_arena.SharedArena` (anonymous shared
  memory), whose descriptor the writer receives over its socket and maps once; each save sends
  only a small description (keys, slots, DTensor layouts, plain values);
* the writer processes of all ranks form their own gloo group (rendezvous through a TCPStore that
  distckpt's coordinator hosts, as DCP's process-based async checkpointer does) and run the save's
  write phase (:func:`distckpt.save.phases.write`: DCP's planning and writing, checksums,
  fingerprints), niced, with the outcome gathered across writers so it is the same everywhere;
* the training process keeps only a thread blocked on the pipe; it commits (the manifest, on the
  coordinator) after every rank's writer has finished, exactly as a thread-mode save does.

Lifecycle (the training side is :class:`WriterProcess`, all calls from distckpt's Checkpointer):

1. ``WriterProcess.start(group, ...)`` (all ranks, collective: the store's address is broadcast)
   starts a fresh Python running :func:`main` per rank (not a fork: the training process has
   threads and maybe CUDA; not multiprocessing's spawn: that re-imports the user's script). It does not wait for the process to be
   ready: the first save's staging overlaps its start.
2. ``submit(...)`` (each rank, background thread) waits for readiness once, then sends a job;
   ``result()`` blocks until the writer answers with :class:`~distckpt.save.phases.Written` or a failure.
3. ``close()`` (each rank) asks the writer to leave its group and exit, and reaps it.

A writer never outlives its training process: it exits as soon as that process is gone (killed,
crashed), whatever it is doing, even with its main thread blocked in a collective on peers or a
store that will never answer (:func:`_exit_with_parent`). It runs in a process group of its own,
so signals sent to the job's process group (torchrun, a terminal) do not reach it: the training
process decides when it stops, so a final save requested from a signal handler is still written.
A SIGTERM (or SIGINT) sent to the writer itself ends it at once; the save it was writing fails
on every rank, and the next async save starts a new writer.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from distckpt._compat import flatten_state_dict, mesh_without_groups
from distckpt._dist import Group, capture, raise_if_any
from distckpt.errors import CheckpointError
from distckpt.save import phases as _saving
from distckpt.save.protocol import PlanCache
from distckpt.save.shared_arena import Slot, attach, descriptor, view
from distckpt.state.containers import unflatten_for_dcp

#: flat key -> where DCP's flattening found it in the nested state (keys and list indices)
Mappings = dict[str, tuple[str | int, ...]]


# ---------------------------------------------------------------------------------------------
# what crosses the pipe (a tensor staged in the arena travels as its :class:`Slot`)
@dataclass(frozen=True)
class _DRef:
    """A staged DTensor shard: its local tensor plus what DCP needs of its layout."""

    local: Slot | torch.Tensor
    mesh: list
    dim_names: tuple[str, ...] | None
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def encode(staged: dict[str, Any], arena: torch.Tensor) -> tuple[dict[str, Any], Mappings]:
    """(training side) ``staged`` as flat key -> value with arena tensors replaced by references.

    Tensors outside the arena (a quantized tensor staged by a fresh copy) travel pickled.
    """
    flat, mappings = flatten_state_dict(staged)
    base, end = arena.data_ptr(), arena.data_ptr() + arena.numel()

    def ref(t: torch.Tensor) -> Slot | torch.Tensor:
        if t.is_quantized or t.numel() == 0 or not base <= t.data_ptr() < end:
            return t  # small, or not staged in the arena: pickled
        return Slot(t.data_ptr() - base, t.dtype, tuple(t.shape))

    out: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, DTensor):
            local = ref(value.to_local())
            mesh = value.device_mesh
            out[key] = _DRef(
                local,
                mesh.mesh.tolist(),
                mesh.mesh_dim_names,
                tuple(value.placements),
                tuple(value.shape),
                tuple(value.stride()),
            )
        elif isinstance(value, torch.Tensor):
            out[key] = ref(value)
        else:
            out[key] = value
    return out, mappings


def decode(flat: dict[str, Any], mappings: Mappings, arena: torch.Tensor, rank: int) -> dict[str, Any]:
    """(writer side) The staged state dict again, its tensors views of the mapped ``arena``."""
    meshes: dict[tuple[str, tuple[str, ...] | None], DeviceMesh] = {}
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, _DRef):
            mk = (repr(value.mesh), value.dim_names)
            if mk not in meshes:
                meshes[mk] = mesh_without_groups(value.mesh, value.dim_names, rank)
            local = view(arena, value.local) if isinstance(value.local, Slot) else value.local
            out[key] = DTensor.from_local(
                local,
                meshes[mk],
                value.placements,
                run_check=False,
                shape=torch.Size(value.shape),
                stride=value.stride,
            )
        elif isinstance(value, Slot):
            out[key] = view(arena, value)
        else:
            out[key] = value
    return unflatten_for_dcp(out, mappings)


@dataclass
class Job:
    """One save's write phase, as sent to the writer process."""

    opts: _saving.SaveOptions
    prepared: _saving.Prepared  # its state_dict replaced by (flat, mappings) below
    flat: dict[str, Any]
    mappings: Mappings
    arena_path: str | None
    arena_nbytes: int


def _send(conn: Connection, obj: object) -> None:
    # Plain pickle, not Connection.send: torch registers reducers with multiprocessing's pickler
    # that pass tensors through multiprocessing's resource sharer, which a process started
    # outside multiprocessing cannot use. The few tensors that travel (quantized ones, empty
    # ones, tensors inside values, fingerprint parts) are small; the staged state travels
    # through the shared arena.
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    conn.send_bytes(buf.getbuffer())


class _Pickler(pickle.Pickler):
    """Plain pickle, with plain tensors as ``torch.save`` bytes: torch's own pickling of a tensor
    cannot be read back for dtypes without a typed storage class (float8, complex32, uint16-64:
    "UntypedStorage has no attribute dtype"), which ended the writer before it could answer."""

    def reducer_override(self, obj: object) -> Any:
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_quantized:  # type: ignore[attr-defined]
            buf = io.BytesIO()
            torch.save(obj, buf)
            return _tensor_from, (buf.getvalue(),)
        return NotImplemented


def _tensor_from(data: bytes) -> torch.Tensor:
    """A tensor :class:`_Pickler` sent (from this job's own training process)."""
    return torch.load(io.BytesIO(data), weights_only=False)


def _recv(conn: Connection) -> Any:
    """The next message :func:`_send` sent: the writer's settings (a dict) first, then
    ``(kind, payload)`` tuples, whose payload depends on the kind (checked by the reader)."""
    return pickle.loads(conn.recv_bytes())


# ---------------------------------------------------------------------------------------------
# training side
def _detached_from_job_signals() -> dict[str, int | bool]:
    """``Popen`` arguments that put the writer in a process group of its own.

    Signals sent to the job's process group (torchrun's SIGTERM on preemption, a terminal's
    Ctrl-C) then never reach it, not even while it starts up: its training process decides when
    it stops. A new process *group*, not a new session: Linux's autogroup scheduler gives every
    session an equal share of the CPU whatever its processes' niceness, so a writer in a
    session of its own would take as much CPU as the whole training job, slowing training down
    markedly while it writes (measured: benchmarks/README.md). Inside the job's session its
    niceness holds. Python 3.10 has no ``process_group``: there the writer gets a session of its
    own and nices that session's autogroup instead (:func:`_nice_own_autogroup`).
    """
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}


def _address() -> str:
    """An address of this host that the other ranks' writers can reach (DCP's choice too)."""
    addr = os.environ.get("MASTER_ADDR")
    if addr and os.environ.get("RANK", "0") == "0":
        return addr
    try:
        return socket.getfqdn()
    except OSError:  # pragma: no cover
        return "127.0.0.1"


class WriterProcess:
    """The training side of one rank's background writer process."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        conn: Connection,
        rank: int,
        store: torch.distributed.TCPStore | None,
        peers: torch.distributed.Store | None = None,
        failed_key: str = "",
    ) -> None:
        # What the writer's plan cache holds (its plans stay in the writer): the token each
        # save's view reports, so repeated async saves skip planning as sync ones do.
        self.plans = PlanCache()
        self.proc = proc
        self.conn = conn
        self.rank = rank
        self._store = store  # the coordinator hosts the rendezvous store; it must outlive init
        self._ready = False
        self._arena_sent: str | None = None
        # Where a rank whose writer died says so (see _wait_ready): the writers' store, this
        # start's key. None with one rank.
        self._peers = peers
        self._failed_key = failed_key
        self._owner = os.getpid()  # (a child forked from the training process inherits this object)

    @classmethod
    def start(cls, group: Group, *, timeout: timedelta, nice: int, threads: int) -> WriterProcess:
        """(all ranks, collective) Start this rank's writer; the writers form their own group."""
        store = None
        if group.is_coordinator:
            host = _address() if group.world_size > 1 else "127.0.0.1"
            # Port 0: the OS picks a free port, so there is no window in which another job takes it.
            store = torch.distributed.TCPStore(
                host,
                0,
                group.world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
            )
            info = (host, store.port, uuid.uuid4().hex)
        else:
            info = None
        host, port, prefix = group.broadcast(info) if group.world_size > 1 else info
        # The writer's global rank must equal the training rank's: DTensor meshes name global ranks.
        rank = torch.distributed.get_rank() if group.enabled else 0
        parent, child = socket.socketpair()
        # A parent-death signal fires when the *thread* that started the writer ends, not the
        # process: ask for it only from the main thread, which lives as long as the process.
        # (Otherwise the writer's watcher thread alone notices the process's death.)
        from_main = threading.current_thread() is threading.main_thread()
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        try:
            proc = subprocess.Popen(
                # Not ``-m distckpt.save.background``: that would load this module twice (once as
                # __main__), and the job's classes would not be the ones it checks for.
                [
                    sys.executable,
                    "-c",
                    "import sys; from distckpt.save.background import main; main(sys.argv[1:])",
                    str(child.fileno()),
                    str(os.getpid()),
                    "1" if from_main else "0",
                ],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
                **_detached_from_job_signals(),
            )
        finally:
            child.close()
        conn = Connection(parent.detach())
        peers = None
        if group.world_size > 1:
            peers = store if store is not None else torch.distributed.TCPStore(host, port, is_master=False, timeout=timeout)
        _send(
            conn,
            {
                "rank": rank,
                "group_rank": group.rank,
                "world": group.world_size,
                "host": host,
                "port": port,
                "prefix": prefix,
                "timeout_s": timeout.total_seconds(),
                "nice": nice,
                "threads": threads,
            }
        )
        return cls(proc, conn, group.rank, store, peers, f"distckpt-writer-failed/{prefix}")

    def _recv(self) -> Any:
        try:
            return _recv(self.conn)
        except (EOFError, OSError):
            code = self.proc.wait()
            self._tell_peers()
            raise CheckpointError(
                f"distckpt's background writer process of rank {self.rank} exited (code {code}) "
                "before answering; the save was not written"
            ) from None

    def _tell_peers(self) -> None:
        """Tell the other ranks' training processes that this rank's writer is gone."""
        if self._peers is not None:
            try:
                self._peers.set(self._failed_key, str(self.rank))
            except Exception:  # noqa: BLE001 - the store's host is gone: the exchange's timeout decides
                pass

    def _wait_ready(self) -> Any:
        """The writer's first message ("ready" once the writers formed their group), or
        ``CheckpointError`` as soon as another rank's writer died before it: this writer then
        waits for that writer in its group's rendezvous until ``timeout``, while that rank's
        training process waits in the save's exchange for this one, which a timeout there would
        break for good (every later save and load failing)."""
        while self._peers is not None and not self.conn.poll(0.2):
            try:
                failed = self._peers.check([self._failed_key])
            except Exception:  # noqa: BLE001 - the store's host is gone: its own error follows
                failed = False
            if failed:
                who = self._peers.get(self._failed_key).decode()
                raise CheckpointError(
                    f"distckpt's background writer process of rank {who} exited before the writers were ready; "
                    "the save was not written (the next async save starts new writers)"
                )
        return self._recv()

    def submit(self, job: Job) -> None:
        """(each rank, background thread) Send one save's write phase (waits for readiness once)."""
        if not self._ready:
            msg = self._wait_ready()
            if msg[0] != "ready":
                raise_if_any([msg[1]], "starting distckpt's background writer process")
            self._ready = True
        if job.arena_path == self._arena_sent:
            job = replace(job, arena_path=None)  # mapped there already
        # A new arena's descriptor follows the job (SCM_RIGHTS): the arena has no name the
        # writer could map it by (see shared_arena). Looked up first, so that a closed arena
        # fails here with nothing half-sent.
        fd = descriptor(job.arena_path) if job.arena_path is not None else None
        try:
            _send(self.conn, ("save", job))
            if fd is not None:
                send_handle(self.conn, fd, self.proc.pid)
        except ConnectionError:  # BrokenPipeError, ConnectionResetError: the writer is gone
            self._recv()  # raises, naming the exit code
        if job.arena_path is not None:
            self._arena_sent = job.arena_path

    def result(self) -> _saving.Written:
        """(each rank, background thread) The writer's :class:`~distckpt.save.phases.Written`; its
        failure raised (the same on every rank: the writers gathered their outcomes)."""
        msg = self._recv()
        if msg[0] == "err":
            self.plans.invalidate()
            raise_if_any([msg[1]], "background write")
        written, stamp = msg[1]
        self.plans.mirror(stamp)
        return written

    def detach(self) -> None:
        """Ask the writer to exit without waiting (its checkpointer was dropped unclosed). Not
        from a forked child: the writer is its parent's, still saving."""
        if os.getpid() != self._owner:
            return
        try:
            _send(self.conn, ("close", None))
        except (BrokenPipeError, OSError):
            pass

    def close(self, timeout: float = 60.0) -> None:
        """(each rank) Ask the writer to leave its group and exit; kill it if it does not (at
        once where it never said it was ready: it may wait in its group's rendezvous for a
        writer that died, and has nothing of a save). Not from a forked child (its parent's)."""
        if os.getpid() != self._owner:
            return
        try:
            _send(self.conn, ("close", None))
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout if self._ready else 0.5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self._store = self._peers = None


# ---------------------------------------------------------------------------------------------
# writer side
def _serve(conn: Connection) -> None:
    import torch.distributed as dist

    init = _recv(conn)
    try:
        if init["nice"] > 0 and hasattr(os, "nice"):
            # Niceness, not SCHED_IDLE: an idle-class writer would never run beside a busy
            # neighbour (a data loader, another job), and its save would never finish.
            os.nice(init["nice"])
            _nice_own_autogroup(init["nice"])
        torch.set_num_threads(max(1, init["threads"]))
        timeout = timedelta(seconds=init["timeout_s"])
        store = dist.TCPStore(init["host"], init["port"], init["world"], is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"distckpt-writer/{init['prefix']}", store),
            rank=init["group_rank"],
            world_size=init["world"],
            timeout=timeout,
        )
        group = Group(None)
    except BaseException as exc:  # noqa: BLE001
        _send(conn, ("err", capture(exc)))
        return
    _send(conn, ("ready", os.getpid()))
    arena = torch.empty(0, dtype=torch.uint8)
    plans = PlanCache()  # this writer's: repeated saves of one structure skip planning

    try:
        while True:
            try:
                kind, job = _recv(conn)
            except (EOFError, OSError):
                return  # the training process is gone
            if kind == "close":
                return
            fd = -1
            if job.arena_path is not None:  # a new arena: its descriptor follows the job
                try:
                    fd = recv_handle(conn)
                except (EOFError, OSError, RuntimeError):  # RuntimeError: no descriptor came
                    return  # the training process is gone, or the stream is out of step
            try:
                if fd >= 0:
                    try:
                        arena = attach(fd, job.arena_nbytes)
                    finally:
                        os.close(fd)  # the mapping keeps the memory
                    # The old arena (a layout that changed: the whole staged state) must be
                    # unmapped now: where a reference cycle still held it, this process, which
                    # makes few objects, would not collect it for many saves.
                    gc.collect()
                job.prepared.state_dict = decode(job.flat, job.mappings, arena, init["rank"])
                written = _saving.write(job.opts, group, job.prepared, plans)
                reply: tuple[str, object] = ("ok", (written, plans.stamp()))
            except BaseException as exc:  # noqa: BLE001 - reported to the training process
                reply = ("err", capture(exc))
            job = None
            _send(conn, reply)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _autogroup(pid: int | str) -> tuple[str, int] | None:
    """``(name, nice)`` of a process's autogroup (``/proc/PID/autogroup``), None where there is none."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            name, _, nice = f.read().split()
        return name, int(nice)
    except (OSError, ValueError):
        return None


def _nice_own_autogroup(nice: int) -> None:
    """Where the writer ended up in an autogroup of its own (a session of its own, see
    :func:`_detached_from_job_signals`), make that autogroup ``nice`` nicer than its training
    process's, so that the niceness means what it says. Best effort: Linux only."""
    mine, parent = _autogroup("self"), _autogroup(os.getppid())
    if mine is None or parent is None or mine[0] == parent[0]:
        return
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(min(19, parent[1] + nice)))
    except OSError:
        pass


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_MS = 1000  # how often the watcher also checks who its parent is (a hang-up wakes it at once)
_ORPHANED = 3  # exit code of a writer whose training process died (seen by nobody but init)


def _parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that started it ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):  # no prctl in this libc
        return False


def _watch_parent(fd: int, parent: int) -> None:
    """(writer, daemon thread) End the process once its training process ``parent`` is gone.

    Two signs, whichever comes first: the training process's end of the socket ``fd`` hangs up
    (its process died: the kernel closed it), or this process was re-parented (``getppid``
    changed: the training process died while a child it forked still holds the socket). Runs
    beside the main thread, which may be blocked in a collective that would wait out its whole
    timeout (its peers or its store alive, its own training process dead): the watcher needs
    nothing from it. ``os._exit``: the save being written has no one left to commit it.
    """
    hangup = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
    poller = select.poll()
    poller.register(fd, getattr(select, "POLLRDHUP", 0))  # POLLHUP/POLLERR are always reported
    while True:
        events = poller.poll(_WATCH_MS)
        if any(ev & hangup for _, ev in events) or os.getppid() != parent:
            os._exit(_ORPHANED)


def _exit_with_parent(conn: Connection, parent: int, from_main_thread: bool) -> None:
    """(writer, first thing) Make sure this process ends when its training process does.

    Linux's parent-death signal (SIGKILL) where the writer was started from the training
    process's main thread, so the kernel ends it even if no Python code can run; and, everywhere,
    a watcher thread (:func:`_watch_parent`). A parent that died before either was in place (the
    writer imports torch first) is caught by the check in between.
    """
    if from_main_thread:
        _parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(_ORPHANED)
    # A descriptor of its own (not the Connection's): it stays valid however the main thread
    # closes its connection.
    watched = os.dup(conn.fileno())
    threading.Thread(target=_watch_parent, args=(watched, parent), name="distckpt-writer-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    """The writer process: ``argv`` = socket descriptor, training process pid, "1" if started
    from the training process's main thread."""
    # A process group of its own keeps the job's signals away (see _detached_from_job_signals);
    # a SIGTERM or SIGINT sent to the writer itself ends it. Explicitly: a training process that
    # ignores them would pass that on (exec keeps ignored signals ignored).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit fails the write with an error we report
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    _exit_with_parent(conn, int(argv[1]), argv[2] == "1")
    code = 0
    try:
        _serve(conn)
    except BaseException:  # noqa: BLE001 - said on stderr and by the exit code the training side reports
        code = 1
        import traceback

        traceback.print_exc()
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown of gloo threads (see Checkpointer._release_group)

