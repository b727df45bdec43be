"""Where an export or import may write, and writing a file there so that it appears whole or not at all.

* :func:`check_output`: refuse an output inside a checkpoint (or a step directory of a root), or
  over one of the inputs: distckpt never writes into what it reads or keeps.
* :func:`open_output`: a binary file that appears only if the block writing it succeeds.

Not collective.
"""

from __future__ import annotations

import errno
import os
import stat
import posixpath
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from distckpt.integrity.manifest import MANIFEST_NAME, parse_step_dir
from distckpt.storage.base import _flat_namespace, _redact, is_local_location, is_pattern, local_path, named_os_error

_CHECKPOINT_MARKERS = (MANIFEST_NAME, ".metadata")


def is_url(location: str) -> bool:
    """Whether ``location`` names a remote object, not the local disk (``file://`` and fsspec's
    ``local://`` name local paths: :func:`~distckpt.storage.base.is_local_location`). Without
    ``://`` it is a path, taken literally (``epoch=1::x.ckpt`` is no chain of URLs)."""
    return not is_local_location(location)


def check_output(out: str, storage_options: Mapping[str, object] | None = None, *, inputs: tuple[str, ...] = ()) -> None:
    """Refuse an output that would write into a checkpoint or over an input. Not collective.

    Refused (local paths are checked as given and with symbolic links resolved, so a link into a
    step is no way in): ``out`` itself or any folder above it that

    * holds ``manifest.json`` or ``.metadata``: a committed step (under any name) or a plain DCP
      checkpoint; writing there would change or shadow its files;
    * is named like a step directory (``step_<N>``) and holds ``.distcp`` files or lies in a
      checkpoint root (a folder holding a committed step): an incomplete step, or a new folder
      that ``ls`` would list as one and the next save would remove.

    ``out`` naming one of ``inputs`` is refused too.

    Raises:
        ValueError: naming ``out`` and the checkpoint (or the input) it would write into.
    """
    where = _redact(out)  # messages never show credentials a URL may carry
    local = local_path(out)
    if local is None:
        fs, path = url_to_fs(out, **dict(storage_options or {}))
        scheme = out.split("://", 1)[0]
        paths = [path.rstrip("/")]

        def show(p: str) -> str:
            return _redact(f"{scheme}://{p.lstrip('/')}")
    else:
        fs, _ = url_to_fs("file:///")
        path = local
        paths = list(dict.fromkeys([path, os.path.realpath(path)]))

        def show(p: str) -> str:
            return p

    for src in inputs:
        src_local = local_path(src)
        if (src_local is None) != (local is None):
            continue  # one on the local disk, the other not (a memory:// path may read as a local one)
        same = os.path.realpath(src_local) == paths[-1] if src_local is not None else src.rstrip("/") == out.rstrip("/")
        if same:
            raise ValueError(f"output {where} is the input {_redact(src)}: distckpt never writes over what it reads; choose another output")
    for p in paths:
        d = p
        while d:
            for marker in _CHECKPOINT_MARKERS:
                if fs.isfile(posixpath.join(d, marker)):  # files: an IDE's .metadata folder is no checkpoint
                    raise ValueError(
                        f"output {where} is inside the checkpoint {show(d)} (it holds {marker}): distckpt never writes "
                        "into a checkpoint; choose an output outside every checkpoint step"
                    )
            if parse_step_dir(posixpath.basename(d)) is not None and _in_checkpoint_root(fs, d):
                raise ValueError(
                    f"output {where} is inside {show(d)}, a step directory of the checkpoint root {show(posixpath.dirname(d))}: "
                    "a save would take it for an incomplete step (and remove it); choose an output outside the root's steps"
                )
            parent = posixpath.dirname(d)
            d = parent if parent != d else ""


def _in_checkpoint_root(fs: AbstractFileSystem, d: str) -> bool:
    """Whether folder ``d`` (named like a step) holds DCP data files or lies beside a committed step."""
    def entries(where: str) -> list[dict[str, Any]]:  # fsspec's detail entries
        try:
            return list(fs.ls(where, detail=True))
        except (FileNotFoundError, NotADirectoryError):
            return []

    if any(e.get("type") == "file" and str(e["name"]).endswith(".distcp") for e in entries(d)):
        return True
    root = posixpath.dirname(d)
    for e in entries(root):
        name = str(e["name"]).rstrip("/")
        if e.get("type") == "directory" and parse_step_dir(posixpath.basename(name)) is not None:
            if fs.isfile(posixpath.join(name, MANIFEST_NAME)):
                return True
    return False


def _refuse_existing(where: str) -> None:
    raise FileExistsError(f"output {where} exists: distckpt convert replaces a file only when asked (--overwrite; overwrite=True)")


