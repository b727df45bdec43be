"""Load planning: what each rank asks DCP for, what does not match, and handing results back.

The checkpointer runs these in phases so that every collective is reached by every rank:
``plan_load`` (each rank, no collectives) -> one exchange of the views -> ``requested_keys``
(all ranks) -> ``judge`` (identical on every rank) -> ``read`` (DCP's read on each rank, then
``apply_load``, with one collective for the outcome).

The views are O(1) per rank when the state matches: a digest and a count of the keys a rank
requests instead of the keys themselves (missing and mismatched keys are listed, to be named in
the error). Whether the checkpoint holds keys nobody asked for needs the union of the requested
keys: when every rank requests the same set (DDP, FSDP) it is this rank's own; otherwise (ZeRO
partitions, per-rank entries) one all-reduce of a bitmap over the checkpoint's sorted keys gives
it, O(keys) per rank instead of O(world x keys).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

from distckpt._compat import flatten_state_dict, load_flat, unflatten_state_dict
from distckpt._dist import Group, all_ranks
from distckpt.errors import CheckpointError, IntegrityError, Interrupted, StateMismatchError, cause_of, from_causes, interrupt_in
from distckpt.integrity.manifest import Manifest
from distckpt.state import rng, scope, values
from distckpt.state.build import build_entries
from distckpt.state.entries import (
    Entry,
    OptimizerEntry,
    StatefulEntry,
    TensorEntry,
    TreeEntry,
    ValueEntry,
    group_firsts,
    same_tensor,
    state_fqn,
    tied_duplicates,
)

#: key -> (shape in the checkpoint, shape in the state)
Mismatches = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
#: key -> global shape of what the checkpoint stores (``None``: a non-tensor value), see
#: :func:`metadata_index`
KeyShapes = Mapping[str, tuple[int, ...] | None]
#: Where DCP's flattening found each flat key in the nested state (keys and list indices).
FlatMapping = dict[str, tuple[str | int, ...]]
#: What one rank shares of its load plan (:func:`plan_load`): missing keys, mismatched keys, a
#: digest and the count of the keys it requests, per-rank entries that cannot be resharded.
#: (missing, mismatched, request digest, per-rank entries, request size, keys and entry names left
#: unread here: :func:`_unread_here`)
LoadView = tuple[list[str], Mismatches, str, dict[str, tuple[int, int]], int, list[str], list[str]]


@dataclass
class LoadReport:
    """What a ``strict=False`` load left out (identical on every rank).

    Attributes:
        step: the step loaded.
        missing: keys the state expects that the checkpoint does not hold.
        unexpected: keys the checkpoint holds that nothing in the state asked for.
        mismatched: key -> (shape in checkpoint, shape in state).
        skipped: entry -> why it was not loaded (per-rank state saved at another world size).
        tier: where the step was read from: ``"root"``, ``"replica"`` (``replicate_to``: the
            root lacked the step) or ``"local"`` (the node-local recovery tier, see
            :mod:`distckpt.storage.local_tier`).
        sources: with ``tier == "local"``, per file of the step this rank's load used, where it
            came from: ``"local"`` (kept on this node) or ``"rank N"`` (sent by rank N at
            recovery: into this node's tier, or streamed into this rank's load).
        unread_on: those of ``unexpected`` that other ranks read -> the ranks whose state did
            not ask for them (an entry every rank holds whole, or does not name at all).
    """

    step: int
    missing: list[str]
    unexpected: list[str]
    mismatched: Mismatches
    skipped: dict[str, str] = field(default_factory=dict)
    per_rank: dict[str, tuple[int, int]] = field(default_factory=dict)
    tier: str = "root"
    sources: dict[str, str] = field(default_factory=dict)
    unread_on: dict[str, list[int]] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched or self.skipped)


def _saved_state_fqns(name: str, index: KeyShapes, manifest: Manifest, selection: Selection) -> set[str]:
    """The parameters (fqns) the checkpoint holds per-parameter state of, for optimizer entry
    ``name`` (``<name>.state.<fqn>.<key>``), among the keys the load selects."""
    prefix = name + ".state."
    return {state_fqn(k[len(name) + 1 :]) for k in (*index, *manifest.fingerprints) if k.startswith(prefix) and selection.key(k)}


def _refuse_partial_made_state(
    entries: Iterable[Entry], index: KeyShapes, target: Mapping[str, Any], request: Mapping[str, Any], selection: Selection, step: int
) -> None:
    """(each rank, at planning) Refuse ``only``/``exclude`` that select some but not all of the
    checkpoint's state of a parameter the optimizer holds none of its own for: its load target
    was made by a step with zero gradients, so the keys left out would keep values nobody saved
    (a step count of 1, zero second moments: Adam's next update blown up), silently.

    Raises:
        ValueError: naming the entry, parameters and keys left out (the same on every rank).
    """
    for e in entries:
        if not isinstance(e, OptimizerEntry) or not e.made:
            continue
        prefix = e.name + ".state."
        stored: dict[str, list[str]] = {}
        for key in index:
            # Keys the load target holds (made up for the load) and the checkpoint too: a key
            # the optimizer does not have (amsgrad off since the save) is no made-up value.
            if key.startswith(prefix) and key in target:
                stored.setdefault(state_fqn(key[len(e.name) + 1 :]), []).append(key)
        partial = {
            fqn: sorted(k for k in keys if not selection.key(k))
            for fqn, keys in stored.items()
            if fqn in e.made and any(k in request for k in keys) and not all(selection.key(k) for k in keys)
        }
        if partial:
            shown = "; ".join(f"{fqn}: {', '.join(k.rsplit('.', 1)[1] for k in left)}" for fqn, left in sorted(partial.items())[:5])
            more = f" (+{len(partial) - 5} more)" if len(partial) > 5 else ""
            raise ValueError(
                f"load(only=..., exclude=...) of step {step} selects part of the optimizer state of {len(partial)} "
                f"parameter(s) of {e.name!r} that the optimizer holds no state of its own for; left out: {shown}{more}. "
                "Those keys would keep values made up for the load (a step count of 1, zero moments), not saved "
                f"ones: select each parameter's state whole (e.g. exclude='{e.name}.state.<parameter>.*'), or load "
                "into an optimizer that has stepped"
            )


def _refuse_regrouped(every: Iterable[Entry], selected: Iterable[Entry], manifest: Manifest) -> None:
    """(each rank, at planning) Refuse loading an LR scheduler (any selected stateful entry whose
    object's ``optimizer`` is an optimizer of ``state``) where that optimizer's parameter groups
    are not the ones saved (reordered, split, merged or added: the first parameter of each group,
    in order, as the manifest records it). The optimizer itself loads its hyper-parameters by
    parameter name, but a scheduler's per-group lists (``base_lrs``, ``_last_lr``,
    ``lr_lambdas``) follow the groups by position: each group would be scheduled with another's
    learning rate from the next ``step()``, silently.

    Raises:
        StateMismatchError: naming the scheduler and both orders (in ``.kinds``).
    """
    optimizers = {id(e.facing): e for e in every if isinstance(e, OptimizerEntry)}
    for s in selected:
        if not isinstance(s, StatefulEntry) or s.name not in manifest.entries:
            continue
        e = optimizers.get(id(getattr(s.obj, "optimizer", None)))
        saved = manifest.entries.get(e.name, {}).get("groups") if e is not None else None
        if e is None or not isinstance(saved, list):
            continue  # (manifests written before the groups were recorded: not judged)
        now = group_firsts(e.facing, e.module.param_fqns())
        if now != saved and not (len(now) == len(saved) == 1):  # (one group: nothing to misalign)
            held = f"a scheduler of {e.name!r} saved with {len(saved)} param group(s) led by {_names(saved)}"
            given = (
                f"{len(now)} group(s) led by {_names(now)} now (reordered, split, merged or added since the save): its "
                "per-group lists follow the groups by position, so each group would be scheduled with another's learning "
                f"rate. Build the optimizer's groups as saved, or load without it (exclude='{s.name}') and make it anew."
            )
            raise StateMismatchError([], [], {}, f"step {manifest.step}", kinds={s.name: (held, given)})


def _names(firsts: list[Any]) -> str:
    return "[" + ", ".join(repr(f) for f in firsts[:6]) + (", ..." if len(firsts) > 6 else "") + "]"


def plan_load(
    group: Group,
    manifest: Manifest,
    index: KeyShapes,
    state: MutableMapping[str, Any],
    restore_rng: bool,
    selection: Selection | None = None,
) -> tuple[LoadPlan, LoadView]:
    """(each rank, no collectives) What this rank asks DCP for, and what does not match."""
    selection = selection or Selection()
    every = build_entries(state)  # (all of them: a scheduler's optimizer may be excluded)
    entries = [e for e in every if selection.entry(e.name)]
    if not selection.entry(rng.NAMESPACE):
        restore_rng = False
    targets: dict[str, Any] = {}
    per_rank: dict[str, tuple[int, int]] = {}
    for e in entries:
        saved = manifest.entries.get(e.name, {})
        if e.kind == "value" and saved.get("kind", "value") != "value" and e.name in index and index[e.name] is None:
            # One non-tensor item under the entry's own name that is no value (a tuple holding
            # tensors): decoded as a value, it read like a damaged checkpoint. (Other kinds
            # differ in keys or shapes, which the report names.)
            held = f"a {saved.get('kind')!r} entry (saved from an object holding tensors)"
            given = f"a plain value ({type(getattr(e, 'value', None)).__name__})"
            raise StateMismatchError([], [], {}, f"step {manifest.step}", kinds={e.name: (held, given)})
        if saved.get("scope") == scope.PER_RANK and manifest.world_size != group.world_size:
            # Cannot be resharded: reported (strict) or skipped. Before its load target is made:
            # making it can change the object (a torchdata loader's state_dict() starts an
            # iterator, which the next epoch then runs instead of a fresh one).
            per_rank[e.name] = (manifest.world_size, group.world_size)
            continue
        if isinstance(e, OptimizerEntry):
            e.held = _saved_state_fqns(e.name, index, manifest, selection)
            if e.held and not saved.get("initialized", True):
                # "initialized" was the coordinator's before 2026-12-07: a ZeRO partition of
                # parameters that had no gradient yet holds no state on rank 0 while other ranks'
                # do. The checkpoint's keys say (a target of groups only refused every saved
                # moment as unexpected).
                saved = {**saved, "initialized": True}
        target = e.load_target(saved)
        if saved.get("scope") == scope.PER_RANK:
            target = {scope.rank_key(group.rank): target}
        targets[e.name] = target
    rng_key = None
    if restore_rng and rng.NAMESPACE in manifest.entries:
        # Same world size: each rank its own states; otherwise rank 0's, to derive seeds.
        rng_key = f"rank_{group.rank if manifest.world_size == group.world_size else 0}"
        targets[rng.NAMESPACE] = {rng_key: rng.capture()}
    flat, mappings = flatten_state_dict(targets)
    for e in entries:
        if isinstance(e, OptimizerEntry) and e.name in targets and isinstance(targets[e.name], Mapping):
            prefix = e.name + "."
            # The manifest's fingerprints name every tensor saved: a parameter's state removed
            # from .metadata (a forged one) is not taken for state that never existed.
            saved_keys = [k[len(prefix) :] for k in (*index, *manifest.fingerprints) if k.startswith(prefix)]
            for key in e.set_stateless({k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}, saved_keys):
                del flat[prefix + key]

    missing: list[str] = []
    mismatched: Mismatches = {}
    later = tied_duplicates(flat)
    tied = {**later, **{first: dup for dup, first in later.items()}}  # both directions
    # One tensor under two keys that the checkpoint holds with different values (recorded
    # fingerprints differ): both would be read into it, the one read last kept, unreported.
    differ = [
        (first, dup)
        for dup, first in later.items()
        if dup in index and first in index and selection.key(dup) and selection.key(first)
        and None not in (manifest.fingerprints.get(first), manifest.fingerprints.get(dup))
        and manifest.fingerprints[first] != manifest.fingerprints[dup]
    ]  # fmt: skip
    if differ:
        shown = "; ".join(f"{a!r} and {b!r}" for a, b in sorted(differ)[:10])
        raise ValueError(
            f"step {manifest.step}: the state holds one tensor under keys the checkpoint holds with different "
            f"values: {shown}; loading would keep whichever is read last. Untie them before loading, or load "
            "one of them (exclude= the other)"
        )
    for key, value in flat.items():
        if not selection.key(key):
            continue
        if key not in index:
            if key in tied and tied[key] in index:
                continue  # tied weights (e.g. lm_head = embeddings): filled through the partner
            if not key.startswith(rng.NAMESPACE + "."):  # e.g. no CUDA state saved: fine
                missing.append(key)
            continue
        saved = index[key]
        if isinstance(value, torch.Tensor):
            if saved is None or saved != tuple(value.shape):
                mismatched[key] = (saved or (), tuple(value.shape))
        elif saved is not None:
            mismatched[key] = (saved, ())
    request = {k: v for k, v in flat.items() if k in index and k not in mismatched and selection.key(k)}
    for e in entries:
        if isinstance(e, OptimizerEntry):  # what it reads (its groups' values are judged by those)
            prefix = e.name + "."
            e.read = {k[len(prefix) :] for k in request if k.startswith(prefix)}
            # A parameter whose shape changed since the save (strict=False: its moments
            # mismatch, its 0-d step fits) kept the checkpoint's step beside other moments: the
            # load target's zeros (a fresh optimizer) or its own (one that stepped: a bias
            # correction for 5 steps over moments of 1, silently). None of its state is read:
            # a fresh optimizer's parameter gets none (OptimizerEntry.apply: unread_params), a
            # stepped one's keeps its own, whole; the state check then judges no step it was
            # never given. (Keys left out by only/exclude or missing from the checkpoint keep
            # their parameters' other state, as before.)
            changed = {state_fqn(k[len(prefix) :]) for k in mismatched if k.startswith(prefix + "state.")}
            for key in [k for k in request if k.startswith(prefix + "state.") and state_fqn(k[len(prefix) :]) in changed]:
                del request[key]
                e.read.discard(key[len(prefix) :])
    _refuse_partial_made_state(entries, index, flat, request, selection, manifest.step)
    _refuse_regrouped(every, entries, manifest)
    plan = LoadPlan(entries, flat, mappings, request, rng_key, {e.name for e in entries}, per_rank)
    unread = _unread_here(manifest, index, every, entries, request, mismatched, selection)
    return plan, (missing, mismatched, _keys_digest(request), per_rank, len(request), *unread)


def _unread_here(
    manifest: Manifest,
    index: KeyShapes,
    every: list[Entry],
    entries: list[Entry],
    request: Mapping[str, Any],
    mismatched: Mismatches,
    selection: Selection,
) -> tuple[list[str], list[str]]:
    """(each rank, pure) What this rank leaves unread that its peers may read: ``(keys, names)``.
    ``keys``: of entries every rank holds whole (plain values, containers, tensors saved alike
    for every rank) that this rank does not ask for; ``names``: entries of the checkpoint this
    rank's state does not name. The union of the ranks' requests (:func:`requested_keys`) took
    them for read, so a strict load with one rank's state lacking them loaded it partly, silently.
    Modules, optimizers and stateful objects are left out: their keys are split between ranks by
    design (ZeRO partitions, pipeline stages)."""
    whole = {
        e.name for e in entries
        if isinstance(e, (TensorEntry, TreeEntry, ValueEntry)) and manifest.entries.get(e.name, {}).get("scope") == scope.GLOBAL
    }  # fmt: skip
    keys = []
    if whole:
        heads = {n.partition(".")[0] for n in whole}  # (most keys are judged by their first part)
        for k in index:
            if k.partition(".")[0] in heads and k not in request and k not in mismatched and _entry_of(k, whole) is not None and selection.key(k):
                keys.append(k)
    named = {e.name for e in every}
    names = sorted(
        n for n, saved in manifest.entries.items()
        if n not in named and n != rng.NAMESPACE and saved.get("kind") in _WHOLE_KINDS and saved.get("scope") == scope.GLOBAL
        and selection.entry(n)
    )  # fmt: skip
    return sorted(keys), names


#: Entry kinds (as manifests record them) every rank holds whole when saved global.
_WHOLE_KINDS = frozenset({TensorEntry.kind, TreeEntry.kind, ValueEntry.kind})


def _entry_of(key: str, names: set[str]) -> str | None:
    """The one of ``names`` (entry names, which may hold dots) that flattened ``key`` lies under."""
    at = len(key)
    while at > 0:
        if key[:at] in names:
            return key[:at]
        at = key.rfind(".", 0, at)
    return None


def refuse_meta(request: Mapping[str, Any], where: str) -> None:
    """(each rank, inside the plan exchange so every rank fails alike) Refuse destinations on
    the meta device (a model built under ``torch.device("meta")`` and not yet ``to_empty``'d):
    DCP's planner replaced them with fresh tensors nothing reads back, so the load returned
    normally and the model held no values (without a process group, an error naming no key).

    Raises:
        ValueError: naming up to five keys and ``where``.
    """
    meta = [k for k, v in request.items() if isinstance(v, torch.Tensor) and v.device.type == "meta"]
    if meta:
        shown = ", ".join(repr(k) for k in meta[:5]) + (f" (+{len(meta) - 5} more)" if len(meta) > 5 else "")
        raise ValueError(
            f"cannot load {where} into tensors on the meta device: {shown}; give them memory first "
            "(model.to_empty(device=...), then load)"
        )


def refuse_overlapping(request: Mapping[str, Any], where: str) -> None:
    """(each rank, inside the plan exchange so every rank fails alike) Refuse a destination
    whose elements share memory (``t.expand(...)``, a stride of 0, or an overlapping
    ``as_strided`` window, see :func:`_overlaps`): no load can fill it; torch's error from the
    read ("more than one element of the written-to tensor refers to a single memory location")
    named no key, and a window torch cannot judge loaded silently wrong.

    Raises:
        ValueError: naming the key and ``where``.
    """
    for key, value in request.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.layout == torch.strided and _overlaps(local):
            raise ValueError(
                f"cannot load {key!r} of {where} into a tensor whose elements share memory (an expand()ed or as_strided "
                f"tensor, shape {tuple(local.shape)}, stride {local.stride()}); load into one with memory of its own (.clone())"
            )


def sharing_memory(request: Mapping[str, Any]) -> list[str]:
    """(each rank, pure) The keys of ``request`` whose destination shares memory with another
    key's without being the very same tensor (a flat buffer and a view into it; ties are
    :func:`~distckpt.state.entries.tied_duplicates`'): both are read, the one read last keeps
    the shared elements, so a checkpoint whose values for them disagree loads one of them wrong
    silently. Judged by address (``from_numpy`` views of one array are other storages over the
    same bytes); strided views that interleave without sharing an element are told apart where
    small enough to enumerate."""
    spans: dict[tuple[str, int | None], list[tuple[int, int, str, torch.Tensor]]] = {}
    for key, value in request.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.layout != torch.strided or not local.numel() or local.device.type == "meta":
            continue
        start = local.data_ptr()
        reach = sum((n - 1) * st for n, st in zip(local.shape, local.stride()) if n > 1)
        spans.setdefault((local.device.type, local.device.index), []).append(
            (start, start + (reach + 1) * local.element_size(), key, local)
        )
    out: set[str] = set()
    for found in spans.values():
        found.sort(key=lambda s: (s[0], s[1]))
        open_: list[tuple[int, int, str, torch.Tensor]] = []
        for span in found:
            open_ = [o for o in open_ if o[1] > span[0]]
            for other in open_:
                if _share_elements(other[3], span[3]):
                    out.update((other[2], span[2]))
            open_.append(span)
    return sorted(out)


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether tensors ``a`` and ``b``, whose address ranges overlap, share a byte and are not
    the very same tensor (one tensor under two keys: a tie, :func:`~distckpt.state.entries.same_tensor`). Decided
    from shapes and strides (a dense tensor holds every byte of its range; a strided one's
    elements are found by :func:`_first_at_least`), without enumerating elements, except for
    layouts those cannot judge (then up to 1M elements; above, taken to share)."""
    if same_tensor(a) == same_tensor(b):
        return False
    dense_a, dense_b = _dense(a), _dense(b)
    if dense_a and dense_b:
        return True  # every byte of both ranges is an element's, and the ranges overlap
    if dense_a or dense_b:
        dense, other = (a, b) if dense_a else (b, a)
        lo, hi = dense.data_ptr(), dense.data_ptr() + dense.numel() * dense.element_size()
        size = other.element_size()
        # The first element of ``other`` ending past ``lo``: it shares if it starts before ``hi``.
        first = _first_at_least(-((other.data_ptr() - lo + size - 1) // size), other)
        if first is not _UNKNOWN:
            return first is not None and other.data_ptr() + first * size < hi
    elif a.element_size() == b.element_size() and not (a.data_ptr() - b.data_ptr()) % a.element_size():
        d = (b.data_ptr() - a.data_ptr()) // a.element_size()
        # Every element offset of either is a multiple of the strides' gcd from its first: the
        # even and odd columns of one matrix never meet, whatever their size.
        if d % math.gcd(*(st for t in (a, b) for st, n in zip(t.stride(), t.shape) if n > 1)):
            return False
        if a.stride() == b.stride():
            shared = _same_strides_meet(a, b, d)
            if shared is not _UNKNOWN:
                return bool(shared)
    if a.element_size() != b.element_size() or a.numel() + b.numel() > 1 << 20 or (a.data_ptr() - b.data_ptr()) % a.element_size():
        return True  # (not enumerated: taken to share; then checked, or named as "may share")
    size, base = a.element_size(), min(a.data_ptr(), b.data_ptr())
    return bool(torch.isin(_offsets(a, (a.data_ptr() - base) // size), _offsets(b, (b.data_ptr() - base) // size)).any())


_UNKNOWN = object()  # a layout the stride arithmetic below cannot judge


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its address range without gaps or overlaps (any order)."""
    expect = 1
    for stride, n in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expect:
            return False
        expect *= n
    return True


def _dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """``t``'s (stride, size) of the dimensions longer than 1, largest stride first."""
    return sorted(((st, n) for st, n in zip(t.stride(), t.shape) if n > 1), reverse=True)


def _offsets(t: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Every element's offset (in elements) of ``t``, its first at ``first``: enumerated."""
    at = torch.tensor([first], dtype=torch.int64)
    for stride, n in zip(t.stride(), t.shape):
        at = (at[:, None] + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
    return at


def _nested(dims: list[tuple[int, int]]) -> bool:
    """Whether each stride of ``dims`` ((stride, size), largest stride first) steps past all
    that the smaller ones reach: each address then has one index, found digit by digit."""
    reach = 0
    for stride, n in reversed(dims):
        if stride <= reach:
            return False
        reach += (n - 1) * stride
    return True


def _first_at_least(target: int, t: torch.Tensor) -> object:
    """The smallest element offset of ``t`` (in elements from its first, ``sum(i * stride)``)
    that is at least ``target``; ``None`` if none is; :data:`_UNKNOWN` for layouts whose
    strides are not nested (:func:`_nested`)."""
    dims = _dims(t)
    if any(st <= 0 for st, _ in dims) or not _nested(dims):
        return _UNKNOWN

    def first(target: int, k: int) -> int | None:
        if k == len(dims):
            return 0 if target <= 0 else None
        stride, n = dims[k]
        i = min(max(0, target // stride), n - 1)
        rest = first(target - i * stride, k + 1)
        if rest is not None:
            return i * stride + rest
        return (i + 1) * stride if i + 1 < n else None  # the next digit, the rest at their least

    return first(target, 0)


def _same_strides_meet(a: torch.Tensor, b: torch.Tensor, d: int) -> object:
    """Whether ``a`` and ``b`` (the same strides and element size; ``b`` starts ``d`` elements
    after ``a``) share an element: ``sum(c_k * stride_k) == d`` for some ``c_k`` between
    ``-(b's size_k - 1)`` and ``a's size_k - 1``. :data:`_UNKNOWN` where the strides do not
    make that ``c`` unique (then it is not searched)."""
    dims = sorted(
        ((st, na, nb) for st, na, nb in zip(a.stride(), a.shape, b.shape) if na > 1 or nb > 1), reverse=True
    )
    if any(st <= 0 for st, _, _ in dims):
        return _UNKNOWN
    reach = 0  # the width of what the smaller strides span, over both tensors' index ranges
    for st, na, nb in reversed(dims):
        if st <= reach:
            return _UNKNOWN
        reach += (na + nb - 2) * st
    r = d
    for k, (st, na, nb) in enumerate(dims):
        lo = -sum((m - 1) * s for s, _, m in dims[k + 1 :])
        hi = sum((m - 1) * s for s, m, _ in dims[k + 1 :])
        c = -((hi - r) // st)  # the least c with r - c * st <= hi (one at most fits: see above)
        if not -(nb - 1) <= c <= na - 1 or r - c * st < lo:
            return False
        r -= c * st
    return r == 0


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory. torch answers "yes" for a stride of 0 and
    "no" for dense layouts; otherwise ("too hard": a column slice, an ``as_strided`` window)
    strides that each step past everything the smaller ones reach cannot overlap, and the rest
    are checked element by element (refused unchecked above 4M elements)."""
    verdict = torch._debug_has_internal_overlap(t)  # 0: no, 1: yes, 2: too hard
    if verdict != 2:
        return verdict == 1
    if _nested(_dims(t)):
        return False
    if t.numel() > 1 << 22:
        return True
    return int(_offsets(t).unique().numel()) != t.numel()


def _keys_digest(keys: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:32]


def metadata_index(metadata: Metadata) -> dict[str, tuple[int, ...] | None]:
    """(any rank, not collective) key -> global shape (``None``: a non-tensor value) of a DCP
    ``Metadata``: built by every rank from the metadata the coordinator read and verified, so
    it need not travel beside it."""
    index: dict[str, tuple[int, ...] | None] = {}
    for key, md in metadata.state_dict_metadata.items():
        size = getattr(md, "size", None)
        index[key] = tuple(size) if size is not None else None
    return index


def requested_keys(group: Group, index: KeyShapes, plan: LoadPlan, views: list[LoadView]) -> set[str]:
    """(all ranks, identical result) The keys some rank requests.

    One collective, only when the ranks' request digests differ: a max-reduce of a byte per
    checkpoint key. Every rank decides from the same gathered views whether to take part.
    """
    if all(v[2] == views[0][2] for v in views[1:]):
        return set(plan.request)
    keys = sorted(index)
    bits = torch.zeros(len(keys), dtype=torch.uint8)
    position = {k: i for i, k in enumerate(keys)}
    mine = [position[k] for k in plan.request]
    if mine:
        bits[torch.tensor(mine, dtype=torch.int64)] = 1
    union = group.all_reduce(bits, "max")
    return {keys[i] for i in union.nonzero().flatten().tolist()}


#: Said after a read that failed: the state may hold a mix of old and loaded values.
PARTLY_LOADED = " (tensors read before the failure already hold their loaded values: load again before using the state)"


def read(
    group: Group,
    where: str,
    request: dict[str, Any],
    reader: StorageReader,
    planner: LoadPlanner,
    then: Callable[[], None] | None = None,
) -> None:
    """(all ranks; one collective, two with ``then``) Read this rank's ``request`` through DCP,
    then, once every rank has read, run ``then``.

    ``dcp.load`` on a process group gathers every rank's load plan (one read item per tensor
    shard it reads) on the coordinator and scatters it back, although DCP's default global load
    plan changes nothing, then all-gathers the outcome: three collectives, the coordinator
    receiving O(world x items). Loading needs no coordination, so each rank plans and reads on
    its own (``no_dist``) and an all-gather of O(1) per rank agrees on the outcome of the read,
    another on that of ``then``: a failure on any rank still fails every rank alike, read failures named
    ``reading WHERE`` (of their common distckpt type, e.g. :class:`~distckpt.errors.IntegrityError`),
    failures of ``then`` ``load of WHERE``. An interrupt (``KeyboardInterrupt``, ``SystemExit``)
    during the read is a :class:`~distckpt.errors.Interrupted` on every rank (the interrupt
    itself once it leaves the public call: :func:`~distckpt._dist.interrupts_raised`).
    """
    read_failure = interrupt = None
    try:
        with warnings.catch_warnings():
            # no_dist is chosen, not a fallback: DCP's warning that it "assumes" it would mislead.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load_flat(request, reader, planner)  # dcp.load, without its per-value Stateful checks
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        read_failure = cause_of(exc)
        # Ctrl-C or a signal handler's sys.exit: its peers learn of it below, and this rank
        # raises it as itself from the public call (it came out as a CheckpointError, which
        # `except Exception` caught: a preempted job ran on).
        interrupt = interrupt_in(exc)
    finish_streams = getattr(reader, "finish_streams", None)
    if finish_streams is not None:
        # A load that failed before its reads still sends and receives what its peers stream
        # (they wait for it otherwise).
        try:
            finish_streams()
        except Exception as exc:  # noqa: BLE001 - every failure must reach the peers
            read_failure = read_failure or cause_of(exc)
    try:
        outcomes = group.all_gather((read_failure, interrupt is not None))
    except CheckpointError as exc:  # a peer died while reading: this rank's tensors may be loaded
        if interrupt is not None:
            raise interrupt from None
        raise CheckpointError(f"{exc._message}{PARTLY_LOADED}", exc.failures) from exc
    reads = {r: failed for r, (failed, _) in enumerate(outcomes) if failed is not None}
    stopped = [r for r, (_, interrupted) in enumerate(outcomes) if interrupted]
    if stopped:
        # The same error on every rank, so that the layers above take the same (collective)
        # way out; the interrupted rank raises its interrupt from the public call.
        raise Interrupted(
            f"reading {where} was interrupted on rank(s) {stopped}{PARTLY_LOADED}", {r: line for r, (_, line) in reads.items()}, interrupt
        )
    if reads:
        # Tensors are read in place (no second copy of the state): those read before the
        # failure hold their new values, which nothing else would tell the user. ``then`` runs
        # only once every rank has read: run where a rank's own read succeeded, it left those
        # ranks holding the whole loaded state (step, optimizer, data position) and the failed
        # ones their old values.
        raise from_causes(reads, f"reading {where}", PARTLY_LOADED)
    if then is not None:
        all_ranks(group, f"load of {where}", then)  # (an interrupt in it: see interrupts_raised)


def entries_read(names: Iterable[str], requested: Iterable[str]) -> set[str]:
    """(pure) The entry ``names`` of which some key (the name itself, or ``name.<...>``) is in
    ``requested``: sorted once, each name found by bisection (not every key tried per entry)."""
    keys = sorted(requested)
    out = set()
    for name in names:
        for probe in (name, name + "."):
            i = bisect.bisect_left(keys, probe)
            if i < len(keys) and (keys[i] == name or keys[i].startswith(name + ".")):
                out.add(name)
                break
    return out


def apply_load(group: Group, manifest: Manifest, plan: LoadPlan, state: MutableMapping[str, Any]) -> None:
    """(each rank, no collectives) Hand what DCP read to the live objects."""
    plan.flat.update(plan.request)  # DCP replaced non-tensor values in the request dict
    nested = unflatten_state_dict(plan.flat, plan.mappings)
    read = entries_read([e.name for e in plan.entries], plan.request)
    handed: list[tuple[Entry, Any]] = []
    for e in plan.entries:
        if e.name in nested:
            if e.name not in read:
                # Nothing of it read (strict=False: missing or mismatched throughout): left as
                # it is, not handed its own state from before the load (a torchdata loader's
                # would rewind the sampler loaded beside it).
                e.left_alone()
                continue
            loaded = nested[e.name]
            saved = manifest.entries.get(e.name, {})
            if saved.get("scope") == scope.PER_RANK:
                loaded = loaded[scope.rank_key(group.rank)]
            handed.append((e, loaded))
    # Every refusal that changes nothing first (a value that is not the one recorded, optimizer
    # groups changed since the save): an entry refusing after others took their state left the
    # model, scheduler and optimizer loaded, the rest not, under a plain refusal.
    for e, loaded in handed:
        saved = manifest.entries.get(e.name, {})
        if saved.get("kind") == "value":
            values.check_digest(loaded, saved, e.name)
        e.check(loaded)
    applied: list[str] = []
    for e, loaded in handed:
        try:
            e.apply(loaded, state)
        except Exception as exc:
            # The object's own load_state_dict refused (a sampler of another dataset size):
            # raised as it is, saying what the load already changed.
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(
                    f"distckpt: the load of step {manifest.step} stopped handing state[{e.name!r}] its state; tensors"
                    f" were read in place, and {', '.join(map(repr, applied)) or 'no entry'} already took the"
                    " checkpoint's state: load again before using the state"
                )
            raise
        applied.append(e.name)
    if plan.rng_key is not None and rng.NAMESPACE in nested:
        saved = nested[rng.NAMESPACE][plan.rng_key]
        try:
            if manifest.world_size == group.world_size:
                rng.restore(saved)
            else:
                rng.reseed(rng.derived_seed(saved["torch"], manifest.step, group.rank))
        except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as exc:
            # Written by distckpt itself, so a state that does not fit is a damaged checkpoint.

            raise IntegrityError(
                f"step {manifest.step}: the saved random-number-generator state ({rng.NAMESPACE}.{plan.rng_key}) "
                f"is malformed: {type(exc).__name__}: {exc}"
            ) from exc


@dataclass
class Selection:
    """Which parts of a checkpoint a load takes: ``only`` / ``exclude`` patterns (``fnmatch``
    style, e.g. ``"model"``, ``"optim"``, ``"model.layers.0.*"``, ``"*.weight"``), matched against
    entry names and full keys. Everything by default.

    ``keys``: the checkpoint's keys. With them, an entry the checkpoint holds takes part exactly
    when some of its keys are selected, so a key pattern selects keys across entries
    (``only="*.weight"``) and an entry whose keys are all excluded is left untouched.
    """

    only: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    keys: frozenset[str] | None = None

    @staticmethod
    def _hit(name: str, patterns: tuple[str, ...]) -> bool:
        from fnmatch import fnmatchcase

        return any(fnmatchcase(name, p) for p in patterns)

    def entry(self, name: str) -> bool:
        """Whether entry ``name`` takes part (some of its keys may still be left out)."""
        if self._hit(name, self.exclude):
            return False
        if self.keys is not None:
            own = [k for k in self.keys if k == name or k.startswith(name + ".")]
            if own:
                return any(self.key(k) for k in own)
        # Not in the checkpoint (or its keys unknown): by name, so strictness still reports it.
        return not self.only or self._hit(name, self.only) or any(p.startswith(name + ".") for p in self.only)

    def key(self, key: str) -> bool:
        if not self.only and not self.exclude:  # everything (the default): asked once per key
            return True
        entry = key.split(".", 1)[0]
        if self.only and not (self._hit(entry, self.only) or self._hit(key, self.only)):
            return False
        return not (self._hit(entry, self.exclude) or self._hit(key, self.exclude))


@dataclass
class LoadPlan:
    """What one rank asks DCP for, and how to hand the result back."""

    entries: list[Entry]
    flat: dict[str, Any]
    mappings: FlatMapping
    request: dict[str, Any]
    rng_key: str | None
    names: set[str]
    per_rank: dict[str, tuple[int, int]]


def judge(
    step: int,
    index: KeyShapes,
    views: list[LoadView],
    names: set[str] | None,
    selection: Selection | None = None,
    requested: set[str] | None = None,
) -> LoadReport:
    """The load report from every rank's view and the union of requested keys
    (:func:`requested_keys`), identical on every rank; keys outside ``selection`` are neither
    missing nor unexpected."""
    selection = selection or Selection()
    missing = sorted({k for v in views for k in v[0]})
    mismatched: Mismatches = {}
    per_rank: dict[str, tuple[int, int]] = {}
    for v in views:
        mismatched.update(v[1])
        per_rank.update(v[3])
    requested = requested or set()
    # Strict: keys of entries the state does not name at all are unexpected too (the whole
    # checkpoint must be taken). Non-strict (``names`` given): only leftovers of named entries
    # are reported, so loading just the model for evaluation is quiet. distckpt's own RNG
    # states are optional either way.
    unexpected = sorted(
        k
        for k in index
        if selection.key(k)
        and k not in requested
        and k not in mismatched
        and not k.startswith(rng.NAMESPACE + ".")
        and k.split(".", 1)[0] not in per_rank
        and (names is None or k.split(".", 1)[0] in names)
    )
    # Read by some ranks only, where every rank holds the entry whole (or, strict, names it):
    # another rank's request hid them above.
    # (only keys some rank asked for: one no rank asked for is unexpected above, on every rank)
    unread_on: dict[str, list[int]] = {}
    unnamed = {n for v in views for n in v[6]} if names is None else set()
    under: dict[str, list[str]] = {}  # (requested keys by the unnamed entry they lie under: one pass)
    if unnamed:
        for k in requested:
            name = _entry_of(k, unnamed)
            if name is not None:
                under.setdefault(name, []).append(k)
    for r, v in enumerate(views):
        held = [k for n in v[6] for k in under.get(n, ())]  # (none unless strict: ``under`` is empty)
        for k in (*v[5], *held):
            if k in requested and selection.key(k) and k not in mismatched and not k.startswith(rng.NAMESPACE + "."):
                unread_on.setdefault(k, []).append(r)
    unexpected = sorted({*unexpected, *unread_on})
    skipped = {
        name: f"per-rank state saved at world size {saved}, loading at {now}" for name, (saved, now) in sorted(per_rank.items())
    }
    return LoadReport(step, missing, unexpected, mismatched, skipped, per_rank, unread_on=unread_on)
