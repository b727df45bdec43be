"""Saving, phase by phase: the mirror of :mod:`distckpt.load.phases`.

:meth:`Checkpointer.save <distckpt.Checkpointer.save>` runs these phases in this order; which
ranks call each is part of the protocol:

1. :func:`prepare`   (each rank, no collectives, inside one ``exchange``) checks the caller's
   input and builds DCP's state dict, the manifest's entry descriptions and this rank's
   :class:`SaveView`. Bad input on one rank fails every rank, before any collective of DCP's.
2. :func:`agree`     (each rank, on the gathered views: the same verdict everywhere) checks that
   the ranks agree on step and entries and gives every undeclared entry its scope (global or
   per rank, see :mod:`distckpt.state.scope`).
3. :func:`claim`     (coordinator, via ``on_coordinator``) refuses a committed step, removes
   stale leftovers of interrupted saves and creates the step directory exclusively, under a
   lease (:mod:`distckpt.storage.ownership`). Async saves claim in their background part,
   after staging (the directory's creation costs fsyncs that training need not wait for); the
   coordinator refuses a committed step during their prepare (:func:`refuse_committed`).
4. :func:`stage`     (async saves only; each rank) copies the state into host buffers
   (:class:`~distckpt.save.staging.Stager`); training resumes after it.
5. :func:`write`     (all ranks, collective) DCP's protocol, driven by :mod:`distckpt.save.protocol`:
   each rank plans only what it writes (or reuses the previous save's plans), replicas are
   compared with O(items) traffic, the data files and ``.metadata`` are written; every rank's
   outcome, file records, fingerprint parts and the digests of the non-tensor items it wrote
   are gathered on the coordinator, and a failure
   on one rank is raised on all of them.
6. :func:`commit`    (coordinator) writes the manifest with a no-replace primitive: from then
   on the step exists; then
7. :func:`apply_retention` (coordinator) deletes committed steps beyond ``keep_last``.

A failure after phase 3 releases the lease: the coordinator removes the directory it created.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from distckpt.save import assign
from distckpt.state import encoded, fingerprint, rng, safetypes, scope, statecheck, values
from distckpt.storage import ownership
from distckpt._compat import flatten_state_dict
from distckpt._dist import Group
from distckpt._process import refuse_different_arguments
from distckpt.save.assign import PlanInput
from distckpt.save.planner import Observe
from distckpt.save.protocol import PlanCache, PlanStats, SaveRun
from distckpt.save.writer import checkpoint_writer
from distckpt._version import __version__
from distckpt.errors import CheckpointError, StagingMismatchError, StepExistsError
from distckpt.integrity.manifest import MANIFEST_NAME, TIER_COPY, FileRecord, Manifest, digest_of, step_dir, tier_copy
from distckpt.storage.retention import Reaper, delete_old_steps
from distckpt.save.staging import Stager, check_saveable, replicated_layout
from distckpt.state.build import build_entries
from distckpt.state.placements import check_block, writes_dtensor
from distckpt.state.entries import contains
from distckpt.storage.base import Storage

log = logging.getLogger("distckpt")


@dataclass(frozen=True)
class SaveOptions:
    """What the save phases take from the :class:`~distckpt.Checkpointer`'s options."""

    storage: Storage
    keep_last: int | None
    thread_count: int
    sync_files: bool
    checksum: str | None
    skip_record_crc: bool
    save_rng: bool
    fingerprint: bool
    on_replica_drift: str
    lease_s: float
    verify_staging: bool | str = "auto"
    local_dir: str | None = None  # this node's local tier (distckpt.storage.local_tier), if any
    local_ranks: int = 1  # ranks of the job on this host (what a writer's helper threads share)


