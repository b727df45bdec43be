"""Save planning that grows with what is written, and repeated saves that skip it.

DCP's own planning (``dcp.save`` with ``DefaultSavePlanner``) has every rank list *everything it
holds* and attach *every* flatten mapping to its plan; the coordinator unpickles ``world x items``
write items, deduplicates them (one ``dataclasses.replace`` per item and plan), builds the
``.metadata`` and scatters whole plans back. For a DDP model that is ``world_size`` copies of
every key, at every save, although the structure rarely changes. This module replaces that with
the following, still producing a standard DCP checkpoint (plain ``dcp.load`` reads it):

**Who writes what is decided locally** (:func:`decide`, every rank, identical result, from the
views every rank exchanges anyway in ``_saving.prepare``/``agree``):

* *Replicated plain items* (same key on every rank: DDP parameters, replicated optimizer state,
  hyper-parameters, ``Global`` entries) get one writer rank from a deterministic size-balanced
  assignment over the sorted keys (largest first, to the least-loaded rank, ties to the lowest
  rank; :func:`balanced_writers`). Whether an entry is replicated is known from per-entry
  digests of its keys, shapes and dtypes (``SaveView.layout`` for tensors, ``SaveView.plain``
  for all plain leaves): equal digests on every rank means equal key sets, without gathering
  anyone's key list. The module/optimizer tensors are assigned first and exactly as
  :func:`distckpt.save.staging.replicated_shares` splits them for async staging, so a rank that
  staged only its share writes exactly that share.
* *Items some ranks hold* (ZeRO partitions: each rank holds its own parameters' optimizer
  keys; per-rank entries re-keyed ``NAME.rank_<r>``; RNG states) are listed by their holders
  only. Keys that turn out to be held by several ranks are deduplicated by the coordinator
  (only those: O(items received)).
* *DTensor shards* are written by the copy whose mesh coordinate is 0 on every mesh dimension
  that replicates the tensor (:func:`replica_dims`): every other dimension shards it (``Shard``,
  ``_StridedShard`` and their subclasses: the placements torch's own chunk helper, and so DCP,
  shards by), so HSDP, ``Replicate`` and FSDP x TP placements write each block once. A placement
  that does neither (``Partial``, or one distckpt does not know) is refused, naming key and
  placement, rather than guessed. Blocks that ranks of *different* meshes hold (a DTensor on a
  sub-mesh, replicated along the rest of the job: the FSDP-only parameters of an FSDP x TP job)
  are equal chunks of one key from several ranks; the coordinator keeps one of each, as DCP's
  own deduplication does (:func:`build_global`).

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

**Repeated saves** (:class:`PlanCache`): a save whose structure (keys, shapes, dtypes, DTensor
placements, mesh coordinates and local shapes, world size, scopes) is unchanged on *every* rank
reuses the previous save's final local plans and the coordinator's ``Metadata``: no plan is
gathered, nothing is scattered. Every rank reports in its ``SaveView`` the cache token it holds
for its current structure; :func:`decide` declares a hit only if all tokens are equal and match
this save's global key, so every rank takes the same path without an extra collective. The
cache is an explicit, picklable object (one per ``Checkpointer``), not DCP's class-level
``SavePlanner._cached_*`` dictionaries, which every planner in the process shares (two
checkpointers, or two writer processes' jobs, would read each other's plans). Byte offsets may
change between saves, so ``storage_data`` is always rebuilt from the save's write results. A
failed save invalidates the cache.

**The protocol** (:class:`SaveRun`) is DCP's own, driven with distckpt's
:class:`~distckpt._dist.Group` collectives instead of ``dcp.save``: ``set_up_planner``,
``set_up_storage_writer``, ``create_local_plan``, ``prepare_local_plan`` (all ranks); gather;
``create_global_plan`` + ``prepare_global_plan`` (coordinator); scatter; ``finish_plan``,
``write_data`` (all ranks); gather of the write results; ``finish`` (coordinator, writes
``.metadata``); broadcast of the outcome. The storage writer's ``prepare_global_plan`` receives
item-less plans: distckpt's writer only assigns file prefixes there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from distckpt.state import fingerprint, statecheck
from distckpt.save.staging import staging_digest
from distckpt._compat import StridedShard
from distckpt._dist import Group, _Failure, capture
from distckpt.errors import CheckpointError, from_causes

#: Version of the structure digests and cache keys (bump when what they cover changes).
_VERSION = "plan1"
_BYTES, _TENSOR, _SHARD = 0, 1, 2


# -------------------------------------------------------------------------------------------------
# What one rank holds (prepare), and who writes what (agree)
@dataclass
class Structure:
    """One rank's state structure, computed in ``prepare`` (no collectives).

    Attributes:
        own: digest of every flattened key with its kind, shape, dtype and (DTensors) mesh,
            placements, coordinate and local shape: equal between two saves exactly when this
            rank's plan would be.
        plain: entry -> digest of its plain (non-DTensor) leaves' keys, shapes and dtypes.
        leaves: plain leaves as ``(key, nbytes, is_tensor)`` in flatten order (nbytes 1 for
            non-tensor values).
        replicas: DTensors with replicated mesh dimensions: ``(key, replication factor)``, sorted.
        replicas_digest: digest of ``replicas`` (ranks must agree to compare those replicas).
    """

    own: str
    plain: dict[str, str]
    leaves: list[tuple[str, int, bool]]
    replicas: list[tuple[str, int]]
    replicas_digest: str


def _entry(key: str) -> str:
    return key.split(".", 1)[0]


class PlacementError(ValueError):
    """A DTensor placement a checkpoint cannot hold correctly (``Partial``, or one distckpt does
    not know); the message names the key, the placement and its mesh dimension."""


#: Placements that shard a tensor along the mesh dimension they sit on: exactly those torch's
#: chunk helper (``compute_local_shape_and_global_offset``, by which DCP writes a DTensor) shards
#: by, subclasses included. ``_StridedShard`` (FSDP2 over TP) is not a ``Shard`` in torch 2.13 and
#: its ``is_shard()`` is False, so ``is_shard()`` is not the test.
_SHARDING = (Shard, StridedShard)


def _dim_name(value: DTensor, dim: int) -> str:
    names = value.device_mesh.mesh_dim_names
    return f"mesh dimension {dim}" + (f" ({names[dim]!r})" if names else "")


def replica_dims(value: DTensor, key: str) -> tuple[int, ...]:
    """(each rank, pure) The mesh dimensions of ``value``'s mesh along which ranks hold the same
    block of it: those whose placement is ``Replicate``. Every other dimension must shard it.

    Args:
        value: a DTensor of the state.
        key: its flattened key, named in errors.

    Raises:
        PlacementError: a ``Partial`` placement (each rank holds an unreduced partial value: any
            one copy would be wrong, and DCP refuses it too), or a placement that is neither
            sharding (:data:`_SHARDING`) nor replicating: distckpt cannot tell which ranks hold
            the same block, and torch's chunk helper would silently treat it as a replica.
    """
    dims = []
    for dim, placement in enumerate(value.placements):
        if isinstance(placement, _SHARDING):
            continue
        if isinstance(placement, Replicate):
            dims.append(dim)
        elif isinstance(placement, Partial):
            raise PlacementError(
                f"cannot checkpoint DTensor {key!r}: its placement {placement!r} on {_dim_name(value, dim)} "
                "holds unreduced partial values (no rank's copy is the tensor, and DCP refuses it too); "
                "reduce it first, e.g. with value.redistribute(placements=...) to Replicate() or Shard(d)"
            )
        else:
            raise PlacementError(
                f"cannot checkpoint DTensor {key!r}: unknown placement {placement!r} "
                f"({type(placement).__module__}.{type(placement).__qualname__}) on {_dim_name(value, dim)}; "
                "distckpt knows Shard, _StridedShard and Replicate (and their subclasses) and cannot "
                "tell which ranks hold the same block under another placement"
            )
    return tuple(dims)


def replication(value: DTensor, key: str) -> tuple[int, tuple[int, ...] | None]:
    """(each rank, pure) ``(replication factor, mesh coordinate)`` of a DTensor: how many ranks of
    its mesh hold each of its blocks (the product of the sizes of its :func:`replica_dims`).

    Raises:
        PlacementError: see :func:`replica_dims` (``key``, the flattened key, names the tensor).
    """
    mesh = value.device_mesh
    factor = 1
    for dim in replica_dims(value, key):
        factor *= mesh.size(dim)
    coord = mesh.get_coordinate()
    return factor, (tuple(coord) if coord is not None else None)


def writes_dtensor(value: DTensor, key: str) -> bool:
    """(each rank, pure) Whether this rank writes its block of ``value``: it is in the mesh and at
    coordinate 0 on every :func:`replica_dims` dimension, so that of the ranks of the mesh
    holding one block exactly one writes it. The load's state check designates the same copy
    (:mod:`distckpt.load.verify`). Copies held on other meshes are left to the coordinator
    (:func:`build_global`).

    Raises:
        PlacementError: see :func:`replica_dims`.
    """
    coord = value.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(coord[dim] == 0 for dim in replica_dims(value, key))


def describe(flat: Mapping[str, Any]) -> Structure:
    """(each rank, no collectives) The :class:`Structure` of a flattened state dict."""
    own = hashlib.sha256(_VERSION.encode())
    per_entry: dict[str, list[str]] = {}
    leaves: list[tuple[str, int, bool]] = []
    replicas: list[tuple[str, int]] = []
    for key, value in flat.items():
        if isinstance(value, DTensor):
            factor, coord = replication(value, key)
            local = value.to_local()
            line = (
                f"{key}|D|{tuple(value.shape)}|{value.dtype}|{tuple(value.device_mesh.shape)}|"
                f"{tuple(repr(p) for p in value.placements)}|{coord}|{tuple(local.shape)}"
            )
            if factor > 1:
                replicas.append((key, factor))
        elif isinstance(value, torch.Tensor):
            line = f"{key}|T|{tuple(value.shape)}|{value.dtype}"
            per_entry.setdefault(_entry(key), []).append(line)
            leaves.append((key, value.numel() * value.element_size(), True))
        else:
            line = f"{key}|B"
            per_entry.setdefault(_entry(key), []).append(line)
            leaves.append((key, 1, False))
        own.update(line.encode() + b"\n")
    replicas.sort()
    return Structure(
        own=own.hexdigest()[:32],
        plain={n: hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32] for n, lines in per_entry.items()},
        leaves=leaves,
        replicas=replicas,
        replicas_digest=hashlib.sha256(repr(replicas).encode()).hexdigest()[:32],
    )


def balanced_writers(
    items: Iterable[tuple[str, int]], world_size: int, heap: list[tuple[int, int]] | None = None
) -> dict[str, int]:
    """(pure) key -> writer rank: largest first, each to the least-loaded rank (ties: the lowest).

    Deterministic for a given item set, whatever its order (sorted by ``(-bytes, key)``), so
    every rank computes the same assignment. ``heap`` (``(load, rank)`` pairs, updated in place)
    continues an earlier assignment's loads. O(n log n + n log world).
    """
    if heap is None:
        heap = [(0, r) for r in range(world_size)]
    out: dict[str, int] = {}
    for key, nbytes in sorted(items, key=lambda kv: (-kv[1], kv[0])):
        load, rank = heap[0]
        out[key] = rank
        heapq.heapreplace(heap, (load + nbytes, rank))
    return out


@dataclass
class PlanInput:
    """Everything :func:`write <distckpt.save.phases.write>` needs to plan this rank's share (the
    result of :func:`decide`; picklable, so a writer process can plan too).

    Attributes:
        rank, world_size: this rank and the save's world size.
        writers: flattened key -> the rank that writes it, for replicated plain items. Keys not
            listed are written by whoever holds them (DTensors: see :func:`writes_dtensor`).
        checked: replicated plain tensors whose copies are compared for drift (sorted).
        dchecked: DTensors with replicated mesh dimensions and their replication factor, when
            every rank agrees on them (their replicas are compared); ``None`` otherwise.
        key: digest of everything the plans depend on besides each rank's own structure.
        own: this rank's :attr:`Structure.own`.
        hit: every rank holds this save's plans from the previous save (skip planning).
    """

    rank: int
    world_size: int
    writers: dict[str, int] = field(default_factory=dict)
    checked: list[str] = field(default_factory=list)
    dchecked: list[tuple[str, int]] | None = None
    key: str = ""
    own: str = ""
    hit: bool = False


def decide(
    views: Sequence[Any],
    structure: Structure,
    unscoped: Iterable[str],
    scopes: Mapping[str, str],
    sizes: Sequence[tuple[str, int]],
    rank: int,
) -> PlanInput:
    """(each rank, pure, identical on every rank) Who writes each replicated item, and whether
    the previous save's plans can be reused.

    Args:
        views: every rank's ``SaveView`` (fields ``layout``, ``plain``, ``replicas``, ``cache``).
        structure: this rank's :class:`Structure`.
        unscoped: module/optimizer entries (replicated or sharded by construction).
        scopes: scoped entry -> ``"global"``/``"per_rank"`` as ``agree`` decided.
        sizes: ``(key, nbytes)`` of the plain tensors of unscoped entries (``Prepared.sizes``).
        rank: this rank.
    """
    from distckpt.state.scope import GLOBAL

    world = len(views)
    first = views[0]
    unscoped = set(unscoped)

    def agreed(field_name: str, name: str) -> bool:
        value = getattr(first, field_name).get(name)
        return value is not None and all(getattr(v, field_name).get(name) == value for v in views[1:])

    # Phase A: module/optimizer tensors, exactly as staging.replicated_shares splits them.
    split = {n for n in unscoped if agreed("layout", n)}
    heap = [(0, r) for r in range(world)]
    writers = balanced_writers(((k, b) for k, b in sizes if _entry(k) in split), world, heap)
    # Phase B: every other plain leaf of an entry that every rank holds alike (or that is Global).
    replicated = {n for n in structure.plain if (scopes.get(n) == GLOBAL) or (n not in scopes and agreed("plain", n))}
    rest = [(k, b) for k, b, _ in structure.leaves if _entry(k) in replicated and k not in writers]
    writers.update(balanced_writers(rest, world, heap))
    checked = sorted(k for k, _, is_tensor in structure.leaves if is_tensor and k in writers)
    dchecked = structure.replicas if all(v.replicas == first.replicas for v in views) else None
    key = hashlib.sha256(
        repr((_VERSION, world, sorted(scopes.items()), sorted(split), sorted(replicated), dchecked is not None)).encode()
    ).hexdigest()[:32]
    token = first.cache
    hit = token is not None and token[1] == key and all(v.cache == token for v in views[1:])
    return PlanInput(rank, world, writers, checked, dchecked, key, structure.own, hit)


# -------------------------------------------------------------------------------------------------
# The planner (DCP's SavePlanner interface) and the wire form of plans
class DistckptSavePlanner(DefaultSavePlanner):
    """DCP save planner whose local plan lists only what this rank writes (see module docstring).

    Usable with ``dcp.save`` too (``create_global_plan`` then runs :func:`build_global`);
    distckpt drives it through :class:`SaveRun`.
    """

    def __init__(self, plan: PlanInput) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.plan_input = plan
        # Fingerprint parts of the blocks this rank writes, computed by the writer threads as
        # they take each tensor (in parallel, and while its memory is about to be read anyway);
        # None: not collected.
        self.fingerprints: list[Any] | None = None
        # Replica digests (statecheck.copy_digest) of the compared keys among what this rank
        # writes, key -> digest; None: not collected. ``on_device``: keys whose copies were taken
        # from accelerator tensors.
        self.copies: dict[str, Any] | None = None
        self.compared: frozenset[str] = frozenset()
        self.on_device: frozenset[str] = frozenset()
        self._fingerprints_lock = threading.Lock()
        # verify_staging: key -> staging digest of the live tensor at the save call (set by the
        # write phase), and key -> the digest of the tensor serialized for it (see :meth:`serializing`).
        self.staging_expected: Mapping[str, int] = {}
        self.staging_seen: dict[str, int] = {}

    def serializing(self, write_item: Any, tensor: torch.Tensor) -> None:
        """(writer threads) ``tensor`` is about to be serialized for ``write_item``, exactly as
        written: take its staging digest where the save verifies staging (see
        :func:`distckpt.save.phases.check_staging`)."""
        key = write_item.index.fqn
        if key in self.staging_expected:
            value = staging_digest(tensor)
            with self._fingerprints_lock:
                self.staging_seen[key] = int(value)

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        td = write_item.tensor_data
        if self.fingerprints is not None and td is not None and isinstance(data, torch.Tensor):
            chunk = td.chunk
            key = write_item.index.fqn
            part = fingerprint.part_of(key, data, chunk.offsets, td.size)
            copy = None
            if self.copies is not None and key in self.compared:
                copy = statecheck.copy_digest(data, chunk.offsets, key in self.on_device)
            with self._fingerprints_lock:
                if part is not None:
                    self.fingerprints.append(part)
                if copy is not None:
                    self.copies[key] = copy
        return data

    def create_local_plan(self) -> SavePlan:
        writers, rank = self.plan_input.writers, self.plan_input.rank
        kept: dict[str, Any] = {}
        for key, value in self.state_dict.items():
            if isinstance(value, DTensor):
                if not writes_dtensor(value, key):
                    continue
            else:
                writer = writers.get(key)
                if writer is not None and writer != rank:
                    continue
            kept[key] = value
        plan = create_default_local_save_plan(kept, self.is_coordinator)
        mappings = self.mappings
        plan = SavePlan(plan.items, planner_data={k: mappings[k] for k in kept if k in mappings})
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        deltas, metadata = build_global([encode_plan(p) for p in all_plans])
        plans = [apply_delta(p, d) for p, d in zip(all_plans, deltas)]
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan


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
        pk = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
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


# -------------------------------------------------------------------------------------------------
# Plans of the previous save
@dataclass
class CachedPlan:
    """One rank's plans from the last successful save (see :class:`PlanCache`)."""

    generation: int
    key: str
    own: str
    plan: SavePlan
    metadata: Metadata | None  # coordinator only
    shared: tuple[str, ...] = ()  # build_global's shared keys


