"""Where checkpoints live: a root on any fsspec filesystem, and DCP readers/writers for it.

Local paths (and ``file://`` URLs) use plain file I/O with ``fsync`` and atomic renames. Any other
URL (``s3://``, ``memory://``, ``gs://`` ...) goes through fsspec with the caller's
``storage_options``; there is no rename on object stores, so the commit is a single object put.

Credentials in ``storage_options`` are handed to fsspec only: they never appear in ``repr``,
error messages or manifests.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import threading
import uuid
import warnings
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecDcpFS
from torch.distributed.checkpoint.filesystem import FileSystem as _LocalDcpFS
from torch.distributed.checkpoint.filesystem import FileSystemBase


# Object stores without real directories: fsspec's ``makedirs`` there creates a missing *bucket*
# (so a typo in the bucket name would silently make a new one); we never create buckets.
# Temporary directories a step directory is built in before it is renamed into place.
NEW_DIR_PREFIX = ".distckpt-new-"
_FLAT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})
# Client libraries whose errors (e.g. botocore's EndpointConnectionError) are not OSErrors.
_CLIENT_ERROR_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "google", "azure")


def _flat_namespace(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in _FLAT_PROTOCOLS for p in protocols)


def _with_location(exc: BaseException, where: str) -> BaseException | None:
    """``exc`` as the same OSError type with ``where`` (redacted URL) in its message, or None."""
    is_client = type(exc).__module__.split(".", 1)[0] in _CLIENT_ERROR_MODULES
    if not isinstance(exc, OSError) and not is_client:
        return None
    detail = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).strip() or type(exc).__name__
    if where in detail:
        return None
    msg = f"{where}: {detail}"
    if isinstance(exc, PermissionError):
        msg += " (access denied: check the credentials in storage_options or the environment)"
    if is_client and not isinstance(exc, OSError):
        return ConnectionError(f"{msg} ({type(exc).__name__})")
    try:
        return type(exc)(msg)
    except Exception:  # noqa: BLE001 - exotic constructor
        return OSError(msg)


def _redact(url: str) -> str:
    """The URL without user info or query string (where credentials hide)."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    rest = rest.split("?", 1)[0]
    if "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}://{rest}"


