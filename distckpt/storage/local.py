"""A checkpoint root on a local disk (see :mod:`distckpt.storage.base`).

Writes are atomic the POSIX way: a temporary file, ``fsync``, then ``rename`` (or, exclusive, a
hard link that fails if the name exists), then ``fsync`` of the directory. Nothing is read,
listed or deleted through a symbolic link below the root: a link may point at another run's
checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import socket
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, BinaryIO

import fsspec
from torch.distributed.checkpoint.filesystem import FileSystem as _LocalDcpFS
from torch.distributed.checkpoint.filesystem import FileSystemBase

from distckpt.storage.base import (
    NotARegularFile,
    Storage,
    WritableFile,
    _fsync_dir,
    _redact,
    local_path,
    named_os_error,
    new_dir_name,
    open_regular_file,
)
from distckpt.errors import UnsafeCheckpointError


class LocalStorage(Storage, kind="local"):
    """A root that is a local directory (a path or a ``file://`` URL)."""

    is_local = True

    def __init__(self, root: str | os.PathLike, storage_options: Mapping[str, object] | None = None) -> None:
        super().__init__(root, storage_options)
        path = local_path(root)
        if path is None:
            raise ValueError(f"LocalStorage serves local paths and file:// URLs, not {_redact(os.fspath(root))}")
        self.path = path
        self.url = self.path
        self.fs = fsspec.filesystem("file")

    def identity(self) -> str:
        return os.path.realpath(self.path)

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
        return self.list_entries(*parts)[0]

    def list_entries(self, *parts: str) -> tuple[dict[str, int], list[str]]:
        files: dict[str, int] = {}
        others: list[str] = []
        try:
            entries = list(os.scandir(self.join(*parts)))
        except FileNotFoundError:
            return files, others
        for e in entries:
            try:  # (as list_files: a link to a file is a file)
                size = e.stat().st_size if e.is_file() else None
            except OSError:  # gone meanwhile, or a link that leads nowhere readable
                size = None
            if size is None:
                others.append(e.name)
            else:
                files[e.name] = size
        return files, sorted(others)

    # bytes ------------------------------------------------------------------------------------
    def read_bytes(self, *parts: str) -> bytes:
        with self._open_read(parts) as f:
            return f.read()

    def write_bytes(self, data: bytes, *parts: str, exclusive: bool = False) -> None:
        path = self.join(*parts)
        if not exclusive:  # a commit never re-creates a step directory cleanup moved away
            self._make_root()
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
        self._make_root()
        tmp = new_dir_name()
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
        self._make_root()
        os.makedirs(self.join(*parts), exist_ok=True)

    def _make_root(self) -> None:
        """Create the root if missing; a root that is, or lies under, a symbolic link to a folder
        not made yet (``ckpt -> runs/8`` for a new run) makes that folder. ``mkdir`` of the link's own name
        fails with EEXIST, which the claim took for another writer's step: every save was
        refused as "being written by another writer"."""
        os.makedirs(os.path.realpath(self.path), exist_ok=True)  # (also under a dangling link: ckpt/sub)

    def rewrite_bytes(self, data: bytes, *parts: str) -> None:
        path = self.join(*parts)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(tmp, flags, 0o644)  # FileNotFoundError if the directory is gone
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def move_dir(self, src: str, dst: str) -> bool:
        os.rename(self.join(src), self.join(dst))
        return True

    def file_stamp(self, *parts: str) -> str | None:
        try:
            st = os.lstat(self.join(*parts))
        except OSError:
            return None
        return f"{st.st_ino}:{st.st_mtime_ns}"

    def last_change(self, *parts: str) -> tuple[float | None, int]:
        path = self.join(*parts)
        times: list[float] = []
        count = 0
        with contextlib.suppress(OSError):
            times.append(os.lstat(path).st_mtime)
        with contextlib.suppress(OSError):
            for entry in os.scandir(path):
                count += 1
                with contextlib.suppress(OSError):
                    times.append(entry.stat(follow_symlinks=False).st_mtime)
        return (max(times) if times else None), count

    # a directory published as a whole: built under a temporary name, renamed into place ------
    def stage_directory(self, *, uncommit: str | None = None) -> str:
        # ``uncommit`` is not needed: the directory in place is untouched until the rename.
        # The name says which process stages it (this host's, by pid): a publish killed
        # half-way left its partial directory beside the folder for good; the next one here
        # removes those of processes of this host that are gone.
        self._remove_dead_staging()
        staged = f"{self.path}.tmp-{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.makedirs(staged)
        return staged

    def _remove_dead_staging(self) -> None:
        """Remove staging directories of this folder left by dead processes of this host."""
        parent, base = os.path.split(self.path)
        prefix = f"{base}.tmp-{_host_tag()}-"
        try:
            names = [n for n in os.listdir(parent or ".") if n.startswith(prefix)]
        except OSError:
            return
        for name in names:
            pid, _, tail = name[len(prefix) :].partition("-")
            if not (pid.isdigit() and len(pid) <= 9 and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail)):
                continue
            path = os.path.join(parent, name)
            if int(pid) == os.getpid() or _alive(int(pid)) or os.path.islink(path) or not os.path.isdir(path):
                continue
            shutil.rmtree(path, ignore_errors=True)

    def commit_directory(self, staged: str, *, overwrite: bool, stale: Callable[[str], bool] | None = None) -> None:
        # ``stale`` is not needed: the rename replaces the old directory with all its files.
        if os.path.exists(self.path):
            if not overwrite and os.listdir(self.path):
                shutil.rmtree(staged, ignore_errors=True)
                raise FileExistsError(f"{self.display()} exists and is not empty (pass overwrite=True)")
            old = f"{self.path}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.path, old)
            try:
                os.replace(staged, self.path)
            except BaseException:
                os.replace(old, self.path)  # the previous directory stays in place
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            os.replace(staged, self.path)

    def abandon_directory(self, staged: str, written: Iterable[str]) -> None:
        if staged != self.path:
            shutil.rmtree(staged, ignore_errors=True)

    def local_dir(self, names: Iterable[str], scratch: str) -> str:
        return self.path

    # files ------------------------------------------------------------------------------------
    @contextmanager
    def open(self, rel: str, mode: str = "rb") -> Iterator[IO[bytes]]:
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

    def _open_read(self, parts: tuple[str, ...]) -> BinaryIO:
        """Open ``parts`` for reading without following any symbolic link below the root: every
        file a load, verify, inspect or convert reads stays inside it."""

        where = self.join(*parts)
        current = self.path
        for part in parts[:-1]:
            current = os.path.join(current, part)
            if os.path.islink(current):
                raise UnsafeCheckpointError(f"{current} is a symbolic link; refusing to read checkpoint files through it")
        try:
            fd, _ = open_regular_file(where)
        except NotARegularFile as exc:
            raise UnsafeCheckpointError(str(exc)) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeCheckpointError(f"{where} is a symbolic link; refusing to read a checkpoint file through it") from None
            raise
        return os.fdopen(fd, "rb")

    def dcp_filesystem(self) -> FileSystemBase:
        return _LocalDcpFS()

    def dcp_path(self, *parts: str) -> Path:
        return Path(self.join(*parts))

    def sync_file(self, f: WritableFile) -> None:
        f.flush()
        os.fsync(f.fileno())

    # A second reader thread of a small load costs more than it saves: its per-tensor Python
    # work contends for the GIL with the first (measured: benchmarks/README.md).
    read_bytes_per_thread = 64 * 1024 * 1024


def _host_tag() -> str:
    """8 hex digits naming this host and PID namespace in staging directory names (a pid means
    something only there: a shared filesystem's other hosts' directories, and those of
    containers sharing the host's name but not its pids, are never removed)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # (no /proc: the hostname alone)
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # (EPERM: it exists; a pid no kernel has)
        return True
    return True
