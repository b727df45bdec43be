"""The pointer files of :class:`~distckpt.integrations.lightning.DistckptCheckpointIO`.

Lightning names checkpoints by path (``.../epoch=1-step=100.ckpt``, ``last.ckpt``); the plugin
writes the state as a distckpt step and, at Lightning's path, a small JSON *pointer*: the root,
the step, the job that saved it and the checkpoint's top-level keys. Pointers are replaced
atomically (:func:`write_pointer`), parsed strictly (:func:`parse_pointer`: anything else is no
pointer) and listed per directory (:func:`pointers_in`); a step of this job that no pointer refers
to any more is deleted (:func:`delete_unreferenced`), as distckpt's retention deletes a step.

A save writes its pointer twice: before the step is saved, a *pending* one (the file's previous
target, if any, plus ``pending``: the step being saved), so that the file exists at once
(ModelCheckpoint's version counter and ``save_last="link"`` look for it on disk while an async
save is still writing) and a crash between the step's commit and the final pointer loses
nothing (:func:`resolve`: the pending step where it committed, else the previous target); then,
once the step is committed, the final one.

Imports no Lightning. Not collective: global rank 0 reads, writes and removes pointers.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TypedDict

import fsspec
import fsspec.implementations.local
from fsspec import AbstractFileSystem

from distckpt.checkpointer import Checkpointer
from distckpt.errors import CheckpointError
from distckpt.integrations.lightning_overlay import MAX_OVERLAY_CHARS, Overlay
from distckpt.integrations.lightning_overlay import check as check_overlay
from distckpt.integrity.manifest import parse_step_dir, step_dir
from distckpt.storage.base import NEW_DIR_PREFIX, Storage, local_path, local_target
from distckpt.storage.ownership import TOMBSTONE_PREFIX
from distckpt.storage.retention import retire_step
from distckpt.tools.outputs import check_output

__all__ = ["POINTER_FORMAT", "POINTER_MAX_BYTES", "Pointer", "PointerRecord", "check_pointer_path", "delete_unreferenced", "dir_of", "dir_url", "exists", "parse_pointer",
           "pointer_bytes", "pointer_hint", "pointers_in", "read_pointer", "record_path", "register_dir", "registered_dirs", "with_pending", "remove_file", "try_pointer", "write_pointer"]  # fmt: skip

#: The ``format`` field of a pointer file.
POINTER_FORMAT = "distckpt-lightning-pointer"
_POINTER_VERSION = 1
#: The version of a pointer holding an overlay: a distckpt that knows no overlays refuses it (as no
#: pointer) rather than load the step's values in place of the overlay's.
_OVERLAY_VERSION = 2
#: Pointers are a few hundred bytes, and an overlay (a later save's values at one step, see
#: :mod:`~distckpt.integrations.lightning_overlay`) at most MAX_OVERLAY_CHARS more; larger files
#: are never parsed as one.
POINTER_MAX_BYTES = 2 * MAX_OVERLAY_CHARS + 64 * 1024  # (a pending pointer: the previous target's and the pending save's)
_POINTER_MAX_BYTES = POINTER_MAX_BYTES


class _Overlaid(TypedDict, total=False):
    overlay: Overlay  # (typing.NotRequired needs Python 3.11)


class PointerRecord(_Overlaid):
    """What a save points at: the step, the Lightning checkpoint's top-level keys, its epoch,
    and (a later save at the step) the values it holds differently from the step's."""

    step: int
    keys: list[str]
    epoch: int | None


class Pointer(_Overlaid):
    """A pointer file's fields as :func:`parse_pointer` returns them (all but ``epoch``,
    which is informational, checked)."""

    format: str
    version: int
    root: str
    step: int
    job: str | None
    epoch: object
    keys: list[str]


def _fs(path: str | os.PathLike) -> tuple[AbstractFileSystem, str]:
    """The filesystem of ``path`` and the path in it. A local path is taken literally: fsspec's
    URL parsing would read ``::`` in a file name (``epoch=1::x.ckpt``) as a chain of URLs and
    open another file (``epoch=1``)."""
    location = os.fspath(path)
    local = local_path(location)
    if local is not None:
        return fsspec.filesystem("file"), local
    return fsspec.core.url_to_fs(location)


def _named(fs: AbstractFileSystem, path: str) -> str:
    """``path`` of ``fs`` as :func:`_fs` opens it again (local: the plain absolute path)."""
    return path if isinstance(fs, fsspec.implementations.local.LocalFileSystem) else fs.unstrip_protocol(path)


