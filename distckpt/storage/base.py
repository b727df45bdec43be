"""Where checkpoints live: a root on a local disk or any fsspec filesystem.

:class:`Storage` is the small interface every other module uses (paths, listings, atomic
byte writes, exclusive creation, removal, file handles), with two implementations, which
register themselves by kind (so that this module imports neither); ``Storage(root)`` opens a
root with the one that fits it and returns it (a factory: the object is of the subclass)

* :class:`~distckpt.storage.local.LocalStorage` for local paths and ``file://`` URLs: plain
  file I/O with ``fsync``, atomic renames and hard links, and reads that never follow a
  symbolic link below the root;
* :class:`~distckpt.storage.objectstore.FsspecStorage` for any other URL (``s3://``, ``memory://``,
  ``gs://`` ...), through fsspec with the caller's ``storage_options``: there is no rename on
  object stores, so a commit is a single (conditional, where supported) object put.

DCP's writer and reader for a storage are :mod:`distckpt.save.writer` and :mod:`distckpt.load.reader`.
Credentials in ``storage_options`` are handed to fsspec only: they never appear in ``repr``,
error messages or manifests.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import socket
import stat
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Protocol, TypeVar

import fsspec
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint.filesystem import FileSystemBase

from distckpt._process import parse_pid


# Temporary directories a step directory is built in before it is renamed into place.
NEW_DIR_PREFIX = ".distckpt-new-"
_T = TypeVar("_T")
_R = TypeVar("_R")

_FLAT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})
# Client libraries whose errors (e.g. botocore's EndpointConnectionError) are not OSErrors.
_CLIENT_ERROR_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "google", "azure")


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode(errors="replace")).hexdigest()[:8]


def new_dir_name() -> str:
    """A unique name for a temporary step directory, naming its creator (pid and a digest of the
    host name): one left by a process killed before it could write the owner record inside is
    then recognised as dead at once (:func:`new_dir_creator`), not only after the lease."""
    return f"{NEW_DIR_PREFIX}{os.getpid()}-{_host_tag()}-{uuid.uuid4().hex[:12]}"


def new_dir_creator(name: str) -> int | None:
    """The pid that created temporary directory ``name`` on this host (``None``: another host,
    or a name without one, such as an older distckpt's)."""
    pid, _, rest = name[len(NEW_DIR_PREFIX):].partition("-") if name.startswith(NEW_DIR_PREFIX) else ("", "", "")
    host, _, _ = rest.partition("-")
    return parse_pid(pid) if host == _host_tag() else None


def is_local_location(location: str) -> bool:
    """Whether ``location`` names the local disk (a path, or a ``file://`` or fsspec ``local://``
    URL): what :class:`~distckpt.storage.local.LocalStorage` serves, and what is checked and
    written as a local path, links resolved. Without ``://`` it is a path, taken literally:
    fsspec would read ``::`` in a folder name (``runs/lr=1::b``) as a chain of URLs and name
    another folder (``runs/lr=1``)."""
    return "://" not in location or fsspec.utils.get_protocol(location) in ("file", "local")


def local_path(location: str | os.PathLike) -> str | None:
    """The absolute local path ``location`` names (``~`` expanded, links kept), or ``None`` when
    it is a URL of another filesystem (:func:`is_local_location`). ``file://localhost/x`` is
    ``/x`` (RFC 8089; fsspec would take ``localhost`` for a folder of the working directory)."""
    location = os.fspath(location)
    if not is_local_location(location):
        return None
    if "://" in location:
        location = location.split("://", 1)[1]
        if location == "localhost" or location.startswith("localhost/"):
            location = location[len("localhost"):] or "/"
    elif location.startswith(("file:", "local:")):  # file:/x is /x to fsspec (and RFC 8089), not ./file:/x
        location = location.split(":", 1)[1]
    return os.path.abspath(os.path.expanduser(location))


def local_target(location: str | os.PathLike) -> str | None:
    """The local path holding ``location``'s files: :func:`local_path`, or that of the last link
    of a chain of fsspec URLs (``simplecache::file:///x``: caches over the local disk); ``None``
    where they are elsewhere."""
    location = os.fspath(location)
    path = local_path(location)
    if path is not None or "::" not in location:
        return path
    last = location.rsplit("::", 1)[1]
    return local_path(last) if "://" in last else None


def _place_options(options: object, key: str = "") -> list[tuple[str, str]]:
    """The storage options that may name another server (an endpoint, host, port or URL, at any
    depth: ``client_kwargs``, a chain's per-protocol options): the rest (block sizes, credentials,
    retries) change how a place is reached, not which it is."""
    if isinstance(options, Mapping):
        # (a set: one endpoint given twice, top-level and in client_kwargs, is one place)
        return sorted({x for k, v in options.items() for x in _place_options(v, f"{key}.{k}")})
    name = key.rsplit(".", 1)[-1].lower()
    return [(name, _place(options))] if any(w in name for w in ("endpoint", "host", "port", "url")) else []


_LOOPBACK = ("localhost", "127.0.0.1", "::1")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _place(value: object) -> str:
    """An endpoint as the server it names: a URL's scheme and host in lower case, its port made
    explicit, no trailing ``/``, loopback names as one (``http://localhost:9000/`` is
    ``http://127.0.0.1:9000``); other values as they are (a port's number, as text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        return repr(value)
    text = value.strip()
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError:
        return text
    if not parts.scheme or not parts.hostname:  # a host name alone: names are not case-sensitive
        return "loopback" if text.lower() in _LOOPBACK else text.lower()
    scheme, host = parts.scheme.lower(), parts.hostname.lower()
    host = "loopback" if host in _LOOPBACK else host
    port = port if port is not None else _DEFAULT_PORTS.get(scheme)
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def _server(url: str, options: Mapping[str, object] | None) -> list[tuple[str, str]]:
    """:func:`_place_options` of a URL's options; for S3 without an endpoint among them, the one
    botocore takes from the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``), so a
    root relying on it and a replica naming the same server are one place."""
    places = _place_options(options)
    if url.split("://", 1)[0].lower() in ("s3", "s3a") and not any("endpoint" in n or "url" in n for n, _ in places):
        env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if env:
            places = sorted({*places, ("endpoint_url", _place(env))})
    return places


def overlaps(a: str, a_options: Mapping[str, object] | None, b: str, b_options: Mapping[str, object] | None) -> bool:
    """Whether the folders that two roots name are the same or one lies in the other, as far as
    their names tell: local ones (:func:`local_target`) with ``~`` and links resolved; URLs of
    one filesystem (the last link of a chain of caches) by their paths, unless their options
    name other servers (another endpoint may hold the same names). Not collective."""
    la, lb = local_target(a), local_target(b)
    if la is not None or lb is not None:
        if la is None or lb is None:
            return False
        ra, rb = os.path.realpath(la), os.path.realpath(lb)
        return os.path.commonpath([ra, rb]) in (ra, rb)
    # A chain of caches (simplecache::s3://...) keeps its files where its last link says.
    a, b = a.rsplit("::", 1)[-1], b.rsplit("::", 1)[-1]
    if "://" not in a or "://" not in b or _server(a, a_options) != _server(b, b_options):
        return False
    try:
        cls_a = fsspec.get_filesystem_class(fsspec.utils.get_protocol(a))
        cls_b = fsspec.get_filesystem_class(fsspec.utils.get_protocol(b))
    except (ImportError, ValueError):  # an unknown protocol: refused when the storage is made
        return False
    if cls_a is not cls_b:
        return False
    pa, pb = (str(cls_a._strip_protocol(x)).rstrip("/") for x in (a, b))
    return pa == pb or pa.startswith(pb + "/") or pb.startswith(pa + "/")


def is_pattern(path: str) -> bool:
    """Whether fsspec's ``rm``, ``mv``, ``copy``, ``get`` and ``put`` read ``path`` as a glob
    pattern (it holds ``*``, ``?`` or ``[``): where it does, distckpt deletes and moves by name
    (``rm_file``, ``cp_file``), so that ``s3://b/exp[12]`` never touches ``exp1`` or ``exp2``."""
    return any(c in path for c in "*?[")


def _flat_namespace(fs: AbstractFileSystem) -> bool:
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
    host = rest.split("/", 1)[0]
    # Azure's container@account names the storage, not a user: kept (else two containers'
    # roots read alike), unless it holds a password (user:secret@). Elsewhere everything up to
    # the LAST "@" is user info: a password may hold "@" itself (ftp://bob:p@ss@host is user
    # bob, password p@ss, host host).
    if "@" in host and (scheme.lower() not in _AZURE_SCHEMES or ":" in host.rsplit("@", 1)[0]):
        rest = host.rsplit("@", 1)[1] + rest[len(host) :]
    return f"{scheme}://{rest}"


_AZURE_SCHEMES = frozenset({"abfs", "abfss", "az", "adl", "wasb", "wasbs"})


def named_os_error(exc: OSError, where: str) -> OSError:
    """``exc`` with ``where`` as its file name, so that its message says which file failed."""
    if exc.errno is None or exc.filename:
        return exc
    named = OSError(exc.errno, exc.strerror or os.strerror(exc.errno), where)
    named.__cause__ = exc
    return named


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


class NotARegularFile(OSError):
    """What :func:`open_regular_file` raises for a path that is a FIFO, a device, a socket or a
    directory."""


def open_regular_file(path: str, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` (relative to directory descriptor ``dir_fd`` if
    given) and its ``fstat``, if it is a regular file whose own name is no symbolic link. The
    caller closes the descriptor.

    Raises:
        OSError: ``ELOOP`` for a symbolic link (``O_NOFOLLOW``); any other failure to open.
        NotARegularFile: ``path`` is a FIFO, a device, a socket or a directory.
    """
    # O_NONBLOCK: a FIFO by that name would block the open (and the load, inspect, ls or peer
    # transfer) until a writer came; it is refused below. Regular files ignore the flag.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class WritableFile(Protocol):
    """A binary file open for writing, as :meth:`Storage.sync_file` takes it: a local file, an
    fsspec file, or what a DCP filesystem's ``create_stream`` yields (``fileno`` may raise where
    there is no descriptor)."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int | None: ...

    def tell(self) -> int: ...

    def flush(self) -> None: ...

    def fileno(self) -> int: ...


# kind -> implementation: "local" (LocalStorage), "url" (FsspecStorage); each registers itself
# when its module is imported, which importing the distckpt.storage package does.
_KINDS: dict[str, type[Storage]] = {}


class Storage:
    """A checkpoint root on a local disk or any fsspec filesystem (see the module doc).

    ``Storage(root, storage_options)`` is a factory: it returns a
    :class:`~distckpt.storage.local.LocalStorage` for a local path or ``file://`` URL and a
    :class:`~distckpt.storage.objectstore.FsspecStorage` for any other URL.

    Args:
        root: a local path, ``file://`` URL or any fsspec URL (``s3://bucket/prefix``).
        storage_options: passed to the fsspec filesystem (endpoint, credentials, region...).

    Attributes:
        is_local: whether the root is a local directory (informational: what differs between
            the two kinds of storage is in their methods, not in callers' branches).
        flat: whether the root is on an object store without real directories.
        url: the root for messages (no credentials); ``path``: the root for the filesystem.
        fs: the fsspec filesystem the root lives on (set by each implementation).
        tier_copies: whether the ``step_*`` folders here that carry the local tier's mark are
            steps to read (only in the tier's own directory); a root never takes them for its
            steps (:func:`distckpt.integrity.manifest.tier_copy`).

    Not collective: any rank may create one. The checkpointer lets only the coordinator list,
    commit and delete.
    """

    is_local = False
    flat = False
    tier_copies = False
    fs: AbstractFileSystem

    @property
    def shared_between_processes(self) -> bool:
        """Whether another process opening the same root sees the same files (``memory://``
        lives inside one process, so async saves there cannot be written by a writer process)."""
        from fsspec.implementations.memory import MemoryFileSystem

        fs, seen = self.fs, set()
        while fs is not None and id(fs) not in seen:  # through chains: simplecache::memory://
            if isinstance(fs, MemoryFileSystem):
                return False
            seen.add(id(fs))
            fs = getattr(fs, "fs", None)
        return True

    def refuse_unshared(self, world_size: int, what: str) -> None:
        """(each rank; every rank decides alike) Refuse a location only this process sees
        (``memory://``) for work of several ranks: each would write and read a copy of its own,
        and the coordinator commit an index or manifest naming files it never sees, on every
        rank "done".

        Raises:
            ValueError: naming ``what``, the location and the world size.
        """
        if world_size > 1 and not self.shared_between_processes:
            raise ValueError(
                f"{what}: {self.display()} lives in this process's memory (memory://), which the other "
                f"{world_size - 1} rank(s) do not see: each would write and read a copy of its own; use a location "
                "every rank reaches (a shared filesystem, an object store)"
            )

    def __init_subclass__(cls, kind: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            _KINDS[kind] = cls

    def __new__(cls, root: str | os.PathLike | None = None, storage_options: Mapping[str, object] | None = None) -> Storage:
        if cls is Storage:
            cls = _KINDS["local" if root is None or is_local_location(os.fspath(root)) else "url"]
        return super().__new__(cls)

    def __init__(self, root: str | os.PathLike, storage_options: Mapping[str, object] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.path = ""
        self.url = ""

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    @contextmanager
    def _at(self, *parts: str) -> Iterator[None]:
        """Re-raise I/O errors with the (redacted) location in the message, same type."""
        try:
            yield
        except Exception as exc:
            located = _with_location(exc, self.display(*parts))
            if located is None:
                raise
            raise located from exc

    # the interface ---------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        """Absolute filesystem path of ``parts`` under the root."""
        raise NotImplementedError

    def display(self, *parts: str) -> str:
        """User-facing location (URL with scheme, no credentials) of ``parts``."""
        raise NotImplementedError

    def identity(self) -> str:
        """The root as manifests record it (:attr:`Manifest.root`): its URL without credentials;
        a local root with symbolic links resolved (one folder named through a link or ``//`` is
        one root)."""
        return self.url

    def refresh(self) -> None:
        """Forget cached listings (another rank or job may have written)."""

    def root_exists(self) -> bool:
        raise NotImplementedError

    def exists(self, *parts: str) -> bool:
        raise NotImplementedError

    def each(self, query: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """``query(item)`` for each item, in order: queries of this storage that each cost a
        request (does a step hold a manifest? its manifest, its files). Async object stores
        run them concurrently, so a root of hundreds of steps costs a few round trips' time
        instead of hundreds; elsewhere one after another. The first exception raised is raised."""
        return [query(item) for item in items]

    def exists_each(self, paths: Iterable[tuple[str, ...]]) -> list[bool]:
        """:meth:`exists` of each path (a tuple of parts), in order (through :meth:`each`)."""
        return self.each(lambda p: self.exists(*p), paths)

    def list_dirs(self) -> list[str]:
        """Names of the sub-directories (prefixes) directly under the root; [] if none."""
        raise NotImplementedError

    def list_files(self, *parts: str) -> dict[str, int]:
        """Relative name -> size of the files directly inside ``parts``."""
        raise NotImplementedError

    def list_entries(self, *parts: str) -> tuple[dict[str, int], list[str]]:
        """:meth:`list_files` of ``parts`` and the sorted names of its other entries (sub-folders,
        links that lead to no file, anything else; both empty if it is missing), from one
        listing (object stores: one request)."""
        try:  # (any fsspec filesystem; the storages of distckpt list in their own ways)
            entries = self.fs.ls(self.join(*parts), detail=True)
        except FileNotFoundError:
            return {}, []
        names = [(posixpath.basename(str(e["name"]).rstrip("/")), e) for e in entries]
        files = {n: int(e.get("size") or 0) for n, e in names if e.get("type") == "file"}
        return files, sorted(n for n, e in names if e.get("type") != "file")

    def read_bytes(self, *parts: str) -> bytes:
        raise NotImplementedError

    def write_bytes(self, data: bytes, *parts: str, exclusive: bool = False) -> None:
        """Write ``data`` so that readers see either nothing or all of it.

        Raises:
            FileExistsError: ``exclusive`` and the file exists, holding other bytes than
                ``data`` (the same bytes are this call's own write, whose answer was lost: an
                object store's client retried the conditional put; every caller writes bytes
                unique to it: an owner record, a manifest).
        """
        raise NotImplementedError

    def create_exclusive(self, dirname: str, name: str, data: bytes) -> None:
        """Create directory ``dirname`` holding file ``name``, failing if someone did first.

        Raises:
            FileExistsError: someone created it first.
        """
        raise NotImplementedError

    def remove(self, *parts: str) -> None:
        """Remove a file; missing is fine."""
        raise NotImplementedError

    def remove_tree(self, *parts: str) -> None:
        """Remove a directory and everything under it; missing is fine."""
        raise NotImplementedError

    def rewrite_bytes(self, data: bytes, *parts: str) -> None:
        """Replace a file like :meth:`write_bytes`, but never create its directory.

        Local disks: a temporary file in the existing directory, ``fsync``, rename; the
        directory is never re-created, so one that cleanup moved away stays gone. Object stores
        have no directories: one put, as :meth:`write_bytes`.

        Raises:
            FileNotFoundError: the directory does not exist (local disks).
        """
        raise NotImplementedError

    def move_dir(self, src: str, dst: str) -> bool:
        """Rename directory ``src`` (under the root) to ``dst`` in one atomic step, so that
        nothing can be written into it through its old path afterwards; returns True.

        Returns False, moving nothing, where the storage has no atomic rename (object stores:
        a copy would not be atomic); callers then act on ``src`` in place.

        Raises:
            FileNotFoundError: ``src`` does not exist (local disks).
        """
        raise NotImplementedError

    def file_stamp(self, *parts: str) -> str | None:
        """An opaque token of the version of file ``parts`` that changes when the file is
        written again, whatever its size: local disks its inode and modification time (kept by a
        rename), object stores its ETag or modification time; ``None`` where the store reports
        neither, or the file is missing."""
        raise NotImplementedError

    def last_change(self, *parts: str) -> tuple[float | None, int]:
        """Newest modification time (Unix seconds) of directory ``parts`` and of the entries
        directly inside it (``None`` if the store reports no times), and how many entries it
        holds (0 if it is missing). Local disks never follow a symbolic link."""
        raise NotImplementedError

    # a directory of several files published as a whole ------------------------------------------
    # The protocol (one process; Hugging Face publishing and export use it):
    #   1. ``staged = storage.stage_directory(...)``; write the files into ``Storage(staged)``,
    #      the file that commits the directory (an index) last;
    #   2. ``storage.commit_directory(staged, ...)``;
    #   on failure: ``storage.abandon_directory(staged, written)``.
    def stage_directory(self, *, uncommit: str | None = None) -> str:
        """Where to write the files of a directory that should appear at this root as a whole:
        a root (path or URL) to open with ``Storage(...)``.

        Local disks: a new, empty temporary sibling directory, renamed into place by
        :meth:`commit_directory`. Object stores (no rename): this root itself; the caller writes
        the file that commits the directory last, and readers take a directory without it as
        incomplete.

        Args:
            uncommit: the name of that committing file (an index). Where files are written in
                place, an existing one is removed first, so that no reader sees the old index
                over a mix of old and new files.
        """
        raise NotImplementedError

    def commit_directory(self, staged: str, *, overwrite: bool, stale: Callable[[str], bool] | None = None) -> None:
        """Make the directory written at ``staged`` (:meth:`stage_directory`) this root's.

        Local disks: renamed into place. An existing directory is moved aside first and moved
        back if the rename fails; without ``overwrite``, a non-empty one is an error (and
        ``staged`` is removed). Object stores: the committing file written last already did it;
        with ``overwrite``, the files of the replaced directory that ``stale(name)`` names are
        then removed, best effort (a warning if that fails).

        Raises:
            FileExistsError: the root is a non-empty directory and ``overwrite`` is False.
        """
        raise NotImplementedError

    def abandon_directory(self, staged: str, written: Iterable[str]) -> None:
        """After a failed publish, remove what it wrote, best effort: the temporary directory
        (local disks; an existing directory at the root was never touched), or on object stores
        the files ``written`` (they were written in place; without their committing file they
        were never a directory)."""
        raise NotImplementedError

    def local_dir(self, names: Iterable[str], scratch: str) -> str:
        """A local directory holding the files ``names`` of this root, for what needs real
        files (``mmap``): the root itself on a local disk; elsewhere ``scratch``, into which
        they are downloaded."""
        raise NotImplementedError

    def makedirs(self, *parts: str) -> None:
        """Create the directory ``parts`` (object stores: only check that the bucket exists)."""
        raise NotImplementedError

    def check_bucket(self) -> None:
        """Raise ``FileNotFoundError`` naming the URL if the root's bucket is missing or not
        accessible (object stores only; elsewhere nothing to check)."""

    @contextmanager
    def open(self, rel: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        """A binary file under the root (``mode`` ``"rb"`` or ``"wb"``). Local reads refuse
        symbolic links and non-regular files (:class:`~distckpt.errors.UnsafeCheckpointError`
        naming the file)."""
        raise NotImplementedError
        yield  # pragma: no cover

    def dcp_filesystem(self) -> FileSystemBase:
        """The DCP filesystem object for this root (shares our fsspec instance and options)."""
        raise NotImplementedError

    def dcp_path(self, *parts: str) -> str | os.PathLike[str]:
        """``parts`` as the path type :meth:`dcp_filesystem` takes."""
        return self.join(*parts)

    def sync_file(self, f: WritableFile) -> None:
        """Make a written file durable before it is closed (local disks: flush Python's buffer,
        then ``fsync``; object stores: nothing, closing the file is what commits it)."""

    #: Bytes a load must read per reader thread before another thread pays off. Object stores:
    #: none (each thread overlaps another request's latency); local files: see LocalStorage.
    read_bytes_per_thread = 0

