"""Host memory shared between a training process and its background writer process.

An asynchronous save stages the state into host memory that the writer process reads. Both
processes map one memory file (a tmpfs: memory, not disk) with ``torch.from_file(...,
shared=True)``, so staged tensors cross the process boundary without a copy or a pickle. The
arena is allocated once and reused by every save of the same layout (memory stays flat).

The memory file never has a name that a dead process could leave behind: it is an anonymous
memory file (``memfd_create``; where that is missing, a file under ``/dev/shm`` unlinked the
moment it is created), held by a file descriptor. Each process maps it through its own
descriptor: the training process keeps the one it created, and hands a copy to its writer
process over their Unix socket (:func:`~distckpt.save.background.WriterProcess.submit`, as
``SCM_RIGHTS``). The kernel frees the memory when the last descriptor and mapping are gone, so
a process killed at any point leaves nothing in ``/dev/shm``. Files that earlier versions of
distckpt left there (``distckpt-stage-<pid>-*``, named until the writer mapped them) are removed
when a new arena is made, once their process is gone (:func:`remove_leftovers`).

For accelerator state the arena is registered as pinned memory (``cudaHostRegister``), so that
device-to-host copies into it run asynchronously, as DCP's own shared+pinned staging does.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import uuid
import weakref
from dataclasses import dataclass

import torch

from distckpt._process import parse_pid, process_exists
from distckpt.state.shape import numel

ALIGN = 64  # bytes: every tensor starts on a cache line
PREFIX = "distckpt-stage-"  # names of staging files: PREFIX + "<pid>-" + a unique part

# The arenas of this process that are open, by name: what a writer process is handed.
_OPEN: weakref.WeakValueDictionary[str, SharedArena] = weakref.WeakValueDictionary()


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class Slot:
    """Where one staged (contiguous) tensor lives in an arena: byte offset, dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