def check_pointer_path(path: str | os.PathLike, root: str) -> None:
    """Refuse a pointer path that would write into a checkpoint: (rank 0, before a save)

    * a path in the plugin's ``root`` that is, or lies in, one of its step directories (also one
      a later save would create) or its temporary folders, or the root itself: the pointer would
      replace a committed file (``manifest.json``, ``.metadata``) or block a later save;
    * a path inside any other checkpoint (a folder holding ``manifest.json`` or ``.metadata``,
      a step folder of a checkpoint root: :func:`distckpt.tools.outputs.check_output`);
    * an existing directory (a pointer is a file; found out after the save, it would leave the
      committed step with nothing pointing at it).

    Raises:
        ValueError: naming the path and why.
    """
    location = os.fspath(path)
    fs, p = _fs(location)
    # Local by their targets (a chain of caches over the local disk writes its files there).
    mine_local, base_local = local_target(location), local_target(root)
    if (mine_local is None) == (base_local is None):
        if mine_local is not None and base_local is not None:
            mine, base = os.path.realpath(mine_local), os.path.realpath(base_local)
        else:  # URLs compared as written (no filesystem is made for the root here)
            mine, base = location.rstrip("/"), root.rstrip("/")
        if mine == base or mine.startswith(base.rstrip("/") + "/"):
            first = mine[len(base):].strip("/").split("/", 1)[0]
            if mine == base or parse_step_dir(first) is not None or first.startswith((NEW_DIR_PREFIX, TOMBSTONE_PREFIX)):
                what = "is the root" if mine == base else "is, or lies in, a step directory"
                raise ValueError(
                    f"checkpoint path {location} {what} of this DistckptCheckpointIO's root {root}: a pointer there "
                    "would replace a checkpoint's files or block a later save; save Lightning checkpoints elsewhere "
                    f"(ModelCheckpoint(dirpath=...)): beside the steps ({root}/<name>.ckpt) or in a folder of your own"
                )
    if fs.isdir(p):
        raise ValueError(f"checkpoint path {location} is a directory: DistckptCheckpointIO writes a pointer file there")
    check_output(location)


def pointer_bytes(
    root: str,
    job: str | None,
    record: PointerRecord,
    pending: tuple[str | None, PointerRecord] | None = None,
    alone: bool = False,
    writer: dict[str, object] | None = None,
) -> bytes:
    """A pointer to ``record``'s step of job ``job``; ``pending``: ``(job, record)`` of a step
    being saved that the file will point to once it is committed (see the module doc);
    ``alone``: the file had no target before (``record`` is then the pending one); ``writer``:
    who writes the pending step (``host``, ``pid``, ``time``), so that another process does not
    take a save in flight for a stopped run's."""
    body: dict[str, object] = {
        "format": POINTER_FORMAT,
        "version": _POINTER_VERSION,
        "root": _root_id(root),
        "step": record["step"],
        "job": job,
        "epoch": record["epoch"],
        "keys": list(record["keys"]),
    }
    if record.get("overlay") and not alone:  # (alone: the body is a placeholder, the pending part the record)
        body["overlay"] = record["overlay"]
        body["version"] = _OVERLAY_VERSION
    if pending is not None:
        part: dict[str, object] = {"step": pending[1]["step"], "job": pending[0], "epoch": pending[1]["epoch"], "keys": list(pending[1]["keys"])}
        if pending[1].get("overlay"):
            part["overlay"] = pending[1]["overlay"]
            body["version"] = _OVERLAY_VERSION
        if alone:
            part["alone"] = True  # no previous target to fall back to
        if writer is not None:
            part["writer"] = dict(writer)
        body["pending"] = part
    return (json.dumps(body, indent=1) + "\n").encode()


def as_record(pointer: Pointer | dict) -> PointerRecord:
    """The :class:`PointerRecord` a pointer (or its ``pending`` part) names."""
    epoch = pointer.get("epoch")
    record: PointerRecord = {"step": pointer["step"], "keys": list(pointer["keys"]), "epoch": epoch if type(epoch) is int else None}
    if pointer.get("overlay"):
        record["overlay"] = pointer["overlay"]
    return record


def pending_of(pointer: Pointer) -> dict | None:
    """The ``pending`` part of a pointer written before its step committed, else ``None``."""
    return pointer.get("pending")  # type: ignore[return-value]