class Storage:
    """A checkpoint root on a local disk or any fsspec filesystem.

    Args:
        root: a local path, ``file://`` URL or any fsspec URL (``s3://bucket/prefix``).
        storage_options: passed to the fsspec filesystem (endpoint, credentials, region...).

    Not collective: any rank may create one. The checkpointer lets only the coordinator list,
    commit and delete.
    """

    def __init__(self, root: str | os.PathLike, storage_options: dict[str, Any] | None = None):
        self.storage_options = dict(storage_options or {})
        root = os.fspath(root)
        protocol = fsspec.utils.get_protocol(root)
        self.is_local = protocol in ("file", "local")
        if self.is_local:
            if "://" in root:
                root = root.split("://", 1)[1]
            self.path = os.path.abspath(os.path.expanduser(root))
            self.url = self.path
            self.fs = fsspec.filesystem("file")
        else:
            self.fs, path = url_to_fs(root, **self.storage_options)
            self.path = path.rstrip("/")
            self.url = _redact(root).rstrip("/")
        self.flat = not self.is_local and _flat_namespace(self.fs)

    @contextmanager
    def _at(self, *parts: str) -> Iterator[None]:
        """Re-raise remote I/O errors with the (redacted) location in the message, same type."""
        try:
            yield
        except Exception as exc:
            located = _with_location(exc, self.display(*parts))
            if located is None:
                raise
            raise located from exc

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # paths -----------------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        """Absolute filesystem path of ``parts`` under the root."""
        if self.is_local:
            return os.path.join(self.path, *parts)
        return "/".join([self.path, *[p.strip("/") for p in parts if p]])

    def display(self, *parts: str) -> str:
        """User-facing location (URL with scheme, no credentials) of ``parts``."""
        if self.is_local:
            return self.join(*parts)
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    # queries ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Forget cached listings (s3fs caches them; another rank or job may have written)."""
        if not self.is_local:
            self.fs.invalidate_cache()

    def root_exists(self) -> bool:
        self.refresh()
        if self.is_local:
            return os.path.isdir(self.path)
        try:
            with self._at():
                return bool(self.fs.isdir(self.path)) or bool(self.fs.exists(self.path))
        except FileNotFoundError:
            return False

    def exists(self, *parts: str) -> bool:
        path = self.join(*parts)
        if self.is_local:
            return os.path.exists(path)
        # s3fs answers from a cached parent listing if it has one: another process may have
        # committed since (a manifest is the commit, so a stale "no" matters).
        self.fs.invalidate_cache(path.rsplit("/", 1)[0])
        with self._at(*parts):
            return bool(self.fs.exists(path))

    def list_dirs(self) -> list[str]:
        """Names of the sub-directories (prefixes) directly under the root; [] if none."""
        self.refresh()
        if self.is_local:
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
        try:
            with self._at():
                entries = self.fs.ls(self.path, detail=True)
        except FileNotFoundError:
            return []
        names = []
        for e in entries:
            if e.get("type") == "directory":
                names.append(e["name"].rstrip("/").rsplit("/", 1)[-1])
        return sorted(names)

    def list_files(self, *parts: str) -> dict[str, int]:
        """Relative name -> size of the files directly inside ``parts``."""
        path = self.join(*parts)
        if self.is_local:
            try:
                return {e.name: e.stat().st_size for e in os.scandir(path) if e.is_file()}
            except FileNotFoundError:
                return {}
        self.refresh()
        try:
            with self._at(*parts):
                entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries
            if e.get("type") == "file"
        }

    # bytes -----------------------------------------------------------------------------------
    def read_bytes(self, *parts: str) -> bytes:
        path = self.join(*parts)
        if self.is_local:
            with self._open_local_read(parts) as f:
                return f.read()
        with self._at(*parts):
            return bytes(self.fs.cat_file(path))

    def write_bytes(self, data: bytes, *parts: str, exclusive: bool = False) -> None:
        """Write ``data`` so that readers see either nothing or all of it.

        Local: temporary file, fsync, rename (or, ``exclusive``, a hard link that fails if the
        file exists), fsync of the directory. Object stores: one put, which is atomic there
        (``exclusive``: a conditional put where the store supports it).

        Raises:
            FileExistsError: ``exclusive`` and the file exists.
        """
        path = self.join(*parts)
        if self.is_local:
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
                    os.link(tmp, path)
                finally:
                    os.remove(tmp)
            else:
                os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path))
        elif exclusive:
            try:
                with self._at(*parts):
                    self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                raise
            except Exception:
                if self.exists(*parts):  # the store refused because it exists (HTTP 412)
                    raise FileExistsError(f"{self.display(*parts)} exists") from None
                raise
        else:
            with self._at(*parts):
                self.fs.pipe_file(path, data)

    def create_exclusive(self, dirname: str, name: str, data: bytes) -> None:
        """Create directory ``dirname`` holding file ``name``, failing if ``dirname`` exists
        (local: ``mkdir``) or ``name`` in it exists (object stores: a conditional put).

        Raises:
            FileExistsError: someone created it first.
        """
        if self.is_local:
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
                import shutil

                shutil.rmtree(self.join(tmp), ignore_errors=True)
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise FileExistsError(f"{self.display(dirname)} exists") from None
                raise
            _fsync_dir(self.path)
        else:
            self.makedirs(dirname)
            self.write_bytes(data, dirname, name, exclusive=True)

    def remove(self, *parts: str) -> None:
        """Remove a file; missing is fine."""
        path = self.join(*parts)
        try:
            if self.is_local:
                os.remove(path)
            else:
                with self._at(*parts):
                    self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, *parts: str) -> None:
        """Remove a directory and everything under it; missing is fine."""
        path = self.join(*parts)
        try:
            if self.is_local:
                import shutil

                shutil.rmtree(path)
            else:
                with self._at(*parts):
                    self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.refresh()

    def makedirs(self, *parts: str) -> None:
        """Create the directory ``parts``. On object stores (no directories) this only checks
        that the bucket exists and is reachable: buckets are never created."""
        path = self.join(*parts)
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        elif self.flat:
            self.check_bucket()
        else:
            with self._at(*parts):
                self.fs.makedirs(path, exist_ok=True)

    def check_bucket(self) -> None:
        """Raise ``FileNotFoundError`` naming the URL if the root's bucket is missing or not
        accessible with the given credentials. Object stores only; one request."""
        if not self.flat:
            return
        bucket = self.path.split("/", 1)[0]
        with self._at():
            ok = bool(self.fs.exists(bucket))
        if not ok:
            raise FileNotFoundError(
                f"{self.display()}: bucket {bucket!r} does not exist or is not accessible with the "
                "given credentials (storage_options or the AWS environment); distckpt never creates buckets"
            )

    @contextmanager
    def open(self, rel: str, mode: str = "rb") -> Iterator[Any]:
        """A file under the root. Local reads refuse symbolic links and non-regular files
        (:class:`~distckpt.errors.UnsafeCheckpointError` naming the file)."""
        path = self.join(rel)
        if self.is_local and "r" in mode and "+" not in mode:
            with self._open_local_read(tuple(p for p in rel.split("/") if p)) as f:
                yield f
        elif self.is_local:
            try:
                with open(path, mode) as f:
                    yield f
            except OSError as exc:  # a full disk: say which file
                raise named_os_error(exc, path) from exc
        else:
            with self.fs.open(path, mode) as f:
                yield f

    def _open_local_read(self, parts: tuple[str, ...]) -> Any:
        """Open ``parts`` under the (local) root for reading without following any symbolic link
        below the root: every file a load, verify, inspect or convert reads stays inside it."""
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

    # DCP -------------------------------------------------------------------------------------
    def writer(
        self,
        *parts: str,
        thread_count: int = 2,
        sync_files: bool = True,
        checksum: str | None = "crc32",
        skip_record_crc: bool = False,
    ) -> CheckpointWriter:
        """A DCP StorageWriter for the directory ``parts`` that records per-file checksums."""
        return CheckpointWriter(
            self,
            self.join(*parts),
            thread_count=thread_count,
            sync_files=sync_files,
            checksum=checksum,
            skip_record_crc=skip_record_crc,
        )

    def reader(
        self,
        *parts: str,
        files: Mapping[str, Any] | None = None,
        checksum: str | None = None,
        thread_count: int = 2,
        metadata: Any = None,
    ) -> Any:
        """A DCP StorageReader for the directory ``parts`` (verifying ``files`` if given; serving
        ``metadata`` if it was read and verified already)."""
        from ._reader import CheckpointReader

        return CheckpointReader(
            self, self.join(*parts), files=files, checksum=checksum, thread_count=thread_count, metadata=metadata
        )

    def dcp_filesystem(self) -> FileSystemBase:
        """The DCP filesystem object for this root (shares our fsspec instance and options)."""
        if self.is_local:
            return _LocalDcpFS()
        fs = _RemoteDcpFS(self.flat)
        fs.fs = self.fs
        return fs


