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

Every field DCP writes must also have the type DCP gives it, and whatever else the file holds
(``planner_data``, ``storage_meta``, attributes a ``BUILD`` added) must not nest tuples deeper
than :data:`MAX_TUPLE_NESTING`: ``.metadata`` is unpickled on a stack deep enough for any
nesting (:mod:`distckpt.integrity.deep_stack`), but the caller's thread, DCP's planner and the
ranks it is broadcast to hash its keys on ordinary stacks, where a deeply nested tuple crashes
the interpreter. The checks here hash nothing before its type is known.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from distckpt.state.shape import numel
from distckpt._shown import shown as _shown
from distckpt.errors import IntegrityError
from distckpt.integrity.safe_pickle import check_relative_name


#: Tuples nested directly in tuples, at most, in the fields DCP leaves free (``planner_data``,
#: attributes it does not write): DCP nests 1. Hashing one level costs 64 bytes of C stack; a
#: ``MetadataIndex`` between levels costs a Python call, which the recursion limit bounds, so
#: this bounds what hashing anything in the file can take (~1000 x 32 levels: ~2 MiB).
MAX_TUPLE_NESTING = 32

#: The attributes DCP's classes have (what ``BUILD`` sets beyond them is checked for nesting).
_FIELDS: dict[type, frozenset[str]] = {
    cls: frozenset(f.name for f in dataclasses.fields(cls))
    for cls in (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                StorageMeta, TensorProperties, _StorageInfo)
}  # fmt: skip


def _ints(value: object) -> bool:
    # Below 2**63 (what torch sizes hold): a size of a hundred references to one 6 KB integer
    # made numel's product take 12 s, and its message fail on Python's digit limit.
    return isinstance(value, (tuple, list, torch.Size)) and all(type(v) is int and 0 <= v < _INT_LIMIT for v in value)


_INT_LIMIT = 1 << 63


def _check_extra(obj: object, where: str, what: str) -> None:
    """Refuse ``obj`` unless it is exactly one of DCP's classes; attributes it has beyond that
    class's fields (set by a crafted ``BUILD``) are checked for nesting."""
    known = _FIELDS.get(type(obj))
    if known is None:
        raise IntegrityError(f"{where}: {what} is a {type(obj).__name__}, not one of DCP's metadata classes")
    attrs = getattr(obj, "__dict__", None)
    if attrs is not None and not attrs.keys() <= known:
        odd = next((k for k in attrs if type(k) is not str), None)
        if odd is not None:
            raise IntegrityError(f"{where}: {what} has an attribute named by a {type(odd).__name__}, which DCP never writes")
        for name in sorted(k for k in attrs if k not in known):
            check_nesting(attrs[name], where, f"{what}.{name}")


