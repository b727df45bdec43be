"""The :class:`Checkpointer`: collective save/load of a whole training state, sync or async."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from . import _saving, fingerprint, ownership, rng, scope, statecheck
from ._compat import flatten_state_dict
from ._dist import Group, all_ranks, exchange, on_coordinator
from ._loading import LoadReport, Selection, apply_load, judge, plan_load
from ._planner import SafeLoadPlanner
from .errors import CheckpointError, StateMismatchError, from_dcp
from .integrity import ALGORITHMS
from .integrity import DEFAULT as DEFAULT_CHECKSUM
from .manifest import MANIFEST_NAME, Manifest, committed_steps, read_manifest, read_metadata, step_dir
from .retention import check_keep_last
from .staging import Stager, replicated_shares
from .storage import Storage

log = logging.getLogger("distckpt")

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
    """

    step: int
    blocking_s: float
    total_s: float | None = None
    bytes_written: int | None = None
    staged_bytes: int = 0

    @property
    def throughput_gbps(self) -> float | None:
        if not self.total_s or not self.bytes_written:
            return None
        return self.bytes_written / self.total_s / 1e9


class _InFlight:
    """The background half of one asynchronous save."""

    def __init__(self, step: int, blocking_s: float) -> None:
        self.step = step
        self.stats = SaveStats(step, blocking_s)
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
        thread_count: writer threads per rank.
        sync_files: fsync local files before committing (object stores commit on close).
        checksum: ``"crc32c"`` (default, hardware CRC-32C), ``"crc32"`` (zlib), ``"sha256"`` or
            ``None``; computed while writing, recorded in the manifest (see :mod:`distckpt.integrity`).
        save_rng: save every rank's RNG states with each checkpoint.
        background_nice: niceness added to the threads of an async save (Linux), so that on a
            busy machine training keeps the CPU and the save takes what is left (0: off).
        verify: on load, check every file read against the manifest's size and checksum
            (:class:`~distckpt.errors.IntegrityError` naming the file on mismatch).
        replicate_to: a second root (e.g. ``s3://...``) every committed checkpoint is uploaded
            to in the background; ``load`` falls back to it when no local copy exists.
        fingerprint: record a sharding-independent fingerprint of every saved tensor in the
            manifest (:mod:`distckpt.statecheck`), so that loads can prove what they loaded.
        on_replica_drift: at save, copies of a tensor that should be identical on every rank
            (DDP replicas, global values) but differ: ``"warn"``, ``"error"`` or ``"ignore"``.
        verify_state: after a load, recompute the fingerprints of the loaded state and compare
            them with the saved ones (:class:`~distckpt.statecheck.StateDivergedError` on every
            rank if any differ). ``None`` (default): when the world size or any entry's
            parallelism differs from the save's; ``True``/``False``: always/never.
        lease_s: how long an incomplete step directory stays protected from other writers'
            cleanup without a refresh (:mod:`distckpt.ownership`).
        skip_torch_record_crc: while this checkpointer writes, turn off the CRC-32 that
            ``torch.save`` computes for every record (most of its CPU time; distckpt's own
            ``checksum`` covers every byte, and ``torch.load`` does not check it). torch has only
            a process-wide switch, so other ``torch.save`` calls in the process during a save also
            write records without CRC (still readable). Off by default.
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
        skip_torch_record_crc: bool = False,
    ) -> None:
        check_keep_last(keep_last)
        if checksum is not None and checksum not in ALGORITHMS:
            raise ValueError(f"checksum must be one of {ALGORITHMS} or None, got {checksum!r}")
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if on_replica_drift not in statecheck.DRIFT_POLICIES:
            raise ValueError(f"on_replica_drift must be one of {statecheck.DRIFT_POLICIES}, got {on_replica_drift!r}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s!r}")
        self.fingerprint = fingerprint
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
        self._stager: Stager | None = None
        self._inflight: _InFlight | None = None
        self._closed = False
        self.last_save: SaveStats | None = None
        self.last_load_report: LoadReport | None = None
        self.replica = None
        if replicate_to is not None:
            from .replica import Replicator

            self.replica = Replicator(
                self.storage,
                Storage(replicate_to, dict(replicate_storage_options or storage_options or {})),
                keep_last,
                # Upload from distckpt's coordinator (the group exists by the first submit).
                is_coordinator=lambda: self._group.is_coordinator if self._group is not None else True,
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
        return self._group

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
            StepExistsError: ``step`` is already committed.
            CheckpointError: writing failed on some rank (same error on every rank).
        """
        if self._closed:
            raise RuntimeError("save() on a closed Checkpointer")
        t0 = time.perf_counter()
        self.wait()
        group = self._ensure_group()
        opts = self._save_options()
        # Phases 1-3 (see distckpt._saving): prepare and agree on every rank, claim on the coordinator.
        prepared, views = exchange(
            group,
            f"save of step {step}",
            lambda: _saving.prepare(opts, step, state, dict(metadata or {}), group.rank, blocking),
        )
        _saving.agree(prepared, views, group.rank)

        def claim() -> None:
            self._lease = _saving.claim(opts, step)

        on_coordinator(group, f"save of step {step}", claim)

        if blocking:
            committed = self._write_and_commit(group, opts, prepared)
            elapsed = time.perf_counter() - t0
            self.last_save = SaveStats(step, elapsed, elapsed, committed)
            self._log_save(self.last_save)
            if self.replica is not None:
                self.replica.submit(step)
            return

        # 4. staging. Each rank stages only its share of replicated tensors (see distckpt.staging).
        if self._stager is None:
            self._stager = Stager()
        stager = self._stager
        skip = replicated_shares([v.layout for v in views], prepared.sizes, group.rank)
        try:
            all_ranks(group, f"staging of step {step}", lambda: _saving.stage(opts, stager, prepared, skip))
        except BaseException:
            self._release_lease(committed=False)  # the owner removes its step directory
            raise
        job = _InFlight(step, time.perf_counter() - t0)
        job.stats.staged_bytes = stager.nbytes

        def run() -> None:
            _lower_priority(self.background_nice)
            try:
                job.stats.bytes_written = self._write_and_commit(group, opts, prepared)
                job.stats.total_s = time.perf_counter() - t0
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait() on every rank
                job.error = exc

        job.thread = threading.Thread(target=run, name=f"distckpt-save-{step}", daemon=True)
        self._inflight = job
        job.thread.start()

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
        )

    def _write_and_commit(self, group: Group, opts: _saving.SaveOptions, prepared: _saving.Prepared) -> int:
        """(all ranks) Phases 5-7: write, commit, retention; returns the checkpoint's bytes.

        Errors are raised on every rank; on any, the lease is released (the coordinator then
        removes the step directory it created).
        """
        try:
            written = _saving.write(opts, group, prepared)

            def commit() -> int:
                manifest = _saving.commit(opts, group.world_size, prepared, written, self._lease)
                self._release_lease(committed=True)
                _saving.apply_retention(opts)
                return manifest.total_bytes

            return on_coordinator(group, f"commit of step {prepared.step}", commit)
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
            if self.replica is not None:
                self.replica.close()
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self._release_group()
            _live.discard(self)

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
            from ._compat import group_is_registered

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
        the objects. See :mod:`distckpt.rng` for RNG states when the world size changed.

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
                :mod:`distckpt.statecheck`); ``None``: the Checkpointer's setting (default: when
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
        self.wait()
        group = self._ensure_group()
        tiers = [self.storage] + ([self.replica.remote] if self.replica is not None else [])
        tier, manifest, index, metadata = on_coordinator(group, "load", lambda: self._read_index(step, tiers))
        storage = tiers[tier]
        where = storage.display(step_dir(manifest.step))
        selection = Selection(_patterns(only, "only"), _patterns(exclude, "exclude"))
        plan, views = exchange(
            group, f"load of {where}", lambda: plan_load(group, manifest, index, state, restore_rng, selection)
        )
        report = judge(manifest.step, index, views, None if strict else plan.names, selection)
        if (only or exclude) and not any(selection.key(k) for k in index):
            entries = sorted({k.split(".", 1)[0] for k in index})
            raise ValueError(f"load(only={only!r}, exclude={exclude!r}) selects nothing in {where} (entries: {entries})")
        if strict and not report.clean:
            raise StateMismatchError(
                report.missing, report.unexpected, report.mismatched, f"step {manifest.step} at {where}", report.per_rank
            )

        reader = storage.reader(
            step_dir(manifest.step),
            files=manifest.files if self.verify else None,
            checksum=manifest.checksum_algorithm if self.verify else None,
            metadata=metadata,
            thread_count=self.thread_count,
        )
        try:
            dcp.load(
                plan.request,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                process_group=group.pg,
                no_dist=not group.enabled,
            )
        except BaseException as exc:  # DCP raises the same CheckpointException on every rank
            raise from_dcp(exc, f"reading {where}") from None
        all_ranks(group, f"load of {where}", lambda: apply_load(group, manifest, plan, state))
        check = verify_state if verify_state is not None else self.verify_state
        if check is None:  # by default where the risk is highest: the layout changed
            check = manifest.world_size != group.world_size or _parallelism_changed(manifest, plan.entries)
        if check and manifest.fingerprints:
            requested = sorted({k for v in views for k in v[2]})
            self._verify_loaded(group, manifest, plan, requested, where)

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
        same :class:`~distckpt.statecheck.StateDivergedError` on every rank if any differ."""

        def parts() -> tuple[None, Any]:
            # Re-extracted through the same functions a save uses, so a wrong mapping between
            # what DCP read and what the objects hold shows up too.
            current: dict[str, Any] = {}
            for e in plan.entries:
                if e.name in plan.per_rank:
                    continue
                value = e.save_state()
                if manifest.entries.get(e.name, {}).get("scope") == scope.PER_RANK:
                    value = {scope.rank_key(group.rank): value}
                current[e.name] = value
            return None, fingerprint.local_parts(flatten_state_dict(current)[0])

        _, parts_by_rank = exchange(group, f"state check of {where}", parts)
        # RNG states are reseeded, not restored, at another world size.
        judged = [k for k in requested if not k.startswith(rng.NAMESPACE + ".")]
        bad = statecheck.diverged(parts_by_rank, manifest.fingerprints, judged)
        if bad:
            raise statecheck.StateDivergedError(bad, f"step {manifest.step} at {where}")

    def _read_index(self, step: int | None, tiers: list[Storage]) -> tuple[int, Manifest, dict[str, tuple[int, ...] | None], Any]:
        """(coordinator) Tier, manifest, key -> global shape (None: non-tensor) and the verified
        DCP metadata of a step (handed to every rank, so no rank reads it unverified)."""
        storage, step = self._locate(step)
        manifest = read_manifest(storage, step)
        metadata = read_metadata(storage, manifest, verify=self.verify)
        index: dict[str, tuple[int, ...] | None] = {}
        for key, md in metadata.state_dict_metadata.items():
            size = getattr(md, "size", None)
            index[key] = tuple(size) if size is not None else None
        return tiers.index(storage), manifest, index, metadata


def _lower_priority(nice: int) -> None:
    """Make the calling thread (and the writer threads it starts, which inherit it) nicer."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


def _patterns(value: str | list[str] | None, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    if not items or not all(isinstance(p, str) and p for p in items):
        raise ValueError(f"load({what}=...) takes a non-empty pattern or list of patterns, got {value!r}")
    return tuple(items)


def _parallelism_changed(manifest: Manifest, entries: list[Any]) -> bool:
    for e in entries:
        saved = manifest.entries.get(e.name, {}).get("parallel")
        now = e.describe().get("parallel")
        if saved is not None and now is not None and saved != now:
            return True
    return False


_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # An async save still in flight at interpreter exit is finished, not silently dropped.
    for ckpt in list(_live):
        try:
            ckpt.close()
        except BaseException as exc:  # noqa: BLE001
            warnings.warn(f"distckpt: in-flight save failed at exit: {exc}", stacklevel=1)
