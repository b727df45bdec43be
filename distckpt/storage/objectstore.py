"""A checkpoint root on any fsspec filesystem: object stores (S3 through s3fs, GCS, Azure ...),
``memory://`` and others (see :mod:`distckpt.storage.base`).

There is no rename on object stores: a small file is committed by one put, which is atomic
there, and an exclusive one by a conditional put (``If-None-Match``) where the store supports
it. Listings are cached by s3fs; every query that decides something (does a manifest exist?)
invalidates the cache first, since another process may have written since.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any, TypeVar

from fsspec.core import url_to_fs
from torch.distributed.checkpoint.filesystem import FileSystemBase

from distckpt._process import map_in_threads
from distckpt._compat import FsspecDcpFileSystem as _FsspecDcpFS
from distckpt.storage.base import Storage, _flat_namespace, _redact, is_pattern


_T = TypeVar("_T")
_R = TypeVar("_R")

#: Queries in flight at once (:meth:`FsspecStorage.each`).
_QUERIES_AT_ONCE = 16


class FsspecStorage(Storage, kind="url"):
    """A root given as a URL of any fsspec filesystem other than the local one."""

    def __init__(self, root: str | os.PathLike, storage_options: Mapping[str, object] | None = None) -> None:
        super().__init__(root, storage_options)
        root = os.fspath(root)
        try:
            self.fs, path = url_to_fs(root, **self.storage_options)
        except ValueError as exc:  # ("Protocol not known: FILE": which location?)
            raise ValueError(f"{_redact(root)}: {exc} (a local path, file://, local:// or an fsspec URL)") from None
        self.path = path.rstrip("/")
        self.url = _redact(root).rstrip("/")
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        if "?" in root and not set(protocols) & {"http", "https"}:
            # Shown without what follows '?' (a query to URLs), while this filesystem takes it as
            # part of the path: a root "exp?new" or "exp?a=b" would be named, and its local
            # tier's copies marked, as "exp", another root (whose load then took them).
            raise ValueError(f"{self.url}: '?' in the path of a {protocols[0]}:// URL is taken literally but shown as a query: use a path without '?'")
        self.flat = _flat_namespace(self.fs)

    # paths and queries ------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        return "/".join([self.path, *[p.strip("/") for p in parts if p]])

    def display(self, *parts: str) -> str:
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    def refresh(self) -> None:
        self.fs.invalidate_cache()

    def root_exists(self) -> bool:
        self.refresh()
        try:
            with self._at():
                return bool(self.fs.isdir(self.path)) or bool(self.fs.exists(self.path))
        except FileNotFoundError:
            return False

    def exists(self, *parts: str) -> bool:
        path = self.join(*parts)
        # s3fs answers from a cached parent listing if it has one: another process may have
        # committed since (a manifest is the commit, so a stale "no" matters).
        self.fs.invalidate_cache(path.rsplit("/", 1)[0])
        with self._at(*parts):
            return bool(self.fs.exists(path))

    def each(self, query: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        items = list(items)
        if len(items) < 2 or not getattr(self.fs, "async_impl", False):
            return [query(item) for item in items]
        # An async filesystem's (s3fs, gcsfs, adlfs) blocking calls may come from several threads:
        # each runs on the filesystem's event loop, so the requests overlap. Others (sftp ...) may
        # hold one connection that is not meant to be shared: asked one at a time above.
        return map_in_threads(query, items, _QUERIES_AT_ONCE, "distckpt-query")

    def _ls(self, *parts: str) -> list[dict[str, Any]]:  # fsspec's detail entries
        self.refresh()
        try:
            with self._at(*parts):
                return list(self.fs.ls(self.join(*parts), detail=True))
        except FileNotFoundError:
            return []

    def list_dirs(self) -> list[str]:
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self._ls() if e.get("type") == "directory")

    def list_files(self, *parts: str) -> dict[str, int]:
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in self._ls(*parts)
            if e.get("type") == "file"
        }

    def list_entries(self, *parts: str) -> tuple[dict[str, int], list[str]]:
        entries = self._ls(*parts)
        files = {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries if e.get("type") == "file"}
        others = sorted(n for n in (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") != "file"))
        return files, others

    # bytes ------------------------------------------------------------------------------------
    def read_bytes(self, *parts: str) -> bytes:
        with self._at(*parts):
            return bytes(self.fs.cat_file(self.join(*parts)))

    def write_bytes(self, data: bytes, *parts: str, exclusive: bool = False) -> None:
        path = self.join(*parts)
        if not exclusive:
            with self._at(*parts):
                self.fs.pipe_file(path, data)
            return
        try:
            with self._at(*parts):
                self.fs.pipe_file(path, data, mode="create")
        except Exception as exc:
            if not isinstance(exc, FileExistsError) and not self.exists(*parts):
                raise
            # HTTP 412: it exists. Perhaps by this very put: it landed, its answer was lost (a
            # dropped connection) and the client's retry found the object. Every exclusive
            # write carries bytes unique to its writer (an owner record, a manifest), so the
            # same bytes there are ours: taken for another writer's, a committed step was
            # reported lost (no retention, no replica) and the claim blocked its own step.
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])  # (a cached "absent" answers otherwise)
            try:
                with self._at(*parts):
                    ours = bytes(self.fs.cat_file(path)) == data
            except Exception:  # noqa: BLE001 - unreadable: the store said it exists
                ours = False
            if not ours:
                raise FileExistsError(f"{self.display(*parts)} exists") from None

    def create_exclusive(self, dirname: str, name: str, data: bytes) -> None:
        # No directories to create atomically: the conditional put of the file is the claim.
        self.makedirs(dirname)
        self.write_bytes(data, dirname, name, exclusive=True)

    def remove(self, *parts: str) -> None:
        try:
            with self._at(*parts):
                self.fs.rm_file(self.join(*parts))
        except FileNotFoundError:
            pass

    def remove_tree(self, *parts: str) -> None:
        path = self.join(*parts)
        try:
            with self._at(*parts):
                if is_pattern(path):  # fsspec's rm would delete what the pattern matches: each object by name
                    found = self.fs.find(path, withdirs=True, detail=True)
                    for name, info in found.items():
                        if info.get("type") != "directory":
                            self.fs.rm_file(name)
                    if not self.flat:  # then the folders, deepest first (rmdir takes a path literally)
                        folders = [n for n, info in found.items() if info.get("type") == "directory"]
                        for name in sorted(folders, key=len, reverse=True) + [path]:
                            try:
                                self.fs.rmdir(name)
                            except (FileNotFoundError, NotADirectoryError):
                                pass
                else:
                    self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.refresh()

    def rewrite_bytes(self, data: bytes, *parts: str) -> None:
        self.write_bytes(data, *parts)  # no directories to re-create

    def move_dir(self, src: str, dst: str) -> bool:
        return False  # no atomic rename on object stores

    def file_stamp(self, *parts: str) -> str | None:
        path = self.join(*parts)
        self.fs.invalidate_cache(path.rsplit("/", 1)[0])  # (a cached listing may be older)
        try:
            with self._at(*parts):
                info = self.fs.info(path)
        except FileNotFoundError:
            return None
        for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated", "created"):
            value = info.get(key)
            if value is not None and value != "":
                return f"{key}:{value}"[:200]
        return None

    def last_change(self, *parts: str) -> tuple[float | None, int]:
        times: list[float] = []
        entries = self._ls(*parts)
        for entry in entries:
            for key in ("mtime", "LastModified", "last_modified", "updated", "created", "timeCreated"):
                stamp = _stamp(entry.get(key))
                if stamp is not None:
                    times.append(stamp)
                    break
        return (max(times) if times else None), len(entries)

    # a directory published as a whole: written in place, committed by its last file -----------
    def stage_directory(self, *, uncommit: str | None = None) -> str:
        if uncommit is not None:
            self.remove(uncommit)  # readers never see the old index over a mix of files
        return self.url

    def commit_directory(self, staged: str, *, overwrite: bool, stale: Callable[[str], bool] | None = None) -> None:
        if not overwrite or stale is None:
            return
        try:  # best effort: the new directory is committed already
            for name in self.list_files():
                if stale(name):
                    self.remove(name)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"distckpt: {self.display()}: could not remove the replaced directory's files: {exc}", stacklevel=3)

    def abandon_directory(self, staged: str, written: Iterable[str]) -> None:
        for name in written:
            try:
                self.remove(name)
            except Exception:  # noqa: BLE001 - best effort: the publish's own error is what counts
                pass

    def local_dir(self, names: Iterable[str], scratch: str) -> str:
        for name in names:
            with self.open(name, "rb") as fin, open(os.path.join(scratch, name), "wb") as fout:
                while chunk := fin.read(16 << 20):
                    fout.write(chunk)
        return scratch

    def makedirs(self, *parts: str) -> None:
        # fsspec's makedirs on an object store creates a missing *bucket* (a typo in its name
        # would silently make a new one): there, only check that the bucket exists.
        if self.flat:
            self.check_bucket()
            return
        with self._at(*parts):
            self.fs.makedirs(self.join(*parts), exist_ok=True)

    def check_bucket(self) -> None:
        if not self.flat:
            return
        bucket = self.path.split("/", 1)[0]
        with self._at():
            ok = bool(self.fs.exists(bucket))
        if ok:
            return
        # exists() answers False for a store it could not reach too (s3fs swallows every error of
        # its bucket probes): a listing tells a missing or forbidden bucket from an unreachable
        # store, which is no caller mistake and must not be reported as one.
        try:
            self.fs.ls(bucket, detail=False)
        except (FileNotFoundError, PermissionError):
            pass
        except Exception as exc:  # noqa: BLE001 - whatever the store's client raises
            raise OSError(f"{self.display()}: could not check bucket {bucket!r}: {type(exc).__name__}: {exc}") from exc
        else:
            return  # listed: it exists after all
        raise FileNotFoundError(
            f"{self.display()}: bucket {bucket!r} does not exist or is not accessible with the "
            "given credentials (storage_options or the AWS environment); distckpt never creates buckets"
        )

    # files ------------------------------------------------------------------------------------
    @contextmanager
    def open(self, rel: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        with self.fs.open(self.join(rel), mode) as f:
            yield f

    def dcp_filesystem(self) -> FileSystemBase:
        fs = _RemoteDcpFS(self.flat)
        fs.fs = self.fs
        return fs


def _stamp(value: object) -> float | None:
    """A listing's time field (float seconds, ``datetime`` or ISO string) as a Unix time."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    return None


class _RemoteDcpFS(_FsspecDcpFS):
    """DCP's fsspec filesystem that never creates buckets (DCP calls ``mkdir`` on every rank)."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        self.flat = flat

    def mkdir(self, path: str | os.PathLike) -> None:
        if not self.flat:  # object stores: prefixes need no creating
            super().mkdir(path)

    # DCP's rename and rm_file call fsspec's mv and rm, which read '*', '?' and '[' in a path as a
    # pattern (a root s3://b/exp[12] would rename and delete exp1's and exp2's files): literal here.
    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        if is_pattern(os.fspath(path)) or is_pattern(os.fspath(new_path)):
            self.fs.cp_file(path, new_path)
            self.fs.rm_file(path)
        else:
            super().rename(path, new_path)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.rm_file(path)
