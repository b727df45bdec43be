"""Finding checkpoints and describing them: what ``distckpt ls`` and ``distckpt inspect`` show.

Nothing here is collective and nothing needs a process group: any process that can reach the
storage may call these functions.

A checkpoint location (``CKPT`` on the command line) is one of:

* a step directory ``ROOT/step_000000100`` (committed: it holds ``manifest.json``);
* a root holding step directories (then the newest committed step, or ``step=N``);
* a plain DCP checkpoint directory (``.metadata`` but no manifest), for inspect and convert.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ._shape import numel
from .errors import CheckpointError
from .manifest import MANIFEST_NAME, Manifest, committed_steps, parse_step_dir, step_dir
from .storage import Storage


class CheckpointNotFound(FileNotFoundError):
    """The location is not a (complete) checkpoint; the message names the problem."""


@dataclass
class Located:
    """A checkpoint found at a user-given location.

    Attributes:
        storage: the root the step directory lives in (or the plain DCP directory itself).
        dirname: the step directory's name under ``storage`` ("" for a plain DCP directory).
        step: the step (``None`` for a plain DCP directory).
        manifest: the manifest (``None`` for a plain DCP directory).
    """

    storage: Storage
    dirname: str
    step: int | None
    manifest: Manifest | None

    def display(self, *parts: str) -> str:
        return self.storage.display(*[p for p in (self.dirname, *parts) if p])

    def metadata(self) -> Metadata:
        """DCP's metadata of the checkpoint (read with distckpt's safe reader).

        For a distckpt step, ``.metadata`` is checked against the manifest (size, checksum) and
        its byte ranges against the data files' recorded sizes, as a load checks it.
        """
        if self.manifest is not None:
            from .manifest import read_metadata

            return read_metadata(self.storage, self.manifest)
        return self.storage.reader(self.dirname).read_metadata()


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


def locate(location: str, storage_options: dict[str, Any] | None = None, step: int | None = None) -> Located:
    """Resolve ``location`` (step directory, root or plain DCP directory) to one checkpoint.

    Raises:
        CheckpointNotFound: nothing there, no committed step, an incomplete step, or not a checkpoint.
        ValueError: ``step`` contradicts a step directory given as ``location``.
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
    if not storage.root_exists():
        raise CheckpointNotFound(f"{storage.display()} does not exist")
    if step is not None:
        return _committed(storage, step)
    steps = committed_steps(storage)
    if steps:
        return _committed(storage, steps[-1])
    if storage.exists(".metadata"):  # a plain DCP checkpoint directory
        return Located(storage, "", None, None)
    if any(parse_step_dir(d) is not None for d in storage.list_dirs()):
        raise CheckpointNotFound(f"no committed checkpoint under {storage.display()} (only incomplete step directories)")
    raise CheckpointNotFound(f"{storage.display()} is not a checkpoint (no step_* directories, no .metadata)")


def _committed(storage: Storage, step: int) -> Located:
    from .manifest import read_manifest

    name = step_dir(step)
    if not storage.exists(name, MANIFEST_NAME):
        if storage.exists(name):
            raise CheckpointNotFound(f"checkpoint {storage.display(name)} is incomplete (no {MANIFEST_NAME}); it was never committed")
        raise CheckpointNotFound(f"checkpoint {storage.display(name)} does not exist")
    return Located(storage, name, step, read_manifest(storage, step))


# ls ----------------------------------------------------------------------------------------------
def list_steps(storage: Storage) -> list[dict[str, Any]]:
    """One record per step directory under ``storage``: step, committed, bytes, world_size, time.

    Raises:
        CheckpointNotFound: the root does not exist.
    """
    from .manifest import read_manifest

    if not storage.root_exists():
        raise CheckpointNotFound(f"{storage.display()} does not exist")
    rows = []
    for name in storage.list_dirs():
        step = parse_step_dir(name)
        if step is None:
            continue
        row: dict[str, Any] = {"step": step, "path": storage.display(name), "committed": False}
        if storage.exists(name, MANIFEST_NAME):
            try:
                manifest = read_manifest(storage, step)
            except (ValueError, CheckpointError) as exc:
                row.update(status="bad manifest", error=str(exc), bytes=sum(storage.list_files(name).values()))
                rows.append(row)
                continue
            row.update(
                committed=True,
                status="committed",
                bytes=manifest.total_bytes,
                world_size=manifest.world_size,
                created_unix=manifest.created_unix,
            )
        else:
            files = storage.list_files(name)
            row.update(status="incomplete", bytes=sum(files.values()), world_size=None, created_unix=None)
        rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


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


def describe(found: Located) -> dict[str, Any]:
    """Everything ``inspect`` shows: location, entries, totals and the manifest (JSON-ready)."""
    from dataclasses import asdict

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
    }