class _RemoteDcpFS(_FsspecDcpFS):
    """DCP's fsspec filesystem that never creates buckets (DCP calls ``mkdir`` on every rank)."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        self.flat = flat

    def mkdir(self, path: str | os.PathLike) -> None:
        if not self.flat:  # object stores: prefixes need no creating
            super().mkdir(path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved = True


@contextmanager
def _without_torch_record_crc() -> Iterator[None]:
    """Skip the CRC-32 ``torch.save`` computes for every zip record while distckpt writes.

    That CRC is most of torch.save's CPU time (5 vs 21 GB/s here) and torch.load never checks
    it; distckpt's own checksum covers every byte of the file instead. The switch is global in
    torch, so it is reference-counted across concurrent saves; a ``torch.save`` elsewhere in the
    process meanwhile writes records without CRC, which ``torch.load`` reads as usual.
    """
    global _crc_users, _crc_saved
    import torch.serialization as ser

    if not hasattr(ser, "set_crc32_options"):  # older torch: nothing to switch
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = ser.get_crc32_options()
            ser.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                ser.set_crc32_options(_crc_saved)


def named_os_error(exc: OSError, where: str) -> OSError:
    """``exc`` with ``where`` as its file name, so that its message says which file failed."""
    if exc.errno is None or exc.filename:
        return exc
    named = OSError(exc.errno, exc.strerror or os.strerror(exc.errno), where)
    named.__cause__ = exc
    return named


class _ChecksumStream(io.RawIOBase):
    """Write-through stream that hashes every byte on its way to the file.

    The checksum is computed while the data is written, so integrity costs no second pass.
    An ``OSError`` from the file (a full disk, a failed upload) is handed to ``on_error`` and
    the rest of the file is dropped instead of raised: DCP writes from threads of its own that
    print an exception and lose it, and ``torch.save`` would replace ENOSPC with
    "enforce fail ... unexpected pos". :meth:`CheckpointWriter.write_data` raises the recorded
    error once DCP returns, with its errno and the file's path.
    """

    def __init__(self, raw: Any, on_close: Any, algorithm: str | None, on_error: Any, sync: bool) -> None:
        from .integrity import new_hasher

        self._raw = raw
        self._hasher = new_hasher(algorithm) if algorithm else None
        self._size = 0
        self._on_close = on_close
        self._on_error = on_error
        self._sync = sync
        self.failed = raw is None

    def writable(self) -> bool:
        return True

    def _fail(self, exc: BaseException) -> None:
        self.failed = True
        self._on_error(exc)

    def write(self, b: Any) -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        if self.failed:
            return len(view)
        if self._hasher is not None:
            self._hasher.update(view)
        try:
            n = self._raw.write(view)
        except OSError as exc:
            self._fail(exc)
            return len(view)
        n = len(view) if n is None else n
        self._size += n
        return n

    def tell(self) -> int:
        return self._size if self.failed else self._raw.tell()

    def flush(self) -> None:
        if not self.failed:
            try:
                self._raw.flush()
            except OSError as exc:
                self._fail(exc)

    def close(self) -> None:
        if not self.closed:
            # Explicit flush before close: some fsspec files drop unflushed data otherwise.
            self.flush()
            if self._sync and not self.failed:
                try:
                    os.fsync(self._raw.fileno())
                except OSError as exc:
                    self._fail(exc)
            if not self.failed:
                self._on_close(self._size, self._hasher.hexdigest() if self._hasher is not None else None)
        super().close()


class _ChecksummingFS(FileSystemBase):
    """A DCP filesystem that hashes every file it writes, recording ``name -> (size, digest)``.

    Write errors of the files are recorded in :attr:`errors` (with the file's path) rather than
    raised inside DCP's writer threads; see :class:`_ChecksumStream`.
    """

    def __init__(self, inner: FileSystemBase, algorithm: str | None, sync_files: bool = False) -> None:
        self.inner = inner
        self.algorithm = algorithm
        self.sync_files = sync_files
        self.files: dict[str, tuple[int, str]] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def _record_error(self, exc: BaseException, where: str) -> None:
        if isinstance(exc, OSError):
            exc = named_os_error(exc, where)
        with self._lock:
            self.errors.append(exc)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as raw:
                yield raw
            return
        name = os.path.basename(os.fspath(path))
        where = os.fspath(path)

        def record(size: int, digest: str) -> None:
            with self._lock:
                self.files[name] = (size, digest)

        def on_error(exc: BaseException) -> None:
            self._record_error(exc, where)

        cm = self.inner.create_stream(path, mode)
        try:
            raw = cm.__enter__()
        except OSError as exc:  # cannot even create the file: nothing written, error recorded
            on_error(exc)
            cm, raw = None, None
        stream = _ChecksumStream(raw, record, self.algorithm, on_error, self.sync_files)
        try:
            yield stream  # type: ignore[misc]
        except BaseException as exc:
            # DCP's extra writer threads drop their exceptions; remember them here.
            on_error(exc)
            raise
        finally:
            stream.close()
            if cm is not None:
                try:
                    cm.__exit__(None, None, None)
                except OSError as exc:  # closing commits remote files: a failed upload lands here
                    on_error(exc)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return self.inner.concat_path(path, suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)
        old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
        with self._lock:
            if old in self.files:
                self.files[new] = self.files.pop(old)

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return self.inner.init_path(path) if isinstance(self.inner, _LocalDcpFS) else path

    def mkdir(self, path: str | os.PathLike) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.inner.rm_file(path)


class CheckpointWriter(FileSystemWriter):
    """DCP's file writer on a :class:`Storage`, recording a checksum of each file it writes.

    Call order is DCP's (all ranks: ``set_up_storage_writer``, ``prepare_local_plan``,
    ``write_data``; coordinator: ``prepare_global_plan``, ``finish``). After ``dcp.save``
    returns, :attr:`files` maps each file this rank wrote to ``(size, digest)``.
    """

    def __init__(
        self,
        storage: Storage,
        path: str,
        *,
        thread_count: int = 2,
        sync_files: bool = True,
        checksum: str | None = "crc32",
        skip_record_crc: bool = False,
    ) -> None:
        # Remote files have no fileno(); DCP would fall back to os.sync() per file. Closing an
        # fsspec file is what commits it, and the stream wrapper flushes before closing.
        super().__init__(
            path if storage.is_local else "unused",
            single_file_per_rank=True,
            # Each file is fsynced by its stream (so a failed fsync is recorded, not raised in a
            # DCP writer thread), not by DCP.
            sync_files=False,
            thread_count=thread_count,
            overwrite=True,
        )
        self.storage = storage
        self.skip_record_crc = skip_record_crc
        self.fs = _ChecksummingFS(storage.dcp_filesystem(), checksum, sync_files=sync_files and storage.is_local)
        self.path = Path(path) if storage.is_local else path

    @property
    def files(self) -> dict[str, tuple[int, str]]:
        return dict(self.fs.files)

    def write_data(self, plan: Any, planner: Any) -> Any:
        # DCP (2.13) runs writer threads whose exceptions are printed and lost: the save would
        # commit without their items. Re-raise them, and check that every item was written.
        if self.skip_record_crc and self.fs.algorithm:  # opt-in: the switch is process-wide
            with _without_torch_record_crc():
                fut = super().write_data(plan, planner)
        else:
            fut = super().write_data(plan, planner)
        results = fut.wait()
        if self.fs.errors:
            raise self.fs.errors[0]
        if len(results) != len(plan.items):
            raise OSError(f"only {len(results)} of {len(plan.items)} items were written (a writer thread failed)")
        return fut

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        # The directory is fixed at construction; a checkpoint_id must not silently redirect it.
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
