"""Which keys each data file of a step stores, read from its ``.metadata`` (for tests about the
files a save writes and a load or a recovering node reads)."""

from __future__ import annotations

import pickle
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def keys_by_file(step: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """file -> every key it stores, and file -> the keys of the tensor chunks it stores that are
    not the whole tensor (shards; files holding none are absent)."""
    md = pickle.loads((Path(step) / ".metadata").read_bytes())
    keys: dict[str, set[str]] = {}
    shards: dict[str, set[str]] = {}
    for index, info in md.storage_data.items():
        meta = md.state_dict_metadata[index.fqn]
        keys.setdefault(info.relative_path, set()).add(index.fqn)
        if isinstance(meta, TensorStorageMetadata):
            chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
            if tuple(chunk.sizes) != tuple(meta.size):
                shards.setdefault(info.relative_path, set()).add(index.fqn)
    return keys, shards