@contextmanager
def _local_output(path: str, overwrite: bool) -> Iterator[IO[bytes]]:
    """:func:`open_output` of a local ``path`` (checked already).

    Written as an unnamed file of ``path``'s folder where the file system has them (Linux's
    ``O_TMPFILE``: a run killed half-way leaves nothing behind, where a named temporary file
    stayed for good), then linked in: at ``path`` itself without ``overwrite``, which never
    replaces a file that appeared meanwhile; beside it and renamed over it with ``overwrite``.
    Elsewhere: a named temporary file beside ``path``, renamed into place.
    """
    tmp: str | None = None
    try:
        fd = _unnamed_file(os.path.dirname(path))
        if fd is None:
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot write {path}: {exc.strerror}") from None
    f = os.fdopen(fd, "wb")
    unnamed = tmp is None
    temporary = {tmp}  # names of ours an error may carry: the output's name is shown instead
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        if unnamed:
            linked = path if not overwrite else f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            temporary.add(linked)
            try:
                _link_unnamed(f.fileno(), linked)
            except FileExistsError:
                _refuse_existing(path)  # (appeared while this was written)
            tmp = None if linked == path else linked
        f.close()
        if tmp is not None:
            if not overwrite and os.path.lexists(path):  # (appeared while this was written)
                _refuse_existing(path)
            os.replace(tmp, path)
    except BaseException as exc:
        try:
            f.close()  # flushes what is buffered: on a full disk this fails again
        except OSError:
            pass
        if tmp is not None:
            try:
                os.remove(tmp)
            except OSError:
                pass
        if isinstance(exc, OSError):
            if exc.errno is not None and exc.filename is not None and exc.filename in temporary - {path}:
                # (a folder that appeared at the output: "Is a directory: model.pt.tmp-1a2b3c4d")
                raise type(exc)(exc.errno, exc.strerror, path) from None
            raise named_os_error(exc, path) from exc
        raise


def _link_unnamed(fd: int, path: str) -> None:
    """Give the unnamed file ``fd`` the name ``path`` (``FileExistsError`` if it is taken)."""
    folder = os.open(os.path.dirname(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        # linkat(..., AT_SYMLINK_FOLLOW) through /proc: what links an O_TMPFILE file. (os.link
        # calls plain link(), which links the /proc entry itself, unless a dir_fd is given.)
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=folder, follow_symlinks=True)
    finally:
        os.close(folder)


def _unnamed_file(folder: str) -> int | None:
    """A descriptor of a new unnamed file in ``folder``, open for writing (``O_TMPFILE``), or
    ``None`` where the system or the file system has none (or no ``/proc`` to link it through).

    Raises:
        OSError: ``folder`` cannot be written (missing, no permission, read-only, full).
    """
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, flag | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):  # not on this file system
            return None
        raise


@contextmanager
def open_output(out: str, storage_options: Mapping[str, object] | None = None, *, overwrite: bool = False) -> Iterator[IO[bytes]]:
    """A binary file at ``out`` (path or URL) that appears only if the block succeeds.

    Local: written as an unnamed (or temporary) file and linked (renamed) into place
    (:func:`_local_output`). Object stores: one upload, discarded if the block fails. An
    existing file at ``out`` is replaced only with ``overwrite`` (checked before the block runs
    and again when the file is put in place); ``out`` ending in ``/`` names a folder, never a file.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False, or is no regular file.
        IsADirectoryError: ``out`` is a directory or ends with ``/``.
    """
    if out.endswith(("/", os.sep)) or out.replace(os.sep, "/").rsplit("/", 1)[-1] in (".", ".."):
        # (the path would be normalised to the folder's name: a file "newdir" written for "newdir/")
        raise IsADirectoryError(f"output {_redact(out)} names a folder (it ends with '/', '.' or '..'): give the name of the file to write")
    path = local_path(out)
    if path is not None:
        if os.path.isdir(path):
            raise IsADirectoryError(f"output {path} is a directory")
        # The file is renamed into place: over a symbolic link, a device (/dev/null, as root) or
        # a named pipe that would replace the entry itself (the link gone, its target untouched;
        # the device node a regular file), not write through it.
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file (a device, a pipe or a socket)"
            raise FileExistsError(f"output {path} is {what}; refusing to replace it: give a regular file's path or a new one")
        if mode is not None and not overwrite:
            _refuse_existing(path)
        with _local_output(path, overwrite) as f:
            yield f
        return
    fs, path = url_to_fs(out, **dict(storage_options or {}))
    if fs.isdir(path):
        raise IsADirectoryError(f"output {_redact(out)} is a directory")
    if not overwrite and fs.exists(path):
        _refuse_existing(_redact(out))
    if not _flat_namespace(fs):
        with _staged_output(fs, path, _redact(out), overwrite) as f:
            yield f
        return
    f = fs.open(path, "wb")
    try:
        yield f
        f.close()
    except BaseException:
        # Object stores publish a file only when its upload completes (close). Discarding the
        # upload leaves any earlier object at ``out`` untouched and publishes nothing partial.
        discard = getattr(f, "discard", None)
        try:
            if discard is not None:
                discard()
                # Discarded, the file is unusable (s3fs drops its buffer); closed, here or when
                # collected, it would flush that buffer: an AttributeError printed at exit.
                f.closed = True
            else:  # a filesystem without uploads: remove what was written
                f.close()
                fs.rm_file(path)
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass
        raise


@contextmanager
def _staged_output(fs: AbstractFileSystem, path: str, where: str, overwrite: bool) -> Iterator[IO[bytes]]:
    """:func:`open_output` on a filesystem whose files appear as they are written (``memory://``,
    sftp, HDFS...: no upload to discard): written under a temporary name beside ``path`` and
    moved into place once complete, removed on failure, so that a failed export neither
    publishes a partial file nor truncates the file it would have replaced."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    f = fs.open(tmp, "wb")
    try:
        yield f
        f.close()
        if not overwrite and fs.exists(path):  # (appeared while this was written)
            _refuse_existing(where)
        if is_pattern(path):  # (fsspec's mv reads '[', '*' and '?' as a pattern: moved by name)
            fs.cp_file(tmp, path)
            fs.rm_file(tmp)
        else:
            fs.mv(tmp, path)
    except BaseException:
        try:
            f.close()
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass
        try:
            fs.rm_file(tmp)
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass
        raise