def check_nesting(value: object, where: str, what: str) -> None:
    """Raise :class:`IntegrityError` where tuples nest more than :data:`MAX_TUPLE_NESTING`
    levels deep (directly, tuple in tuple: what hashing recurses through in C) anywhere in
    ``value``, through dicts (keys and values), lists, sets and objects' attributes. Iterative,
    each object visited once (a pickle's shared objects do not multiply the work); hashes
    nothing it walks."""
    heights: dict[int, int] = {}  # id(tuple) -> the longest chain of tuples from it down
    seen: set[int] = set()
    # (object, tuples directly above it: refused at once past the bound, not after walking a
    # million levels down; the heights catch a chain whose tuples were first reached from above
    # on a shorter path, as a pickle's shared objects can be)
    todo: list[tuple[object, int, bool]] = [(value, 0, False)]

    def refuse() -> IntegrityError:
        return IntegrityError(
            f"{where}: {what} nests tuples more than {MAX_TUPLE_NESTING} levels deep (DCP writes 1; hashing a "
            "deeply nested tuple crashes the interpreter)"
        )

    while todo:
        obj, above, children_done = todo.pop()
        key = id(obj)
        if isinstance(obj, tuple):
            if children_done:
                height = 1 + max((heights[id(c)] for c in obj if isinstance(c, tuple) and id(c) in heights), default=0)
                if height > MAX_TUPLE_NESTING:
                    raise refuse()
                heights[key] = height
                continue
            if above >= MAX_TUPLE_NESTING:
                raise refuse()
            if key in seen:
                continue
            seen.add(key)
            todo.append((obj, above, True))
            todo.extend((c, above + 1, False) for c in obj)
            continue
        if key in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype)):
            continue
        seen.add(key)
        if isinstance(obj, dict):
            todo.extend((k, 0, False) for k in obj.keys())
            todo.extend((v, 0, False) for v in obj.values())
        elif isinstance(obj, (list, set, frozenset)):
            todo.extend((v, 0, False) for v in obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                todo.extend((v, 0, False) for v in attrs.values())


def validate_metadata(metadata: Metadata, where: str, file_sizes: Mapping[str, int] | None = None) -> None:
    """Raise :class:`IntegrityError` unless ``metadata`` is consistent.

    Args:
        metadata: DCP ``Metadata`` (already unpickled with the allow-list unpickler; each field
            is checked here, as anything may have been pickled into it).
        where: the ``.metadata`` file's location, for messages.
        file_sizes: data file name -> size (the manifest's); every stored item must fit.
    """
    _check_extra(metadata, where, "Metadata")
    sdm = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if type(sdm) is not dict or type(storage) is not dict:
        raise IntegrityError(f"{where}: state_dict_metadata and storage_data must be dicts")
    version = getattr(metadata, "version", None)
    if version is not None and type(version) is not str:
        raise IntegrityError(f"{where}: version is a {type(version).__name__}, not a string")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None:
        if not isinstance(storage_meta, StorageMeta):
            raise IntegrityError(f"{where}: storage_meta is a {type(storage_meta).__name__}, not StorageMeta")
        _check_extra(storage_meta, where, "storage_meta")
        check_nesting(vars(storage_meta), where, "storage_meta")
    check_nesting(getattr(metadata, "planner_data", None), where, "planner_data")
    per_file: dict[str, list[tuple[int, int, str]]] = {}
    # Items by (fqn, offsets as a plain tuple), for the chunk lookups below: a MetadataIndex is a
    # dataclass whose construction, hash and equality run Python code, which for tens of
    # thousands of items cost more than the rest of the check. Every key's offsets are checked
    # to be plain ints first: the tuples compare as MetadataIndex compares them.
    plain: dict[tuple[str, tuple[int, ...] | None], object] = {}
    named: set[str] = set()
    index_fields, info_fields = _FIELDS[MetadataIndex], _FIELDS[_StorageInfo]
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise IntegrityError(f"{where}: storage_data key {_shown(index)} is not a MetadataIndex")
        at = index.offset
        if (at is not None and not _ints(at)) or (index.index is not None and type(index.index) is not int):
            raise IntegrityError(
                f"{where}: item {index.fqn!r}: its key's offset {_shown(at)} or index {_shown(index.index)} is malformed "
                "(DCP writes a tuple of non-negative ints and an int)"
            )
        # (inline: the key and its storage's attributes are DCP's, as for every item DCP wrote)
        if not index.__dict__.keys() <= index_fields:
            _check_extra(index, where, f"the key of item {index.fqn!r}")
        if type(info) is not _StorageInfo or not info.__dict__.keys() <= info_fields:
            _check_extra(info, where, f"the storage of item {index.fqn!r}")
        offset, length = info.offset, info.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise IntegrityError(
                f"{where}: item {index.fqn!r}: offset/length must be non-negative ints, got {_shown(offset)}/{_shown(length)}"
            )
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not (type(transforms) in (list, tuple) and all(type(t) is str for t in transforms)):
            raise IntegrityError(f"{where}: item {index.fqn!r}: transform_descriptors {_shown(transforms)} are not strings")
        name = info.relative_path
        if type(name) is not str:
            raise IntegrityError(f"{where}: item {index.fqn!r}: its file name {_shown(name)} is not a string")
        if name not in named:  # a few files hold every item: each checked once
            check_relative_name(name, where)  # a file outside the step directory: UnsafeCheckpointError
            named.add(name)
        per_file.setdefault(name, []).append((offset, length, index.fqn))
        plain[(index.fqn, None if at is None else tuple(at))] = info
        if file_sizes is not None:
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
    chunk_fields = _FIELDS[ChunkStorageMetadata]
    for key, md in sdm.items():
        if type(key) is not str:
            raise IntegrityError(f"{where}: state_dict_metadata key {_shown(key)} is not a string")
        if type(md) is BytesStorageMetadata:
            _check_extra(md, where, f"entry {key!r}")
            if MetadataIndex(key) not in storage:
                raise IntegrityError(f"{where}: value {key!r} has no stored item")
            continue
        if type(md) is not TensorStorageMetadata:
            raise IntegrityError(f"{where}: entry {key!r} is a {type(md).__name__}, not tensor or bytes metadata")
        _check_extra(md, where, f"tensor {key!r}")
        size = md.size
        properties = md.properties
        dtype = getattr(properties, "dtype", None)
        if not _ints(size) or not isinstance(dtype, torch.dtype):
            raise IntegrityError(f"{where}: tensor {key!r}: size {_shown(size)} or dtype {_shown(dtype)} is malformed")
        if math.prod(size) >= _INT_LIMIT:  # (no tensor holds as many; its count would not even print)
            raise IntegrityError(f"{where}: tensor {key!r}: size {_shown(size)} holds 2**63 elements or more")
        _check_properties(properties, where, key)
        if type(md.chunks) is not list or not all(type(c) is ChunkStorageMetadata for c in md.chunks):
            raise IntegrityError(f"{where}: tensor {key!r}: chunks must be a list of ChunkStorageMetadata")
        for chunk in md.chunks:
            if not chunk.__dict__.keys() <= chunk_fields:
                _check_extra(chunk, where, f"a chunk of tensor {key!r}")
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


#: The types of ``TensorProperties``' fields as DCP writes them.
_PROPERTY_TYPES = {"layout": torch.layout, "requires_grad": bool, "memory_format": torch.memory_format, "pin_memory": bool}


def _check_properties(properties: object, where: str, key: str) -> None:
    """A tensor's ``TensorProperties``: DCP's class, each field of the type DCP writes (``strides``,
    which torch 2.15 added: ``None`` or a tuple of ints; no DCP reads it back, so its length is
    not held against the tensor's shape)."""
    _check_extra(properties, where, f"the properties of tensor {key!r}")
    for name, kind in _PROPERTY_TYPES.items():
        value = getattr(properties, name, None)
        if type(value) is not kind:
            raise IntegrityError(f"{where}: tensor {key!r}: its property {name} is {_shown(value)}, not a {kind.__name__}")
    strides = getattr(properties, "strides", None)
    if strides is not None and not (type(strides) is tuple and _ints(strides)):
        raise IntegrityError(f"{where}: tensor {key!r}: its property strides is {_shown(strides)}, not None or a tuple of ints")


#: Pairs of chunks of one tensor compared for overlap, at most (see :func:`_check_coverage`):
#: ~1.5 s here; column shards over 2,000 ranks compare none, a 45 x 45 grid of shards 90,000.
MAX_CHUNK_COMPARISONS = 1_000_000


def _check_coverage(key: str, size: tuple[int, ...], chunks: list[ChunkStorageMetadata], where: str) -> None:
    """Chunks inside the tensor, pairwise disjoint, volumes adding up to the tensor's."""
    boxes = []
    for c in chunks:
        if not (_ints(c.offsets) and _ints(c.sizes)) or len(c.offsets) != len(size) or len(c.sizes) != len(size):
            raise IntegrityError(
                f"{where}: tensor {key!r}: chunk at {_shown(c.offsets)} of size {_shown(c.sizes)} does not match its "
                f"{len(size)} dimensions"
            )
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
    # Sweep along the dimension where chunks start at the most places (dim 0 for FSDP's row
    # blocks, dim 1 for column shards): only chunks whose ranges along it overlap can
    # intersect, so the check stays near-linear for row, column and grid layouts. A layout
    # that defeats it (chunks overlapping along every dimension) is refused past a bound on
    # the comparisons: 20,000 chunks of a (1, 20000) tensor took minutes swept along dim 0.
    boxes = [b for b in boxes if numel(b[1])]
    dim = max(range(len(size)), key=lambda d: len({b[0][d] for b in boxes}))
    boxes.sort(key=lambda b: b[0][dim])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    budget = MAX_CHUNK_COMPARISONS
    for box in boxes:
        start = box[0][dim]
        active = [a for a in active if a[0][dim] + a[1][dim] > start]
        budget -= len(active)
        if budget < 0:
            raise IntegrityError(
                f"{where}: tensor {key!r}: its {len(boxes):,} chunks overlap along every dimension in more than "
                f"{MAX_CHUNK_COMPARISONS:,} pairs to compare (no layout DCP writes; a crafted file)"
            )
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1])):
                raise IntegrityError(f"{where}: tensor {key!r}: chunks at {list(other[0])} and {list(box[0])} overlap")
        active.append(box)