class PlanCache:
    """The plans of the last successful save of one ``Checkpointer``, on this rank.

    An explicit object handed to :func:`distckpt.save.phases.prepare` (which reports its token in
    the ``SaveView``) and :func:`distckpt.save.phases.write` (which reuses or replaces its plans);
    picklable, so a writer process may hold one. Not thread-safe: one save at a time.
    """

    def __init__(self) -> None:
        self.entry: CachedPlan | None = None
        self.generation = 0

    def token(self, own: str) -> tuple[int, str] | None:
        """``(generation, key)`` if the cached plans were made for this rank's structure ``own``."""
        e = self.entry
        return (e.generation, e.key) if e is not None and e.own == own else None

    def lookup(self, plan: PlanInput) -> CachedPlan | None:
        e = self.entry
        return e if e is not None and e.key == plan.key and e.own == plan.own else None

    def store(self, plan: PlanInput, final: SavePlan, metadata: Metadata | None, shared: tuple[str, ...] = ()) -> None:
        self.generation += 1
        self.entry = CachedPlan(self.generation, plan.key, plan.own, final, metadata, shared)

    def invalidate(self) -> None:
        self.entry = None

    def stamp(self) -> tuple[int, str, str] | None:
        """What identifies the cached plans (generation, key, own structure), without them."""
        e = self.entry
        return (e.generation, e.key, e.own) if e is not None else None

    def mirror(self, stamp: tuple[int, str, str] | None) -> None:
        """Hold only ``stamp`` of another process's cache (a writer process's: its plans stay
        there), so that :meth:`token` reports what that cache holds. Never used to write."""
        self.entry = None if stamp is None else CachedPlan(stamp[0], stamp[1], stamp[2], None, None)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------------
