"""Who writes what in a save, decided on every rank alike from what the ranks exchange anyway.

DCP's own planning (``dcp.save`` with ``DefaultSavePlanner``) has every rank list *everything it
holds* and attach *every* flatten mapping to its plan; the coordinator unpickles ``world x items``
write items, deduplicates them (one ``dataclasses.replace`` per item and plan), builds the
``.metadata`` and scatters whole plans back. For a DDP model that is ``world_size`` copies of
every key, at every save, although the structure rarely changes. distckpt replaces that with the
following (this module, :mod:`distckpt.save.metadata` and :mod:`distckpt.save.protocol`), still producing a standard DCP checkpoint (plain ``dcp.load`` reads it):

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

Pure and local: no collectives.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from distckpt.state.placements import replication
from distckpt.state.scope import GLOBAL, digest

#: Version of the structure digests and cache keys (bump when what they cover changes).
_VERSION = "plan2"


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
        values: entry -> digest of its non-tensor leaves' keys and values (ranks holding an
            entry replicated must agree on them: DCP writes one copy; see :func:`value_drift`).
    """

    own: str
    plain: dict[str, str]
    leaves: list[tuple[str, int, bool]]
    replicas: list[tuple[str, int]]
    replicas_digest: str
    values: dict[str, str] = field(default_factory=dict)


def _entry(key: str) -> str:
    return key.split(".", 1)[0]


def describe(
    flat: Mapping[str, Any], values_of: Set[str] = frozenset(), mappings: Mapping[str, Any] | None = None
) -> Structure:
    """(each rank, no collectives) The :class:`Structure` of a flattened state dict;
    :attr:`Structure.values` of the entries in ``values_of`` only (the drift check's).
    ``mappings``: the flattening's paths (``flatten_state_dict``'s second result), which the
    plan's ``planner_data`` (in ``.metadata``) records: a state whose nesting changed under the
    same flat keys (``{"a": {"b": t}}`` then ``{"a.b": t}``, a list then a dict) has another
    plan, as does a tensor whose ``requires_grad`` changed (its ``TensorProperties``)."""
    own = hashlib.sha256(_VERSION.encode())
    per_entry: dict[str, list[str]] = {}
    leaves: list[tuple[str, int, bool]] = []
    replicas: list[tuple[str, int]] = []
    values: dict[str, list[tuple[str, Any]]] = {}
    for key, value in flat.items():
        if isinstance(value, DTensor):
            factor, coord = replication(value, key)
            local = value.to_local()
            line = (
                f"{key}|D|{tuple(value.shape)}|{value.dtype}|{tuple(value.device_mesh.shape)}|"
                f"{tuple(repr(p) for p in value.placements)}|{coord}|{tuple(local.shape)}"
            )
            planned = f"|{value.requires_grad}"
            if factor > 1:
                replicas.append((key, factor))
        elif isinstance(value, torch.Tensor):
            line = f"{key}|T|{tuple(value.shape)}|{value.dtype}"
            planned = f"|{value.requires_grad}"
            per_entry.setdefault(_entry(key), []).append(line)
            leaves.append((key, value.numel() * value.element_size(), True))
        else:
            line = f"{key}|B"
            planned = ""
            per_entry.setdefault(_entry(key), []).append(line)
            leaves.append((key, 1, False))
            if values_of and _entry(key) in values_of:
                values.setdefault(_entry(key), []).append((key, value))
        try:
            path = "" if mappings is None else f"|{mappings.get(key)!r}"
            own.update((line + planned + path).encode() + b"\n")
        except UnicodeEncodeError:
            raise TypeError(
                f"cannot save state key {key!r:.200}: it holds a lone surrogate (text that is not Unicode, as "
                "os.fsdecode makes of undecodable file names); a checkpoint's keys are UTF-8 text"
            ) from None
    replicas.sort()
    return Structure(
        own=own.hexdigest()[:32],
        plain={n: hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32] for n, lines in per_entry.items()},
        leaves=leaves,
        replicas=replicas,
        replicas_digest=hashlib.sha256(repr(replicas).encode()).hexdigest()[:32],
        values={n: digest(pairs) for n, pairs in values.items()},
    )


def value_drift(views: Sequence[Any], unscoped: Iterable[str]) -> dict[str, list[list[int]]]:
    """(pure, every rank alike) Module/optimizer entries that every rank holds alike (the same
    plain leaves) but whose non-tensor values differ (a module's extra state, an optimizer's
    hyper-parameters): DCP writes one copy, so every rank would load one rank's values. Entry ->
    the groups of ranks holding equal values."""
    out: dict[str, list[list[int]]] = {}
    for name in sorted(unscoped):
        plain = views[0].plain.get(name)
        if plain is None or any(v.plain.get(name) != plain for v in views[1:]):
            continue  # (held alike by no two ranks: a ZeRO partition's keys are each rank's)
        groups: dict[str | None, list[int]] = {}
        for r, v in enumerate(views):
            groups.setdefault(v.values.get(name), []).append(r)
        if len(groups) > 1:
            out[name] = sorted(groups.values())
    return out


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
