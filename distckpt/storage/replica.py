"""Tiered saving: upload committed local checkpoints to a second root (e.g. S3) in the background.

``Checkpointer(local_root, replicate_to="s3://bucket/run")`` commits every save on the fast local
root first, then hands the step to a :class:`Replicator`, which copies the step directory to the
remote root on a background thread of the coordinator, under the same rules as a save to the main
root (:mod:`distckpt.storage.ownership`), so that several writers may replicate to one remote root:

1. if the remote step is committed already: done when its manifest is this one, otherwise the
   upload fails with :class:`~distckpt.StepExistsError` (another writer's checkpoint is never
   un-committed, replaced or deleted);
2. stale leftovers of interrupted uploads are removed (never a live writer's, never a committed
   step), and the remote step is created exclusively, under a lease (an owner record refreshed
   while the upload runs; a second uploader of the step gets ``StepExistsError``);
3. the DCP data files, several at a time, then ``.metadata``, each read from the local root
   through its no-follow open (a symbolic link there is refused, never followed);
4. after checking every remote size against the local manifest and that the lease is still
   this uploader's, ``manifest.json`` LAST, with the storage's exclusive write (a conditional
   put on S3): the remote commit. A manifest that appeared meanwhile is never replaced: the
   upload fails with ``StepExistsError``. A failed upload removes the remote directory it owns.

Then ``keep_last`` retention runs on the remote root (committed steps beyond the newest
``keep_last``, manifest first; the newest committed step is never deleted), as on the main root.

Only the coordinator uploads, so the local root must be visible to it: one node, or a shared
filesystem. A step whose files are missing locally (written on another node's disk) fails with
a message saying so.

Upload failures never fail training by themselves: they are recorded in
:attr:`Replicator.failed` and reported with ``warnings.warn`` (and the ``distckpt`` logger) on
the coordinator. Raising them from the next collective call on the coordinator alone would leave
the other ranks waiting in a collective it abandoned; the local checkpoint is committed either
way. Code that must know (before the job exits, before deleting local files) calls
:meth:`Replicator.wait`, which waits for the uploads submitted so far (or up to one step, with a
timeout) and raises a failed one as :class:`ReplicationError`; :meth:`Replicator.status` says
where one step stands.
"""

from __future__ import annotations

import logging
import numbers
import queue
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from distckpt._process import map_in_threads
from distckpt.errors import CheckpointError, StepExistsError
from distckpt.integrity.manifest import (
    MANIFEST_NAME,
    Manifest,
    committed_steps,
    step_dir,
)
from distckpt.storage import ownership
from distckpt.storage.base import Storage
from distckpt.storage.retention import check_keep_last, delete_old_steps

log = logging.getLogger("distckpt")

_METADATA = ".metadata"
_STOP = object()


class ReplicationError(CheckpointError):
    """Uploads to the replica root failed (raised by :meth:`Replicator.wait`). The local steps
    are committed; :attr:`steps` maps each failed step to its cause."""

    def __init__(self, message: str, steps: dict[int, str]) -> None:
        self.steps = dict(steps)
        self._head = message
        lines = [f"  step {s}: {m}" for s, m in sorted(self.steps.items())]
        super().__init__("\n".join([message, *lines]))

    def __reduce__(self) -> tuple:
        return (self.__class__, (self._head, self.steps))


@dataclass(frozen=True)
class ReplicaStatus:
    """Where the uploads submitted to a :class:`Replicator` stand (on the coordinator; other
    ranks upload nothing and see empty lists).

    Attributes:
        uploaded: steps committed on the remote root, in order.
        failed: ``(step, message)`` of failed uploads (messages carry no credentials).
        skipped: steps not uploaded because newer ones pushed them out of the remote's
            ``keep_last`` (queued, or committed locally after retention deleted them there):
            nothing lost.
        pending: steps queued or uploading now.
    """

    uploaded: tuple[int, ...]
    failed: tuple[tuple[int, str], ...]
    skipped: tuple[int, ...]
    pending: tuple[int, ...]


