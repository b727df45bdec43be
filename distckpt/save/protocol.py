"""One save's DCP protocol on distckpt's collectives, and the plans repeated saves reuse.

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
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from distckpt._dist import Group, _Failure, capture
from distckpt.errors import CheckpointError, from_causes
from distckpt.save.assign import PlanInput
from distckpt.save.metadata import apply_delta, build_global, encode_plan
from distckpt.save.planner import DistckptSavePlanner
from distckpt.save.writer import CheckpointWriter


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

    def __init__(
        self,
        group: Group,
        writer: CheckpointWriter,
        plan: PlanInput,
        cache: PlanCache | None,
        what: str,
    ) -> None:
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
