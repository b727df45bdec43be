"""The save driver of a checkpointer: one save after another, sync or async, through the phases.

:class:`SaveDriver` runs :mod:`distckpt.save.phases` in their order for every ``save`` and owns
what lives from save to save: the staging buffers (:class:`~distckpt.save.staging.Stager`), the
writer process (:class:`~distckpt.save.background.WriterProcess`), the plans of the previous save
(:class:`~distckpt.save.protocol.PlanCache`), the in-flight async save, the step's lease and the
reaper of retired steps. Which ranks call what: every method is collective (all ranks, same
order) except :attr:`SaveDriver.in_flight`.

An async save: phases 1-2 and staging while the caller is blocked, then a thread of this process
runs the claim, the write (here, or in the writer process) and the commit; :meth:`SaveDriver.wait`
joins it and raises its error on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from distckpt._dist import INTERRUPTS, Group, all_ranks, exchange, on_coordinator
from distckpt._process import GroupHolder, background_threads, gc_paused, lower_priority, same_arguments, signals_held
from distckpt.errors import CheckpointError, one_line
from distckpt.integrity.manifest import check_extra, step_dir
from distckpt.options import CheckpointerOptions
from distckpt.save import phases
from distckpt.save.background import Job, WriterProcess, encode
from distckpt.save.protocol import PlanCache, PlanStats
from distckpt.save.staging import Stager, replicated_shares
from distckpt.storage import ownership
from distckpt.storage.base import Storage
from distckpt.storage.lineage import Lineage
from distckpt.storage.local_tier import LocalTier
from distckpt.storage.replica import Replicator
from distckpt.storage.retention import Reaper

log = logging.getLogger("distckpt")


@dataclass
class SaveStats:
    """Timing of one save, as seen by this rank.

    Attributes:
        step: the step saved.
        blocking_s: time ``save`` blocked the caller (staging only, for async saves).
        total_s: time from the call until the checkpoint was committed.
        bytes_written: bytes of all ranks' files (the checkpoint's size).
        staged_bytes: host memory this rank's staging buffers hold after an async save (each
            rank stages only its share of replicated state); 0 for a blocking save.
        plan: how the save planned (:class:`~distckpt.save.protocol.PlanStats`: whether it reused
            the previous save's plans, the bytes of plans gathered, the coordinator's time).
        phases: seconds per phase on this rank: ``prepare`` (state dict, views, agreement),
            ``claim`` (the step directory), ``stage`` (async), then the write phase's parts
            (``fingerprint``, ``plan``, ``replicas``, ``write`` and inside it the writer threads'
            ``serialize``/``checksum``/``io_write``/``fsync`` thread-seconds, and in a sync save
            of accelerator state ``d2h_issue``/``d2h_wait``/``proof_wait``, its copies to host
            memory (:data:`distckpt.save.d2h.PARTS`), ``metadata``, ``verify_staging``; for an
            async save measured in its writer) and ``commit`` (manifest and retention).
    """

    step: int
    blocking_s: float
    total_s: float | None = None
    bytes_written: int | None = None
    staged_bytes: int = 0
    plan: PlanStats | None = None
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def throughput_gbps(self) -> float | None:
        if not self.total_s or not self.bytes_written:
            return None
        return self.bytes_written / self.total_s / 1e9


class _InFlight:
    """The background half of one asynchronous save."""

    def __init__(self, step: int, stats: SaveStats) -> None:
        self.step = step
        self.stats = stats
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # Set by the thread as its last act. Waited on instead of Thread.join: before Python 3.13
        # a join ended by KeyboardInterrupt marks the thread stopped while it still runs
        # (is_alive() False, later joins return at once), so nothing else would be waited for.
        self.done = threading.Event()
        self.seq = 0  # the order of its save() call among this driver's (SaveDriver._report)
        # What of its report is done (SaveDriver._report): a call interrupted half-way (Ctrl-C,
        # a signal handler's own wait) leaves the rest to the next wait(), which finishes it.
        self.recorded = False
        self.submitted = False

    def wait(self) -> None:
        """Until the thread has finished (interruptible: a KeyboardInterrupt leaves it in flight)."""
        if self.thread is not None:
            if self.thread.ident is None:
                # Published, but an interrupt landed before it was started: the blocked part
                # was done on every rank, so the save goes on (never started, this waited forever).
                self.thread.start()
            self.done.wait()
            self.thread.join()

    @property
    def running(self) -> bool:
        return self.thread is not None and not self.done.is_set()


class SaveDriver:
    """Saves of one checkpointer (see the module doc).

    Args:
        options: the checkpointer's options.
        storage: its root.
        groups: its process group (created on first use).
        lineage: which committed steps are this job's (retention, the manifest's ``job``).
        replica: where committed steps are uploaded, if anywhere.
        local: the node-local recovery tier every committed step is also kept in, if any.
    """

    def __init__(
        self,
        options: CheckpointerOptions,
        storage: Storage,
        groups: GroupHolder,
        lineage: Lineage,
        replica: Replicator | None,
        local: LocalTier | None = None,
    ) -> None:
        self.options = options
        self.local = local
        self.storage = storage
        self.groups = groups
        self.lineage = lineage
        self.replica = replica
        self.opts = options.save_options(storage)
        self.stager: Stager | None = None
        self.writer: WriterProcess | None = None
        # The plans of the last successful save: repeated saves of one structure skip planning.
        self.plan_cache = PlanCache()
        self.inflight: _InFlight | None = None
        #: Whether this rank is inside a save's blocked collectives (from its prepare to its
        #: commit, or to the start of its background part): an interrupt escaping then leaves
        #: the ranks out of step (see Checkpointer._steps_kept).
        self.in_collectives = False
        #: An interrupt in the coordinator's retention, raised once the blocking save is reported.
        self._deferred_interrupt: BaseException | None = None
        self.lease: ownership.Lease | None = None
        # Deletes retired steps' files in the background (coordinator; see storage.retention).
        self.reaper = Reaper()
        self.last_save: SaveStats | None = None
        self._calls = 0  # save() calls so far (their order: see _report)
        self._recorded_seq = 0  # the call whose stats last_save holds
        self._committed_here: int | None = None  # (coordinator) the step this driver committed last
        self._generation: int | None = None  # (GroupHolder.generation of the group saves use)

    # -- the calls -------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], blocking: bool, metadata: Mapping[str, Any] | None) -> None:
        """(all ranks) Phases 1-7 of one save (async: the caller returns after staging)."""
        t0 = time.perf_counter()
        self.wait()  # the previous async save (outside the GC pause: it may take long)
        self._deferred_interrupt = None  # (one an earlier save left, interrupted again, is not this one's)
        with gc_paused(), self._collectives():
            try:
                self._save(t0, step, state, blocking, metadata)
            except Exception:
                self._deferred_interrupt = None  # (the error is raised instead)
                raise

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """Mark this rank inside a call's collectives (``in_collectives``) for its duration. The
        call may clear the mark earlier (a save: at its last collective, or when its background
        job is published). An ``Exception`` is one every rank raised alike, so it clears the mark;
        an interrupt (``BaseException``) keeps it set: this rank may have left its peers in a
        collective (see Checkpointer._steps_kept)."""
        self.in_collectives = True
        try:
            yield
        except Exception:
            self.in_collectives = False
            raise
        self.in_collectives = False

    def prepare_staging(self, state: Mapping[str, Any]) -> None:
        """(all ranks) Plan as a save of ``state`` would, and reserve its staging buffers in the
        background (:meth:`~distckpt.save.staging.Stager.reserve`); waits for an in-flight save
        first. The failure of an earlier reservation is raised here, on every rank."""
        self.wait()
        with gc_paused(), self._collectives():
            self._prepare_staging(state)

    def _prepare_staging(self, state: Mapping[str, Any]) -> None:
        """(all ranks) :meth:`prepare_staging` after the in-flight save is joined."""
        group = self._current_group()
        prepared, views = exchange(
            group,
            "prepare_staging",
            lambda: phases.prepare(self.opts, 0, state, {}, group.rank, False, None, safe_types=self.options.safe_types, peek=True),
        )
        phases.agree(prepared, views, group.rank)
        skip = replicated_shares([v.layout for v in views], prepared.sizes, group.rank)
        in_process = self._writes_in_process(group)
        if in_process:
            # Started now, its interpreter's start-up (seconds: Python, torch) runs beside
            # training instead of delaying the first async save's commit.
            self._start_writer(group)
        stager = self._stager(in_process)
        # A previous reservation's failure surfaces here (or the state's): on every rank alike.
        all_ranks(group, "prepare_staging", lambda: stager.reserve(prepared.state_dict, skip))

    @property
    def in_flight(self) -> bool:
        """(any rank, never blocks) Whether an async save is still writing on this rank."""
        job = self.inflight
        return job is not None and job.running

    @property
    def in_flight_step(self) -> int | None:
        """(any rank, never blocks) The step of the async save begun and not yet joined (by
        :meth:`wait` or the next save), written or not; ``None`` if none."""
        job = self.inflight
        return job.step if job is not None else None

    def wait(self) -> SaveStats | None:
        """(all ranks) Join the in-flight save; its stats, or ``None`` if none was in flight.
        Raises its error, identically on every rank."""
        job = self.inflight
        if job is None:
            return None
        # In flight until it has finished: a KeyboardInterrupt (or a signal handler's exception)
        # ending this wait leaves the save to the next call, which waits again. Forgotten here,
        # the next save staged into the buffers this one was still writing (step N committed
        # holding N+1's values) or, with writer processes, ran its collectives beside it.
        job.wait()
        if self.inflight is not job:
            # A signal handler's save joined and reported it while this call was waiting, and
            # may have started the next save (in flight now): nothing of either is this call's.
            return job.stats if job.error is None else None
        if job.error is not None:
            self.inflight = None
            # The error is the same on every rank, so every rank restarts its writer process
            # at the next async save (a writer whose peers failed may be left in a broken group).
            self.stop_writer()
            raise job.error
        # Reported before it stops counting as in flight (its upload submitted: replica.wait), and
        # part by part: an interrupt inside leaves the rest to the next wait(); a signal handler's
        # wait() meanwhile finishes what is missing.
        try:
            self._report(job.stats, job.seq, job)
        except Exception:
            # An error (not an interrupt) would fail every later call the same way: the save is
            # committed, its report given up (as before the report was resumable).
            if self.inflight is job:
                self.inflight = None
            raise
        if self.inflight is job:  # (a handler's save meanwhile is in flight now: kept)
            self.inflight = None
        return job.stats

    def close(self) -> None:
        """(all ranks) Release what lives between saves (call :meth:`wait` first)."""
        self.reaper.drain()
        self.stop_writer()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def retire_uploaded(self) -> None:
        """(all ranks, at close, once the replica's uploads ended; acts on the coordinator) The
        root's retention that uploads still to come held back at the last commit
        (:meth:`~distckpt.storage.replica.Replicator.holds`): without it the root kept every such
        step beyond ``keep_last`` after the job ended, until the next run's first save. Warns,
        never raises (see :func:`~distckpt.storage.retention.delete_old_steps`)."""
        step, replica = self._committed_here, self.replica
        if step is None or replica is None or self.opts.keep_last is None:
            return
        # (warns where it fails, e.g. the root unreachable by now: the next run's saves retire them)
        phases.apply_retention(
            self.opts, self.reaper, lambda s: self.lineage.owns(self.opts.storage, s),
            # Never what it saved last (a resume from an older step), nor a step the replica
            # keeps that it lacks (an upload that failed: the next run's retention uploads it).
            keep=lambda s: s == step or replica.holds(s, step),
            forget=lambda s: self.lineage.forget(self.opts.storage, s),
            what="retention at close", then="the next run's saves retire those steps",
        )  # fmt: skip

    def stop_writer(self) -> None:
        """Stop the writer process; a new one gets fresh staging buffers (nothing of a failed
        save is reused)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
            if self.stager is not None and self.stager.shared:
                self.stager.close()
                self.stager = None

    # -- one save ------------------------------------------------------------------------------
    def _current_group(self) -> Group:
        """(all ranks) The group of a save; where it was made anew since the last save (the job's
        process group destroyed, or made again), the writer and the plans of the old one go."""
        group = self.groups.get(save=True)
        for storage in (self.storage, *([self.replica.remote] if self.replica is not None else [])):
            storage.refuse_unshared(group.world_size, "save")
        if self._generation != self.groups.generation:
            if self._generation is not None:
                self.stop_writer()  # (its writers formed a group with the old job's)
                self.plan_cache = PlanCache()
            self._generation = self.groups.generation
        return group

    def _save(self, t0: float, step: int, state: Mapping[str, Any], blocking: bool, metadata: Mapping[str, Any] | None) -> None:
        group = self._current_group()
        opts = replace(self.opts, local_ranks=self.groups.local_ranks)  # known once the group is
        writes_in_process = self._writes_in_process(group)
        if writes_in_process and self.writer is None:
            # Before the first async save starts the writer processes (a collective only the
            # ranks saving asynchronously would take): ranks passing different ``blocking``
            # would wait for each other forever. Later saves compare it in the prepare exchange.
            same_arguments(group, "save()", {"blocking": blocking})
        in_process = not blocking and writes_in_process
        if in_process:
            self._start_writer(group)
        # The plans of whoever writes this save: this process, or the writer process.
        plans = self.writer.plans if in_process and self.writer is not None else self.plan_cache
        stats = SaveStats(step, 0.0)
        self._calls += 1
        seq = self._calls
        t1 = time.perf_counter()
        local = self.local
        if local is not None:
            local.nodes_of(group)  # collective the first time: every rank is here

        # Phases 1-3: prepare and agree on every rank, claim on the coordinator (async saves: in
        # the background, after refusing a committed step here).
        def prepare() -> tuple[phases.Prepared, phases.SaveView]:
            extra = check_extra(metadata)  # in the exchange: bad metadata on one rank fails all
            phases.check_step(step)  # before refuse_committed names the step's folder
            if not blocking and group.is_coordinator:
                phases.refuse_committed(opts, step)
            prepared, view = phases.prepare(opts, step, state, extra, group.rank, blocking, plans, safe_types=self.options.safe_types)
            if in_process and self.writer is not None:
                view.writer_exit = self.writer.proc.poll()
            if local is not None:
                # In the exchange, not a collective of its own: an async save's blocked time.
                view.tier_usable = local.usable_for(step)
            return prepared, view

        prepared, views = exchange(group, f"save of step {step}", prepare)
        exited = {r: v.writer_exit for r, v in enumerate(views) if v.writer_exit is not None}
        if exited:
            # A writer that died between saves (the OOM killer, say) would fail this save on every
            # rank: the writers form one group. Every rank restarts its own (the same views on
            # every rank: all do), then prepares again with the new writer's empty plan cache.
            warnings.warn(
                "distckpt: the background writer process of "
                + ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(exited.items()))
                + f" has exited (since the last save, or since prepare_staging started it); every rank restarts its"
                f" writer before saving step {step}",
                stacklevel=4,
            )
            self.stop_writer()
            self._start_writer(group)
            assert self.writer is not None
            plans = self.writer.plans
            prepared, views = exchange(group, f"save of step {step}", prepare)
        phases.agree(prepared, views, group.rank, self.opts.on_replica_drift)
        tier = None
        if local is not None:
            # Every node's tier must be able to take the step (nothing of another root's in the
            # way), or this save keeps no local copy anywhere.
            if all(v.tier_usable for v in views):
                tier = local
            else:
                local.skipped(step)
        if tier is None:
            opts = replace(opts, local_dir=None)
        stats.phases["prepare"] = time.perf_counter() - t1
        if blocking:
            self._claim(group, opts, step, stats, tier)
            try:
                self._write_and_commit(group, opts, prepared, stats, tier=tier, settled=self._collectives_done)
            except INTERRUPTS as exc:
                if self.in_collectives:  # midway: raised now (the checkpointer is out of step)
                    raise
                # After the last collective (the local tier's retention): committed; raised once reported.
                self._deferred_interrupt = self._deferred_interrupt or exc
            self.in_collectives = False  # (an interrupt from here on leaves every rank in step)
            stats.blocking_s = stats.total_s = time.perf_counter() - t0
            self._report(stats, seq)
            deferred, self._deferred_interrupt = self._deferred_interrupt, None
            if deferred is not None:
                raise deferred
            return

        # 4. staging. Each rank stages only its share of replicated tensors (see save.staging).
        stager = self._stager(in_process)
        skip = replicated_shares([v.layout for v in views], prepared.sizes, group.rank)
        t3 = time.perf_counter()
        all_ranks(group, f"staging of step {step}", lambda: phases.stage(opts, stager, prepared, skip))
        # The write phase runs beside training: no more threads than this host's share of cores.
        opts = replace(opts, thread_count=background_threads(self.options.thread_count, self.groups.local_ranks))
        write = self._write_in_process(group, opts, prepared, stager) if in_process else None
        stats.phases["stage"] = time.perf_counter() - t3
        stats.blocking_s = time.perf_counter() - t0
        stats.staged_bytes = stager.nbytes
        job = _InFlight(step, stats)
        job.seq = seq

        def run() -> None:
            try:
                lower_priority(self.options.background_nice)
                self._claim(group, opts, step, stats, tier)
                self._write_and_commit(group, opts, prepared, stats, write, tier)
                stats.total_s = time.perf_counter() - t0
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait() on every rank
                job.error = exc
            finally:
                job.done.set()

        job.thread = threading.Thread(target=run, name=f"distckpt-save-{step}", daemon=True)
        self.inflight = job
        # Published: a wait() starts the thread if an interrupt lands before this start does, so
        # the background collectives its peers run are met (until here, they were not).
        self.in_collectives = False
        job.thread.start()

    def _start_writer(self, group: Group) -> None:
        """(all ranks, collective) Start this rank's writer process unless it runs already
        (:meth:`WriterProcess.start` does not wait for it to be ready)."""
        if self.writer is not None:
            return
        self.writer = WriterProcess.start(
            group,
            timeout=self.options.timeout,
            nice=self.options.background_nice,
            threads=background_threads(self.options.thread_count, self.groups.local_ranks),
        )
        # A checkpointer dropped without close() must not leave its writer running until exit.
        weakref.finalize(self, self.writer.detach)

    def _stager(self, shared: bool) -> Stager:
        if self.stager is None:
            self.stager = Stager(shared=shared)
        return self.stager

    def _writes_in_process(self, group: Group) -> bool:
        """Whether async saves go to a writer process (see ``async_mode``)."""
        if self.options.async_mode != "process" or not self.storage.shared_between_processes:
            return False
        # The writers' group must number ranks as the job does: DTensor meshes name global ranks.
        return not group.enabled or group.world_size == dist.get_world_size()

    def _claim(self, group: Group, opts: phases.SaveOptions, step: int, stats: SaveStats, tier: LocalTier | None = None) -> None:
        """(all ranks) Phase 3: the coordinator creates the step directory under this writer's
        lease; then each node's local tier (``tier``) opens its directory of the step (after the
        claim: a refused save leaves the tier's copy of a committed step alone)."""
        t0 = time.perf_counter()

        def claim() -> None:
            try:
                self.lease = phases.claim(opts, step, self.reaper.busy)
            except (FileNotFoundError, PermissionError):
                raise  # caller mistakes (no such bucket, no access) keep their builtin type
            except OSError as exc:  # e.g. an unreachable store: name the save it stopped
                where = opts.storage.display(step_dir(step))
                raise CheckpointError(f"save of step {step}: could not create {where}: {one_line(exc)}") from exc

        try:
            on_coordinator(group, f"save of step {step}", claim)
            if tier is not None:
                tier.open_step(group, step)
        except BaseException:
            # E.g. Ctrl-C, or a peer's failure in the claim's exchange: the step directory this
            # rank claimed goes (its lease thread would refresh it for the life of the process).
            self._release_lease(committed=False)
            raise
        stats.phases["claim"] = time.perf_counter() - t0

    def _write_in_process(
        self, group: Group, opts: phases.SaveOptions, prepared: phases.Prepared, stager: Stager
    ) -> Callable[[], phases.Written]:
        """(each rank) Phase 5 for the writer process: returns the background thread's ``write``.

        The staged tensors are described by their place in the shared arena (encoded here,
        while training is still blocked, because training may change the state's structure
        once ``save`` returns)."""
        writer, arena = self.writer, stager.arena
        if writer is None or arena is None:
            raise CheckpointError("internal: an async save to a writer process has no writer or no staging arena")
        flat, mappings = encode(prepared.state_dict, arena.tensor)
        job = Job(opts, replace(prepared, state_dict={}), flat, mappings, arena.path, arena.nbytes)

        def write() -> phases.Written:
            def run() -> tuple[phases.Written, None]:
                writer.submit(job)
                return writer.result(), None

            # The writers gathered their outcomes already; this exchange also covers a writer
            # that died, so every rank decides alike whether to commit.
            return exchange(group, f"save of step {prepared.step}", run)[0]

        return write

    def _write_and_commit(
        self,
        group: Group,
        opts: phases.SaveOptions,
        prepared: phases.Prepared,
        stats: SaveStats,
        write: Callable[[], phases.Written] | None = None,
        tier: LocalTier | None = None,
        settled: Callable[[], None] = lambda: None,
    ) -> None:
        """(all ranks) Phases 5-7: write, commit, retention, recorded in ``stats``.

        ``write`` replaces phase 5 (the writer process's). Errors are raised on every rank; on
        any, the lease is released (the coordinator then removes the step directory it created).
        ``settled`` runs once the last collective is done (a blocking save's: see
        ``in_collectives``); the root's retention runs before, inside the commit (an interrupt in
        it deferred: ``_deferred_interrupt``)."""
        try:
            written = write() if write is not None else phases.write(opts, group, prepared, self.plan_cache)
            stats.plan = written.plan
            stats.phases.update(written.phases)
            t0 = time.perf_counter()

            committed_here: list[int] = []  # (coordinator) the manifest's bytes, once written

            def commit() -> tuple[int, bytes | None]:
                manifest = phases.commit(opts, group.world_size, prepared, written, self.lease, self.lineage.job)
                committed_here.append(manifest.total_bytes)
                self._release_lease(committed=True)
                replica, step = self.replica, prepared.step
                self._committed_here = step
                # This number is this job's now, whatever was remembered of it (another job's
                # step of that number, deleted since).
                self.lineage.forget(opts.storage, step)
                try:
                    # Before the outcome goes out: every rank's save returns with retired steps gone.
                    phases.apply_retention(
                        opts, self.reaper, lambda s: self.lineage.owns(opts.storage, s),
                        # Never the step just committed (a resume from an older step saves below the
                        # newest); nor a step the replica keeps whose upload is still to come.
                        keep=lambda s: s == step or (replica is not None and replica.holds(s, step)),
                        forget=lambda s: self.lineage.forget(opts.storage, s),
                    )  # fmt: skip
                except INTERRUPTS as exc:
                    # (a Ctrl-C in a long rmtree) Raised once the save is settled and reported:
                    # raised here, it left the peers waiting for the outcome, and the committed
                    # step unrecorded and never handed to the replica.
                    self._deferred_interrupt = exc
                return manifest.total_bytes, manifest.to_json() if tier is not None else None

            try:
                stats.bytes_written, manifest_json = on_coordinator(group, f"commit of step {prepared.step}", commit)
            except CheckpointError:
                if not committed_here or not group.gone:
                    raise
                # The coordinator committed (every rank had written), and the process group went
                # away before the outcome reached the other ranks: committed here, said so (the
                # other ranks raise, not knowing); recorded, and handed to the replica.
                warnings.warn(
                    f"distckpt: step {prepared.step} is committed, but the process group went away before the other "
                    "ranks heard it (there the save raises; an asynchronous one from wait())",
                    stacklevel=2,
                )
                stats.bytes_written, manifest_json = committed_here[0], None
            stats.phases["commit"] = time.perf_counter() - t0
            if tier is not None and manifest_json is not None:
                t1 = time.perf_counter()
                # Committed at the root: the local tier's failures are warnings (never raised).
                tier.after_commit(group, prepared.step, manifest_json, written.local_errors, settled)
                stats.phases["local_tier"] = time.perf_counter() - t1
            settled()
        finally:
            self._release_lease(committed=False)  # no-op after a commit

    def _collectives_done(self) -> None:
        self.in_collectives = False

    def _release_lease(self, committed: bool) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release(committed)

    def _report(self, stats: SaveStats, seq: int, job: _InFlight | None = None) -> None:
        """A save committed: record it, log it (rank 0) and hand it to the replica. With ``job``
        (an async save), each part once, marked after it is done: called again (the next
        wait() after an interrupt here, or a signal handler's wait() meanwhile), the missing
        parts run. The submit and its mark are one step with the program's signal handlers held
        (see :func:`~distckpt._process.signals_held`): a handler's wait() inside the replica's
        lock deadlocked, and one cut between its parts queued the step twice or never. ``seq``: the
        order of the save() call: ``last_save`` is never replaced by an earlier call's."""
        if job is None or not job.recorded:
            if seq >= self._recorded_seq:
                self.last_save, self._recorded_seq = stats, seq
            group = self.groups.group
            if group is not None and group.rank == 0:
                tp = stats.throughput_gbps
                log.info(
                    "saved step %d: blocked %.3fs, committed after %.3fs%s",
                    stats.step,
                    stats.blocking_s,
                    stats.total_s or 0.0,
                    f", {tp:.2f} GB/s" if tp else "",
                )
            if job is not None:
                job.recorded = True
        if self.replica is not None and (job is None or not job.submitted):
            with signals_held():
                self.replica.submit(stats.step)
                if job is not None:
                    job.submitted = True
