"""Checksums of checkpoint files: computed while writing (:mod:`distckpt.save.writer`), recorded in
the manifest, verified while reading (:class:`distckpt.integrity.stepfiles.VerifiedFile`, the one read path
of load, verify, inspect and convert).

``crc32c`` is the default. Every byte saved or loaded passes through the checksum once, so its
speed bounds both. CRC-32C (Castagnoli) has a CPU instruction on x86-64 (SSE4.2) and ARMv8,
and it is the checksum S3 (``x-amz-checksum-crc32c``) and GCS verify natively. It is computed by
the ``crc32c`` package: its C code uses that instruction, takes any buffer without a copy (the
reader checks tensors' memory in place), and releases the GIL, so reader and writer threads
checksum in parallel. google-crc32c was rejected because it accepts only immutable ``bytes``,
which would mean a copy of every tensor. Where the CPU lacks the instruction, the package falls
back to a table-driven C loop (still no pure-Python loop), and distckpt warns once.

``crc32`` (zlib, the default before 0.3) and ``sha256`` (a cryptographic digest) stay
available, and checkpoints written with them are read as before: the manifest records the
algorithm. No checksum protects against an attacker who can also rewrite the manifest.
"""

from __future__ import annotations

import hashlib
import warnings
import zlib
from collections.abc import Callable
from typing import IO, Protocol

ALGORITHMS = ("crc32c", "crc32", "sha256")
DEFAULT = "crc32c"


#: What a hasher takes: any contiguous bytes-like object (tensor memory is handed over as a
#: ``memoryview``, without a copy).
Buffer = bytes | bytearray | memoryview


class Hasher(Protocol):
    """A streaming checksum (``hashlib``'s interface): ``update`` with each piece, in order,
    then ``hexdigest``."""

    def update(self, data: Buffer) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Buffer) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


class _Crc32c:
    def __init__(self) -> None:
        self._crc = _crc32c_function()
        self._value = 0

    def update(self, data: Buffer) -> None:
        self._value = self._crc(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


_crc32c: Callable[[Buffer, int], int] | None = None


def _crc32c_function() -> Callable[[Buffer, int], int]:
    """The ``crc32c`` package's function, imported once; warns once if it has no hardware path."""
    global _crc32c
    if _crc32c is None:
        try:
            import crc32c
        except ImportError:
            raise ImportError(
                "checksum 'crc32c' needs the crc32c package (a distckpt dependency): pip install crc32c"
            ) from None
        if not getattr(crc32c, "hardware_based", True):
            warnings.warn(
                "distckpt: this CPU has no CRC32C instruction that the crc32c package can use; "
                "checksums run in its table-driven C fallback (several times slower)",
                RuntimeWarning,
                stacklevel=3,
            )
        _crc32c = crc32c.crc32c
    return _crc32c


def digest_of_file(f: IO[bytes], algorithm: str, chunk: int = 16 << 20) -> str:
    """The checksum with ``algorithm`` of what is left to read in open file ``f``, read in
    pieces of ``chunk`` bytes."""
    hasher = new_hasher(algorithm)
    while piece := f.read(chunk):
        hasher.update(piece)
    return hasher.hexdigest()


def new_hasher(algorithm: str) -> Hasher:
    """A fresh streaming hasher for ``algorithm`` (one of :data:`ALGORITHMS`)."""
    if algorithm == "crc32c":
        return _Crc32c()
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; choose one of {ALGORITHMS}")


CHUNK = 8 * 1024 * 1024
