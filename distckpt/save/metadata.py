"""The wire form of save plans, and the global ``.metadata`` the coordinator builds from them.

Each rank's plan therefore lists only what it writes, and its ``planner_data`` only those keys'
flatten mappings: the bytes the coordinator gathers grow with the items written, not with
``world_size x items``. Plans travel in a compact wire form (:func:`encode_plan`: tuples, one
shared ``TensorProperties`` per kind) instead of pickled ``WriteItem`` dataclasses, and the
coordinator answers each rank with a small delta (its file prefix and, rarely, positions of
deduplicated items) instead of the whole plan.

**The coordinator** (:func:`build_global`) builds the ``.metadata`` in one pass over the received
items with no per-item ``dataclasses.replace`` (DCP's index hints are optional: storage lookups
hash ``MetadataIndex`` without them), shares equal chunk descriptions between tensors (a pickle
of FSDP metadata then stores each distinct chunk once), and keeps DCP's validation guarantees:
chunks inside their tensor, pairwise disjoint, volumes adding up to the tensor's (exact cover),
checked per distinct layout with a sort-and-sweep along the most spread dimension
(O(n log n) for slab and grid layouts, where DCP sweeps the largest dimension).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType



# Kinds of items in the wire form.
_BYTES, _TENSOR, _SHARD = 0, 1, 2

Wire = tuple  # (items: list[tuple], planner_data: dict)


def encode_plan(plan: SavePlan) -> Wire:
    """(each rank) A local plan as plain tuples ``(fqn, kind, offsets, sizes, size, props)``;
    equal ``TensorProperties`` are one shared object (pickled once)."""
    props: dict[tuple, TensorProperties] = {}
    items: list[tuple] = []
    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            items.append((fqn, _BYTES, None, None, None, None))
            continue
        td = item.tensor_data
        if td is None:
            raise ValueError(f"write item {fqn!r} has no tensor data")
        p = td.properties
        # torch 2.15 added the tensor's strides to its properties: equal only with equal strides.
        pk = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory, getattr(p, "strides", None))
        shared = props.setdefault(pk, p)
        kind = _SHARD if item.type == WriteItemType.SHARD else _TENSOR
        items.append((fqn, kind, tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size), shared))
    return (items, dict(plan.planner_data or {}))


def apply_delta(plan: SavePlan, delta: tuple[Any, ...]) -> SavePlan:
    """(each rank) The final plan: the local plan with the coordinator's storage data, minus the
    items the coordinator gave to another holder (``delta``: ``(storage_data, dropped
    positions[, shared keys])``, see :func:`build_global`)."""
    storage_data, dropped = delta[0], delta[1]
    items = plan.items
    if dropped:
        gone = set(dropped)
        items = [it for i, it in enumerate(items) if i not in gone]
    return SavePlan(items, storage_data=storage_data, planner_data=plan.planner_data)


class PlanError(ValueError):
    """The coordinator found the ranks' plans inconsistent (overlapping or missing chunks)."""


