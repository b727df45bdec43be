"""Forging a committed step as an attacker who controls its directory would: a file rewritten and
its size, checksum (and value digest) re-sealed in the manifest, so that only distckpt's own
checks of the content stand between the forgery and a load."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

from torch.distributed.checkpoint.metadata import MetadataIndex

from distckpt.integrity.manifest import MANIFEST_NAME, digest_of


def reseal(d: Path, name: str, data: bytes) -> None:
    """Write ``data`` as file ``name`` of step directory ``d`` and re-seal its manifest record."""
    (d / name).write_bytes(data)
    raw = json.loads((d / MANIFEST_NAME).read_text())
    raw["files"][name] = {"size": len(data), "checksum": digest_of(data, raw["checksum_algorithm"])}
    (d / MANIFEST_NAME).write_text(json.dumps(raw))


def replace_item(d: Path, key: str, blob: bytes, offset: tuple[int, ...] | None = None) -> None:
    """Store ``blob`` (a torch.save record) as item ``key`` of step directory ``d`` (a tensor's
    shard where ``offset`` gives its offsets): its data file, ``.metadata`` (the items after it
    moved) and, for a non-tensor item, its value digest re-sealed."""
    md = pickle.loads((d / ".metadata").read_bytes())
    info = md.storage_data[MetadataIndex(key, offset)]
    data = (d / info.relative_path).read_bytes()
    new = data[: info.offset] + blob + data[info.offset + info.length :]
    for other in md.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += len(blob) - info.length
    info.length = len(blob)
    reseal(d, info.relative_path, new)
    reseal(d, ".metadata", pickle.dumps(md))
    if offset is None:
        raw = json.loads((d / MANIFEST_NAME).read_text())
        raw["value_digests"][key] = hashlib.sha256(blob).hexdigest()
        (d / MANIFEST_NAME).write_text(json.dumps(raw))
