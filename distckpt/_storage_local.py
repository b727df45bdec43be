"""A checkpoint root on a local disk (see :mod:`distckpt.storage`).

Writes are atomic the POSIX way: a temporary file, ``fsync``, then ``rename`` (or, exclusive, a
hard link that fails if the name exists), then ``fsync`` of the directory. Nothing is read,
listed or deleted through a symbolic link below the root: a link may point at another run's
checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
from torch.distributed.checkpoint.filesystem import FileSystem as _LocalDcpFS
from torch.distributed.checkpoint.filesystem import FileSystemBase

from .storage import NEW_DIR_PREFIX, Storage, _fsync_dir, named_os_error


class LocalStorage(Storage):
    """A root that is a local directory (a path or a ``file://`` URL)."""

    is_local = True

    def __init__(self, root: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(root, storage_options)
        root = os.fspath(root)
        if "://" in root:
            root = root.split("://", 1)[1]
        self.path = os.path.abspath(os.path.expanduser(root))
        self.url = self.path
        self.fs = fsspec.filesystem("file")

    # paths and queries ------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def display(self, *parts: str) -> str:
        return self.join(*parts)

    def root_exists(self) -> bool:
        return os.path.isdir(self.path)

    def exists(self, *parts: str) -> bool:
        return os.path.exists(self.join(*parts))

    def list_dirs(self) -> list[str]:
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return []
        links = sorted(e.name for e in entries if e.is_symlink())
        if links:
            # A link may point at another run's checkpoints: never list, clean up or delete
            # through it (that would delete outside the root).
            warnings.warn(
                f"distckpt: ignoring symbolic link(s) in checkpoint root {self.path}: {', '.join(links)}",
                stacklevel=3,
            )
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))

    def list_files(self, *parts: str) -> dict[str, int]:
        try:
            return {e.name: e.stat().st_size for e in os.scandir(self.join(*parts)) if e.is_file()}
        except FileNotFoundError:
            return {}

    # bytes ------------------------------------------------------------------------------------
    def read_bytes(self, *parts: str) -> bytes:
        with self._open_read(parts) as f:
            return f.read()

    def write_bytes(self, data: bytes, *parts: str, exclusive: bool = False) -> None:
        path = self.join(*parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # e.g. a full disk: no temporary file left, the path named
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise named_os_error(exc, path) from exc
        if exclusive:
            try:
                os.link(tmp, path)  # fails if ``path`` exists: the first writer wins
            finally:
                os.remove(tmp)
        else:
            os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))

    def create_exclusive(self, dirname: str, name: str, data: bytes) -> None:
        # Built under a temporary name and renamed into place, so the directory never exists
        # without its file (a writer killed in between leaves only a temporary directory).
        # rename() refuses a non-empty target: the first writer wins.
        os.makedirs(self.path, exist_ok=True)
        tmp = f"{NEW_DIR_PREFIX}{uuid.uuid4().hex[:12]}"
        os.mkdir(self.join(tmp))
        try:
            self.write_bytes(data, tmp, name)
            os.rename(self.join(tmp), self.join(dirname))
        except OSError as exc:
            shutil.rmtree(self.join(tmp), ignore_errors=True)
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise FileExistsError(f"{self.display(dirname)} exists") from None
            raise
        _fsync_dir(self.path)

    def remove(self, *parts: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.join(*parts))

    def remove_tree(self, *parts: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.join(*parts))

    def makedirs(self, *parts: str) -> None:
        os.makedirs(self.join(*parts), exist_ok=True)

    # files ------------------------------------------------------------------------------------
    @contextmanager
    def open(self, rel: str, mode: str = "rb") -> Iterator[Any]:
        if "r" in mode and "+" not in mode:
            with self._open_read(tuple(p for p in rel.split("/") if p)) as f:
                yield f
            return
        path = self.join(rel)
        try:
            with open(path, mode) as f:
                yield f
        except OSError as exc:  # a full disk: say which file
            raise named_os_error(exc, path) from exc

    def _open_read(self, parts: tuple[str, ...]) -> Any:
        """Open ``parts`` for reading without following any symbolic link below the root: every
        file a load, verify, inspect or convert reads stays inside it."""
        from .errors import UnsafeCheckpointError

        where = self.join(*parts)
        current = self.path
        for part in parts[:-1]:
            current = os.path.join(current, part)
            if os.path.islink(current):
                raise UnsafeCheckpointError(f"{current} is a symbolic link; refusing to read checkpoint files through it")
        try:
            fd = os.open(where, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeCheckpointError(f"{where} is a symbolic link; refusing to read a checkpoint file through it") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeCheckpointError(f"{where} is not a regular file")
        return os.fdopen(fd, "rb")

    def dcp_filesystem(self) -> FileSystemBase:
        return _LocalDcpFS()

    def dcp_path(self, *parts: str) -> Any:
        return Path(self.join(*parts))

    def sync_file(self, f: Any) -> None:
        os.fsync(f.fileno())

    cheap_seeks = True