def plan_slots(layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[dict[str, Slot], int]:
    """Aligned slots for ``(key, dtype, shape)`` entries, and the arena size they need."""
    slots: dict[str, Slot] = {}
    offset = 0
    for key, dtype, shape in layout:
        slot = Slot(offset, dtype, tuple(shape))
        slots[key] = slot
        offset += -(-slot.nbytes // ALIGN) * ALIGN
    return slots, offset


def view(arena: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor ``slot`` describes, a view of ``arena``'s memory (uint8, 1-D)."""
    raw = arena[slot.offset : slot.offset + slot.nbytes]
    return raw.view(slot.dtype).view(slot.shape) if slot.shape else raw.view(slot.dtype).view(())


class SharedArena:
    """One anonymous shared-memory file mapped as a flat uint8 tensor (the creating side).

    Args:
        nbytes: size of the arena.
        pin: register the memory with CUDA as pinned (for non-blocking device-to-host copies).

    Attributes:
        name: identifies this arena between the training process and its writer
            (``distckpt-stage-<pid>-<unique>``); no file has this name.
        fd: the descriptor holding the memory (-1 once closed); :func:`descriptor` finds it
            by ``name``.
    """

    def __init__(self, nbytes: int, pin: bool = False) -> None:
        remove_leftovers()
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        self.fd = _anonymous_file(max(1, nbytes))
        self.nbytes = nbytes
        try:
            self.tensor = attach(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        _OPEN[self.name] = self
        self.pinned = False
        if pin and nbytes and torch.cuda.is_available():
            # Same call DCP's shared+pinned staging makes; 0 = cudaSuccess.
            flags = 1  # cudaHostRegisterPortable
            self.pinned = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, flags)) == 0
        # An arena dropped unclosed (its checkpointer dropped without close()) must not keep its
        # memory: the descriptor alone holds it once the mapping is gone. Run on close() too.
        self._finalizer = weakref.finalize(self, _release, self.fd, self.tensor.data_ptr() if self.pinned else None)

    @property
    def path(self) -> str:
        """The arena's :attr:`name` (what a save's ``Job.arena_path`` carries; not a file)."""
        return self.name

    def close(self) -> None:
        """Unpin, drop this process's mapping and close its descriptor (the memory is freed
        once the writer process's mapping is gone too)."""
        self._finalizer()  # unpinned while still mapped; once
        self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        _OPEN.pop(self.name, None)
        self.fd = -1


def _release(fd: int, pinned_at: int | None) -> None:
    """Unpin the arena mapped at ``pinned_at`` (if pinned) and close its descriptor ``fd``."""
    if pinned_at is not None:
        torch.cuda.cudart().cudaHostUnregister(pinned_at)
    try:
        os.close(fd)
    except OSError:
        pass


def descriptor(name: str) -> int:
    """(training side) The descriptor of this process's open arena ``name``, to hand to a writer.

    Raises:
        FileNotFoundError: no arena of that name is open (it was closed).
    """
    arena = _OPEN.get(name)
    if arena is None or arena.fd < 0:
        raise FileNotFoundError(f"distckpt's staging arena {name} is closed; the staged state cannot be written")
    return arena.fd


def _anonymous_file(nbytes: int) -> int:
    """A descriptor of ``nbytes`` of fresh shared memory that has no name anywhere."""
    fd = -1
    if hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create("distckpt-stage", os.MFD_CLOEXEC)
        except OSError:  # e.g. a seccomp profile without it: fall back to a named file
            fd = -1
    named = fd < 0
    if named:
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=_shm_dir())
        # Mapped through the descriptor, so the name can go at once. Should this process die
        # in between, its file is a leftover of a dead process: the next arena removes it.
        os.unlink(path)
    try:
        try:
            os.ftruncate(fd, nbytes)
        except OSError as exc:
            if exc.errno != errno.EFBIG:
                raise
            raise OSError(
                exc.errno,
                f"distckpt's staging arena of {nbytes:,} bytes (a shared-memory file) is larger than this process "
                "may make a file (`ulimit -f`, RLIMIT_FSIZE): raise that limit, or save with async_mode=\"thread\" "
                "(private host memory)",
            ) from None
        if named and nbytes:
            _reserve(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate the named file's blocks now: a sparse file on a tmpfs too small for it (Docker's
    64 MiB ``/dev/shm``) is accepted, and the first copy into a page it has no room for kills
    the process with SIGBUS. (Not for ``memfd_create``'s memory, which no mount limits.)

    Raises:
        OSError: ``ENOSPC``, naming the directory, the size and the ways out.
    """
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a filesystem that cannot reserve: as before
        raise OSError(
            exc.errno,
            f"distckpt's staging arena needs {nbytes:,} bytes of shared memory in {_shm_dir()} (memfd_create is not "
            f"available here) and cannot have them ({os.strerror(exc.errno)}): enlarge that mount (docker run "
            "--shm-size), or save with async_mode=\"thread\" (private host memory)",
        ) from None


def _fd_path(fd: int) -> str:
    """A path that opens this process's descriptor ``fd`` (what ``torch.from_file`` maps)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def attach(fd: int, nbytes: int) -> torch.Tensor:
    """Map the arena held by descriptor ``fd`` (``nbytes`` long) as a shared uint8 tensor.

    The mapping stays valid after ``fd`` is closed.

    Raises:
        FileNotFoundError: the memory file is shorter than ``nbytes`` (``torch.from_file`` would
            extend it with zeros, and the writer would write zeros that pass every check).
    """
    size = os.fstat(fd).st_size
    if size < max(1, nbytes):
        raise FileNotFoundError(f"distckpt's staging arena holds {size} bytes, not the {nbytes} staged")
    return torch.from_file(_fd_path(fd), shared=True, size=max(1, nbytes), dtype=torch.uint8)[:nbytes]


def remove_leftovers(directory: str | None = None) -> list[str]:
    """Remove staging files (``distckpt-stage-<pid>-*``) whose process is gone; their paths.

    Only this user's regular files whose ``<pid>`` is no running process are removed: a live
    process's files are never touched (nor those of a process that reused a dead one's pid,
    which are then kept, not lost). A process of another pid namespace that shares
    ``/dev/shm`` looks dead here; the arenas of this version are mapped through their
    descriptors, so removing such a name cannot take their memory away.

    Args:
        directory: where staging files live (default: ``/dev/shm``, or the temp dir without it).
    """
    directory = directory or _shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    uid = os.getuid() if hasattr(os, "getuid") else None
    removed = []
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = parse_pid(name[len(PREFIX) :].split("-", 1)[0])
        if pid is None or process_exists(pid):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
                continue
            os.unlink(path)
        except OSError:  # gone already, or not ours to remove
            continue
        removed.append(path)
    return removed
