"""Finding checkpoints and describing them: what ``distckpt ls`` and ``distckpt inspect`` show.

Nothing here is collective and nothing needs a process group: any process that can reach the
storage may call these functions.

A checkpoint location (``CKPT`` on the command line) is one of:

* a step directory ``ROOT/step_000000100`` (committed: it holds ``manifest.json``), or a
  committed step directory copied or renamed to another name (``best/``);
* a root holding step directories (then the newest committed step, or ``step=N``);
* a plain DCP checkpoint directory (``.metadata`` but no manifest), for inspect and convert,
  which read it unverified and say so; also under a step's name in a root, where no distckpt
  save left it (no owner record: ``ls`` says ``plain dcp``).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from distckpt.integrations.lightning_pointers import POINTER_MAX_BYTES, pointer_hint
from distckpt.errors import CheckpointError, StepDeletedError
from distckpt.integrity.manifest import (
    MANIFEST_NAME,
    TIER_MARK,
    committed_steps,
    load_manifest,
    parse_step_dir,
    read_manifest,
    step_dir,
    tier_copy,
)
from distckpt.integrity.stepfiles import StepFiles, deleted_while
from distckpt.state.shape import numel
from distckpt.storage.base import Storage
from distckpt.storage.ownership import unowned_dcp_checkpoint


class CheckpointNotFound(FileNotFoundError):
    """The location is not a (complete) checkpoint; the message names the problem."""


# A located checkpoint is a step directory opened for verified reads.
Located = StepFiles


def _split_parent(location: str) -> tuple[str, str]:
    text = location.rstrip("/")
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if "/" not in rest:
            return text, ""
        parent, name = rest.rsplit("/", 1)
        return f"{scheme}://{parent}", name
    text = os.path.abspath(os.path.expanduser(text))
    return os.path.dirname(text), os.path.basename(text)


def locate(location: str, storage_options: Mapping[str, object] | None = None, step: int | None = None) -> StepFiles:
    """Resolve ``location`` (step directory, root or plain DCP directory) to one checkpoint,
    opened for verified reads (:class:`~distckpt.integrity.stepfiles.StepFiles`).

    A directory holding ``manifest.json`` is a committed step whatever its name: one named
    ``step_N`` must hold step N's manifest; one copied or renamed (e.g. ``best``) takes its step
    from the manifest, and its files are verified against it all the same. A directory with
    ``.metadata`` and no manifest is a plain DCP checkpoint, read unverified.

    Raises:
        CheckpointNotFound: nothing there, no committed step, an incomplete step, or not a checkpoint.
        NotADirectoryError: ``location`` is a file.
        IntegrityError: the manifest is malformed or belongs to another step's directory.
        ValueError: ``step`` contradicts the step directory given as ``location``.
    """
    options = dict(storage_options or {})
    parent, name = _split_parent(location)
    named_step = parse_step_dir(name) if name else None
    if named_step is not None:
        if step is not None and step != named_step:
            raise ValueError(f"--step {step} contradicts the step directory {location}")
        storage = Storage(parent, options)
        return _committed(storage, named_step)

    storage = Storage(location, options)
    _refuse_file(storage, "a checkpoint (a step directory, a root of steps or a DCP directory)")
    if not storage.root_exists():
        storage.check_bucket()  # a misspelled bucket is named as such
        raise CheckpointNotFound(f"{storage.display()} does not exist")
    if storage.exists(MANIFEST_NAME):  # a committed step directory under another name
        found = _open_committed(storage, "", None)
        if step is not None and step != found.step:
            raise ValueError(f"--step {step} contradicts {storage.display()}, which holds step {found.step}")
        return found
    if step is not None:
        return _committed(storage, step)
    steps = committed_steps(storage)
    if steps:
        return _committed(storage, steps[-1], listed=True)
    if storage.exists(".metadata"):  # a plain DCP checkpoint directory
        return StepFiles(storage, "")
    dirs = sorted(s for d in storage.list_dirs() if (s := parse_step_dir(d)) is not None)
    # A local tier's directory (``distckpt inspect /dev/shm/JOB``): its newest committed copy.
    copies = [s for s in dirs if tier_copy(storage, s) and storage.exists(step_dir(s), MANIFEST_NAME)]
    if copies:
        return _committed(storage, copies[-1], listed=True)
    if dirs:
        raise CheckpointNotFound(f"no committed checkpoint under {storage.display()} (only incomplete step directories)")
    raise CheckpointNotFound(f"{storage.display()} is not a checkpoint (no step_* directories, no .metadata)")


def _refuse_file(storage: Storage, what: str) -> None:
    """A file where a directory is expected is said to be one: a local file would otherwise be
    reported as missing, and a file on an object store as a root holding nothing.

    Raises:
        NotADirectoryError: naming the file and what was expected instead.
    """
    if storage.fs.isfile(storage.path):
        try:
            with storage.fs.open(storage.path, "rb") as f:
                hint = pointer_hint(f.read(_POINTER_PEEK))
        except OSError:
            hint = None
        if hint is not None:  # (users hold Lightning's .ckpt paths, not step folders)
            raise NotADirectoryError(f"{storage.display()} is {hint}")
        raise NotADirectoryError(f"{storage.display()} is a file, not {what}")


_POINTER_PEEK = POINTER_MAX_BYTES + 1  # (pointers are smaller: a larger read is no pointer)


def _committed(storage: Storage, step: int, listed: bool = False) -> StepFiles:
    """Committed step ``step`` (``listed``: it was listed as committed a moment ago, so a missing
    manifest now means it was deleted since)."""
    name = step_dir(step)
    if not storage.exists(name, MANIFEST_NAME):
        if listed:
            raise StepDeletedError(deleted_while(storage, name, step, "opened"))
        if storage.exists(name):
            if storage.exists(name, TIER_MARK):  # (no plain DCP checkpoint: what a recovery left)
                raise CheckpointNotFound(
                    f"{storage.display(name)} is a local tier's copy without {MANIFEST_NAME}: not committed on this node "
                    "(a recovery streamed its files to the ranks, or a save's copy was cut short); its files are on "
                    "other nodes' tiers and at the root"
                )
            if unowned_dcp_checkpoint(storage, name):  # a plain dcp.save under a step's name
                return StepFiles(storage, name)
            raise CheckpointNotFound(f"checkpoint {storage.display(name)} is incomplete (no {MANIFEST_NAME}); it was never committed")
        raise CheckpointNotFound(f"checkpoint {storage.display(name)} does not exist")
    return _open_committed(storage, name, step)


def _open_committed(storage: Storage, dirname: str, step: int | None) -> StepFiles:
    """The committed step in ``dirname``, whose manifest was there a moment ago: gone now, it was
    deleted since (retention removes a step's manifest first), not a plain DCP directory."""
    try:
        manifest = load_manifest(storage, dirname)
    except FileNotFoundError:
        raise StepDeletedError(deleted_while(storage, dirname, step, "opened")) from None
    return StepFiles(storage, dirname, manifest=manifest)


# ls ----------------------------------------------------------------------------------------------
def list_steps(storage: Storage) -> list[dict[str, Any]]:
    """One record per step directory under ``storage``: step, committed, bytes, world_size, time.

    Raises:
        CheckpointNotFound: the root does not exist.
        NotADirectoryError: the root is a file.
    """
    _refuse_file(storage, "a checkpoint root (a directory of step_* directories)")
    if not storage.root_exists():
        storage.check_bucket()  # a misspelled bucket is named as such
        raise CheckpointNotFound(f"{storage.display()} does not exist")
    steps = [(name, step) for name in storage.list_dirs() if (step := parse_step_dir(name)) is not None]
    # A request or two per step: asked concurrently on object stores (Storage.each).
    rows = storage.each(lambda named: _step_row(storage, *named), steps)
    return sorted(rows, key=lambda r: r["step"])


def _step_row(storage: Storage, name: str, step: int) -> dict[str, Any]:
    """``ls``'s record of step directory ``name``."""
    row: dict[str, Any] = {"step": step, "path": storage.display(name), "committed": False}
    if storage.exists(name, MANIFEST_NAME):
        try:
            manifest = read_manifest(storage, step)
        except (ValueError, CheckpointError) as exc:
            row.update(status="bad manifest", error=str(exc), bytes=sum(storage.list_files(name).values()))
            return row
        row.update(
            committed=True,
            # A local tier's copy of another root's step: no checkpointer of this root takes it.
            status="tier copy" if tier_copy(storage, step) else "committed",
            bytes=manifest.total_bytes,
            world_size=manifest.world_size,
            created_unix=manifest.created_unix,
            job=manifest.job,  # (two jobs sharing a root, job=: whose step)
        )
    else:
        files = storage.list_files(name)
        # A DCP checkpoint no distckpt save left (no owner record): a plain dcp.save under a
        # step's name, which cleanup keeps and inspect/convert read (unverified); not "incomplete".
        # A tier's folder without a manifest (a recovery streamed the step's files into the
        # ranks' loads and kept only .metadata here): not a plain DCP checkpoint.
        if TIER_MARK in files:
            status = "incomplete tier copy"
        else:
            status = "plain dcp" if unowned_dcp_checkpoint(storage, name, files) else "incomplete"
        row.update(status=status, bytes=sum(files.values()), world_size=None, created_unix=None, job=None)
    return row


# inspect -----------------------------------------------------------------------------------------
def entry_rows(metadata: Metadata) -> list[dict[str, Any]]:
    """key, kind, dtype, global shape, bytes and number of shards of every checkpoint entry."""
    value_bytes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        value_bytes[index.fqn] = value_bytes.get(index.fqn, 0) + int(getattr(info, "length", 0) or 0)
    rows = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            rows.append(
                {
                    "key": key,
                    "kind": "tensor",
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": [int(d) for d in md.size],
                    "bytes": numel(md.size) * dtype.itemsize,
                    "shards": len(md.chunks),
                }
            )
        else:
            rows.append({"key": key, "kind": "value", "dtype": None, "shape": None, "bytes": value_bytes.get(key, 0), "shards": 1})
    return rows


def describe(found: StepFiles) -> dict[str, Any]:
    """Everything ``inspect`` shows: location, entries, totals, the manifest and, if reads of it
    are not verified, why (JSON-ready)."""
    rows = entry_rows(found.metadata())
    tensors = [r for r in rows if r["kind"] == "tensor"]
    files = found.storage.list_files(found.dirname) if found.dirname else found.storage.list_files()
    totals = {
        "entries": len(rows),
        "tensors": len(tensors),
        "values": len(rows) - len(tensors),
        "tensor_bytes": sum(r["bytes"] for r in tensors),
        "parameters": sum(numel(r["shape"]) for r in tensors),
        "file_bytes": sum(files.values()),
        "files": len(files),
    }
    return {
        "location": found.display(),
        "step": found.step,
        "entries": rows,
        "totals": totals,
        "manifest": asdict(found.manifest) if found.manifest is not None else None,
        "verified": not found.unverified,
        "unverified": found.unverified,
    }