def build_global(wires: Sequence[Wire]) -> tuple[list[tuple[Any, tuple[int, ...], tuple[str, ...]]], Metadata]:
    """(coordinator, pure) Deduplicate, build and validate the global ``Metadata`` from every
    rank's :func:`encode_plan`.

    Returns ``(deltas, metadata)``: per rank ``(None, positions of items it must drop, shared
    keys)`` (the storage data is filled in by the writer's ``prepare_global_plan``) and the
    ``Metadata`` (``state_dict_metadata`` and ``planner_data``; ``storage_data`` comes from
    ``finish``). *Shared keys* (the same on every rank, usually none) are DTensors of which
    ranks on different meshes listed equal blocks (see :func:`_keep_one_copy`).

    Raises:
        PlanError: chunks outside their tensor, overlapping, or not covering it, or a key
            written both as a tensor and as bytes.
    """
    md: dict[str, Any] = {}
    chunk_of: dict[tuple, ChunkStorageMetadata] = {}
    sizes_of: dict[tuple, torch.Size] = {}
    the_bytes = BytesStorageMetadata()
    holder: dict[str, tuple[int, int]] = {}
    dups: dict[str, list[tuple[int, int]]] = {}
    empty_seen: set[tuple[str, tuple]] = set()
    drops: list[list[int]] = [[] for _ in wires]
    planner_data: dict[str, Any] = {}

    def size_obj(t: tuple) -> torch.Size:
        s = sizes_of.get(t)
        if s is None:
            s = sizes_of[t] = torch.Size(t)
        return s

    for rank, (items, pdata) in enumerate(wires):
        planner_data.update(pdata)
        for pos, (fqn, kind, offsets, sizes, size, props) in enumerate(items):
            if kind != _SHARD:
                prev = holder.get(fqn)
                if prev is not None:  # held (and listed) by several ranks: decided below
                    dups.setdefault(fqn, [prev]).append((rank, pos))
                    continue
                holder[fqn] = (rank, pos)
                if kind == _BYTES:
                    if fqn in md:
                        raise PlanError(f"key {fqn!r} is written both as a tensor and as bytes")
                    md[fqn] = the_bytes
                    continue
            elif 0 in sizes:  # an empty shard (uneven sharding): DCP keeps one per offset
                mark = (fqn, offsets)
                if mark in empty_seen:
                    drops[rank].append(pos)
                    continue
                empty_seen.add(mark)
            tmd = md.get(fqn)
            if tmd is None:
                tmd = md[fqn] = TensorStorageMetadata(properties=props, size=size_obj(size), chunks=[])
            elif tmd is the_bytes:
                raise PlanError(f"key {fqn!r} is written both as a tensor and as bytes")
            ck = (offsets, sizes)
            chunk = chunk_of.get(ck)
            if chunk is None:
                chunk = chunk_of[ck] = ChunkStorageMetadata(offsets=size_obj(offsets), sizes=size_obj(sizes))
            tmd.chunks.append(chunk)
    if dups:
        _resolve_duplicates(wires, holder, dups, drops)
    invalid = _invalid(md)
    shared: tuple[str, ...] = ()
    if invalid:
        # A key listing one chunk several times (chunks equal in offsets and sizes are one object
        # here) is held by ranks of several meshes, not an inconsistency: keep one copy of each
        # block. Looked for only among invalid keys, so valid plans pay nothing for it.
        repeated = {k for k, _ in invalid if len({id(c) for c in md[k].chunks}) < len(md[k].chunks)}
        if repeated:
            shared = _keep_one_copy(wires, md, repeated, drops)
            invalid = [e for e in invalid if e[0] not in repeated] + _invalid({k: md[k] for k in shared})
    if invalid:
        errors = [f"key {k!r}: {err}" for k, err in invalid]
        summary = "; ".join(errors[:5]) + (f"; ... (+{len(errors) - 5} more)" if len(errors) > 5 else "")
        raise PlanError(f"the ranks' save plans are inconsistent: {summary}")
    return [(None, tuple(d), shared) for d in drops], Metadata(state_dict_metadata=md, planner_data=planner_data)


def _keep_one_copy(wires: Sequence[Wire], md: Mapping[str, Any], keys: set[str], drops: list[list[int]]) -> tuple[str, ...]:
    """(coordinator) One writer for each block of ``keys`` that several ranks listed, as DCP's
    ``dedup_save_plans`` keeps one item per key and offset; the others go to ``drops``.

    Such copies come from ranks of different device meshes holding one block: a DTensor on a
    sub-mesh is replicated along the job's other mesh dimensions (FSDP-only parameters of an
    FSDP x TP job, on each TP rank's ``dp`` sub-mesh), which no rank can see from its own mesh.
    Largest first, each to the holder with the fewest bytes kept so far (ties: the lowest rank).
    Returns the keys, sorted.
    """
    places: dict[tuple[str, tuple, tuple], list[tuple[int, int]]] = {}
    for rank, (items, _) in enumerate(wires):
        for pos, (fqn, kind, offsets, sizes, _, _) in enumerate(items):
            if kind == _SHARD and fqn in keys and 0 not in sizes:
                places.setdefault((fqn, offsets, sizes), []).append((rank, pos))
    load: dict[int, int] = {}
    order = sorted(places.items(), key=lambda kv: (-_item_bytes(wires[kv[1][0][0]][0][kv[1][0][1]]), kv[0]))
    for _, holders in order:
        if len(holders) < 2:
            continue
        keep = min(holders, key=lambda rp: (load.get(rp[0], 0), rp[0]))
        load[keep[0]] = load.get(keep[0], 0) + _item_bytes(wires[keep[0]][0][keep[1]])
        for rank, pos in holders:
            if (rank, pos) != keep:
                drops[rank].append(pos)
    for key in keys:
        unique: dict[int, ChunkStorageMetadata] = {}
        for chunk in md[key].chunks:
            unique.setdefault(id(chunk), chunk)  # equal chunks are one object (build_global)
        md[key].chunks = list(unique.values())
    return tuple(sorted(keys))


