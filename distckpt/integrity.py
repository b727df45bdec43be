"""Checksums of checkpoint files: computed while writing, recorded in the manifest, verified on read.

``crc32`` (zlib) is the default: it detects flipped bytes and truncation at a cost well under
a disk's speed (figures in benchmarks/README.md). ``sha256`` is there for users who want a
cryptographic digest. Neither protects against an attacker who can also rewrite the manifest.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, Protocol

ALGORITHMS = ("crc32", "sha256")


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


def new_hasher(algorithm: str) -> Hasher:
    """A fresh streaming hasher for ``algorithm`` (one of :data:`ALGORITHMS`)."""
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
            size, digest = file_digest(f, algorithm or "crc32")
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
