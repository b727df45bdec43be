"""The :class:`Checkpointer`: collective save/load of a whole training state, sync or async."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from distckpt.save import phases as _saving
from distckpt.state import rng, scope, statecheck, values
from distckpt.storage import ownership
from distckpt._compat import flatten_state_dict
from distckpt._dist import Group, all_ranks, exchange, on_coordinator
from distckpt.load.phases import LoadReport, Selection, apply_load, judge, metadata_index, plan_load, read, requested_keys
from distckpt.load.planner import SafeLoadPlanner
from distckpt.load.verify import diverged_keys
from distckpt.save.plan import PlanCache, PlanStats
from distckpt.errors import CheckpointError, StateMismatchError, one_line
from distckpt.integrity.checksums import ALGORITHMS
from distckpt.integrity.checksums import DEFAULT as DEFAULT_CHECKSUM
from distckpt.integrity.manifest import (
    MANIFEST_NAME,
    Manifest,
    check_extra,
    committed_steps,
    read_manifest,
    read_metadata,
    step_dir,
)
from distckpt.storage.lineage import Lineage
from distckpt.storage.retention import Reaper, check_keep_last
from distckpt.save.background import Job, WriterProcess, encode
from distckpt.save.staging import Stager, replicated_shares
from distckpt.storage.base import Storage

log = logging.getLogger("distckpt")

ASYNC_MODES = ("process", "thread")

# distckpt runs DCP without a process group on purpose when torch.distributed is not initialized
# (single-process use); DCP warns about that on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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
        plan: how the save planned (:class:`~distckpt.save.plan.PlanStats`: whether it reused
            the previous save's plans, the bytes of plans gathered, the coordinator's time).
        phases: seconds per phase on this rank: ``prepare`` (state dict, views, agreement),
            ``claim`` (the step directory), ``stage`` (async), then the write phase's parts
            (``fingerprint``, ``plan``, ``replicas``, ``write`` and inside it the writer threads'
            ``serialize``/``checksum``/``io_write``/``fsync`` thread-seconds, ``metadata``; for an
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


class Checkpointer:
    """Save and resume the complete training state of a (``torchrun``) job.

    Every rank constructs one with the same arguments. ``save``, ``load``, ``wait`` and ``close``
    are collective: every rank of the job calls them, in the same order. ``steps`` and
    ``latest_step`` only read storage, and any rank may call them alone.

    Args:
        root: directory of step checkpoints: a local path or any fsspec URL (``s3://b/prefix``).
        keep_last: keep only the newest ``k`` committed checkpoints (``None``: keep all). Older
            ones are deleted only after a newer one committed; the newest is never deleted.
        storage_options: passed to the fsspec filesystem (endpoint_url, key, secret, ...).
        process_group: the group whose ranks checkpoint together (default: all ranks). By
            default distckpt creates its own group over all ranks, so that its collectives
            (background ones too) never interleave with training collectives on the default
            group. A group passed here is used as is: it must be one no training collective
            runs on while an async save is in flight (e.g. ``new_group(ranks, backend="gloo")``).
        backend: backend of distckpt's own group (``"gloo"``: CPU collectives, safe beside NCCL
            training).
        timeout: timeout of distckpt's collectives; a rank that dies makes the others fail
            after this long instead of hanging.
        thread_count: writer (and reader) threads per rank. An async save's background write
            uses no more than this host's cores per co-located rank (it competes with training
            for memory bandwidth).
        sync_files: fsync local files before committing (object stores commit on close).
        checksum: ``"crc32c"`` (default, hardware CRC-32C), ``"crc32"`` (zlib), ``"sha256"`` or
            ``None``; computed while writing, recorded in the manifest (see :mod:`distckpt.integrity.checksums`).
        save_rng: save every rank's RNG states with each checkpoint.
        background_nice: niceness added to an async save's writer process (or threads), so
            that on a busy machine training keeps the CPU and the save takes what is left (0: off).
        async_mode: where async saves are written. ``"process"`` (default): a writer process per
            rank, fed through shared memory, so serialization, checksums and I/O never take the
            training process's GIL or cores (:mod:`distckpt.save.background`); it starts on the
            first async save. ``"thread"``: a thread of the training process. In-memory
            filesystems (``memory://``), which another process cannot see, and a
            ``process_group`` that is not the whole job use threads.
        verify: on load, check every file read against the manifest's size and checksum
            (:class:`~distckpt.errors.IntegrityError` naming the file on mismatch).
        replicate_to: a second root (e.g. ``s3://...``) every committed checkpoint is uploaded
            to in the background; ``load`` falls back to it when no local copy exists.
        fingerprint: record a sharding-independent fingerprint of every saved tensor in the
            manifest (:mod:`distckpt.state.statecheck`), so that loads can prove what they loaded.
        on_replica_drift: at save, copies of a tensor that should be identical on every rank
            (DDP replicas, global values) but differ: ``"warn"``, ``"error"`` or ``"ignore"``.
        verify_state: after a load, recompute the fingerprints of the loaded state and compare
            them with the saved ones (:class:`~distckpt.state.statecheck.StateDivergedError` on every
            rank if any differ). ``None`` (default): when the world size or any entry's
            parallelism differs from the save's; ``True``/``False``: always/never.
        lease_s: how long an incomplete step directory stays protected from other writers'
            cleanup without a refresh (:mod:`distckpt.storage.ownership`).
        skip_torch_record_crc: leave out the CRC-32 that ``torch.save`` computes for every
            record it writes (most of its CPU time, ~2 GB/s per core) where distckpt's own
            ``checksum`` covers every byte of the file (``torch.load`` does not check it; plain
            ``dcp.load`` reads the files alike). Chosen per record (:mod:`distckpt.save.records`),
            so other ``torch.save`` calls in the process are unaffected. On by default;
            ``False`` writes the CRCs (e.g. for tools that unzip records), as does ``checksum=None``.
        safe_types: Enum, dataclass and NamedTuple classes that values in ``state`` may hold. A
            save stores them by class name and refuses others, naming key and class; a load
            rebuilds only these (:mod:`distckpt.state.values`). Pass the same list on every rank
            and in every job that loads the checkpoints.
        job: the name of this job's saves; ``keep_last`` counts and deletes only the steps of this
            job (several jobs may share a root). ``None`` (default): a full ``load`` continues the
            job of the step it loaded, a checkpointer that saves without loading starts a new one
            (:mod:`distckpt.storage.lineage`).
        verify_staging: every async save proves that what its writer serialized is the state at
            the ``save`` call: a digest of each live tensor is taken while training is blocked
            and compared with a digest of the tensor the writer serializes; a mismatch fails the
            save on every rank (``StagingMismatchError``, raised by ``wait()``), nothing is
            committed. ``"auto"`` (default): for accelerator tensors (digested on the device,
            beside their staging copy); ``True``: host tensors too (a NumPy pass over them while
            training is blocked); ``False``: off.
    """

    def __init__(
        self,
        root: str,
        keep_last: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        backend: str | None = "gloo",
        timeout: timedelta | float = timedelta(minutes=10),
        thread_count: int = 2,
        sync_files: bool = True,
        checksum: str | None = DEFAULT_CHECKSUM,
        save_rng: bool = True,
        verify: bool = True,
        background_nice: int = 10,
        replicate_to: str | None = None,
        replicate_storage_options: Mapping[str, Any] | None = None,
        fingerprint: bool = True,
        on_replica_drift: str = "warn",
        verify_state: bool | None = None,
        lease_s: float = ownership.DEFAULT_LEASE_S,
        skip_torch_record_crc: bool = True,
        async_mode: str = "process",
        verify_staging: bool | str = "auto",
        job: str | None = None,
        safe_types: Sequence[type] = (),
    ) -> None:
        check_keep_last(keep_last)
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root).strip():
            raise ValueError(f"root must be a local path or an fsspec URL, got {root!r}")
        root = os.fspath(root)
        if storage_options and ("://" not in root or root.startswith("file://")):
            raise ValueError(
                f"storage_options configure the filesystem of a URL (s3://..., memory://...); {root!r} is a local path, "
                "where they would be ignored"
            )
        if not (isinstance(verify_staging, bool) or verify_staging == "auto"):
            raise ValueError(f'verify_staging must be "auto", True or False, got {verify_staging!r}')
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode must be one of {ASYNC_MODES}, got {async_mode!r}")
        if checksum is not None and checksum not in ALGORITHMS:
            raise ValueError(f"checksum must be one of {ALGORITHMS} or None, got {checksum!r}")
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if on_replica_drift not in statecheck.DRIFT_POLICIES:
            raise ValueError(f"on_replica_drift must be one of {statecheck.DRIFT_POLICIES}, got {on_replica_drift!r}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s!r}")
        self.fingerprint = fingerprint
        self.verify_staging = verify_staging
        self._lineage = Lineage(job)
        # Validated once (ValueError naming the bad entry). Not in SaveOptions: that is pickled
        # into the writer process's job, where classes defined in __main__ cannot be unpickled;
        # the writer needs none of them (values are encoded before staging).
        self.safe_types = values.SafeTypes.of(safe_types)
        self.on_replica_drift = on_replica_drift
        self.verify_state = verify_state
        self.lease_s = float(lease_s)
        self._lease: ownership.Lease | None = None
        self.storage = Storage(root, dict(storage_options or {}))
        self.keep_last = keep_last
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.skip_torch_record_crc = skip_torch_record_crc
        self.checksum = checksum
        self.save_rng = save_rng
        self.verify = verify
        self.background_nice = background_nice
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self._user_pg = process_group
        self._backend = backend
        self._group: Group | None = None
        self._local_ranks = 1  # ranks of the group on this host (set with the group)
        self.async_mode = async_mode
        self._stager: Stager | None = None
        self._writer: WriterProcess | None = None
        # The plans of the last successful save (see distckpt.save.plan): repeated saves of an
        # unchanged structure skip planning.
        self._plan_cache = PlanCache()
        self._inflight: _InFlight | None = None
        # Deletes retired steps' files in the background (coordinator; see storage.retention).
        self._reaper = Reaper()
        self._closed = False
        self.last_save: SaveStats | None = None
        self.last_load_report: LoadReport | None = None
        self.replica = None
        if replicate_to is not None:
            from distckpt.storage.replica import Replicator

            self.replica = Replicator(
                self.storage,
                Storage(replicate_to, dict(replicate_storage_options or storage_options or {})),
                keep_last,
                # Upload from distckpt's coordinator (the group exists by the first submit).
                is_coordinator=lambda: self._group.is_coordinator if self._group is not None else True,
                owned=self._lineage.owns,
            )
        _live.add(self)

    def __repr__(self) -> str:
        return f"Checkpointer({self.storage.url!r}, keep_last={self.keep_last})"

    # ---------------------------------------------------------------------------------------
    # groups
    def _ensure_group(self) -> Group:
        if self._group is None:
            if not (dist.is_available() and dist.is_initialized()):
                self._group = Group(None)
            elif self._user_pg is not None:
                # Used as given: creating a group over a subset would need every rank of the
                # job, members or not, to call new_group, and non-members never get here.
                self._group = Group(self._user_pg)
            else:
                # A dedicated group: background saves run collectives while training runs its
                # own on the default group; sharing one group deadlocks (torch 2.13).
                try:
                    pg = dist.new_group(backend=self._backend, timeout=self.timeout)
                except Exception as exc:  # e.g. "Wait timeout": a peer died or never called us
                    raise CheckpointError(
                        f"creating distckpt's process group (rank {dist.get_rank()} of {dist.get_world_size()}) failed: "
                        f"a peer rank died or did not call save/load within {self.timeout} ({type(exc).__name__}: {exc})"
                    ) from exc
                self._group = Group(pg)
            self._local_ranks = self._group.ranks_on_this_host()
        return self._group

    def _background_threads(self) -> int:
        """Writer threads of an async save: ``thread_count``, but no more than this host's cores
        per co-located rank. A background writer competes with training for memory bandwidth
        and caches, which niceness does not share out (measured at world size 2 on 2 cores:
        training at 0.68x its speed during a save with 2 writer threads per rank, at 0.69x with
        the writers at nice 19, at 0.80x with 1 thread)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        return max(1, min(self.thread_count, cores // max(1, self._local_ranks)))

    # ---------------------------------------------------------------------------------------
    # listing (not collective)
    def steps(self) -> list[int]:
        """Committed steps under the root, ascending. Not collective."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` if there is none (local or replica). Not collective."""
        steps = self.steps()
        if steps:
            return steps[-1]
        if self.replica is not None:
            remote = committed_steps(self.replica.remote)
            return remote[-1] if remote else None
        return None

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: newest). ``FileNotFoundError`` if not committed."""
        storage, step = self._locate(step)
        return read_manifest(storage, step)

    # ---------------------------------------------------------------------------------------
    # saving
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        blocking: bool = True,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """(all ranks) Save ``state`` as checkpoint ``step``.

        Each rank writes its own shards; replicated tensors are written once, spread across
        ranks. The checkpoint becomes visible only once every rank's data, DCP's metadata and
        finally the manifest are written.

        Args:
            step: a non-negative int, the same on every rank; must not be committed already.
            state: name -> module, optimizer, scheduler/scaler/any object with ``state_dict``,
                tensor, or plain value (same names on every rank).
            blocking: ``False`` returns once the state is copied to host memory and writes in
                the background; ``wait()`` commits it. A previous in-flight save is waited for
                first, and its error (if any) is raised here.
            metadata: JSON values recorded in the manifest (``extra``).

        Raises:
            StepExistsError: ``step`` is already committed, or another writer is writing it (an
                async save finds the latter in its background part: raised by ``wait()``, the
                next ``save`` or ``close()``, like its other errors).
            CheckpointError: writing failed on some rank (same error on every rank).
        """
        if self._closed:
            raise RuntimeError("save() on a closed Checkpointer")
        t0 = time.perf_counter()
        self.wait()  # the previous async save (outside the GC pause: it may take long)
        with _gc_paused():
            self._save(t0, step, state, blocking, metadata)

    def prepare_staging(self, state: Mapping[str, Any]) -> None:
        """(all ranks) Reserve, in the background, the host memory async saves of ``state`` will
        stage into, so that the first ``save(..., blocking=False)`` blocks no longer than later
        ones; returns at once.

        A first async save otherwise allocates its staging buffers while training waits: page
        faults over the whole state and, for CUDA tensors, registering it as pinned memory (most
        of its blocked time). Call it once the model and optimizer exist (after a first optimizer
        step, so that the optimizer's state exists too), e.g. right after ``load``; training
        goes on meanwhile. A later save of another structure allocates anew, as without it.

        Raises:
            The same errors a save of ``state`` would raise while preparing (on every rank).
        """
        if self._closed:
            raise RuntimeError("prepare_staging() on a closed Checkpointer")
        self.wait()
        with _gc_paused():
            group = self._ensure_group()
            opts = self._save_options()
            # Exactly what a save plans, so the buffers have the layout staging will look for.
            prepared, views = exchange(
                group,
                "prepare_staging",
                lambda: _saving.prepare(opts, 0, state, {}, group.rank, False, None, safe_types=self.safe_types),
            )
            _saving.agree(prepared, views, group.rank)
            skip = replicated_shares([v.layout for v in views], prepared.sizes, group.rank)
            if self._stager is None:
                self._stager = Stager(shared=self._writes_in_process(group))
            self._stager.reserve(prepared.state_dict, skip)

    def _save(
        self, t0: float, step: int, state: Mapping[str, Any], blocking: bool, metadata: Mapping[str, Any] | None
    ) -> None:
        group = self._ensure_group()
        opts = self._save_options()
        in_process = not blocking and self._writes_in_process(group)
        if in_process and self._writer is None:
            self._writer = WriterProcess.start(
                group, timeout=self.timeout, nice=self.background_nice, threads=self._background_threads()
            )
            # A checkpointer dropped without close() must not leave its writer running until exit.
            weakref.finalize(self, self._writer.detach)
        # The plans of whoever writes this save: this process, or the writer process.
        plans = self._writer.plans if in_process and self._writer is not None else self._plan_cache
        stats = SaveStats(step, 0.0)
        t1 = time.perf_counter()
        # Phases 1-3 (see distckpt.save.phases): prepare and agree on every rank, claim on the
        # coordinator (async saves: in the background, after refusing a committed step here).
        def prepare() -> tuple[_saving.Prepared, _saving.SaveView]:
            extra = check_extra(metadata)  # in the exchange: bad metadata on one rank fails all
            if not blocking and group.is_coordinator:
                _saving.refuse_committed(opts, step)
            return _saving.prepare(opts, step, state, extra, group.rank, blocking, plans, safe_types=self.safe_types)

        prepared, views = exchange(group, f"save of step {step}", prepare)
        _saving.agree(prepared, views, group.rank)
        stats.phases["prepare"] = time.perf_counter() - t1

        if blocking:
            self._claim(group, opts, step, stats)
            self._write_and_commit(group, opts, prepared, stats)
            stats.blocking_s = stats.total_s = time.perf_counter() - t0
            self.last_save = stats
            self._log_save(self.last_save)
            if self.replica is not None:
                self.replica.submit(step)
            return

        # 4. staging. Each rank stages only its share of replicated tensors (see distckpt.save.staging).
        if self._stager is None:
            self._stager = Stager(shared=in_process)
        stager = self._stager
        skip = replicated_shares([v.layout for v in views], prepared.sizes, group.rank)
        t3 = time.perf_counter()
        try:
            all_ranks(group, f"staging of step {step}", lambda: _saving.stage(opts, stager, prepared, skip))
        except BaseException:
            self._release_lease(committed=False)  # the owner removes its step directory
            raise
        opts = replace(opts, thread_count=self._background_threads())  # the write phase runs beside training
        write = self._write_in_process(group, opts, prepared, stager) if in_process else None
        stats.phases["stage"] = time.perf_counter() - t3
        stats.blocking_s = time.perf_counter() - t0
        stats.staged_bytes = stager.nbytes
        job = _InFlight(step, stats)

        def run() -> None:
            _lower_priority(self.background_nice)
            try:
                self._claim(group, opts, step, stats)
                self._write_and_commit(group, opts, prepared, stats, write)
                stats.total_s = time.perf_counter() - t0
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait() on every rank
                job.error = exc

        job.thread = threading.Thread(target=run, name=f"distckpt-save-{step}", daemon=True)
        self._inflight = job
        job.thread.start()

    def _claim(self, group: Group, opts: _saving.SaveOptions, step: int, stats: SaveStats) -> None:
        """(all ranks) Phase 3: the coordinator creates the step directory under this writer's lease."""
        t0 = time.perf_counter()

        def claim() -> None:
            try:
                self._lease = _saving.claim(opts, step, self._reaper.busy)
            except (FileNotFoundError, PermissionError):
                raise  # caller mistakes (no such bucket, no access) keep their builtin type
            except OSError as exc:  # e.g. an unreachable store: name the save it stopped
                where = opts.storage.display(step_dir(step))
                raise CheckpointError(f"save of step {step}: could not create {where}: {one_line(exc)}") from exc

        on_coordinator(group, f"save of step {step}", claim)
        stats.phases["claim"] = time.perf_counter() - t0

    def _save_options(self) -> _saving.SaveOptions:
        return _saving.SaveOptions(
            storage=self.storage,
            keep_last=self.keep_last,
            thread_count=self.thread_count,
            sync_files=self.sync_files,
            checksum=self.checksum,
            skip_record_crc=self.skip_torch_record_crc,
            save_rng=self.save_rng,
            fingerprint=self.fingerprint,
            on_replica_drift=self.on_replica_drift,
            lease_s=self.lease_s,
            verify_staging=self.verify_staging,
        )

    def _writes_in_process(self, group: Group) -> bool:
        """Whether async saves go to a writer process (see ``async_mode``)."""
        if self.async_mode != "process" or not self.storage.shared_between_processes:
            return False
        # The writers' group must number ranks as the job does: DTensor meshes name global ranks.
        return not group.enabled or group.world_size == dist.get_world_size()

    def _write_in_process(
        self, group: Group, opts: _saving.SaveOptions, prepared: _saving.Prepared, stager: Stager
    ) -> Callable[[], _saving.Written]:
        """(each rank) Phase 5 for the writer process: returns the background thread's ``write``.

        The staged tensors are described by their place in the shared arena (encoded here,
        while training is still blocked, because training may change the state's structure
        once ``save`` returns).
        """
        writer = self._writer
        assert writer is not None and stager.arena is not None
        flat, mappings = encode(prepared.state_dict, stager.arena.tensor)
        job = Job(opts, replace(prepared, state_dict={}), flat, mappings, stager.arena.path, stager.arena.nbytes)

        def write() -> _saving.Written:
            def run() -> tuple[_saving.Written, None]:
                writer.submit(job)
                return writer.result(), None

            # The writers gathered their outcomes already; this exchange also covers a writer
            # that died, so every rank decides alike whether to commit.
            return exchange(group, f"save of step {prepared.step}", run)[0]

        return write

    def _write_and_commit(
        self,
        group: Group,
        opts: _saving.SaveOptions,
        prepared: _saving.Prepared,
        stats: SaveStats,
        write: Callable[[], _saving.Written] | None = None,
    ) -> None:
        """(all ranks) Phases 5-7: write, commit, retention, recorded in ``stats``.

        ``write`` replaces phase 5 (the writer process's). Errors are raised on every rank; on
        any, the lease is released (the coordinator then removes the step directory it created).
        """
        try:
            written = write() if write is not None else _saving.write(opts, group, prepared, self._plan_cache)
            stats.plan = written.plan
            stats.phases.update(written.phases)
            t0 = time.perf_counter()

            def commit() -> int:
                manifest = _saving.commit(opts, group.world_size, prepared, written, self._lease, self._lineage.job)
                self._release_lease(committed=True)
                _saving.apply_retention(opts, self._reaper, lambda s: self._lineage.owns(opts.storage, s))
                return manifest.total_bytes

            stats.bytes_written = on_coordinator(group, f"commit of step {prepared.step}", commit)
            stats.phases["commit"] = time.perf_counter() - t0
        finally:
            self._release_lease(committed=False)  # no-op after a commit

    def _release_lease(self, committed: bool) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release(committed)

    def _log_save(self, stats: SaveStats) -> None:
        if self._group is not None and self._group.rank == 0:
            tp = stats.throughput_gbps
            log.info(
                "saved step %d: blocked %.3fs, committed after %.3fs%s",
                stats.step,
                stats.blocking_s,
                stats.total_s or 0.0,
                f", {tp:.2f} GB/s" if tp else "",
            )

    # ---------------------------------------------------------------------------------------
    # async completion
    @property
    def in_flight(self) -> bool:
        """True while an async save is still writing on this rank. Not collective, never blocks
        or raises: the save is committed (or its error raised) by the next ``wait``/``save``."""
        job = self._inflight
        return job is not None and job.thread is not None and job.thread.is_alive()

    def wait(self) -> SaveStats | None:
        """(all ranks) Block until the in-flight save (if any) is committed.

        Returns its stats, or ``None`` if nothing was in flight. Raises the background save's
        error, identically on every rank.
        """
        job, self._inflight = self._inflight, None
        if job is None:
            return None
        assert job.thread is not None
        job.thread.join()
        if job.error is not None:
            # The error is the same on every rank, so every rank restarts its writer process
            # at the next async save (a writer whose peers failed may be left in a broken group).
            self._stop_writer()
            raise job.error
        self.last_save = job.stats
        self._log_save(job.stats)
        if self.replica is not None:
            self.replica.submit(job.step)
        return job.stats

    def close(self) -> None:
        """(all ranks) Wait for the in-flight save and release staging buffers and threads."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._reaper.drain()
            if self.replica is not None:
                self.replica.close()
            self._stop_writer()
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self._release_group()
            _live.discard(self)

    def _stop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            # Its arena goes with it: the writer unlinked the arena's file name once it had
            # mapped it, so a new writer could not map the same memory (see shared_arena).
            if self._stager is not None and self._stager.shared:
                self._stager.close()
                self._stager = None

    def _release_group(self) -> None:
        """Destroy distckpt's own process group while Python still runs.

        A group that lives on into interpreter finalisation (a module-level Checkpointer, an
        error kept in a variable) has its backend threads torn down there, where one that needs
        the GIL aborts the process (SIGABRT) although the job succeeded. A group the caller
        passed in is the caller's to destroy.
        """
        group, self._group = self._group, None
        if group is None or group.pg is None or self._user_pg is not None:
            return
        pg, group.pg = group.pg, None  # frames and errors that still hold the Group lose the pg
        try:
            from distckpt._compat import group_is_registered

            if dist.is_initialized() and group_is_registered(pg):
                dist.destroy_process_group(pg)
            else:
                pg.shutdown()  # destroy_process_group() already ran: make sure its threads end
        except Exception as exc:  # noqa: BLE001 - never fail a close over this
            log.debug("releasing distckpt's process group: %s", exc)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------
    # loading
    def _locate(self, step: int | None) -> tuple[Storage, int]:
        """Which storage holds ``step`` (default newest): local first, then the replica."""
        tiers = [self.storage] + ([self.replica.remote] if self.replica is not None else [])
        if step is None:
            for storage in tiers:
                steps = committed_steps(storage)
                if steps:
                    return storage, steps[-1]
            if not any(s.root_exists() for s in tiers):
                raise FileNotFoundError(f"checkpoint root {self.storage.display()} does not exist")
            raise FileNotFoundError(f"no committed checkpoint under {' or '.join(s.display() for s in tiers)}")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int or None, got {step!r}")
        for storage in tiers:
            if storage.exists(step_dir(step), MANIFEST_NAME):
                return storage, step
        where = self.storage.display(step_dir(step))
        if not any(s.root_exists() for s in tiers):
            raise FileNotFoundError(f"checkpoint root {self.storage.display()} does not exist")
        if self.storage.exists(step_dir(step)):
            raise FileNotFoundError(f"checkpoint step {step} at {where} is incomplete (no {MANIFEST_NAME}); it was never committed")
        raise FileNotFoundError(f"checkpoint step {step} not found at {where} (committed steps: {self.steps()})")

    def load(
        self,
        state: MutableMapping[str, Any],
        step: int | None = None,
        strict: bool = True,
        *,
        restore_rng: bool = True,
        verify_state: bool | None = None,
        only: str | list[str] | None = None,
        exclude: str | list[str] | None = None,
    ) -> int:
        """(all ranks) Load checkpoint ``step`` (default: newest committed) into ``state`` in place.

        Works at any world size: each rank reads only what its objects hold (its shards, its
        ZeRO partition). Plain values are replaced in ``state``; everything else is loaded into
        the objects. See :mod:`distckpt.state.rng` for RNG states when the world size changed.

        Args:
            state: the same kind of mapping ``save`` took, with freshly built objects.
            step: which step; ``None`` for the newest committed one.
            strict: raise if keys or shapes differ; with ``False``, load what matches and record
                the rest in :attr:`last_load_report` (and a warning).
            restore_rng: restore the RNG states saved with the checkpoint.
            only / exclude: load only part of the checkpoint: entry names or key patterns
                (``fnmatch``), e.g. ``only="model"`` to start a new fine-tuning run from a
                checkpoint's weights, or ``exclude=["loader", "_rng"]``. Strictness applies to
                what is selected; entries of ``state`` outside the selection are left untouched.
            verify_state: prove the loaded state equals the saved one (fingerprints, see
                :mod:`distckpt.state.statecheck`); ``None``: the Checkpointer's setting (default: when
                the world size or a module's parallelism changed since the save).

        Returns:
            The loaded step.

        Raises:
            FileNotFoundError: no such root or committed step.
            StateMismatchError: ``strict`` and keys/shapes differ (missing, unexpected, mismatched
                keys are listed).
            CheckpointError: reading failed on some rank.
        """
        if self._closed:
            raise RuntimeError("load() on a closed Checkpointer")
        self.wait()  # the in-flight async save (outside the GC pause: it may take long)
        with _gc_paused():
            return self._load(state, step, strict, restore_rng, verify_state, only, exclude)

    def _load(
        self,
        state: MutableMapping[str, Any],
        step: int | None,
        strict: bool,
        restore_rng: bool,
        verify_state: bool | None,
        only: str | list[str] | None,
        exclude: str | list[str] | None,
    ) -> int:
        group = self._ensure_group()
        tiers = [self.storage] + ([self.replica.remote] if self.replica is not None else [])
        # One verified read of .metadata (coordinator), handed to every rank; each derives the index.
        tier, manifest, metadata = on_coordinator(group, "load", lambda: self._read_index(step, tiers))
        index = metadata_index(metadata)
        storage = tiers[tier]
        where = storage.display(step_dir(manifest.step))
        # Every rank alike (pure): a non-tensor item the save recorded must still be one.
        values.check_items_listed(manifest.value_digests, index, storage.display(step_dir(manifest.step), ".metadata"))
        selection = Selection(_patterns(only, "only"), _patterns(exclude, "exclude"), frozenset(index))

        def plan_here() -> Any:
            # Inside the exchange: patterns a rank got wrong fail every rank alike.
            _refuse_dead_patterns(only, exclude, index, where)
            return plan_load(group, manifest, index, state, restore_rng, selection)

        plan, views = exchange(group, f"load of {where}", plan_here)
        # Digests first; the requested keys themselves only where ranks request different sets.
        requested_set = requested_keys(group, index, plan, views)
        report = judge(manifest.step, index, views, None if strict else plan.names, selection, requested_set)
        if (only or exclude) and not any(selection.key(k) for k in index):
            entries = sorted({k.split(".", 1)[0] for k in index})
            raise ValueError(f"load(only={only!r}, exclude={exclude!r}) selects nothing in {where} (entries: {entries})")
        if strict and not report.clean:
            raise StateMismatchError(
                report.missing, report.unexpected, report.mismatched, f"step {manifest.step} at {where}", report.per_rank
            )

        requested = sorted(requested_set)
        explicit = verify_state if verify_state is not None else self.verify_state
        if explicit:  # asked for a proof: refuse before reading if the checkpoint cannot give it
            _require_fingerprints(manifest, index, requested, where)

        reader = storage.reader(
            step_dir(manifest.step),
            files=manifest.files if self.verify else None,
            checksum=manifest.checksum_algorithm if self.verify else None,
            metadata=metadata,
            thread_count=self.thread_count,
        )
        read(
            group,
            where,
            plan.request,
            reader,
            # Non-tensor items' bytes are checked against the manifest before unpickling.
            SafeLoadPlanner(value_digests=manifest.value_digests, where=where, safe_types=self.safe_types),
            then=lambda: apply_load(group, manifest, plan, state),
        )
        check = explicit
        if check is None:
            # By default where the risk is highest: the layout changed, or nothing else proved the
            # bytes (a checkpoint saved with checksum=None: its fingerprints are the only proof).
            relaid = manifest.world_size != group.world_size or _parallelism_changed(manifest, plan.entries)
            unchecked = manifest.checksum_algorithm is None
            check = relaid or unchecked
            if check and not manifest.fingerprints:
                _warn_unverifiable(manifest.step, where, relaid)
                check = False
        if check:
            self._verify_loaded(group, manifest, plan, requested, where)
        if not (only or exclude):  # a resume (not a new run from part of it): continue its job
            self._lineage.adopt(manifest.job)

        self.last_load_report = report
        if not report.clean:
            warnings.warn(
                f"distckpt: partial load of {where}: "
                + StateMismatchError(report.missing, report.unexpected, report.mismatched, per_rank=report.per_rank).describe(),
                stacklevel=2,
            )
        return manifest.step

    def _verify_loaded(self, group: Group, manifest: Manifest, plan: Any, requested: list[str], where: str) -> None:
        """(all ranks) Fingerprints of what the objects hold now against the saved ones; the
        same :class:`~distckpt.state.statecheck.StateDivergedError` on every rank if any differ."""

        what = f"state check of {where}"

        def current() -> dict[str, Any]:
            # Re-extracted through the same functions a save uses, so a wrong mapping between
            # what DCP read and what the objects hold shows up too.
            out: dict[str, Any] = {}
            for e in plan.entries:
                if e.name in plan.per_rank:
                    continue
                value = e.save_state()
                if manifest.entries.get(e.name, {}).get("scope") == scope.PER_RANK:
                    value = {scope.rank_key(group.rank): value}
                out[e.name] = value
            return flatten_state_dict(out)[0]

        # RNG states are reseeded, not restored, at another world size.
        judged = [k for k in requested if not k.startswith(rng.NAMESPACE + ".")]
        bad = diverged_keys(
            group, current, manifest.fingerprints, judged, what, threads=self.thread_count, version=manifest.fingerprint_version
        )
        if bad:
            raise statecheck.StateDivergedError(bad, f"step {manifest.step} at {where}")

    def _read_index(self, step: int | None, tiers: list[Storage]) -> tuple[int, Manifest, Any]:
        """(coordinator) Tier, manifest and the DCP metadata of a step, read once and verified
        (with ``verify``), then handed to every rank: no rank reads it again, none unverified.
        The key index is derived by each rank (``metadata_index``) instead of travelling beside it."""
        storage, step = self._locate(step)
        manifest = read_manifest(storage, step)
        metadata = read_metadata(storage, manifest, verify=self.verify)
        return tiers.index(storage), manifest, metadata


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a save or load runs in the caller's
    thread (torch's state-dict helpers do the same, ``_gc_context``). Their bursts of
    allocations (metadata, plans, state-dict entries) would otherwise trigger collections that
    scan the whole process's heap: 0.1-0.2 s each in a process holding only torch, more in a
    training job's. What they leave behind is freed by reference counting; anything cyclic is
    collected as usual afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _lower_priority(nice: int) -> None:
    """Make the calling thread (and the writer threads it starts, which inherit it) nicer."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


def _refuse_dead_patterns(only: Any, exclude: Any, index: Mapping[str, Any], where: str) -> None:
    """(every rank, pure) ``ValueError`` naming each ``only``/``exclude`` pattern that matches no
    entry name and no key of the checkpoint: a typo (``exclude="optm"``) must not load what it
    was meant to leave out, nor one dead name in a list (``only=["model.weight", "model.bais"]``)
    go unnoticed beside one that matches."""
    from fnmatch import fnmatchcase

    names = set(index) | {k.split(".", 1)[0] for k in index}
    dead = [
        f"{what}={p!r}"
        for what, value in (("only", only), ("exclude", exclude))
        for p in _patterns(value, what)
        if not any(fnmatchcase(n, p) for n in names)
    ]
    if dead:
        entries = sorted({k.split(".", 1)[0] for k in index})
        raise ValueError(
            f"load({', '.join(dead)}): {'this pattern matches' if len(dead) == 1 else 'these patterns match'} "
            f"nothing in {where} (entries: {entries}; patterns are fnmatch-style, matched against entry names and keys)"
        )


def _patterns(value: str | list[str] | None, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(p, str) and p for p in items):
        raise ValueError(f"load({what}=...) takes a non-empty pattern or list of patterns, got {value!r}")
    return tuple(items)


def _parallelism_changed(manifest: Manifest, entries: list[Any]) -> bool:
    """Whether any entry is laid out otherwise than at the save: its kind of parallelism
    (plain, DDP, FSDP2; ZeRO vs a plain optimizer, which records no ``parallel``) or, where the
    save recorded one, its DTensor layout (a digest of mesh shapes and placements; manifests
    written before ``layout`` was recorded compare kinds only)."""

    def kind(described: Mapping[str, Any]) -> Any:
        if described.get("kind") == "optimizer":
            return described.get("parallel", "plain")
        return described.get("parallel")

    for e in entries:
        saved = manifest.entries.get(e.name)
        if not isinstance(saved, Mapping):
            continue
        now = e.describe()
        if kind(saved) is not None and kind(now) is not None and kind(saved) != kind(now):
            return True
        if saved.get("layout") is not None and saved.get("layout") != now.get("layout"):
            return True
    return False


def _require_fingerprints(manifest: Manifest, index: Mapping[str, Any], requested: list[str], where: str) -> None:
    """(every rank, pure: the same error everywhere) For ``verify_state=True``: every requested
    tensor must have a recorded fingerprint, else the load is refused before anything is read.
    Plain values are not fingerprinted (``kind: value`` entries are checked by digest); RNG
    states are reseeded at another world size and never judged."""
    how = "load with verify_state=False to load it without that proof (or None: verify only where fingerprints exist)"
    if not manifest.fingerprints:
        raise CheckpointError(
            f"load(verify_state=True) of step {manifest.step} at {where}: the checkpoint records no state "
            f"fingerprints (saved with fingerprint=False or by an older distckpt), so the loaded state cannot "
            f"be proven equal to the saved one; {how}"
        )
    lacking = [
        k
        for k in requested
        if index.get(k) is not None and k not in manifest.fingerprints and not k.startswith(rng.NAMESPACE + ".")
    ]
    if lacking:
        shown = ", ".join(lacking[:20]) + (f", ... (+{len(lacking) - 20} more)" if len(lacking) > 20 else "")
        raise CheckpointError(
            f"load(verify_state=True) of step {manifest.step} at {where}: {len(lacking)} requested tensor(s) have "
            f"no recorded fingerprint (replicas that drifted at save, or layouts that were not fingerprinted), "
            f"so they cannot be verified: {shown}; {how}"
        )


_warned_unverifiable: set[str] = set()


def _warn_unverifiable(step: int, where: str, relaid: bool) -> None:
    """Once per checkpoint root and process: the default check was due but has nothing to compare."""
    root = where.rsplit("/", 1)[0]
    if root in _warned_unverifiable:
        return
    _warned_unverifiable.add(root)
    why = "was loaded at another world size or parallelism" if relaid else "records no file checksums (saved with checksum=None)"
    warnings.warn(
        f"distckpt: step {step} at {where} {why}, and it records no state fingerprints (saved with "
        "fingerprint=False), so the loaded state was not verified",
        stacklevel=3,
    )


_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # An async save still in flight at interpreter exit is finished, not silently dropped.
    for ckpt in list(_live):
        try:
            ckpt.close()
        except BaseException as exc:  # noqa: BLE001
            warnings.warn(f"distckpt: in-flight save failed at exit: {exc}", stacklevel=1)
