"""Nothing left behind by a crash (issue #28, item 5): no staging arena in /dev/shm, no writer.

A training process that dies (SIGKILL, OOM killer) must not leave its async-save writer process
running, nor its staging memory named in ``/dev/shm``; a writer must stop on a SIGTERM sent to it,
while a SIGTERM to the job's process group still misses it. Each test starts a training process
(this file run as a script, see ``_child``) and times everything by what it observes: a line the
process prints, a process that is gone; deadlines only bound how long a failure takes.

    python tests/test_leftovers.py crash ROOT             # async save, then SIGKILL itself
    python tests/test_leftovers.py blocked main|thread PORT  # a writer that joins the test's store
    python tests/test_leftovers.py signals ROOT           # saves on command (stdin), reports what happened
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Deadlines only bound how long a failure takes (this machine may be loaded: a Python that
# imports torch has taken 20 s to start here).
ANSWER_S = 300.0  # for a training process to answer
DEADLINE_S = 120.0  # a writer that outlives its parent by this long is an orphan (the bug: 600 s+)
PREFIX = "distckpt-stage-"


# ---------------------------------------------------------------------------------------------
# helpers (test side)
def _alive(proc) -> bool:  # proc: psutil.Process
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _writer(pid: int):
    """A psutil handle on the writer ``pid`` (its start time guards against pid reuse), or None
    if it is gone already."""
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _wait_gone(proc, deadline_s: float = DEADLINE_S) -> float:
    """Poll until ``proc`` exited (a zombie counts: its parent may be dead); seconds it took."""
    t0 = time.monotonic()
    while proc is not None and _alive(proc):
        if time.monotonic() - t0 > deadline_s:
            raise AssertionError(f"writer process {proc.pid} still alive {deadline_s:.0f}s after its parent died")
        time.sleep(0.02)
    return time.monotonic() - t0


def _wait_reapable(pid: int, deadline_s: float = DEADLINE_S) -> None:
    """Poll until process ``pid`` (a zombie, or gone) has no thread left but its leader: a
    thread-group leader shows as a zombie while its other threads still exit, and its parent
    cannot reap it (nor see its exit code) until they have."""
    t0 = time.monotonic()
    while True:
        try:
            if len(os.listdir(f"/proc/{pid}/task")) <= 1:
                return
        except FileNotFoundError:
            return
        if time.monotonic() - t0 > deadline_s:
            raise AssertionError(f"process {pid}'s threads still exiting {deadline_s:.0f}s after it died")
        time.sleep(0.02)


def _kill(proc) -> None:
    """Clean up after a failure: SIGKILL (a writer of the old code ignored SIGTERM)."""
    if proc is not None and _alive(proc):
        proc.kill()


def _shm() -> str:
    """Where a staging arena would have its name (distckpt.save.shared_arena's choice)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _leftovers(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(_shm()) if n.startswith(f"{PREFIX}{pid}-"))


class _Lines:
    """The lines a child prints, read by a thread so that every read has a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def next(self, timeout: float = ANSWER_S) -> str:
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer from the training process within {timeout:.0f}s") from None
        if line is None:
            raise AssertionError(f"the training process exited ({self.proc.wait()}): {self.proc.stderr.read()[-3000:]}")
        return line.strip()


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a process group of its own: the test may signal the whole group
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# tests
@pytest.mark.timeout(900)
def test_a_training_process_killed_after_its_first_async_save_leaves_nothing_behind(tmp_path):
    """The probe: SIGKILL right after the first async save returned. The writer was still
    starting (its rendezvous store lived in the dead process); it used to retry that store for
    longer than its timeout (600 s here), and the staging arena stayed in /dev/shm for good."""
    child = _spawn("crash", str(tmp_path / "ck"))
    writer = None
    try:
        info = json.loads(_Lines(child).next())
        writer = _writer(info["writer"])
        assert child.wait(DEADLINE_S) == -signal.SIGKILL
        _wait_gone(writer)
        assert not _leftovers(info["pid"]), "the dead process's staging arena is still in /dev/shm"
    finally:
        child.kill()
        _kill(writer)
        if child.pid is not None:
            for name in _leftovers(child.pid):  # the old code's leftovers: do not keep them
                os.unlink(os.path.join(_shm(), name))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_a_writer_blocked_in_a_collective_exits_when_its_training_process_dies(started_from):
    """A writer waits in its writers' rendezvous for a peer that never comes, on a store that
    stays up (hosted here, as rank 0's store is when another rank's training process dies) when
    its training process is SIGKILLed. The old writer waited out its timeout (600 s here), its
    main thread blocked where it could not notice. Started from the main thread, the kernel kills
    it (parent-death signal); started from a thread that has ended (where a parent-death signal
    would have fired at that thread's end), its watcher thread ends it."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=600), wait_for_workers=False)
    child = _spawn("blocked", started_from, str(store.port))
    writer = None
    try:
        info = json.loads(_Lines(child).next())
        writer = _writer(info["writer"])
        t0 = time.monotonic()
        while store.num_keys() == 0:  # observed: the writer has checked in and waits for its peer
            assert writer is not None and _alive(writer), "the writer died before its rendezvous"
            assert time.monotonic() - t0 < ANSWER_S, "the writer never reached its rendezvous"
            time.sleep(0.02)
        child.kill()
        assert child.wait(DEADLINE_S) == -signal.SIGKILL
        took = _wait_gone(writer)
        print(f"writer gone {took:.2f}s after its parent's death")
    finally:
        child.kill()
        _kill(writer)
        del store


@pytest.mark.timeout(900)
def test_a_writer_honours_sigterm_sent_to_it_but_not_to_the_jobs_process_group(tmp_path):
    """SIGTERM to the training job's process group (torchrun, a terminal) misses the writer, so a
    final save requested from a signal handler is still written; SIGTERM to the writer itself
    ends it (the old writer ignored it), and the next async save replaces it and commits. The
    training process ignores SIGTERM, a disposition every exec'd child inherits: the writer must
    restore the default itself. The first save runs in a thread that ends before the second: a
    writer must outlive the thread that started it (a parent-death signal would fire at that
    thread's end, and a writer with one pending cannot answer the second save)."""
    child = _spawn("signals", str(tmp_path / "ck"))
    lines = _Lines(child)
    writer = None

    def save(step: int) -> str:
        child.stdin.write(f"save {step}\n")
        child.stdin.flush()
        return lines.next()

    try:
        info = json.loads(lines.next())
        writer = _writer(info["writer"])
        assert writer is not None and os.getpgid(writer.pid) != os.getpgid(child.pid)
        assert save(2) == json.dumps({"saved": 2, "writer": writer.pid}), "the writer must outlive the thread that started it"
        os.killpg(child.pid, signal.SIGTERM)  # the job's group (the child leads its own session)
        assert save(3) == json.dumps({"saved": 3, "writer": writer.pid}), "a SIGTERM to the job's group must miss the writer"
        writer.send_signal(signal.SIGTERM)
        _wait_gone(writer)
        _wait_reapable(writer.pid)
        # The next async save replaces the ended writer (every rank restarts its own, one
        # warning naming its exit code) and commits; it failed before (tests/test_writer_restart.py).
        replaced = json.loads(save(4))
        assert replaced["saved"] == 4 and replaced["writer"] != writer.pid, replaced
        again = json.loads(save(5))
        assert again == {"saved": 5, "writer": replaced["writer"]}, again
        child.stdin.close()
        assert child.wait(ANSWER_S) == 0, child.stderr.read()[-3000:]
    finally:
        child.kill()
        _kill(writer)


def test_a_staging_arena_has_no_name_and_close_releases_it():
    """No file of the arena is ever in /dev/shm (a process killed at any point leaves none), and
    close() releases its descriptor."""
    import torch

    from distckpt.save.shared_arena import SharedArena

    arena = SharedArena(1 << 16)
    arena.tensor[:4] = torch.arange(4, dtype=torch.uint8)
    assert not _leftovers(os.getpid()), "the arena has a name in /dev/shm"
    fd = arena.fd
    assert os.fstat(fd).st_size == 1 << 16
    arena.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed (unless reused by then: this test runs alone in its thread)
    assert not _leftovers(os.getpid())


def test_an_arena_in_a_mount_too_small_for_it_is_an_error_not_a_sigbus(monkeypatch):
    """Where memfd_create is refused (a seccomp profile), the arena is a file in /dev/shm. On a
    tmpfs smaller than the arena (Docker's 64 MiB default) the sparse file was accepted and the
    first copy into a page it had no room for killed training with SIGBUS (found by a helper:
    a 64 MiB tmpfs in a private mount namespace). Its blocks are reserved when it is made."""
    import errno

    from distckpt.save.shared_arena import SharedArena

    def refused(*_a, **_k):
        raise OSError(errno.EPERM, "memfd_create refused")

    monkeypatch.setattr(os, "memfd_create", refused, raising=False)
    arena = SharedArena(1 << 16)  # the named file, with room: as before
    arena.tensor.fill_(7)
    assert int(arena.tensor.sum()) == 7 << 16 and not _leftovers(os.getpid())
    arena.close()
    reserved = []

    def full(fd, offset, length):
        reserved.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match=r"needs 1,048,576 bytes of shared memory .*--shm-size.*async_mode=\"thread\"") as info:
        SharedArena(1 << 20)
    assert info.value.errno == errno.ENOSPC and reserved == [1 << 20]
    assert set(os.listdir("/proc/self/fd")) <= before and not _leftovers(os.getpid())  # nothing left open or named


def _staging_descriptors() -> list[int]:
    """This process's open descriptors of staging arenas."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if "distckpt-stage" in os.readlink(f"/proc/self/fd/{name}"):
                out.append(int(name))
        except OSError:
            pass
    return out


def test_a_checkpointer_dropped_unclosed_releases_its_staging_memory(tmp_path):
    """A Checkpointer dropped without close() after an async save with a writer process kept its
    staging arena's descriptor open, and with it the whole staged state in shared memory (ten
    dropped checkpointers of 16 MiB held 160 MiB). Found by a helper (2026-11-29)."""
    import gc

    import torch

    import distckpt
    from distckpt.save.shared_arena import SharedArena

    before = _staging_descriptors()
    arena = SharedArena(1 << 16)
    assert arena.fd in _staging_descriptors()
    del arena
    gc.collect()
    assert _staging_descriptors() == before, "a dropped arena keeps its memory"

    ck = distckpt.Checkpointer(tmp_path / "ck", async_mode="process")
    ck.save(1, {"w": torch.ones(1 << 16)}, blocking=False)
    ck.wait()
    assert len(_staging_descriptors()) > len(before)
    del ck
    gc.collect()
    assert _staging_descriptors() == before, "a dropped checkpointer keeps its staging memory"


def test_a_new_arena_removes_the_leftovers_of_dead_processes_only(tmp_path):
    """Staging files named by a process that is gone (left by a distckpt that named its arenas)
    are removed when the next arena is made; a live process's files are never touched."""
    from distckpt.save.shared_arena import SharedArena

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead = int(done.stdout)  # reaped: no process has this pid (pids are reused only after a wrap)
    shm = _shm()
    planted = {
        "dead": os.path.join(shm, f"{PREFIX}{dead}-k2j4l1x0"),
        "live": os.path.join(shm, f"{PREFIX}{os.getppid()}-a9b8c7d6"),
        "other": os.path.join(shm, f"{PREFIX}notapid-x"),
        # Anybody can name a file in /dev/shm: these failed every user's next arena (OverflowError
        # from os.kill, ValueError from int("²"), which str.isdigit takes) and must be kept.
        "huge": os.path.join(shm, f"{PREFIX}99999999999999999999999-x"),
        "superscript": os.path.join(shm, f"{PREFIX}²-x"),
        "zero": os.path.join(shm, f"{PREFIX}0-x"),
    }
    for path in planted.values():
        Path(path).write_bytes(b"\0" * 64)
    try:
        SharedArena(4096).close()
        assert not os.path.exists(planted["dead"]), "a dead process's staging file was left behind"
        assert all(os.path.exists(planted[k]) for k in ("live", "other", "huge", "superscript", "zero"))
    finally:
        for path in planted.values():
            if os.path.exists(path):
                os.unlink(path)