def _warn(message: str) -> None:
    """Warn from the upload thread. A warning turned into an error (``-W error``) has nobody to
    reach there and would end the thread: the failure is recorded (and raised by ``wait()``)
    and logged; the warning is not raised."""
    try:
        warnings.warn(message, stacklevel=2)
    except Exception:  # noqa: BLE001
        log.warning("%s", message)


#: Attempts to upload a step before it is given up: its first, then a retry at each of the next
#: saves whose retention comes to it (see :meth:`Replicator.holds`).
UPLOAD_ATTEMPTS = 3


def _default_is_coordinator() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class Replicator:
    """Copies committed steps of ``local`` to ``remote`` in the background.

    Protocol: every rank constructs one and calls :meth:`submit` after each committed save and
    :meth:`close` at the end (the :class:`~distckpt.Checkpointer` does both, and its ``replica``
    attribute is this object). None of its methods is a collective or blocks on a peer: only the
    coordinator does any work; on the other ranks they return at once. User code may call
    :meth:`wait` (e.g. before the job exits, or before deleting local files) and
    :meth:`status` on any rank; the coordinator's are the ones that know.

    Args:
        local: the root the checkpointer commits to; must be readable by the coordinator.
        remote: where copies go (any :class:`~distckpt.storage.base.Storage`, typically ``s3://``).
        keep_last: retention on the remote (``None``: keep all).
        max_concurrency: files uploaded at the same time.
        is_coordinator: whether this process uploads (evaluated at the first ``submit``);
            default: global rank 0, or a single process without ``torch.distributed``.
        lease_s: how long a remote step being uploaded stays protected from other writers'
            cleanup without a refresh (:mod:`distckpt.storage.ownership`).

    Attributes:
        remote: the remote :class:`~distckpt.storage.base.Storage` (``load`` falls back to it).
        uploaded: steps committed on the remote by this replicator, in order.
        failed: ``(step, message)`` of uploads that failed (messages carry no credentials);
            retried when the root's retention comes to the step, up to :data:`UPLOAD_ATTEMPTS`
            attempts in all (an entry goes once it succeeds).
        skipped: steps not uploaded because a newer step superseded them before their turn.
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        keep_last: int | None = None,
        *,
        max_concurrency: int = 4,
        is_coordinator: Callable[[], bool] | None = None,
        lease_s: float = ownership.DEFAULT_LEASE_S,
        owned: Callable[[Storage, int], bool] | None = None,
        forget: Callable[[Storage, int], None] | None = None,
        unsubmitted: Callable[[], int | None] | None = None,
    ) -> None:
        check_keep_last(keep_last)
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s!r}")
        self.lease_s = float(lease_s)
        self.local = local
        self.remote = remote
        self.keep_last = keep_last
        # Which remote steps are this job's (distckpt.storage.lineage): retention leaves the rest.
        self._owned = owned
        self._forget = forget  # (drops what ``owned`` remembers of a step: see delete_old_steps)
        # The step of an asynchronous save begun and not yet joined (its upload is submitted
        # when ckpt.wait() or the next save joins it): what wait() cannot cover, and says so.
        self._unsubmitted = unsubmitted
        self.max_concurrency = max_concurrency
        self._is_coordinator = is_coordinator or _default_is_coordinator
        self._coordinator: bool | None = None
        self.uploaded: list[int] = []
        self.failed: list[tuple[int, str]] = []
        self._failures: dict[int, int] = {}  # step -> failed attempts to upload it
        self.skipped: list[int] = []
        self._queue: queue.Queue = queue.Queue()
        self._pending: list[int] = []  # queued or uploading, oldest first
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)  # notified whenever a step's upload ends
        self._submitted: list[int] = []  # every step handed to the upload thread, in order
        self._thread: threading.Thread | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"Replicator({self.local.display()!r} -> {self.remote.display()!r}, keep_last={self.keep_last})"

    # ---------------------------------------------------------------------------------------
    def submit(self, step: int, *, retry: bool = False) -> None:
        """(all ranks, not collective) Queue the upload of committed local ``step``.

        Returns at once. On the coordinator, the upload runs on a background thread; on other
        ranks this does nothing. ``retry``: again, after a failed attempt (else the step was
        committed anew: attempts of an earlier step of that number no longer count).
        """
        if self._closed:
            raise RuntimeError("submit() on a closed Replicator")
        if self._coordinator is None:
            self._coordinator = bool(self._is_coordinator())
        if not self._coordinator:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="distckpt-replicate", daemon=True)
            self._thread.start()
        with self._lock:
            # Queued and listed as pending together (the thread takes the lock before it drops a
            # step from _pending): a failure between the two left a step pending that was never
            # queued (wait() never returned) or queued twice.
            self._queue.put_nowait(step)  # (unbounded: never blocks)
            if not retry:
                self._failures.pop(step, None)
            self._pending.append(step)
            self._submitted.append(step)

    def status(self) -> ReplicaStatus:
        """(any rank, not collective, never blocks) Where the submitted uploads stand."""
        with self._lock:
            return ReplicaStatus(tuple(self.uploaded), tuple(self.failed), tuple(self.skipped), tuple(self._pending))

    def wait(self, step: int | None = None, timeout: float | None = None, *, raise_on_failure: bool = True) -> ReplicaStatus:
        """(any rank, not collective) Wait until the uploads submitted so far have ended (with
        ``step``: those of steps up to ``step``), uploaded, skipped or failed.

        On ranks other than the coordinator nothing is uploaded: it returns at once.

        Args:
            step: wait only for this step and earlier ones.
            timeout: seconds to wait at most (``None``: no limit).
            raise_on_failure: raise a failed upload among those waited for (``False``: only
                report it in the returned status; it was warned about when it failed).

        Returns:
            The :class:`ReplicaStatus` once they ended.

        Raises:
            TimeoutError: ``timeout`` passed first (naming the steps still pending).
            ReplicationError: ``raise_on_failure`` and uploads of the steps waited for failed,
                each step with its cause.
        """
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf")
        ):
            raise ValueError(f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
            raise ValueError(f"step must be None or an int, got {step!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        late = self._unsubmitted() if self._unsubmitted is not None else None
        if late is not None and step is not None and step >= late:
            # Waiting would return at once, saying nothing of that step (or, were it waited
            # for, never end: only the joining call on every rank submits its upload).
            raise RuntimeError(
                f"replica.wait(step={step}): the asynchronous save of step {late} is still in flight (not joined), so "
                f"its upload is not submitted yet: call ckpt.wait() on every rank first (it commits the save and "
                f"submits the upload), then replica.wait()"
            )
        if late is not None and step is None:
            warnings.warn(
                f"distckpt: replica.wait(): the asynchronous save of step {late} is still in flight (not joined): its "
                "upload is not among those waited for; call ckpt.wait() on every rank first to include it",
                stacklevel=2,
            )

        def waited(s: int) -> bool:
            return step is None or s <= step

        with self._lock:
            while any(waited(s) for s in self._pending):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    pending = sorted(s for s in self._pending if waited(s))
                    raise TimeoutError(
                        f"uploads of step(s) {pending} to {self.remote.display()} still running after {timeout}s"
                    )
                self._done.wait(left)
            failed = [(s, m) for s, m in self.failed if waited(s)]
        if failed and raise_on_failure:
            raise ReplicationError(
                f"uploading {len(failed)} step(s) to {self.remote.display()} failed (committed locally at "
                f"{self.local.display()})",
                {s: m for s, m in failed},
            )
        return self.status()

    def close(self) -> None:
        """(all ranks, not collective) Wait for pending uploads, then stop the thread.

        Failures were already warned about and stay in :attr:`failed`.
        """
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    # ---------------------------------------------------------------------------------------
    # the background thread (coordinator)
    def _run(self) -> None:
        while True:
            step = self._queue.get()
            try:
                if step is _STOP:
                    return
                try:
                    self._handle(step)
                except BaseException as exc:  # noqa: BLE001 - this thread must outlive any one step
                    # E.g. warnings turned into errors (``-W error``), or an error while deciding
                    # whether a failed step was skipped: recorded as that step's failure (raised by
                    # wait()), and the thread goes on with the next step instead of dying with
                    # later steps left pending (wait() would never return).
                    with self._lock:
                        recorded = any(s == step for s, _ in self.failed) or step in self.uploaded or step in self.skipped
                        if not recorded:
                            self.failed.append((step, f"{type(exc).__name__}: {exc}"))
            finally:
                if step is not _STOP:
                    with self._lock:
                        self._pending.remove(step)
                        self._done.notify_all()
                self._queue.task_done()

    def holds(self, step: int, newest: int) -> bool:
        """(coordinator, root retention) Whether the root must keep committed ``step`` for its
        upload: queued or uploading, and kept by the remote's ``keep_last`` once ``newest`` (just
        committed) and the newer queued steps are there. Retention deleting it first would lose
        it from a replica that keeps more than the root (``replicate_keep_last``).

        A step whose upload failed (an object store down for a while), or that this replicator
        never handled (committed by an earlier run of the job whose upload a crash cut off, or
        saved before ``replicate_to`` was given), that the remote lacks and would keep is queued
        for upload here (again), and held until it is there: otherwise the root's retention
        deleted the only copy of a step the replica keeps. A failed step is retried without
        asking the remote first, and given up after :data:`UPLOAD_ATTEMPTS` failed attempts.
        Once closed (the root's retention at ``close()``), such a step is held with no upload:
        the next run's retention uploads it."""
        with self._lock:
            closed = self._closed
            queued = step in self._pending
            there = step in self.uploaded or step in self.skipped
            failures = self._failures.get(step, 0)
            newer = {s for s in self._pending if s > step} | ({newest} if newest > step else set())
        if queued:
            return self.keep_last is None or len(newer) < self.keep_last
        if there:
            return False  # uploaded
        if self._dropped_anyway(step):
            if failures:
                self._superseded_failure(step)
            return False
        if failures:
            # Retried in the background (nothing asked of the remote here: a store that hangs
            # would stall every commit), at most UPLOAD_ATTEMPTS times in all: a replica that
            # can never be written (a missing bucket) must not turn the root's keep_last off.
            if failures >= UPLOAD_ATTEMPTS:
                return False  # given up (its last failure's warning said the root retires it)
            if not closed:
                self.submit(step, retry=True)
            return True
        try:
            if self.remote.exists(step_dir(step), MANIFEST_NAME):
                return False  # there already (this job's, or another writer's commit of the number)
        except Exception:  # noqa: BLE001 - an unreachable remote: the upload fails and is reported
            pass
        if closed:
            return True
        log.info("step %d is not at %s: uploading it before the root's retention deletes it", step, self.remote.display())
        self.submit(step)
        return True

    def _superseded(self, step: int) -> bool:
        """A newer queued step will push ``step`` out of the remote's ``keep_last`` anyway."""
        if self.keep_last is None:
            return False
        with self._lock:
            newer = {s for s in self._pending if s > step}
        return len(newer) >= self.keep_last

    def _handle(self, step: int) -> None:
        with self._lock:
            moot = step in self.skipped  # (a queued retry of a failure superseded since)
        if moot:
            return
        if self._superseded(step):
            self._record(self.skipped, step)
            return
        t0 = time.perf_counter()
        try:
            nbytes = self._upload(step)
        except Exception as exc:  # noqa: BLE001 - recorded and warned, never fatal for training
            if self._superseded(step) or (
                isinstance(exc, FileNotFoundError) and not self.local.exists(step_dir(step), MANIFEST_NAME) and self._dropped_anyway(step)
            ):
                # Deleted locally by retention after newer steps committed, enough of them that
                # the remote's keep_last would drop it too: nothing lost.
                self._record(self.skipped, step)
                return
            msg = f"{type(exc).__name__}: {exc}"
            self._forget_failure(step)  # (a retry: one entry per step, the latest cause)
            self._record(self.failed, (step, msg))
            with self._lock:
                failures = self._failures[step] = self._failures.get(step, 0) + 1
            log.error("replication of step %d to %s failed (attempt %d): %s", step, self.remote.display(), failures, msg)
            then = (
                f"it was attempt {failures} of {UPLOAD_ATTEMPTS}: no more; the root's keep_last may retire the step now"
                if failures >= UPLOAD_ATTEMPTS
                else "retried at the next save, the root keeping the step meanwhile"
            )
            _warn(
                f"distckpt: step {step} was committed locally at {self.local.display(step_dir(step))} "
                f"but its upload to {self.remote.display(step_dir(step))} failed: {msg} ({then})"
            )
            return
        self._forget_failure(step)  # (a retry that succeeded: no longer failed)
        self._record(self.uploaded, step)
        with self._lock:
            older = sorted(s for s, _ in self.failed if s < step)
        for s in older:  # (also where the root keeps every step: no retention asks holds())
            if self._dropped_anyway(s):
                self._superseded_failure(s)
        log.info(
            "replicated step %d to %s: %.1f MB in %.2fs",
            step,
            self.remote.display(step_dir(step)),
            nbytes / 1e6,
            time.perf_counter() - t0,
        )
        try:
            self._apply_retention(step)
        except Exception as exc:  # noqa: BLE001
            _warn(f"distckpt: retention on {self.remote.display()} failed: {exc}")

    def _superseded_failure(self, step: int) -> None:
        """A failed ``step`` that the replica's ``keep_last`` drops anyway (newer steps are
        committed): its failure is moot, so it counts as skipped (``wait()`` raised it for good,
        though the replica holds what it keeps)."""
        self._forget_failure(step)
        with self._lock:
            self._failures.pop(step, None)
            if step not in self.skipped:
                self.skipped.append(step)

    def _forget_failure(self, step: int) -> None:
        with self._lock:
            self.failed[:] = [(s, m) for s, m in self.failed if s != step]

    def _record(self, where: list, item: object) -> None:
        with self._lock:
            where.append(item)

    def _dropped_anyway(self, step: int) -> bool:
        """Whether the remote's ``keep_last`` would drop ``step`` once the newer committed local
        steps are there (never with ``keep_last=None``: a step the replica keeps every one of
        that is gone locally before its upload is a failure, reported)."""
        return self.keep_last is not None and len([s for s in committed_steps(self.local) if s > step]) >= self.keep_last

    def _upload(self, step: int) -> int:
        """Copy one committed step; the remote manifest is written last. Returns bytes copied."""
        name = step_dir(step)
        where = self.local.display(name)
        try:
            manifest_bytes = self.local.read_bytes(name, MANIFEST_NAME)
        except FileNotFoundError:
            raise FileNotFoundError(f"{where} is not committed locally (no {MANIFEST_NAME})") from None
        manifest = Manifest.from_json(manifest_bytes, where)
        local_files = self.local.list_files(name)
        missing = sorted(f for f in manifest.files if f not in local_files)
        if missing:
            raise FileNotFoundError(
                f"{where} lacks {missing[:5]} on this node: the local root must be visible to the "
                "coordinator (single node or a shared filesystem) for replicate_to"
            )

        remote_where = self.remote.display(name)
        if self._committed_remotely(name, manifest_bytes, remote_where):
            return 0  # already there (e.g. submitted twice)
        ownership.remove_stale_leftovers(self.remote, self.lease_s)
        foreign = ownership.not_distckpts(self.remote, name)  # as a save's claim: never upload into it
        if foreign is not None:
            raise StepExistsError(f"step {step} cannot be uploaded: {remote_where} {foreign}; move it out of the replica's root")
        lease = ownership.Lease(self.remote, name, self.lease_s)
        try:
            lease.acquire()
        except FileExistsError:
            if self._committed_remotely(name, manifest_bytes, remote_where):
                return 0
            raise StepExistsError(
                f"step {step} at {remote_where} is being uploaded by another writer (its lease is live); not replaced"
            ) from None
        committed = False
        try:
            self._put_all(name, manifest)
            if not lease.still_mine():
                raise StepExistsError(f"step {step} at {remote_where}: another writer took the upload over")
            try:
                self.remote.write_bytes(manifest_bytes, name, MANIFEST_NAME, exclusive=True)  # the remote commit
            except FileExistsError:
                raise StepExistsError(
                    f"step {step} at {remote_where} was committed by another writer meanwhile; not replaced"
                ) from None
            committed = True
        finally:
            lease.release(committed)  # on failure: removes the remote directory it owns
        return manifest.total_bytes

    def _committed_remotely(self, name: str, manifest_bytes: bytes, where: str) -> bool:
        """Whether the remote step is committed with this very manifest.

        Raises:
            StepExistsError: it is committed with another manifest (another writer's checkpoint).
        """
        if not self.remote.exists(name, MANIFEST_NAME):
            return False
        there = self.remote.read_bytes(name, MANIFEST_NAME)
        if there == manifest_bytes:
            return True
        try:
            same_job = Manifest.from_json(there, where).job == Manifest.from_json(manifest_bytes, where).job is not None
        except Exception:  # noqa: BLE001 - an unreadable remote manifest: someone else's
            same_job = False
        if same_job:  # e.g. a run resumed from an older step saved this step again
            raise StepExistsError(
                f"{where} is already committed with an earlier checkpoint of this step by this job (a run resumed "
                "from an older step saves it again); the replica's is not replaced"
            )
        raise StepExistsError(
            f"{where} is already committed with a different checkpoint (another writer's); "
            "it is not replaced: give each job its own remote root"
        )

    def _put_all(self, name: str, manifest: Manifest) -> None:
        """Upload the data files, then ``.metadata``, and check every remote size."""
        data = sorted(f for f in manifest.files if f != _METADATA)
        map_in_threads(lambda f: self._put(name, f), data, self.max_concurrency, "distckpt-put")
        if _METADATA in manifest.files:
            self._put(name, _METADATA)
        remote_files = self.remote.list_files(name)
        wrong = {
            f: (rec.size, remote_files.get(f))
            for f, rec in manifest.files.items()
            if remote_files.get(f) != rec.size
        }
        if wrong:
            raise OSError(f"{self.remote.display(name)}: uploaded sizes differ from the manifest (expected, got): {wrong}")

    def _put(self, name: str, filename: str) -> None:
        """Copy one file; the local side is read through the local Storage's no-follow open."""
        rel = f"{name}/{filename}"
        with self.local.open(rel, "rb") as fi, self.remote._at(name, filename), self.remote.open(rel, "wb") as fo:
            shutil.copyfileobj(fi, fo, 16 << 20)
            self.remote.sync_file(fo)  # durable before the manifest commits it (local disks: fsync)

    def _apply_retention(self, uploaded: int) -> None:
        """Delete this job's remote steps beyond ``keep_last`` (manifest first; never the step
        just ``uploaded``), then stale leftovers of interrupted uploads (never a live writer's,
        see :mod:`distckpt.storage.ownership`)."""
        owned, forget = self._owned, self._forget
        if forget is not None:
            forget(self.remote, uploaded)  # (this job's now, whatever was remembered of the number)
        delete_old_steps(
            self.remote, self.keep_last, owned=(lambda s: owned(self.remote, s)) if owned is not None else None,
            keep=lambda s: s == uploaded, forget=(lambda s: forget(self.remote, s)) if forget is not None else None,
        )  # fmt: skip
        ownership.remove_stale_leftovers(self.remote, self.lease_s)