@dataclass
class SaveView:
    """What one rank says about the save it was asked for (exchanged in one collective).

    Attributes:
        step, names: the step and the state's entry names (must agree across ranks).
        digests: scoped entry -> digest of its value on this rank (decides global/per-rank).
        declared: scoped entry -> scope declared by the user or the object's kind, or None.
        layout: per module/optimizer entry, a digest of its plain tensors' keys, shapes and
            dtypes (ranks agreeing hold the entry replicated: each of its tensors gets one
            writer, and async saves stage only their share, see staging).
        plain: per entry, a digest of all its plain (non-DTensor) leaves' keys, shapes and
            dtypes (ranks agreeing hold them replicated; see :mod:`distckpt.save.assign`).
        replicas: digest of this rank's DTensors with replicated mesh dimensions.
        cache: the plan cache's token for this rank's current structure, or None.
        blocking: the save's ``blocking`` argument (must agree across ranks).
        writer_exit: this rank's background writer process's exit code where it exited since
            the last save (killed while idle, by the OOM killer say), else ``None``: any such
            rank makes every rank restart its writer before this save (they form one group).
        tier_usable: whether this node's local recovery tier can take the step
            (:meth:`~distckpt.storage.local_tier.LocalTier.usable_for`; ``True`` without a tier):
            the save keeps a local copy only where every rank's can.
        initialized: the optimizer entries holding state on this rank (a ZeRO partition may
            hold none where others do: the manifest says "initialized" if any rank's does).
        values: per entry, a digest of its non-tensor leaves' values (module/optimizer entries
            held alike must agree on them, :func:`~distckpt.save.assign.value_drift`).

    Every field is O(entries), so the exchange is O(world x entries), never O(world x keys).
    """

    step: int
    names: list[str]
    digests: dict[str, str]
    declared: dict[str, str | None]
    layout: dict[str, str]
    plain: dict[str, str] = field(default_factory=dict)
    replicas: str = ""
    cache: tuple[int, str] | None = None
    blocking: bool = True  # must agree: a save is synchronous on every rank or on none
    writer_exit: int | None = None
    tier_usable: bool = True
    initialized: list[str] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)


@dataclass
class Prepared:
    """One rank's save after :func:`prepare` (and :func:`agree`).

    Attributes:
        step: the step.
        state_dict: what DCP writes (per-rank entries re-keyed by :func:`agree`).
        described: entry name -> its manifest description (kind, scope, ...).
        sizes: ``(flattened key, bytes)`` of plain tensors of modules/optimizers (who writes
            each replicated one; async saves split them among the ranks' stagers alike).
        extra: the caller's JSON metadata for the manifest.
        replica_digests: replica digests (:func:`distckpt.state.statecheck.copy_digest`) of
            replicated tensors this rank holds but another rank stages and writes (async saves,
            see :func:`stage`), so that replicas are compared across ranks even though each
            rank stages only its share.
        on_device: flattened keys of tensors that live on an accelerator (their copies are
            compared by fingerprint sums, on the device, see ``copy_digest``).
        staging_digests: (async saves with ``verify_staging``) flattened key -> the staging
            digest of the live tensor at the call (:func:`distckpt.save.staging.staging_digest`)
            for the tensors this rank stages and writes; :func:`write` checks every one it
            writes against the tensor its writer serializes.
        structure: this rank's state structure (:func:`distckpt.save.assign.describe`).
        unscoped: the module/optimizer entries.
        plan: what :func:`write` plans from (set by :func:`agree`; picklable).
    """

    step: int
    state_dict: dict[str, Any]
    described: dict[str, Any]
    sizes: list[tuple[str, int]]
    extra: dict[str, Any]
    replica_digests: dict[str, Any] = field(default_factory=dict)
    on_device: frozenset[str] = frozenset()
    staging_digests: dict[str, int] = field(default_factory=dict)
    structure: assign.Structure | None = None
    unscoped: list[str] = field(default_factory=list)
    plan: PlanInput | None = None


