"""Validation of DCP ``.metadata`` after it was unpickled safely: types, bounds and chunk coverage.

A tampered or corrupt ``.metadata`` can unpickle into well-formed classes holding wrong values:
a chunk moved outside its tensor leaves the tensor untouched by a load (and ``convert`` writes
uninitialised memory), two overlapping chunks make the result depend on read order. Every load
and every export therefore checks, per tensor, that its chunks lie inside it, do not overlap and
cover it exactly (their volumes add up to its size), and that each chunk has a stored item whose
byte range is sane: in a file of the step directory (a plain name, else
:class:`~distckpt.errors.UnsafeCheckpointError`), inside that file, disjoint from every other
item, and long enough to hold the chunk's bytes. The last bound refuses a consistent but
oversized declaration (a tensor and its chunk both declared 2^40 elements) before any reader
allocates the tensor: what a reader allocates is at most the bytes the files hold. Violations
raise :class:`~distckpt.errors.IntegrityError` naming the file and the key. Not collective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from distckpt.state.shape import numel
from distckpt.errors import IntegrityError
from distckpt.integrity.safe_pickle import check_relative_name


def _ints(value: object) -> bool:
    return isinstance(value, (tuple, list, torch.Size)) and all(type(v) is int and v >= 0 for v in value)


def validate_metadata(metadata: Metadata, where: str, file_sizes: Mapping[str, int] | None = None) -> None:
    """Raise :class:`IntegrityError` unless ``metadata`` is consistent.

    Args:
        metadata: DCP ``Metadata`` (already unpickled with the allow-list unpickler; each field
            is checked here, as anything may have been pickled into it).
        where: the ``.metadata`` file's location, for messages.
        file_sizes: data file name -> size (the manifest's); every stored item must fit.
    """
    sdm = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise IntegrityError(f"{where}: state_dict_metadata and storage_data must be dicts")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise IntegrityError(f"{where}: storage_meta is a {type(storage_meta).__name__}, not StorageMeta")
    per_file: dict[str, list[tuple[int, int, str]]] = {}
    # Items by (fqn, offsets as a plain tuple), for the chunk lookups below: a MetadataIndex is a
    # dataclass whose construction, hash and equality run Python code, which for tens of
    # thousands of items cost more than the rest of the check. Only keys whose offsets are
    # exactly a tuple or torch.Size (as DCP writes them) go in: those compare as MetadataIndex
    # compares them; anything else is looked up as before.
    plain: dict[tuple[str, tuple[int, ...] | None], object] = {}
    named: set[str] = set()
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise IntegrityError(f"{where}: storage_data key {index!r:.80} is not a MetadataIndex")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise IntegrityError(f"{where}: item {index.fqn!r}: offset/length must be non-negative ints, got {offset!r}/{length!r}")
        name = getattr(info, "relative_path", None)
        if type(name) is not str or name not in named:  # a few files hold every item: each checked once
            check_relative_name(name, where)  # a file outside the step directory: UnsafeCheckpointError
            if type(name) is str:
                named.add(name)
        per_file.setdefault(str(name), []).append((offset, length, index.fqn))
        at = index.offset
        if at is None or type(at) in (tuple, torch.Size):
            plain[(index.fqn, None if at is None else tuple(at))] = info
        if file_sizes is not None:
            name = str(name)
            size = file_sizes.get(name)
            if size is None:
                raise IntegrityError(f"{where}: item {index.fqn!r} is stored in {name!r}, which the manifest does not list")
            if offset + length > size:
                raise IntegrityError(f"{where}: item {index.fqn!r}: bytes [{offset}, {offset + length}) lie outside {name} ({size} bytes)")
    for name, items in per_file.items():
        # DCP writes each item once, one after another: items sharing bytes were put there.
        items.sort()
        for (o1, n1, k1), (o2, _, k2) in zip(items, items[1:]):
            if o2 < o1 + n1:
                raise IntegrityError(f"{where}: items {k1!r} and {k2!r} share bytes of {name} (at {o2}); stored items never overlap")
    for key, md in sdm.items():
        if not isinstance(key, str):
            raise IntegrityError(f"{where}: state_dict_metadata key {key!r:.80} is not a string")
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(key) not in storage:
                raise IntegrityError(f"{where}: value {key!r} has no stored item")
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise IntegrityError(f"{where}: entry {key!r} is a {type(md).__name__}, not tensor or bytes metadata")
        size = md.size
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        if not _ints(size) or not isinstance(dtype, torch.dtype):
            raise IntegrityError(f"{where}: tensor {key!r}: size {size!r:.80} or dtype {dtype!r} is malformed")
        if not isinstance(md.chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in md.chunks):
            raise IntegrityError(f"{where}: tensor {key!r}: chunks must be a list of ChunkStorageMetadata")
        _check_coverage(key, tuple(size), md.chunks, where)
        for chunk in md.chunks:
            info = plain.get((key, tuple(chunk.offsets)))  # chunk.offsets: ints, checked above
            if info is None:
                info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise IntegrityError(f"{where}: tensor {key!r}: chunk at {list(chunk.offsets)} has no stored item")
            need = numel(chunk.sizes) * dtype.itemsize
            if need > info.length and not getattr(info, "transform_descriptors", None):
                # A stored item holds the chunk's raw bytes plus a small header (transformed,
                # e.g. compressed, items excepted).
                raise IntegrityError(
                    f"{where}: tensor {key!r}: chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} needs "
                    f"{need} bytes of {dtype}, but its stored item holds only {info.length}"
                )


def _check_coverage(key: str, size: tuple[int, ...], chunks: list[ChunkStorageMetadata], where: str) -> None:
    """Chunks inside the tensor, pairwise disjoint, volumes adding up to the tensor's."""
    boxes = []
    for c in chunks:
        if not (_ints(c.offsets) and _ints(c.sizes)) or len(c.offsets) != len(size) or len(c.sizes) != len(size):
            raise IntegrityError(f"{where}: tensor {key!r}: chunk {c!r:.80} does not match its {len(size)} dimensions")
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise IntegrityError(
                f"{where}: tensor {key!r}: chunk at {list(offsets)} of size {list(sizes)} lies outside its shape {list(size)}"
            )
        boxes.append((offsets, sizes))
    covered = sum(numel(s) for _, s in boxes)
    if covered != numel(size):
        raise IntegrityError(
            f"{where}: tensor {key!r}: its chunks cover {covered} of {numel(size)} elements (gaps or overlaps)"
        )
    if not size:
        return
    # Sweep along dimension 0: only chunks whose dim-0 ranges overlap can intersect, so the
    # check stays near-linear for FSDP row blocks and grid layouts alike.
    boxes = [b for b in boxes if numel(b[1])]
    boxes.sort(key=lambda b: b[0][0])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in boxes:
        start = box[0][0]
        active = [a for a in active if a[0][0] + a[1][0] > start]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1])):
                raise IntegrityError(f"{where}: tensor {key!r}: chunks at {list(other[0])} and {list(box[0])} overlap")
        active.append(box)
