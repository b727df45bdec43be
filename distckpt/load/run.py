"""The load driver of a checkpointer: find the step, plan, judge, read, apply and check.

:func:`load` runs :mod:`distckpt.load.phases` in their order (all ranks, collective): the
coordinator reads and verifies the step's manifest and ``.metadata`` once and hands them to every
rank; each rank plans what its objects hold, the ranks agree on what matches, each reads its part
(:func:`~distckpt.load.phases.read`) and hands it to its objects; then the state check
(:mod:`distckpt.load.verify`) proves the loaded state equals the saved one where the rules say so.
:func:`locate` (any rank, not collective) finds a committed step in the tiers (the root, then the
replica).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from distckpt._dist import Group, exchange, on_coordinator
from distckpt._process import refuse_different_arguments
from distckpt.errors import CheckpointError, StateMismatchError, StepDeletedError
from distckpt.integrity.manifest import MANIFEST_NAME, TIER_COPY, Manifest, committed_steps, read_manifest, step_dir, tier_copy
from distckpt.integrity.stepfiles import deleted_while, kept, read_metadata
from distckpt.load import verify
from distckpt.load.phases import (
    LoadPlan,
    LoadReport,
    LoadView,
    Selection,
    apply_load,
    judge,
    metadata_index,
    plan_load,
    refuse_meta,
    refuse_overlapping,
    sharing_memory,
    read,
    requested_keys,
)
from distckpt.load.planner import SafeLoadPlanner
from distckpt.load.reader import checkpoint_reader
from distckpt.options import CheckpointerOptions, flag
from distckpt.state import values
from distckpt.storage.base import Storage
from distckpt.storage.stream import Streams


@dataclass
class Loaded:
    """What one load gave: the step, where it was read from, its manifest and the report."""

    step: int
    storage: Storage
    manifest: Manifest
    report: LoadReport


@dataclass(frozen=True)
class Planned:
    """One rank's plan of a load, made before the load (:func:`plan_ahead`): the fast recovery
    tier plans which files each node needs, and the load then reuses that plan instead of
    planning again (DCP's planning of a sharded state is a tenth of a local-tier recovery).
    Valid only for the same ``state``, ``metadata`` object and selection it was made with."""

    plan: LoadPlan
    view: LoadView
    metadata: Metadata
    items: tuple[ReadItem, ...]  # DCP's local read plan of ``plan.request``
    files: frozenset[str]  # the step's files those items read (relative names)


def locate(
    tiers: Sequence[Storage], step: int | None, eligible: Callable[[Storage, int], bool] | None = None
) -> tuple[Storage, int]:
    """(any rank, not collective) Which tier holds ``step`` (default newest; with ``eligible``,
    the newest it accepts: a named job resumes its own steps): the root first, then the replica.

    Raises:
        FileNotFoundError: no root (a missing bucket named as such), no committed step, or
            ``step`` incomplete or absent (named).
        ValueError: ``step`` is not an int.
        CheckpointError: ``step=None`` without ``eligible``, the root holds no committed step and
            the replica holds several jobs' steps (which is this run's cannot be told).
    """
    root = tiers[0]
    if step is None:
        others = False
        for storage in tiers:
            steps = committed_steps(storage)
            if storage is not root and eligible is None and steps:
                refuse_several_jobs(root, storage, steps)
            for s in reversed(steps):
                if eligible is None or eligible(storage, s):
                    return storage, s
            others = others or bool(steps)
        if not any(s.root_exists() for s in tiers):
            root.check_bucket()  # (a misspelled bucket is named, not taken for a new root)
            raise FileNotFoundError(f"checkpoint root {root.display()} does not exist")
        if others:
            raise FileNotFoundError(
                f"no committed checkpoint of this job under {' or '.join(s.display() for s in tiers)}: the steps there are "
                "other jobs' (a Checkpointer with a job name resumes only its own; pass step=N to load another's)"
            )
        raise FileNotFoundError(f"no committed checkpoint under {' or '.join(s.display() for s in tiers)}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        # (-1 was looked for as step_-00000001 and named as a missing step)
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    for storage in tiers:
        if storage.exists(step_dir(step), MANIFEST_NAME) and not tier_copy(storage, step):
            return storage, step
    where = root.display(step_dir(step))
    if not any(s.root_exists() for s in tiers):
        root.check_bucket()
        raise FileNotFoundError(f"checkpoint root {root.display()} does not exist")
    if tier_copy(root, step):
        raise FileNotFoundError(f"checkpoint step {step} at {where} is {TIER_COPY}, not a step of this root")
    if root.exists(step_dir(step)):
        raise FileNotFoundError(f"checkpoint step {step} at {where} is incomplete (no {MANIFEST_NAME}); it was never committed")
    raise FileNotFoundError(f"checkpoint step {step} not found at {where} (committed steps: {committed_steps(root)})")


def refuse_several_jobs(root: Storage, replica: Storage, steps: list[int]) -> None:
    """The root holds no committed step, so ``load(step=None)`` would take the replica's newest:
    refused where the replica (which several jobs may share) holds steps of more than one job,
    since a checkpointer without ``job=`` cannot tell which is its own (it would resume another
    job's state and, continuing that job, retire its steps). Reads every step's manifest: only
    on this fallback, a restart whose root is gone.

    Raises:
        CheckpointError: naming each job and its newest step, and the way out.
    """
    newest: dict[str, int] = {}
    for s in steps:  # ascending: each job's newest step ends up recorded
        try:
            job = read_manifest(replica, s).job
        except (OSError, ValueError):  # unreadable or deleted meanwhile: not evidence of a job
            continue
        if job is not None:
            newest[job] = s
    if len(newest) > 1:
        shown = ", ".join(f"job {j!r} (newest step {s})" for j, s in sorted(newest.items(), key=lambda js: -js[1]))
        raise CheckpointError(
            f"{root.display()} holds no committed step, and the replica {replica.display()} holds steps of "
            f"{len(newest)} jobs: {shown}. A Checkpointer without job= cannot tell which is this run's: pass "
            "job=NAME (that job's newest step is resumed) or load(state, step=N)"
        )


#: How many times ``load(step=None)`` moves on to the newest step after the one it was reading
#: was deleted under it (:class:`StepDeletedError`): a job that saves faster than another loads
#: would otherwise keep it retrying.
DELETED_RETRIES = 3


def moving_on(attempt: Callable[[int, Manifest | None], Loaded], step: int | None, strict: bool) -> Loaded:
    """(all ranks) ``attempt(skip, expect)``, a :func:`load` with these ``step`` and ``strict``
    from the tiers (root, replica) after the first ``skip``, of the commit ``expect`` if given.
    A step deleted under it (another job's retention) is a :class:`StepDeletedError` on every
    rank; where :func:`retries` allows, the load is attempted again, with a warning, up to
    :data:`DELETED_RETRIES` times, every rank alike: with ``step=None`` it loads the newest
    committed step; with an explicit step, the step from a later tier (the replica,
    ``replicate_to``) if it holds it, the same commit where the manifest had been read, else the
    deletion is raised (the root's new commit of the step is not read, nor another job's commit
    of it on a shared replica). The error and, where it was raised before the ranks compared
    their arguments, the decision (``exc.retry``, ``exc.skip``) are the coordinator's, so ranks
    passing different ones all attempt the same load and fail alike instead of one retrying
    alone into a collective."""
    deleted: StepDeletedError | None = None
    skip, expect = 0, None
    for n in range(DELETED_RETRIES + 1):
        try:
            return attempt(skip, expect)
        except StepDeletedError as exc:
            if not getattr(exc, "retry", retries(step, strict)):
                if deleted is not None and getattr(deleted, "skip", 0):
                    raise StepDeletedError(f"{deleted}; {exc}") from exc
                raise
            if n == DELETED_RETRIES:
                raise StepDeletedError(
                    f"{exc}; the step was deleted under {DELETED_RETRIES + 1} loads in a row: the job "
                    "saving to this root retires steps faster than they load (keep_last larger, or load a step it keeps)"
                ) from exc
            if getattr(exc, "skip", 0):  # the same commit, from the tiers after the one it left
                skip, expect = skip + exc.skip, exc.expect  # type: ignore[attr-defined]
                instead = f"step {step} from the replica"
            else:
                instead = "the newest committed step"
            warnings.warn(f"distckpt: {exc}; loading {instead} instead", stacklevel=3)
            deleted = exc
        except FileNotFoundError as exc:
            # The step, deleted from the root, is not in the replica either (never uploaded, or
            # retired there too): the deletion is what happened to it. Decided by the
            # coordinator's ``skip``, so every rank (whatever step it passed) raises the same.
            if deleted is None or not getattr(deleted, "skip", 0):
                raise
            raise StepDeletedError(f"{deleted}; the replica does not hold it either") from exc
    raise AssertionError("unreachable")  # the loop returns or raises


def retries(step: int | None, strict: bool, tier: int = 0, tiers: int = 1) -> bool:
    """Whether a load whose step was deleted under it (while it read tier ``tier`` of ``tiers``:
    the root, then the replica) is attempted again: with ``step=None``, loading the newest
    committed step; with an explicit step, only where a later tier (the replica) may hold it.
    Only strict loads: with ``strict=False`` keys the step read next lacks would keep what the
    failed attempt read into them, reported "missing" but no longer as they were."""
    return strict and (step is None or tier < tiers - 1)


def load(
    group: Group,
    options: CheckpointerOptions,
    tiers: Sequence[Storage],
    state: MutableMapping[str, Any],
    step: int | None,
    strict: bool,
    restore_rng: bool,
    verify_state: bool | None,
    only: str | list[str] | None,
    exclude: str | list[str] | None,
    preread: tuple[Manifest, Any] | None = None,
    planned: Planned | None = None,
    streams: Sequence[tuple[str, int, int]] = (),
    expect: Manifest | None = None,
    eligible: Callable[[Storage, int], bool] | None = None,
    where: str | None = None,
) -> Loaded:
    """(all ranks) Load ``step`` (default newest; ``eligible``: see :func:`locate`) of ``tiers`` into ``state`` in place (see
    :meth:`distckpt.Checkpointer.load` for the arguments and errors). ``preread``: the step's
    manifest and DCP metadata, already read and verified on this rank (every rank passes it, or
    none): the first tier's step is loaded without reading them again. ``planned``: this rank's
    plan of this load (:func:`plan_ahead` with the same state, selection and ``preread``
    metadata; any rank may pass it or not): used instead of planning again. ``streams`` (every
    rank the same, with ``preread``): ``(file, from rank, to rank)`` of files that are not in the
    first tier's directory of the receiving rank but sent by a rank whose directory holds them,
    during the read (the local tier's recovery, :mod:`distckpt.storage.stream`). ``expect``
    (every rank alike): the commit the step must be, its manifest (:func:`moving_on`'s retry of
    a step deleted from the root): another is a :class:`StepDeletedError` saying so. ``where``
    (every rank alike): the step's name in errors, instead of its path (a local tier's copy:
    each node's directory is its own, and an error naming it would differ between ranks)."""
    if preread is not None:
        tier, (manifest, metadata) = 0, preread
    else:
        # One verified read of .metadata (coordinator), handed to every rank; each derives the index.
        tier, manifest, metadata = on_coordinator(group, "load", lambda: _read_index(tiers, step, options.verify, strict, expect, eligible))
    index = metadata_index(metadata)
    storage = tiers[tier]
    where = where or storage.display(step_dir(manifest.step))
    # Every rank alike (pure): a non-tensor item the save recorded must still be one.
    values.check_items_listed(manifest.value_digests, index, storage.display(step_dir(manifest.step), ".metadata"))
    if planned is not None and (preread is None or planned.metadata is not metadata):
        planned = None  # made for other metadata: never trusted for this one
    selected: list[Selection] = []
    explicit = verify_state if verify_state is not None else options.verify_state
    saved_dtypes = {k: md.properties.dtype for k, md in metadata.state_dict_metadata.items() if hasattr(md, "properties")}

    def plan_here() -> Any:
        # Inside the exchange: patterns a rank got wrong (malformed, or matching nothing) fail
        # every rank alike; raised before it, one rank's ``only=[]`` hung the others. So are
        # flags that are no bools (strict='no' was strict, by its truth).
        flag(strict, "load(strict=...)")
        flag(restore_rng, "load(restore_rng=...)")
        if verify_state is not None:
            flag(verify_state, "load(verify_state=...)", "None, True or False")
        refuse_dead_patterns(only, exclude, index, where)
        selected.append(Selection(patterns(only, "only"), patterns(exclude, "exclude"), frozenset(index)))
        plan, view = (planned.plan, planned.view) if planned is not None else plan_load(group, manifest, index, state, restore_rng, selected[0])
        refuse_meta(plan.request, where)
        refuse_overlapping(plan.request, where)
        shares = sharing_memory(plan.request) if explicit is not False else []
        if explicit:
            verify.refuse_unprovable(plan.request, saved_dtypes, manifest.step, where)
        else:
            verify.warn_lossy(plan.request, saved_dtypes, manifest.step, where)
        return plan, (view, arguments(step, strict, verify_state, only, exclude), shares)

    plan, shared = exchange(group, f"load of {where}", plan_here)
    selection = selected[0]
    # In the exchange that exists anyway (no collective of its own): ranks passing different
    # arguments fail alike before anything is read.
    refuse_different_arguments("load()", [a for _, a, _ in shared])
    views = [v for v, _, _ in shared]
    # Keys some rank reads into memory another of its keys shares (the same list on every rank).
    sharing = sorted({k for _, _, keys in shared for k in keys})
    # Digests first; the requested keys themselves only where ranks request different sets.
    requested_set = requested_keys(group, index, plan, views)
    report = judge(manifest.step, index, views, None if strict else plan.names, selection, requested_set)
    if (only or exclude) and not any(selection.key(k) for k in index):
        entries = sorted({k.split(".", 1)[0] for k in index})
        raise ValueError(f"load(only={only!r}, exclude={exclude!r}) selects nothing in {where} (entries: {entries})")
    if strict and not report.clean:
        raise StateMismatchError(
            report.missing, report.unexpected, report.mismatched, f"step {manifest.step} at {where}", report.per_rank,
            unread_on=report.unread_on,
        )
    requested = sorted(requested_set)
    if explicit:  # asked for a proof: refuse before reading if the checkpoint cannot give it
        verify.require_fingerprints(manifest, index, requested, where)
    reader = checkpoint_reader(
        storage,
        step_dir(manifest.step),
        files=manifest.files if options.verify else None,
        checksum=manifest.checksum_algorithm if options.verify else None,
        metadata=metadata,
        thread_count=options.thread_count,
        streams=Streams.plan(group, storage.join(step_dir(manifest.step)), manifest, metadata, streams) if streams else None,
    )
    # Raised on every rank alike, so every rank asks the coordinator: a file missing because the
    # step was deleted under the load is not a damaged checkpoint, nor (without checksums) the
    # values of a step committed anew a diverged state.
    deletion = kept(
        storage, step_dir(manifest.step), manifest, "loaded", catch=(CheckpointError, OSError, StateMismatchError),
        ask=lambda check: on_coordinator(group, f"load of {where}", check),
        error=lambda why: _deleted(why, step, strict, tier, len(tiers), manifest),
    ) if preread is None else contextlib.nullcontext()  # fmt: skip
    with deletion:
        read(
            group,
            where,
            plan.request,
            reader,
            # Non-tensor items' bytes are checked against the manifest before unpickling.
            SafeLoadPlanner(
                value_digests=manifest.value_digests,
                where=where,
                safe_types=options.safe_types,
                local_plan=planned.items if planned is not None else None,
            ),
            then=lambda: apply_load(group, manifest, plan, state),
        )
        if verify.due(explicit, manifest, group.world_size, plan.entries, where):
            verify.check_loaded(group, manifest, plan, requested, where, options.thread_count, saved_dtypes, explicit)
        elif sharing and explicit is None:
            # Destinations sharing memory keep whichever key was read last: checked, so values
            # of the checkpoint that disagree there are an error, never a silent wrong load
            # (verify_state=False opts out of this too).
            verify.check_shared(group, manifest, plan, [k for k in requested if k in set(sharing)], where, options.thread_count, saved_dtypes)
    if not report.clean:
        warnings.warn(
            f"distckpt: partial load of {where}: "
            + StateMismatchError(report.missing, report.unexpected, report.mismatched, per_rank=report.per_rank, unread_on=report.unread_on).describe(skipped=True),
            stacklevel=3,
        )
    return Loaded(manifest.step, storage, manifest, report)


def arguments(
    step: int | None,
    strict: bool,
    verify_state: bool | None,
    only: str | list[str] | None = None,
    exclude: str | list[str] | None = None,
) -> dict[str, object]:
    """The arguments of a load every rank must pass alike: ranks asking for different steps would
    each be served the coordinator's, and different strictness or state checks raise on some
    ranks while the others wait for them. Different selections (``only``/``exclude``) broke the
    exchange of per-rank state on one rank and blamed the other's state ("unexpected keys"), or
    left a ZeRO/FSDP optimizer loaded on some ranks only; they are compared as sets of patterns
    (``"model"`` and ``["model"]``, or a list in another order, agree). Pure and never raising:
    a rank's malformed pattern is refused later, inside the load's exchange, on every rank."""
    return {"step": step, "strict": strict, "verify_state": verify_state, "only": _as_set(only), "exclude": _as_set(exclude)}


def _as_set(value: Any) -> object:
    """A selection argument as the patterns it means (:func:`patterns`), sorted: comparable
    between ranks (its repr where it is malformed: that rank's load raises it anyway)."""
    if value is None:
        return None
    try:
        return sorted(set(patterns(value, "")))
    except (TypeError, ValueError):
        return repr(value)


def plan_ahead(
    group: Group,
    manifest: Manifest,
    metadata: Metadata,
    state: MutableMapping[str, Any],
    restore_rng: bool,
    only: str | list[str] | None,
    exclude: str | list[str] | None,
) -> Planned:
    """(each rank, no collectives) This rank's plan of a :func:`load` of ``state``, made as the
    load makes it, before the load: which files it will read (what the fast recovery tier sends
    a node that lacks them, :mod:`distckpt.storage.local_tier`), and the plan the load reuses
    (``load(planned=...)``). Errors (a pattern that selects nothing ...) are left to the load,
    which raises them on every rank alike."""
    index = metadata_index(metadata)
    selection = Selection(patterns(only, "only"), patterns(exclude, "exclude"), frozenset(index))
    plan, view = plan_load(group, manifest, index, state, restore_rng, selection)
    planner = DefaultLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(plan.request, metadata, is_coordinator=False)
    items = tuple(planner.create_local_plan().items)
    storage = metadata.storage_data
    return Planned(plan, view, metadata, items, frozenset(storage[item.storage_index].relative_path for item in items))


def files_read(
    group: Group,
    manifest: Manifest,
    metadata: Any,
    state: MutableMapping[str, Any],
    restore_rng: bool,
    only: str | list[str] | None,
    exclude: str | list[str] | None,
) -> set[str]:
    """(each rank, no collectives) The files of a step a :func:`load` of ``state`` on this rank
    would read (relative names), planned as the load plans (see :func:`plan_ahead`)."""
    return set(plan_ahead(group, manifest, metadata, state, restore_rng, only, exclude).files)


def _read_index(
    tiers: Sequence[Storage],
    step: int | None,
    check: bool,
    strict: bool,
    expect: Manifest | None = None,
    eligible: Callable[[Storage, int], bool] | None = None,
) -> tuple[int, Manifest, Any]:
    """(coordinator) Tier, manifest and the DCP metadata of a step, read once and verified
    (``check``), then handed to every rank: no rank reads it again, none unverified. The key
    index is derived by each rank (``metadata_index``) instead of travelling beside it. A step
    deleted meanwhile is a :class:`StepDeletedError` carrying whether the load moves on
    (:func:`_deleted`: decided here, before the ranks compared their arguments); so is a step
    that is not the commit ``expect``."""
    storage, found = locate(tiers, step, eligible)
    tier = list(tiers).index(storage)
    try:
        manifest = read_manifest(storage, found)
    except FileNotFoundError:  # there a moment ago: deleted since
        raise _deleted(deleted_while(storage, step_dir(found), found, "loaded"), step, strict, tier, len(tiers), None) from None
    if expect is not None and manifest != expect:
        job = f" (job {manifest.job})" if manifest.job else ""
        raise _deleted(
            f"{storage.display(step_dir(found))} holds another commit of step {found}{job} than the one that was "
            "being loaded: not loaded in its place", step, strict, tier, len(tiers), None, retry=False,
        )  # fmt: skip
    with kept(storage, step_dir(found), manifest, "loaded", catch=(CheckpointError, OSError),
              error=lambda why: _deleted(why, step, strict, tier, len(tiers), manifest)):  # fmt: skip
        metadata = read_metadata(storage, manifest, verify=check)
    return tier, manifest, metadata


def _deleted(
    message: str, step: int | None, strict: bool, tier: int, tiers: int, manifest: Manifest | None, retry: bool = True
) -> StepDeletedError:
    """A :class:`StepDeletedError` of a step deleted from tier ``tier`` of ``tiers`` (its
    ``manifest`` where it was read), carrying for :func:`moving_on` whether the load moves on
    (``retry``: :func:`retries`), how many tiers the next attempt skips (``skip``: an explicit
    step is read from the tiers after the one it left) and the commit it must find there
    (``expect``). Raised on the coordinator before the ranks compared their arguments, they are
    the coordinator's for every rank: ranks passing different steps then all attempt the same
    load, and fail alike."""
    if retry and not strict and retries(step, True, tier, tiers):
        # What a strict load would have done by itself, the caller may do knowingly.
        instead = "the newest committed step" if step is None else f"step {step} from the replica, where it holds it"
        message += (
            f"; a load with strict=False is not attempted again by itself (keys the next attempt lacks would keep "
            f"what this one read into them): call load again to read {instead}"
        )
    exc = StepDeletedError(message)
    # They travel with the error (pickled with its __dict__ from the coordinator).
    exc.retry = retry and retries(step, strict, tier, tiers)  # type: ignore[attr-defined]
    exc.skip = tier + 1 if exc.retry and step is not None else 0  # type: ignore[attr-defined]
    # Deleted before its manifest was read: whatever commit the replica holds, as a load begun a
    # moment later would read it (locate falls back to the replica for a step the root lacks).
    exc.expect = manifest if exc.skip else None  # type: ignore[attr-defined]
    return exc


def patterns(value: str | list[str] | None, what: str) -> tuple[str, ...]:
    """``load(only=/exclude=)`` as a tuple of patterns (``ValueError`` for an empty or non-string one)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(p, str) and p for p in items):
        raise ValueError(f"load({what}=...) takes a non-empty pattern or list of patterns, got {value!r}")
    return tuple(items)


def refuse_dead_patterns(only: Any, exclude: Any, index: Mapping[str, Any], where: str) -> None:
    """(every rank, pure) ``ValueError`` naming each ``only``/``exclude`` pattern that matches no
    entry name and no key of the checkpoint: a typo (``exclude="optm"``) must not load what it
    was meant to leave out, nor one dead name in a list (``only=["model.weight", "model.bais"]``)
    go unnoticed beside one that matches."""
    names = set(index) | {k.split(".", 1)[0] for k in index}
    dead = [
        f"{what}={p!r}"
        for what, value in (("only", only), ("exclude", exclude))
        for p in patterns(value, what)
        if not any(fnmatchcase(n, p) for n in names)
    ]
    if dead:
        entries = sorted({k.split(".", 1)[0] for k in index})
        raise ValueError(
            f"load({', '.join(dead)}): {'this pattern matches' if len(dead) == 1 else 'these patterns match'} "
            f"nothing in {where} (entries: {entries}; patterns are fnmatch-style, matched against entry names and keys)"
        )