@dataclass
class Written:
    """A completed :func:`write`: what :func:`commit` (coordinator) needs.

    Attributes:
        files: per rank, file name -> ``(size, digest)`` of the files that rank wrote
            (coordinator only; empty elsewhere).
        parts: per rank, the fingerprint parts it handed in (what it wrote, plus every copy of
            drifted replicas; see :func:`distckpt.state.statecheck.parts_to_send`; coordinator only).
        value_digests: flattened key -> sha256 of the bytes stored for each non-tensor item any
            rank wrote (:func:`distckpt.state.values.record_item_digests`; coordinator only).
        drifted: replicated keys whose copies differ -> groups of ranks holding equal copies
            (:func:`distckpt.state.statecheck.name_drift`; coordinator only).
        plan: how the save planned (every rank).
        phases: this rank's seconds per part of the write phase: ``fingerprint``, ``plan``,
            ``replicas`` (drift check), ``write`` (wall time of writing the data files),
            ``metadata`` (gathering results; ``.metadata`` on the coordinator), and inside
            ``write`` the writer threads' ``serialize``, ``checksum``, ``io_write`` and
            ``fsync`` (thread-seconds, see :class:`distckpt.save.writer.WriteTimings`).
    """

    files: list[dict[str, tuple[int, str]]] = field(default_factory=list)
    parts: list[list[Any]] = field(default_factory=list)
    value_digests: dict[str, str] = field(default_factory=dict)
    drifted: dict[str, list[list[int]]] = field(default_factory=dict)
    plan: PlanStats = field(default_factory=PlanStats)
    phases: dict[str, float] = field(default_factory=dict)
    local_errors: list[str] = field(default_factory=list)


# 1. prepare --------------------------------------------------------------------------------------
def prepare(
    opts: SaveOptions,
    step: int,
    state: Mapping[str, Any],
    extra: dict[str, Any],
    rank: int,
    blocking: bool,
    cache: PlanCache | None = None,
    safe_types: safetypes.SafeTypesLike = None,
    peek: bool = False,
) -> tuple[Prepared, SaveView]:
    """(each rank, no collectives) What to save, and this rank's view for the agreement check.

    ``cache`` (the checkpointer's :class:`~distckpt.save.protocol.PlanCache`, also handed to
    :func:`write`) contributes its token, so that :func:`agree` can tell on every rank alike
    whether the previous save's plans still hold. ``safe_types``: the classes registered with
    ``Checkpointer(safe_types=...)`` (see :func:`distckpt.state.encoded.encode_for_save`).
    ``peek``: the state is taken for a plan only (``prepare_staging``), leaving every object as
    it was (:meth:`~distckpt.state.entries.Entry.peek_state`).
    """
    check_step(step)
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"save(metadata=...) must hold JSON values only: {exc}") from None
    entries = build_entries(state)
    state_dict: dict[str, Any] = {e.name: e.peek_state() if peek else e.save_state() for e in entries}
    # Non-tensor values in the form a load reads (once, here: async staging copies this form);
    # what a load could not read fails this save, on every rank alike (prepare runs in an exchange).
    state_dict = encoded.encode_for_save(state_dict, safe_types)
    check_saveable(state_dict)
    described = {e.name: e.describe() for e in entries}
    if opts.save_rng:
        state_dict[rng.NAMESPACE] = {scope.rank_key(rank): rng.capture()}
        described[rng.NAMESPACE] = {"kind": "rng", "scope": scope.PER_RANK}
    # Entries that are not modules/optimizers get a scope from every rank's digest (after the
    # exchange); sharded DTensor state is written shard by shard and needs none.
    scoped = [e for e in entries if e.scoped and not contains(state_dict[e.name], DTensor)]
    # Modules and optimizers are replicated or sharded by construction: the layout digests say
    # which are replicated (each tensor then gets one writer; async saves stage only their share).
    unscoped = {e.name: state_dict[e.name] for e in entries if not e.scoped}
    digests, sizes = replicated_layout(unscoped)
    flat, mappings = flatten_state_dict(state_dict)
    for key, value in flat.items():
        if isinstance(value, DTensor):
            check_block(value, key)
    # Values digested only where the drift check reads them (module/optimizer entries, a
    # policy that checks, not a prepare_staging peek): a 2M-int list of a sampler's state cost
    # every save 2 s here.
    checks_values = opts.on_replica_drift != "ignore" and not peek
    structure = assign.describe(flat, values_of=frozenset(unscoped) if checks_values else frozenset(), mappings=mappings)
    on_device = frozenset(k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.device.type != "cpu")
    view = SaveView(
        step=step,
        blocking=blocking,
        names=sorted(described),
        digests={e.name: scope.digest(state_dict[e.name]) for e in scoped},
        # Undeclared entries holding a data loader's state are per rank by kind, as the loader
        # itself is (rank 0's view decides, on every rank alike).
        declared={
            e.name: e.declared or (scope.PER_RANK if scope.holds_per_rank_state(state_dict[e.name]) else None) for e in scoped
        },
        layout=digests,
        plain=structure.plain,
        replicas=structure.replicas_digest,
        cache=cache.token(structure.own) if cache is not None else None,
        initialized=sorted(n for n, d in described.items() if d.get("initialized")),
        values=structure.values,
    )
    prepared = Prepared(
        step, state_dict, described, sizes, extra, structure=structure, unscoped=sorted(unscoped), on_device=on_device
    )
    return prepared, view