def resolve(pointer: Pointer, committed_job: Callable[[int], object]) -> Pointer:
    """The pointer a load follows: a pending one's step where it committed (``committed_job(step)``
    returns the job its manifest records, or raises ``FileNotFoundError`` where it is not
    committed) by the pending job, else its previous target.

    Raises:
        FileNotFoundError: the pending step never committed and the file had no target before.
    """
    pending = pending_of(pointer)
    if pending is None:
        return pointer
    try:
        job = committed_job(pending["step"])
    except FileNotFoundError:
        pass
    else:
        if pending["job"] is None or job == pending["job"]:
            resolved = {k: v for k, v in pointer.items() if k != "overlay"}  # (the previous target's values are not the pending save's)
            resolved.update(step=pending["step"], job=job, epoch=pending.get("epoch"), keys=pending["keys"])
            if pending.get("overlay"):
                resolved["overlay"] = pending["overlay"]
            return resolved  # type: ignore[return-value]
    if pending.get("alone"):
        raise FileNotFoundError(
            f"it names step {pending['step']}, whose save never committed (the run stopped while saving it)"
        )
    return pointer


def parse_pointer(data: bytes) -> Pointer | None:
    """The pointer's fields if ``data`` is a valid pointer, else ``None``."""
    if len(data) > _POINTER_MAX_BYTES or data.lstrip()[:1] != b"{":
        return None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or body.get("format") != POINTER_FORMAT or body.get("version") not in (_POINTER_VERSION, _OVERLAY_VERSION):
        return None
    step, keys, job, root = body.get("step"), body.get("keys"), body.get("job"), body.get("root")
    if type(step) is not int or step < 0 or not isinstance(root, str):
        return None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or not (job is None or isinstance(job, str)):
        return None
    if "overlay" in body and not check_overlay(body["overlay"]):
        return None
    if "pending" in body:
        p = body["pending"]
        if not isinstance(p, dict) or type(p.get("step")) is not int or p["step"] < 0:
            return None
        if not isinstance(p.get("keys"), list) or not all(isinstance(k, str) for k in p["keys"]):
            return None
        if not (p.get("job") is None or isinstance(p.get("job"), str)) or not isinstance(p.get("alone", False), bool):
            return None
        if "overlay" in p and not check_overlay(p["overlay"]):
            return None
    return body


def _read_small(fs: AbstractFileSystem, path: str) -> bytes:
    with fs.open(path, "rb") as f:
        head = f.read(64)
        if head.lstrip()[:1] != b"{":
            return head  # no pointer (parse_pointer says so): the rest of another file is not read
        return head + f.read(_POINTER_MAX_BYTES + 1 - len(head))


def pointer_hint(data: bytes) -> str | None:
    """(the CLI) What a pointer file is and what to pass instead (``data``: the file's first
    bytes); ``None`` where ``data`` is no pointer."""
    record = parse_pointer(data)
    if record is None:
        return None
    target = f"{record['root'].rstrip('/')}/{step_dir(record['step'])}"
    pending = pending_of(record)
    if pending is not None:
        new = f"{record['root'].rstrip('/')}/{step_dir(pending['step'])}"
        before = "it named no step before" if pending.get("alone") else f"else {target}"
        return (
            f"a pointer file written by Lightning's DistckptCheckpointIO while step {pending['step']} was being saved at "
            f"{record['root']} (the run stopped before the save settled): pass {new} if it is committed; {before}"
        )
    kept = (
        f" (the values this save held other than the step's, {sorted(record['overlay'])}, are kept in the pointer, "
        "not in the folder)" if record.get("overlay") else ""
    )
    return (
        f"a pointer file written by Lightning's DistckptCheckpointIO, to step {record['step']} at {record['root']}: "
        f"pass that step's folder, {target}{kept}"
    )


def try_pointer(path: str) -> Pointer | None:
    fs, p = _fs(path)
    try:
        if not fs.isfile(p):
            return None
        return parse_pointer(_read_small(fs, p))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def exists(path: str) -> bool:
    fs, p = _fs(path)
    return bool(fs.exists(p))


def write_pointer(path: str, data: bytes) -> None:
    """Replace the file at ``path`` atomically (local: a temporary file, fsync, rename; object
    stores: one put)."""
    fs, p = _fs(path)
    parent = posixpath.dirname(p)
    if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        if parent:
            fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(p, data)
        return
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(p)}.distckpt-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)  # a symbolic link at p (save_last="link") is replaced, not followed
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_file(path: str) -> None:
    fs, p = _fs(path)
    try:
        fs.rm_file(p)
    except FileNotFoundError:
        pass


