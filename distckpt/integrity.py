"""Checksums of checkpoint files: computed while writing, recorded in the manifest, verified on read.

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
from typing import Any, Protocol

ALGORITHMS = ("crc32c", "crc32", "sha256")
DEFAULT = "crc32c"


class Hasher(Protocol):
    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


class _Crc32c:
    def __init__(self) -> None:
        self._crc = _crc32c_function()
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = self._crc(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


_crc32c: Any = None


def _crc32c_function() -> Any:
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


def file_digest(stream: Any, algorithm: str) -> tuple[int, str]:
    """Size and digest of everything readable from ``stream`` (read in bounded chunks)."""
    h = new_hasher(algorithm)
    size = 0
    while True:
        chunk = stream.read(CHUNK)
        if not chunk:
            break
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def check_file(storage: Any, directory: str, name: str, record: Any, algorithm: str | None) -> None:
    """Check one file of a step against its manifest record (size, and checksum if recorded),
    reading it once, streaming; opened the way loads open it (a symbolic link is refused).

    The one whole-file check behind ``verify`` and ``convert`` (loads check the same while they
    read, in :mod:`distckpt._reader`).

    Raises:
        IntegrityError: missing, wrong size or wrong checksum, naming the file.
        UnsafeCheckpointError: the file is a symbolic link or not a regular file.
    """
    from .errors import IntegrityError

    where = storage.display(directory, name)
    try:
        with storage.open(f"{directory}/{name}" if directory else name, "rb") as f:
            size, digest = file_digest(f, algorithm or DEFAULT)
    except FileNotFoundError:
        raise IntegrityError(f"{where}: missing") from None
    if size != record.size:
        raise IntegrityError(f"{where}: size {size} bytes, manifest says {record.size} (truncated or overwritten)")
    if record.checksum and algorithm and digest != record.checksum:
        raise IntegrityError(f"{where}: {algorithm} {digest} does not match the manifest's {record.checksum} (corrupted)")


def verify_checkpoint(storage: Any, step: int) -> list[str]:
    """Problems of committed ``step`` under ``storage``: one line per bad file, [] if intact.

    Checks every file the manifest lists (:func:`check_file`), and that the step directory
    holds no data file the manifest does not know. Not collective.
    """
    from .errors import IntegrityError, UnsafeCheckpointError
    from .manifest import read_manifest, step_dir

    manifest = read_manifest(storage, step)
    directory = step_dir(step)
    present = storage.list_files(directory)
    problems: list[str] = []
    for name, record in sorted(manifest.files.items()):
        if name not in present:
            problems.append(f"{storage.display(directory, name)}: missing")
            continue
        try:
            check_file(storage, directory, name, record, manifest.checksum_algorithm)
        except (IntegrityError, UnsafeCheckpointError) as exc:
            problems.append(str(exc))
    for name in sorted(set(present) - set(manifest.files) - {"manifest.json"}):
        if name.endswith(".distcp"):
            problems.append(f"{storage.display(directory, name)}: not listed in the manifest")
    return problems