def _item_bytes(item: tuple) -> int:
    _, kind, _, sizes, _, props = item
    if kind == _BYTES:
        return 1
    n = 1
    for d in sizes:
        n *= d
    return n * props.dtype.itemsize


def _resolve_duplicates(
    wires: Sequence[Wire],
    holder: dict[str, tuple[int, int]],
    dups: dict[str, list[tuple[int, int]]],
    drops: list[list[int]],
) -> None:
    """Keys listed by several ranks keep one writer: largest first to the holder with the fewest
    bytes so far (each rank's load starts at its unique items' bytes)."""
    involved = {r for places in dups.values() for r, _ in places}
    load = {r: 0 for r in involved}
    for fqn, (r, pos) in holder.items():
        if r in involved and fqn not in dups:
            load[r] += _item_bytes(wires[r][0][pos])
    order = sorted(dups, key=lambda f: (-_item_bytes(wires[holder[f][0]][0][holder[f][1]]), f))
    for fqn in order:
        places = dups[fqn]
        keep = min(places, key=lambda rp: (load[rp[0]], rp[0]))
        load[keep[0]] += _item_bytes(wires[keep[0]][0][keep[1]])
        for r, pos in places:
            if (r, pos) != keep:
                drops[r].append(pos)


def validate(md: Mapping[str, Any]) -> list[str]:
    """(pure) DCP's global-plan checks, per tensor: every chunk inside the tensor, no two
    overlapping, volumes adding up to the tensor's (with the other two: exact cover).

    Each distinct chunk layout (tensor size + the chunk objects, shared between tensors by
    :func:`build_global`) is checked once, by a sort-and-sweep along its most spread dimension.
    """
    return [f"key {key!r}: {err}" for key, err in _invalid(md)]


def _invalid(md: Mapping[str, Any]) -> list[tuple[str, str]]:
    """:func:`validate`'s findings as ``(key, error)``."""
    errors: list[tuple[str, str]] = []
    seen: dict[tuple, str | None] = {}
    for key, value in md.items():
        if not isinstance(value, TensorStorageMetadata):
            continue
        size = tuple(value.size)
        chunks = value.chunks
        if len(chunks) == 1:
            c = chunks[0]
            if tuple(c.sizes) == size and not any(c.offsets):
                continue  # the common case: one whole tensor
        sig = (size, tuple(map(id, chunks)))
        if sig not in seen:
            seen[sig] = _cover_error(size, chunks)
        err = seen[sig]
        if err is not None:
            errors.append((key, err))
    return errors


def _cover_error(size: tuple[int, ...], chunks: Sequence[ChunkStorageMetadata]) -> str | None:
    nd = len(size)
    if nd == 0:
        return None if len(chunks) == 1 else f"a scalar written {len(chunks)} times"
    volume = 0
    boxes = []
    for c in chunks:
        o, s = tuple(c.offsets), tuple(c.sizes)
        if len(o) != nd or len(s) != nd or any(a < 0 or b < 0 or a + b > d for a, b, d in zip(o, s, size)):
            return f"chunk at {list(o)} of size {list(s)} lies outside its shape {list(size)}"
        v = 1
        for d in s:
            v *= d
        volume += v
        if v:
            boxes.append((o, s))
    total = 1
    for d in size:
        total *= d
    if volume != total:
        return f"its chunks cover {volume} of {total} elements (gaps or overlaps)"
    if len(boxes) < 2:
        return None
    # Sweep along the dimension whose offsets are most spread: slabs and grids keep few active.
    dim = max(range(nd), key=lambda d: len({o[d] for o, _ in boxes}))
    boxes.sort(key=lambda b: b[0][dim])
    active: list[tuple[int, int]] = []  # heap of (end along dim, index)
    for i, (o, s) in enumerate(boxes):
        start = o[dim]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, j in active:
            o2, s2 = boxes[j]
            if all(a < b + t and b < a + u for a, u, b, t in zip(o, s, o2, s2)):
                return f"chunks at {list(o2)} and {list(o)} overlap"
        heapq.heappush(active, (start + s[dim], i))
    return None