def dir_of(path: str | os.PathLike) -> str:
    """The directory holding ``path``, as a URL fsspec opens again (``file:///...`` when local)."""
    fs, p = _fs(path)
    return _named(fs, posixpath.dirname(p))


def dir_url(dirpath: str | os.PathLike) -> str:
    """A directory, as :func:`dir_of` names it."""
    fs, p = _fs(dirpath)
    return _named(fs, p.rstrip("/") or "/")


def _root_id(root: str) -> str:
    """How pointers name a root (informational: loads read from the plugin's own root)."""
    local = local_path(root)
    return root.rstrip("/") if local is None else os.path.realpath(local)


def read_pointer(path: str) -> Pointer:
    """The fields of the pointer at ``path``.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``path`` is a directory, or a file that is no pointer (a ``torch.save``
            checkpoint from Lightning's default ``TorchCheckpointIO`` is named as such).
    """
    fs, p = _fs(path)
    if not fs.exists(p):
        raise FileNotFoundError(f"Lightning checkpoint not found: {path}")
    if fs.isdir(p):
        raise ValueError(f"{path} is a directory, not a distckpt pointer file written by DistckptCheckpointIO")
    data = _read_small(fs, p)
    record = parse_pointer(data)
    if record is None:
        zipped = data[:4] == b"PK\x03\x04"
        kind = " (it is a torch.save/zip checkpoint, e.g. from Lightning's default TorchCheckpointIO)" if zipped else ""
        raise ValueError(
            f"{path} is not a checkpoint written by DistckptCheckpointIO{kind}; this plugin reads only its "
            f"own checkpoints (pointer files naming a distckpt step)"
        )
    return record


