"""Saving, phase by phase: the mirror of :mod:`distckpt._loading`.

:meth:`Checkpointer.save <distckpt.Checkpointer.save>` runs these phases in this order; which
ranks call each is part of the protocol:

1. :func:`prepare`   (each rank, no collectives, inside one ``exchange``) checks the caller's
   input and builds DCP's state dict, the manifest's entry descriptions and this rank's
   :class:`SaveView`. Bad input on one rank fails every rank, before any collective of DCP's.
2. :func:`agree`     (each rank, on the gathered views: the same verdict everywhere) checks that
   the ranks agree on step and entries and gives every undeclared entry its scope (global or
   per rank, see :mod:`distckpt.scope`).
3. :func:`claim`     (coordinator, via ``on_coordinator``) refuses a committed step, removes
   stale leftovers of interrupted saves and creates the step directory exclusively, under a
   lease (:mod:`distckpt.ownership`).
4. :func:`stage`     (async saves only; each rank) copies the state into host buffers
   (:class:`~distckpt.staging.Stager`); training resumes after it.
5. :func:`write`     (all ranks, collective) DCP writes the data files and ``.metadata``; every
   rank's outcome, file records and fingerprint parts are gathered, so that a failure on one
   rank is raised on all of them.
6. :func:`commit`    (coordinator) writes the manifest with a no-replace primitive: from then
   on the step exists; then
7. :func:`apply_retention` (coordinator) deletes committed steps beyond ``keep_last``.

A failure after phase 3 releases the lease: the coordinator removes the directory it created.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from . import fingerprint, ownership, rng, scope, statecheck
from ._compat import flatten_state_dict
from ._dist import Group, capture, raise_if_any
from ._version import __version__
from .errors import StepExistsError, from_dcp
from .manifest import MANIFEST_NAME, FileRecord, Manifest, digest_of, parse_step_dir, step_dir
from .retention import delete_old_steps
from .staging import Stager, check_saveable, replicated_layout
from .state import build_entries, contains
from .storage import NEW_DIR_PREFIX, Storage

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


@dataclass
class SaveView:
    """What one rank says about the save it was asked for (exchanged in one collective).

    Attributes:
        step, names: the step and the state's entry names (must agree across ranks).
        digests: scoped entry -> digest of its value on this rank (decides global/per-rank).
        declared: scoped entry -> scope declared by the user or the object's kind, or None.
        layout: per module/optimizer entry, a digest of its plain tensors' keys, shapes and
            dtypes (async saves: ranks agreeing hold the entry replicated, see staging).
    """

    step: int
    names: list[str]
    digests: dict[str, str]
    declared: dict[str, str | None]
    layout: dict[str, str]


@dataclass
class Prepared:
    """One rank's save after :func:`prepare` (and :func:`agree`).

    Attributes:
        step: the step.
        state_dict: what DCP writes (per-rank entries re-keyed by :func:`agree`).
        described: entry name -> its manifest description (kind, scope, ...).
        sizes: ``(flattened key, bytes)`` of plain tensors of modules/optimizers (async only:
            used to split replicated state among the ranks' stagers).
        extra: the caller's JSON metadata for the manifest.
        replica_parts: fingerprint parts of replicated tensors this rank holds but another
            rank stages and writes (async saves, see :func:`stage`), so that replicas are
            compared across ranks even though each rank stages only its share.
    """

    step: int
    state_dict: dict[str, Any]
    described: dict[str, Any]
    sizes: list[tuple[str, int]]
    extra: dict[str, Any]
    replica_parts: list[Any] = field(default_factory=list)


@dataclass
class Written:
    """Every rank's share of a completed :func:`write` (the same on every rank).

    Attributes:
        files: per rank, file name -> ``(size, digest)`` of the files that rank wrote.
        parts: per rank, the fingerprint parts of what that rank wrote.
    """

    files: list[dict[str, tuple[int, str]]] = field(default_factory=list)
    parts: list[list[Any]] = field(default_factory=list)


# 1. prepare --------------------------------------------------------------------------------------
def prepare(
    opts: SaveOptions, step: int, state: Mapping[str, Any], extra: dict[str, Any], rank: int, blocking: bool
) -> tuple[Prepared, SaveView]:
    """(each rank, no collectives) What to save, and this rank's view for the agreement check."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"save(metadata=...) must hold JSON values only: {exc}") from None
    entries = build_entries(state)
    state_dict: dict[str, Any] = {e.name: e.save_state() for e in entries}
    check_saveable(state_dict)
    described = {e.name: e.describe() for e in entries}
    if opts.save_rng:
        state_dict[rng.NAMESPACE] = {scope.rank_key(rank): rng.capture()}
        described[rng.NAMESPACE] = {"kind": "rng", "scope": scope.PER_RANK}
    # Entries that are not modules/optimizers get a scope from every rank's digest (after the
    # exchange); sharded DTensor state is written shard by shard and needs none.
    scoped = [e for e in entries if e.scoped and not contains(state_dict[e.name], DTensor)]
    # Only async saves stage, so only they need the replicated-tensor layout; it covers
    # modules and optimizers, which are replicated or sharded by construction.
    unscoped = {e.name: state_dict[e.name] for e in entries if not e.scoped}
    digests, sizes = ({}, []) if blocking else replicated_layout(unscoped)
    view = SaveView(
        step=step,
        names=sorted(described),
        digests={e.name: scope.digest(state_dict[e.name]) for e in scoped},
        declared={e.name: e.declared for e in scoped},
        layout=digests,
    )
    return Prepared(step, state_dict, described, sizes, extra), view


# 2. agree ----------------------------------------------------------------------------------------
def agree(prepared: Prepared, views: list[SaveView], rank: int) -> None:
    """(each rank, pure) Check the gathered views agree and settle every scoped entry's scope.

    Every rank judges the same gathered views, so an error (different steps or entries, a
    ``Global`` entry that differs) is raised identically everywhere.
    """
    if len({(v.step, tuple(v.names)) for v in views}) > 1:
        detail = "; ".join(f"rank {r}: step {v.step}, keys {v.names}" for r, v in enumerate(views))
        raise ValueError(f"ranks called save() with different steps or state keys: {detail}")
    if len({tuple(sorted(v.digests)) for v in views}) > 1:
        detail = "; ".join(f"rank {r}: {sorted(v.digests)}" for r, v in enumerate(views))
        raise ValueError(f"ranks hold sharded (DTensor) state under different entries: {detail}")
    for name, declared in views[0].declared.items():
        kind = scope.classify(name, declared, [v.digests[name] for v in views])
        prepared.described[name]["scope"] = kind
        if kind == scope.PER_RANK:
            prepared.state_dict[name] = {scope.rank_key(rank): prepared.state_dict[name]}


# 3. claim ----------------------------------------------------------------------------------------
def claim(opts: SaveOptions, step: int) -> ownership.Lease:
    """(coordinator) Refuse a committed step, remove stale leftovers of interrupted saves and
    create the step directory exclusively, under a lease (see :mod:`distckpt.ownership`)."""
    storage = opts.storage
    where = storage.display(step_dir(step))
    if storage.exists(step_dir(step), MANIFEST_NAME):
        raise StepExistsError(
            f"step {step} is already committed at {where}; "
            "saving it again would mix two checkpoints (delete it first or use a new step)"
        )
    _remove_stale_leftovers(storage, opts.lease_s)
    lease = ownership.Lease(storage, step_dir(step), opts.lease_s)
    try:
        lease.acquire()
    except FileExistsError:
        raise StepExistsError(
            f"step {step} at {where} is being written by another writer (its lease is live); "
            "two jobs must not save the same step to one root"
        ) from None
    return lease


def _remove_stale_leftovers(storage: Storage, lease_s: float) -> None:
    for name in storage.list_dirs():
        s = parse_step_dir(name)
        if name.startswith(NEW_DIR_PREFIX):
            # A step directory being built (local roots only): removable once its record is
            # stale, or with no record yet only after a whole lease without change.
            if not storage.exists(name, ownership.OWNER_NAME):
                try:
                    age = time.time() - os.lstat(storage.join(name)).st_mtime
                except OSError:
                    continue
                if age <= lease_s:
                    continue
        elif s is None or storage.exists(name, MANIFEST_NAME):
            continue
        if ownership.is_stale(storage, name, lease_s):
            log.info("removing incomplete checkpoint %s", storage.display(name))
            storage.remove_tree(name)
        else:
            log.info("leaving incomplete checkpoint %s: another writer holds its lease", storage.display(name))


# 4. stage ----------------------------------------------------------------------------------------
def stage(opts: SaveOptions, stager: Stager, prepared: Prepared, skip: frozenset[str]) -> None:
    """(each rank, async saves; training is blocked meanwhile) Copy the state into ``stager``'s
    host buffers, leaving out ``skip``: replicated tensors another rank stages and writes.

    Those left-out replicas are still fingerprinted here, from the live tensors before training
    changes them, so that replicas that drifted apart are reported as in a blocking save. It
    reads each of them once (cheaper than the copy it replaces); ``on_replica_drift="ignore"``
    or ``fingerprint=False`` skips it.
    """
    live = prepared.state_dict
    prepared.state_dict = stager.stage(live, skip)
    if skip and opts.fingerprint and opts.on_replica_drift != "ignore":
        flat = flatten_state_dict(live)[0]
        prepared.replica_parts = fingerprint.local_parts({k: flat[k] for k in skip if k in flat})


# 5. write ----------------------------------------------------------------------------------------
def write(opts: SaveOptions, group: Group, prepared: Prepared) -> Written:
    """(all ranks) DCP writes this rank's data and the coordinator ``.metadata``.

    Raises:
        CheckpointError: on every rank, naming each failed rank's cause.
    """
    step = prepared.step
    writer = opts.storage.writer(
        step_dir(step),
        thread_count=opts.thread_count,
        sync_files=opts.sync_files,
        checksum=opts.checksum,
        skip_record_crc=opts.skip_record_crc,
    )
    outcome: Any = None
    parts: list[Any] = []
    try:
        if opts.fingerprint:
            # What this rank writes (its shards, its share of replicas), in DCP's keys, and
            # (async) the replicas it holds but another rank writes, for the drift comparison.
            parts = fingerprint.local_parts(flatten_state_dict(prepared.state_dict)[0]) + prepared.replica_parts
        dcp.save(
            prepared.state_dict,
            storage_writer=writer,
            planner=DefaultSavePlanner(),
            process_group=group.pg,
            no_dist=not group.enabled,
        )
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        outcome = capture(from_dcp(exc, f"writing step {step} to {opts.storage.display(step_dir(step))}"))
    gathered = group.all_gather((outcome, writer.files, parts))
    raise_if_any([o for o, _, _ in gathered], f"save of step {step}")
    return Written(files=[f for _, f, _ in gathered], parts=[p for _, _, p in gathered])


# 6. commit ---------------------------------------------------------------------------------------
def commit(opts: SaveOptions, world_size: int, prepared: Prepared, written: Written, lease: ownership.Lease | None) -> Manifest:
    """(coordinator) Write the manifest, exclusively: the step is committed once it exists.

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
        fingerprints=statecheck.record(written.parts, opts.on_replica_drift, step) if opts.fingerprint else {},
    )
    where = storage.display(step_dir(step))
    if lease is not None and not lease.still_mine():
        raise StepExistsError(f"step {step} at {where}: another writer took it over")
    try:
        storage.write_bytes(manifest.to_json(), step_dir(step), MANIFEST_NAME, exclusive=True)
    except FileExistsError:
        raise StepExistsError(f"step {step} at {where} was committed by another writer") from None
    return manifest


# 7. retention ------------------------------------------------------------------------------------
def apply_retention(opts: SaveOptions) -> None:
    """(coordinator) Delete committed steps beyond ``keep_last``; warn, never fail, on errors."""
    delete_old_steps(opts.storage, opts.keep_last)