# DCP's protocol on distckpt's collectives
@dataclass
class PlanStats:
    """How one save planned (the same on every rank).

    Attributes:
        cached: the save reused the previous save's plans (no plan exchange at all).
        plan_bytes: pickled bytes of the local plans the coordinator gathered (0 when cached).
        coordinator_s: the coordinator's time from holding the local plans to the answers it
            scatters (deduplication, ``Metadata``, validation, file prefixes; 0 when cached).
        finish_s: the coordinator's ``finish``: ``storage_data`` from the write results, and
            ``.metadata`` pickled and written.
        collectives: collectives the write phase ran (plan gather + scatter, replica check,
            results gather + outcome broadcast).
    """

    cached: bool = False
    plan_bytes: int = 0
    coordinator_s: float = 0.0
    finish_s: float = 0.0
    collectives: int = 0


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class SaveRun:
    """One save's DCP protocol on ``group`` (all ranks call every method, in order).

    Local failures are recorded instead of raised (:meth:`attempt`) so that the rank still
    takes part in every collective; they are raised on every rank alike at the next exchange
    that carries outcomes (the plan scatter, or :meth:`finish`).
    """

    def __init__(self, group: Group, writer: Any, plan: PlanInput, cache: PlanCache | None, what: str) -> None:
        self.group = group
        self.writer = writer
        self.input = plan
        self.cache = cache
        self.what = what
        self.planner = DistckptSavePlanner(plan)
        self.failure: _Failure | None = None
        self.final: SavePlan | None = None
        self.metadata: Metadata | None = None
        self.results: list[Any] = []
        self.stats = PlanStats()
        self.shared: tuple[str, ...] = ()  # see _compare_shared_by_parts
        self._cached = cache.lookup(plan) if (cache is not None and plan.hit) else None

    # -- helpers
    def attempt(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` unless this rank already failed; record its failure instead of raising."""
        if self.failure is not None:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - reaches every rank through the next exchange
            self.failure = capture(exc)
            return None

    def _raise(self, failures: Mapping[int, _Failure]) -> None:
        if self.cache is not None:
            self.cache.invalidate()
        raise_failures(failures, self.what)

    # -- phases
    def plan(self, state_dict: dict[str, Any]) -> None:
        """(all ranks) Set up planner and writer, and settle this rank's final plan: from the
        cache (no collective) or through one gather and one scatter."""
        group, coordinator = self.group, self.group.is_coordinator
        self.stats.cached = self._cached is not None

        def local() -> Any:
            from torch.distributed.checkpoint.stateful import Stateful

            sd = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}
            self.planner.set_up_planner(sd, storage_meta=self.writer.storage_meta(), is_coordinator=coordinator)
            self.writer.set_up_storage_writer(coordinator, rank=group.rank, use_collectives=True)
            if self._cached is not None:
                self.writer.prepare_local_plan(SavePlan([]))  # creates the directory; plan reused
                self.final = self.planner.finish_plan(self._cached.plan)
                self.metadata = self._cached.metadata
                self._compare_shared_by_parts(self._cached.shared)
                return None
            local_plan = self.writer.prepare_local_plan(self.planner.create_local_plan())
            self._local = local_plan
            return encode_plan(local_plan)

        wire = self.attempt(local)
        if self._cached is not None:
            return
        if self.cache is not None:
            self.cache.invalidate()  # replaced below, or left empty if this save fails
        payload = dumps((self.failure, wire))
        gathered = group.gather(payload)
        self.stats.collectives += 1
        answers = None
        if coordinator:
            assert gathered is not None
            answers = self._coordinate(gathered)
        failures, delta, nbytes, coord_s = group.scatter(answers)
        self.stats.collectives += 1
        self.stats.plan_bytes, self.stats.coordinator_s = nbytes, coord_s
        if failures:
            self._raise(failures)
        self.final = self.planner.finish_plan(apply_delta(self._local, delta))
        self._compare_shared_by_parts(delta[2])

    def _compare_shared_by_parts(self, shared: tuple[str, ...]) -> None:
        """(every rank alike: ``shared`` comes from the coordinator) DTensors of which ranks of
        several meshes hold copies (see :func:`build_global`) leave the slot-sum replica check,
        whose expected number of copies is their own mesh's (:func:`replication`): every copy's
        fingerprint part goes to the coordinator instead, which compares them by block
        (``statecheck.parts_to_send``)."""
        self.shared = tuple(shared)
        if shared and self.input.dchecked:
            gone = set(shared)
            self.input.dchecked = [(k, f) for k, f in self.input.dchecked if k not in gone]

    def _coordinate(self, gathered: list[bytes]) -> list[tuple]:
        """(coordinator) Unpickle the local plans, build the global plan; the answers to scatter."""
        world = len(gathered)
        nbytes = sum(len(b) for b in gathered)
        received = [pickle.loads(b) for b in gathered]
        failures = {r: f for r, (f, _) in enumerate(received) if f is not None}
        deltas: list[Any] = [(None, (), ())] * world
        t0 = time.perf_counter()
        if not failures:
            try:
                deltas, self.metadata = build_global([w for _, w in received])
                prefixes = self.writer.prepare_global_plan([SavePlan([]) for _ in range(world)])
                deltas = [(p.storage_data, d[1], d[2]) for p, d in zip(prefixes, deltas)]
            except Exception as exc:  # noqa: BLE001
                failures = {0: capture(exc)}
        coord_s = time.perf_counter() - t0
        return [(failures, d, nbytes, coord_s) for d in deltas]

    def write(self) -> None:
        """(each rank, no collectives) Write this rank's items."""
        if self.final is None:
            return

        def run() -> None:
            fut = self.writer.write_data(self.final, self.planner)
            fut.wait()
            self.results = fut.value()

        self.attempt(run)

    def finish(self, extra: Any) -> list[Any] | None:
        """(all ranks) Gather every rank's outcome, write results and ``extra``; the coordinator
        writes ``.metadata``; the outcome is broadcast and any failure raised on every rank.

        Returns every rank's ``extra`` on the coordinator, ``None`` elsewhere.
        """
        group = self.group
        gathered = group.gather((self.failure, self.results, extra))
        self.stats.collectives += 1
        answer: Any = None
        if group.is_coordinator:
            assert gathered is not None
            failures = {r: f for r, (f, _, _) in enumerate(gathered) if f is not None}
            t0 = time.perf_counter()
            if not failures:
                try:
                    if self.metadata is None:
                        raise CheckpointError("the coordinator holds no global metadata for this save")
                    # finish() sets storage_data and storage_meta: on a copy, the cache keeps its own.
                    self.writer.finish(metadata=dataclasses.replace(self.metadata), results=[res for _, res, _ in gathered])
                except Exception as exc:  # noqa: BLE001
                    failures = {0: capture(exc)}
            answer = (failures, time.perf_counter() - t0)
        failures, finish_s = group.broadcast(answer)
        self.stats.collectives += 1
        self.stats.finish_s = finish_s
        if failures:
            self._raise(failures)
        if self.cache is not None and self._cached is None and self.final is not None:
            self.cache.store(self.input, self.final, self.metadata if group.is_coordinator else None, self.shared)
        return [e for _, _, e in gathered] if gathered is not None else None


def raise_failures(failures: Mapping[int, _Failure], what: str) -> None:
    """Raise one error for every rank's failure, as DCP's ``CheckpointException`` did
    (:func:`distckpt.errors.from_causes`): a common distckpt error type is kept, each rank's
    cause is listed."""
    causes = {r: (type(f.exc) if isinstance(f.exc, CheckpointError) else None, f.message) for r, f in sorted(failures.items())}
    raise from_causes(causes, what) from failures[min(failures)].exc