# ---------------------------------------------------------------------------------------------
# the training process (this file run as a script)
def _child(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled", category=UserWarning)
    import torch

    import distckpt

    mode = argv[0]
    if mode == "crash":
        ckpt = distckpt.Checkpointer(argv[1], timeout=600)
        ckpt.save(1, {"w": torch.arange(4096, dtype=torch.float32)}, blocking=False)
        print(json.dumps({"pid": os.getpid(), "writer": ckpt._saver.writer.proc.pid}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "blocked":
        from types import SimpleNamespace

        from distckpt.save.background import WriterProcess

        # Rank 1 of a group of two whose store the test hosts: the writer joins its writers'
        # group and waits there for rank 0's writer (which never comes).
        address = ("127.0.0.1", int(argv[2]), "blocked")
        group = SimpleNamespace(is_coordinator=False, world_size=2, rank=1, enabled=False, broadcast=lambda obj: address)
        box: dict[str, WriterProcess] = {}

        def start() -> None:
            box["writer"] = WriterProcess.start(group, timeout=timedelta(seconds=600), nice=0, threads=1)

        if argv[1] == "thread":
            thread = threading.Thread(target=start)
            thread.start()
            thread.join()
        else:
            start()
        print(json.dumps({"pid": os.getpid(), "writer": box["writer"].proc.pid}), flush=True)
        sys.stdin.read()  # until the test kills this process
    elif mode == "signals":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ckpt = distckpt.Checkpointer(argv[1], timeout=600)
        state = {"w": torch.arange(4096, dtype=torch.float32)}
        tid: list[int] = []

        def first_save() -> None:  # starts the writer from a thread that then ends
            ckpt.save(1, state, blocking=False)
            ckpt.wait()
            tid.append(threading.get_native_id())

        thread = threading.Thread(target=first_save)
        thread.start()
        thread.join()
        t0 = time.monotonic()
        while os.path.exists(f"/proc/self/task/{tid[0]}"):  # observed: the thread's end is done
            assert time.monotonic() - t0 < ANSWER_S, "the thread did not end"
            time.sleep(0.01)
        print(json.dumps({"writer": ckpt._saver.writer.proc.pid}), flush=True)
        for line in sys.stdin:
            step = int(line.split()[1])
            try:
                ckpt.save(step, state, blocking=False)
                ckpt.wait()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                print(f"failed {step}: {type(exc).__name__}: {exc}", flush=True)
                continue
            print(json.dumps({"saved": step, "writer": ckpt._saver.writer.proc.pid}), flush=True)
        ckpt.close()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    _child(sys.argv[1:])


def test_an_arena_over_the_file_size_limit_is_named(tmp_path):
    """Under `ulimit -f` (RLIMIT_FSIZE) smaller than the state, the first async save of process
    mode failed with a bare `OSError: File too large` on every rank."""
    script = tmp_path / "limit.py"
    script.write_text(
        "import errno, os, resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "from distckpt.save.shared_arena import SharedArena\n"
        "try:\n"
        "    SharedArena(1 << 20)\n"
        "except OSError as exc:\n"
        "    assert exc.errno == errno.EFBIG, exc\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "staging arena of 1,048,576 bytes" in out.stdout and "ulimit -f" in out.stdout and 'async_mode="thread"' in out.stdout