def pointer_files_in(dirs: Iterable[str]) -> Iterator[tuple[str, Pointer]]:
    """``(path, pointer)`` of every pointer file in the directories ``dirs`` (URLs, as
    :func:`dir_of` names them).

    Raises:
        OSError: a directory, or a file in it, cannot be read (a missing directory holds none).
    """
    for d in sorted(dirs):
        fs, base = _fs(d)
        try:
            listing = fs.ls(base, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for item in listing:
            if item.get("type") != "file" or not 0 < (item.get("size") or 0) <= _POINTER_MAX_BYTES:
                continue
            # (A file gone since the listing raises too: a pointer written meanwhile may not
            # have been listed, so the caller keeps every step this once.)
            record = parse_pointer(_read_small(fs, item["name"]))
            if record is not None:
                yield _named(fs, item["name"]), record


def pointers_in(dirs: Iterable[str]) -> Iterator[Pointer]:
    """Every pointer in the directories ``dirs`` (as :func:`pointer_files_in`); a pending one
    also as a pointer to its pending step (both are referred to until its save settles).

    Raises:
        OSError: a directory, or a file in it, cannot be read (a missing directory holds none).
    """
    yield from with_pending(record for _, record in pointer_files_in(dirs))


def with_pending(records: Iterable[Pointer]) -> Iterator[Pointer]:
    """Every pointer of ``records``, and a pending one also as a pointer to its pending step."""
    for record in records:
        yield record
        pending = pending_of(record)
        if pending is not None:
            yield {**record, "step": pending["step"], "job": pending["job"]}  # type: ignore[typeddict-item]


#: The folder of a root that names every directory a pointer to the root was written in
#: (:func:`register_dir`): a pointer saved by hand (``trainer.save_checkpoint("keep/x.ckpt")``)
#: or by a callback a later run dropped is found there by every later process, which keeps
#: its step (it searched only its own directories and callbacks' before, and deleted it).
REGISTRY_DIR = ".distckpt-pointer-dirs"
_REGISTRY_FORMAT = "distckpt-pointer-dir"
_REGISTRY_ENTRY = re.compile(r"[0-9a-f]{32}\.json")
_REGISTRY_MAX_BYTES = 64 * 1024


def _registry_name(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:32] + ".json"


def register_dir(storage: Storage, url: str) -> None:
    """(rank 0) Record in the root that directory ``url`` (as :func:`dir_of` names it) holds a
    pointer to it; a directory recorded before is left as it is.

    Raises:
        OSError: the root could not be written.
    """
    name = _registry_name(url)
    if storage.exists(REGISTRY_DIR, name):
        return
    storage.write_bytes(json.dumps({"format": _REGISTRY_FORMAT, "dir": url}).encode(), REGISTRY_DIR, name)


def record_path(storage: Storage, url: str) -> str:
    """Where the root records directory ``url`` (for messages: the file to remove)."""
    return storage.display(REGISTRY_DIR, _registry_name(url))


def _protocols(fs: AbstractFileSystem) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


def registered_dirs(storage: Storage) -> set[str]:
    """(rank 0) The directories the root records (:func:`register_dir`). An entry that is not one
    (malformed, a URL this process cannot open) is passed over: it names no directory to search,
    as is one of another store than the root's (a local folder always counts): a record planted
    there must not send every removal to a host of the planter's choosing. Raises ``OSError``
    where the record cannot be listed or read (a missing one holds none).
    """
    try:
        files = storage.list_files(REGISTRY_DIR)
    except FileNotFoundError:
        return set()
    out: set[str] = set()
    for name, size in files.items():
        if not _REGISTRY_ENTRY.fullmatch(name) or size > _REGISTRY_MAX_BYTES:
            continue
        try:
            raw = json.loads(storage.read_bytes(REGISTRY_DIR, name))
        except (FileNotFoundError, ValueError, RecursionError):  # gone since the listing, or no JSON
            continue
        url = raw.get("dir") if isinstance(raw, dict) and raw.get("format") == _REGISTRY_FORMAT else None
        if not isinstance(url, str) or name != _registry_name(url):
            continue
        try:
            if dir_url(url) != url:
                continue
            if local_path(url) is None and not _protocols(_fs(url)[0]) & _protocols(storage.fs):
                continue
        except Exception:  # noqa: BLE001 - a protocol this process has no filesystem for: nothing to search
            continue
        out.add(url)
    return out


def delete_unreferenced(
    ckpt: Checkpointer, steps: set[int], job: str, pointers: Callable[[], Iterable[Pointer]], kept: set[int] | None = None
) -> list[int]:
    """(rank 0) Delete those of ``steps`` that are committed in ``ckpt``'s root, of job ``job``,
    and referred to by none of ``pointers()``; returns them. Errors are warned about, never
    raised (as distckpt's retention: a committed save must not fail over a deletion). Such a
    step holding files distckpt does not write is kept (warned once) and added to ``kept``, as
    is a step the replica still needs (its upload queued or running:
    :meth:`~distckpt.storage.replica.Replicator.holds`).
    """
    if not steps:
        return []
    try:
        committed = set(ckpt.steps())
    except (OSError, ValueError, CheckpointError) as exc:  # a store's hiccup: judged at the next removal
        warnings.warn(f"distckpt: not deleting steps {sorted(steps)} now: could not list {ckpt.storage.display()} ({exc})", stacklevel=3)
        if kept is not None:
            kept.update(steps)
        return []
    candidates = {}
    for step in sorted(steps & committed):
        try:
            owner = ckpt.manifest(step).job
        except (OSError, ValueError, CheckpointError):  # (a damaged manifest: IntegrityError)
            if kept is not None:
                kept.add(step)  # unreadable now (a store's hiccup): judged again at the next removal
            continue  # unreadable: not attributable, so not ours to delete
        if owner is not None and owner == job:
            candidates[step] = owner
    if not candidates:
        return []
    try:
        for record in pointers():
            if candidates.get(record["step"]) == record.get("job"):
                del candidates[record["step"]]
    except OSError as exc:  # a pointer we could not read may refer to any of them: keep all
        warnings.warn(
            f"distckpt: not deleting steps {sorted(candidates)} now: could not read every pointer ({exc}); retried at "
            "this process's next checkpoint removal",
            stacklevel=3,
        )
        if kept is not None:
            kept.update(candidates)  # (retried, as a step holding the user's files is)
        return []
    deleted = []
    storage = ckpt.storage
    newest = max(committed)
    for step in candidates:
        name = step_dir(step)
        if ckpt.replica is not None and ckpt.replica.holds(step, newest):
            # Its upload is queued or running (or failed, to be retried): deleted under it, the
            # replica (which keeps every step unless replicate_keep_last says otherwise) lost it.
            if kept is not None:
                kept.add(step)  # (retried at the next removal, and at teardown once uploads ended)
            continue
        try:
            # distckpt's retention (a step holding files the user added is kept, warned)
            if retire_step(
                storage, step, why="no Lightning checkpoint refers to",
                then="move those files out: this process retries at its next checkpoint removal",
            ):  # fmt: skip
                deleted.append(step)
            elif kept is not None:
                kept.add(step)
        except FileNotFoundError:
            deleted.append(step)
        except OSError as exc:
            warnings.warn(f"distckpt: could not delete {storage.display(name)}: {exc}", stacklevel=3)
    return deleted