# 2. agree ----------------------------------------------------------------------------------------
def agree(prepared: Prepared, views: list[SaveView], rank: int, on_drift: str = "ignore") -> None:
    """(each rank, pure) Check the gathered views agree, settle every scoped entry's scope and
    decide who writes each replicated item and whether the cached plans hold
    (:func:`distckpt.save.assign.decide`, into ``prepared.plan``).

    Every rank judges the same gathered views, so an error (different steps or entries, a
    ``Global`` entry that differs) is raised identically everywhere, and every rank takes the
    same planning path.
    """
    if len({(v.step, tuple(v.names)) for v in views}) > 1:
        detail = "; ".join(f"rank {r}: step {v.step}, keys {v.names}" for r, v in enumerate(views))
        raise ValueError(f"ranks called save() with different steps or state keys: {detail}")
    # A save is synchronous on every rank or on none (the same message as before a first async
    # save, where the writer processes' start compares it).
    refuse_different_arguments("save()", [{"blocking": v.blocking} for v in views])
    if len({tuple(sorted(v.digests)) for v in views}) > 1:
        detail = "; ".join(f"rank {r}: {sorted(v.digests)}" for r, v in enumerate(views))
        raise ValueError(f"ranks hold sharded (DTensor) state under different entries: {detail}")
    for name, entry in prepared.described.items():
        if "initialized" in entry:  # (the coordinator's alone said "no state" for a ZeRO rank 0)
            entry["initialized"] = any(name in v.initialized for v in views)
    scopes: dict[str, str] = {}
    for name, declared in views[0].declared.items():
        kind = scope.classify(name, declared, [v.digests[name] for v in views])
        prepared.described[name]["scope"] = kind
        scopes[name] = kind
        if kind == scope.PER_RANK:
            prepared.state_dict[name] = {scope.rank_key(rank): prepared.state_dict[name]}
    drifted = assign.value_drift(views, prepared.unscoped) if on_drift != "ignore" and len(views) > 1 else {}
    if drifted:
        # Before anything is written, on every rank alike (a warning turned into an error too).
        message = (
            f"save of step {prepared.step}: values that are not tensors differ between ranks (a module's extra "
            "state, an optimizer's hyper-parameters ...; DCP writes one copy, which every rank would load): "
            f"{statecheck.describe_drift(drifted)}"
        )
        if on_drift == "error":
            raise statecheck.ReplicaDriftError(message)
        warnings.warn(f"distckpt: {message}", stacklevel=4)
    if prepared.structure is not None:
        prepared.plan = assign.decide(views, prepared.structure, prepared.unscoped, scopes, prepared.sizes, rank)
        prepared.structure = None  # decided; not needed by write (keeps the job small)


