"""Host memory shared between a training process and its background writer process.

An asynchronous save stages the state into host memory that the writer process reads. Both
processes map one file under ``/dev/shm`` (a tmpfs: memory, not disk) with ``torch.from_file(...,
shared=True)``, so staged tensors cross the process boundary without a copy or a pickle. The
arena is allocated once and reused by every save of the same layout (memory stays flat); the
writer unlinks the file as soon as it has mapped it, so nothing is left behind if either process
dies.

For accelerator state the arena is registered as pinned memory (``cudaHostRegister``), so that
device-to-host copies into it run asynchronously, as DCP's own shared+pinned staging does.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes: every tensor starts on a cache line


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
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


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
    """One shared-memory file mapped as a flat uint8 tensor (the creating side).

    Args:
        nbytes: size of the arena.
        pin: register the memory with CUDA as pinned (for non-blocking device-to-host copies).
    """

    def __init__(self, nbytes: int, pin: bool = False) -> None:
        fd, self.path = tempfile.mkstemp(prefix=f"distckpt-stage-{os.getpid()}-", dir=_shm_dir())
        try:
            os.ftruncate(fd, max(1, nbytes))
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.tensor = attach(self.path, nbytes)
        self.pinned = False
        if pin and nbytes and torch.cuda.is_available():
            # Same call DCP's shared+pinned staging makes; 0 = cudaSuccess.
            flags = 1  # cudaHostRegisterPortable
            self.pinned = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, flags)) == 0

    def unlink(self) -> None:
        """Remove the file name (the memory lives on while a process maps it)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unpin, unlink, and drop this process's mapping."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.unlink()
        self.tensor = torch.empty(0, dtype=torch.uint8)


def attach(path: str, nbytes: int, *, existing: bool = False) -> torch.Tensor:
    """Map the arena file ``path`` (``nbytes`` long) as a shared uint8 tensor.

    Args:
        existing: the file must exist already with (at least) ``nbytes`` bytes: what a writer
            process maps was staged by its training process. ``torch.from_file`` would create a
            missing file, empty, and the writer would write zeros that pass every check.

    Raises:
        FileNotFoundError: ``existing`` and the file is missing or shorter than ``nbytes``.
    """
    if existing:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"distckpt's staging arena {path} is gone; the staged state cannot be written") from None
        if size < max(1, nbytes):
            raise FileNotFoundError(f"distckpt's staging arena {path} holds {size} bytes, not the {nbytes} staged")
    return torch.from_file(path, shared=True, size=max(1, nbytes), dtype=torch.uint8)[:nbytes]