# 3. claim ----------------------------------------------------------------------------------------
def check_step(step: object) -> None:
    """``ValueError`` unless ``step`` is a non-negative int (any rank; before anything names its folder)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


def refuse_committed(opts: SaveOptions, step: int) -> None:
    """(coordinator) :class:`~distckpt.errors.StepExistsError` if ``step`` is committed already.

    Part of :func:`claim`; an async save, which claims in its background part, runs it while the
    caller is still blocked (inside :func:`prepare`'s exchange), so that ``save`` itself refuses
    a committed step."""
    if tier_copy(opts.storage, step):
        raise StepExistsError(
            f"step {step} at {opts.storage.display(step_dir(step))} is {TIER_COPY}: this root cannot save step {step} "
            "there (give each job's local_dir a directory of its own)"
        )
    if opts.storage.exists(step_dir(step), MANIFEST_NAME):
        raise StepExistsError(
            f"step {step} is already committed at {opts.storage.display(step_dir(step))}; "
            "saving it again would mix two checkpoints (delete it first or use a new step)"
        )


def claim(opts: SaveOptions, step: int, busy: frozenset[str] = frozenset()) -> ownership.Lease:
    """(coordinator) Refuse a committed step, remove stale leftovers of interrupted saves (but
    not ``busy``: tombstones this checkpointer's reaper is deleting) and create the step directory
    exclusively, under a lease (see :mod:`distckpt.storage.ownership`)."""
    storage = opts.storage
    where = storage.display(step_dir(step))
    refuse_committed(opts, step)
    ownership.remove_stale_leftovers(storage, opts.lease_s, busy)
    # A folder of another tool's under the step's name: local disks refuse to create the step
    # over it anyway, but an object store's exclusive creation is a conditional put of the owner
    # record only, and the save would write into it (and retention later delete its files).
    foreign = ownership.not_distckpts(storage, step_dir(step))
    if foreign is not None:
        raise StepExistsError(f"step {step} cannot be saved: {where} {foreign}; move it out of the checkpoint root or save another step")
    lease = ownership.Lease(storage, step_dir(step), opts.lease_s)
    try:
        lease.acquire()
    except FileExistsError:
        raise StepExistsError(
            f"step {step} at {where} is being written by another writer (its lease is live); "
            "two jobs must not save the same step to one root"
        ) from None
    return lease


# 4. stage ----------------------------------------------------------------------------------------
def stage(opts: SaveOptions, stager: Stager, prepared: Prepared, skip: frozenset[str]) -> None:
    """(each rank, async saves; training is blocked meanwhile) Copy the state into ``stager``'s
    host buffers, leaving out ``skip``: replicated tensors another rank stages and writes.

    Those left-out replicas still get their replica digests here, from the live tensors before
    training changes them, so that replicas that drifted apart are reported as in a blocking
    save: a CRC-32C of each host copy (read once, at several times the speed of the copy it
    replaces), a fingerprint sum on the device for accelerator copies.
    ``on_replica_drift="ignore"`` or ``fingerprint=False`` skips it.

    With ``verify_staging`` (``"auto"``: the tensors on an accelerator; ``True``: every tensor),
    each tensor this rank writes gets its staging digest from the live tensor, here, before
    training can change it; :func:`write` proves the writer serialized the same values.
    """
    live = prepared.state_dict
    staged = stager.stage(live, skip, verify=_staging_checked(opts.verify_staging, prepared))
    prepared.state_dict, prepared.staging_digests = staged.state_dict, staged.digests
    if skip and opts.fingerprint and opts.on_replica_drift != "ignore":
        flat = flatten_state_dict(live)[0]
        prepared.replica_digests = statecheck.copy_digests({k: flat[k] for k in skip if k in flat}, prepared.on_device)


def _staging_checked(mode: bool | str, prepared: Prepared) -> Callable[[str, Any], bool] | None:
    """Which staged tensors ``verify_staging=mode`` proves: those this rank writes (replicated
    plain tensors: its share; DTensors: the blocks it is the designated writer of), on an
    accelerator (``"auto"``) or anywhere (``True``). ``None`` for ``False``."""
    if mode is False:
        return None
    plan = prepared.plan

    def checked(key: str, value: Any) -> bool:
        if isinstance(value, DTensor):
            if not writes_dtensor(value, key):
                return False
            local = value.to_local()
        else:
            writer = plan.writers.get(key) if plan is not None else None
            if writer is not None and writer != plan.rank:
                return False
            local = value
        return mode is True or local.device.type != "cpu"

    return checked


def check_staging(expected: Mapping[str, int], seen: Mapping[str, int], written: set[str], step: int, rank: int) -> None:
    """(each rank) Every tensor this rank wrote that staging digested must have been serialized
    with the same digest (``seen``: what the writer threads computed over each serialized tensor).

    Keys staged but not written here (a block another rank's copy of was kept) are not judged.

    Raises:
        StagingMismatchError: naming the tensors whose written values differ from the state at the
            save call, or that were written without being checked.
    """
    mine = sorted(k for k in expected if k in written)
    differ = [k for k in mine if k in seen and seen[k] != expected[k]]
    unchecked = [k for k in mine if k not in seen]
    if differ or unchecked:
        raise StagingMismatchError.found(step, rank, differ, unchecked)


# 5. write ----------------------------------------------------------------------------------------
def write(opts: SaveOptions, group: Group, prepared: Prepared, cache: PlanCache | None = None) -> Written:
    """(all ranks) Plan, write this rank's data, check it, compare replicas; the coordinator
    writes ``.metadata``. A pipeline of named steps (each timed in ``Written.phases``):

    1. ``plan``: DCP's protocol settles what this rank writes (:class:`~distckpt.save.protocol.SaveRun`);
    2. ``write``: the writer threads write it, observing each tensor (:class:`~distckpt.save.planner.Observe`)
       while, meanwhile, the copies this rank holds but does not write are digested;
    3. ``verify_staging``: every staged tensor written equals the state at the call (:func:`check_staging`);
    4. ``fingerprint``: this rank's fingerprint parts and replica digests;
    5. ``replicas``: one all-reduce compares replicated copies (:func:`_drifted`);
    6. ``metadata``: every rank's outcome, files, parts and item digests gathered; ``.metadata``.

    Collectives (all ranks, in order): the plan gather and scatter, unless every rank reuses
    ``cache``'s plans (``prepared.plan.hit``, decided by :func:`agree`); the replica check's
    all-reduce when replicas are compared; the gather of outcomes and the broadcast of the result.

    Args:
        cache: the plans of the previous save on this rank (the checkpointer's; read and
            replaced here, emptied on failure). ``None``: plan from scratch and keep nothing;
            every rank must pass one, or every rank none.

    Raises:
        CheckpointError: on every rank, naming each failed rank's cause.
    """
    step = prepared.step
    writer = checkpoint_writer(
        opts.storage,
        step_dir(step),
        thread_count=opts.thread_count,
        sync_files=opts.sync_files,
        checksum=opts.checksum,
        skip_record_crc=opts.skip_record_crc,
        prove_copies=opts.verify_staging is not False,
        local_dir=os.path.join(opts.local_dir, step_dir(step)) if opts.local_dir else None,
        local_ranks=opts.local_ranks,
    )
    plan = prepared.plan or PlanInput(rank=group.rank, world_size=group.world_size)
    run = SaveRun(group, writer, plan, cache, f"writing step {step} to {opts.storage.display(step_dir(step))}")
    laps = _Laps()
    # 1. plan (which settles the replicas the ranks compare: see SaveRun._compare_shared_by_parts)
    run.plan(prepared.state_dict)
    compare = _compares_replicas(opts, plan)
    observe = Observe(
        fingerprints=opts.fingerprint,
        compared=_compared_keys(plan) if compare else frozenset(),
        on_device=prepared.on_device,
        staging=prepared.staging_digests,
    )
    run.planner.watch(observe)
    laps("plan")
    item_digests = values.record_item_digests(run.planner)  # non-tensor items, as written
    written_keys = {item.index.fqn for item in run.final.items} if run.final is not None else set()
    # 2. write (and, meanwhile, the copies this rank holds but another writes)
    aside = _in_background(lambda: _held_aside(prepared, written_keys, observe)) if opts.fingerprint else None
    run.write()
    laps("write")
    # 3. verify_staging
    if prepared.staging_digests:
        run.attempt(lambda: check_staging(prepared.staging_digests, run.planner.observed.staging, written_keys, step, group.rank))
        laps("verify_staging")
    # 4. fingerprint parts and replica digests
    # The writer threads left accelerator tensors' sums on their devices: one transfer each now.
    observed = run.planner.observed
    held, copies = run.attempt(lambda: (fingerprint.settled(observed.parts), statecheck.settled_copies(observed.copies))) or ([], {})
    if aside is not None:
        aside_parts, aside_copies = run.attempt(aside) or ([], {})
        held += aside_parts
        copies.update(aside_copies)
        copies.update(prepared.replica_digests)
    laps("fingerprint")
    phases = dict(writer.fs.timings.breakdown())
    # 5. replicas
    drifted = _drifted(group, run, plan, copies, written_keys) if compare else []
    laps("replicas")
    parts: list[fingerprint.Part] = []
    if opts.fingerprint:
        parts = run.attempt(lambda: statecheck.parts_to_send(held, written_keys, plan.writers, plan.dchecked)) or []
    laps("fingerprint")
    # 6. metadata
    drift_copies = {k: copies[k] for k in drifted if k in copies}
    gathered = run.finish((writer.files, parts, item_digests, drift_copies))
    laps("metadata")
    phases.update(laps.seconds)
    local_errors = writer.fs.local_errors
    if gathered is None:
        return Written(plan=run.stats, phases=phases, local_errors=local_errors)
    files = [g[0] for g in gathered]
    files[0] = writer.files  # the coordinator's, now with .metadata
    merged = {k: v for g in gathered for k, v in g[2].items()}  # each item has one writer
    return Written(
        files=files,
        parts=[g[1] for g in gathered],
        value_digests=merged,
        drifted=statecheck.name_drift([g[3] for g in gathered], drifted),
        plan=run.stats,
        phases=phases,
        local_errors=local_errors,
    )


class _Laps:
    """Seconds per named step, accumulated (a step may be timed in several laps)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._clock
        self._clock = now


def _compares_replicas(opts: SaveOptions, plan: PlanInput) -> bool:
    """Whether this save compares replicated copies: with fingerprints, unless told to ignore
    drift, and only where some rank's copy is not the only one."""
    return (
        opts.fingerprint
        and opts.on_replica_drift != "ignore"
        and plan.world_size > 1
        and bool(plan.checked or plan.dchecked)
    )


def _compared_keys(plan: PlanInput) -> frozenset[str]:
    return frozenset(plan.checked) | frozenset(k for k, _ in plan.dchecked or [])


def _held_aside(
    prepared: Prepared, written: set[str], observe: Observe
) -> tuple[list[fingerprint.Part], dict[str, statecheck.Copy]]:
    """(a background thread, during the write) What this rank holds but another rank writes:
    digests of the compared copies, fingerprint parts of the rest (where a later comparison
    needs them, :func:`statecheck.parts_to_send` keeps them). (Async saves: the replicas it did
    not stage were digested while staging.)"""
    others = {k: v for k, v in flatten_state_dict(prepared.state_dict)[0].items() if k not in written}
    digested = {k: v for k, v in others.items() if k in observe.compared}
    rest = {k: v for k, v in others.items() if k not in digested}
    return fingerprint.local_parts(rest), statecheck.copy_digests(digested, observe.on_device)


def _drifted(
    group: Group, run: SaveRun, plan: PlanInput, copies: Mapping[str, statecheck.Copy], written: set[str]
) -> list[str]:
    """(all ranks, one all-reduce) Replicated keys whose copies differ (:func:`statecheck.replica_vector`).
    Every rank contributes a vector of the same length, even one that failed (empty slots)."""
    dchecked = plan.dchecked or []
    vector = run.attempt(lambda: statecheck.replica_vector(copies, plan.checked, dchecked, written))
    if vector is None:
        vector = statecheck.replica_vector({}, plan.checked, dchecked, set())
    summed = group.all_reduce(vector)
    run.stats.collectives += 1
    return statecheck.replica_mismatches(summed, plan.checked, dchecked, plan.world_size)


def _in_background(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``fn`` in a thread; the returned callable waits for it and returns (or raises) its
    result. For torch work that releases the GIL while the writer threads run."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            box["error"] = exc

    thread = threading.Thread(target=run, name="distckpt-fingerprint", daemon=True)
    thread.start()

    def result() -> Any:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result


# 6. commit ---------------------------------------------------------------------------------------
def commit(
    opts: SaveOptions,
    world_size: int,
    prepared: Prepared,
    written: Written,
    lease: ownership.Lease | None,
    job: str | None = None,
) -> Manifest:
    """(coordinator) Write the manifest, exclusively: the step is committed once it exists.
    ``job``: the job recorded as its owner (:mod:`distckpt.storage.lineage`).

    Raises:
        StepExistsError: another writer took the step over or committed it first.
    """
    step, storage = prepared.step, opts.storage
    merged: dict[str, FileRecord] = {}
    for per_rank in written.files:
        for name, (size, digest) in per_rank.items():
            merged[name] = FileRecord(size, digest if opts.checksum else None)
    meta = storage.read_bytes(step_dir(step), ".metadata")
    merged[".metadata"] = FileRecord(len(meta), digest_of(meta, opts.checksum))
    manifest = Manifest(
        step=step,
        world_size=world_size,
        entries=prepared.described,
        files=merged,
        checksum_algorithm=opts.checksum,
        torch_version=torch.__version__,
        distckpt_version=__version__,
        extra=prepared.extra,
        fingerprints=statecheck.record(written.parts, opts.on_replica_drift, step, written.drifted) if opts.fingerprint else {},
        fingerprint_version=fingerprint.VERSION,
        job=job,
        value_digests=dict(sorted(written.value_digests.items())),
        root=storage.identity(),
    )
    where = storage.display(step_dir(step))
    if lease is not None and not lease.still_mine():
        if not storage.exists(step_dir(step), ownership.OWNER_NAME):
            # Nobody's record: the folder (or the whole root) was deleted while the step was
            # written, and the writes made it again. Not another writer's doing.
            raise CheckpointError(
                f"step {step} at {where} was not committed: its owner record is gone (the step directory or the root "
                "was deleted while the step was being written)"
            )
        raise StepExistsError(f"step {step} at {where}: another writer took it over")
    try:
        storage.write_bytes(manifest.to_json(), step_dir(step), MANIFEST_NAME, exclusive=True)
    except FileExistsError:
        raise StepExistsError(f"step {step} at {where} was committed by another writer") from None
    return manifest


# 7. retention ------------------------------------------------------------------------------------
def apply_retention(
    opts: SaveOptions,
    reaper: Reaper | None = None,
    owned: Callable[[int], bool] | None = None,
    keep: Callable[[int], bool] | None = None,
    forget: Callable[[int], None] | None = None,
    what: str = "retention",
    then: str = "the next save retries it",
) -> None:
    """(coordinator) Delete this job's committed steps beyond ``keep_last`` (``owned``: which are
    this job's; ``None``: all; ``keep``: steps kept for now; ``forget``: see
    :func:`~distckpt.storage.retention.delete_old_steps`); warn, never fail, on errors. With
    ``reaper``, their files are unlinked in its thread (see :class:`~distckpt.storage.retention.Reaper`).

    Runs after the manifest committed the step: whatever fails here (listing the root, reading
    an old step's manifest to tell whose it is) is a warning, never the save's error. Raised,
    it reported a committed save as failed; a retry of the step then met ``StepExistsError``,
    and the local tier and replica never got the step."""
    try:
        delete_old_steps(opts.storage, opts.keep_last, reaper, owned, keep, forget)
    except Exception as exc:  # noqa: BLE001 - the step is committed; the next save's retention retries
        message = f"distckpt: {what} on {opts.storage.display()} failed: {exc} ({then})"
        try:
            warnings.warn(message, stacklevel=2)
        except Exception:  # noqa: BLE001 - warnings turned into errors (-W error): still never the save's
            log.warning(message)
