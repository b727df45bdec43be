"""The :class:`Checkpointer`: collective save/load of a whole training state, sync or async.

A facade: it validates its options once (:class:`~distckpt.options.CheckpointerOptions`) and
hands every call to the driver that does it, in order: saves to
:class:`~distckpt.save.run.SaveDriver`, loads to :func:`distckpt.load.run.load`, the process group
and process-level concerns to :mod:`distckpt._process`. Read those for *how*.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from distckpt._ints import plain_int
from distckpt._dist import INTERRUPTS, interrupts_raised, left_alike, on_coordinator
from distckpt._process import GroupHolder, close_at_exit, closed, gc_paused
from distckpt.errors import CheckpointError, Interrupted, one_line
from distckpt.integrity.checksums import DEFAULT as DEFAULT_CHECKSUM
from distckpt.integrity.manifest import MANIFEST_NAME, Manifest, committed_steps, read_manifest, step_dir
from distckpt.integrity.stepfiles import read_metadata
from distckpt.load import run as loading
from distckpt.load.phases import LoadReport
from distckpt.options import ASYNC_MODES, CheckpointerOptions  # noqa: F401 (ASYNC_MODES: public before)
from distckpt.save.run import SaveDriver, SaveStats
from distckpt.storage import ownership
from distckpt.state.entries import targets_undone_on_failure
from distckpt.state.statecheck import StateDivergedError
from distckpt.storage.base import Storage
from distckpt.storage.lineage import Lineage
from distckpt.storage.local_tier import LocalTier, root_mark, superseded_by
from distckpt.storage.replica import Replicator

__all__ = ["Checkpointer", "SaveStats"]


def _refuse_root_in_a_step(storage: Storage, name: str = "checkpoint root") -> None:
    """(each rank, local paths) Refuse a root (``name``: or ``replicate_to``, ``local_dir``) that
    is a committed step, or lies inside one (a ``step_N`` folder given for a resume from that
    step, or a step copied as ``best``): its saves would write new steps into that step's
    folder (and a load would find nothing there and start from scratch), and the retention of
    that step's root would delete them with it. A folder is a step where its ``manifest.json``
    is a distckpt manifest; the path is judged where it really lies (links resolved).

    Raises:
        ValueError: naming the step and the root to pass instead.
    """
    if not storage.is_local:
        return
    path = os.path.realpath(storage.path)
    folder = path
    while True:
        if _holds_a_manifest(folder):
            inside = "is" if folder == path else "lies inside"
            raise ValueError(
                f"{name} {storage.display()} {inside} the committed step {folder}: its saves would write into that "
                f"step. Pass the checkpoint's root, {os.path.dirname(folder)} (load(state, step=N) loads step N)"
            )
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent


def _holds_a_manifest(folder: str) -> bool:
    """Whether ``folder`` holds a distckpt manifest (not any ``manifest.json``: a dataset's, a
    web app's)."""
    path = os.path.join(folder, MANIFEST_NAME)
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > _MANIFEST_MAX:
            return False
        with open(path, "rb") as f:
            raw = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and all(k in raw for k in ("step", "files", "entries", "distckpt_version"))


_MANIFEST_MAX = 1 << 28  # (a manifest of a million files is ~100 MB)


class Checkpointer:
    """Save and resume the complete training state of a (``torchrun``) job.

    Every rank constructs one with the same arguments. ``save``, ``load``, ``wait`` and ``close``
    are collective: every rank of the job calls them, in the same order. ``steps`` and
    ``latest_step`` only read storage, and any rank may call them alone. The options that change
    the protocol (``local_dir`` set or not, ``local_peers``, ``async_mode``, ``checksum``,
    ``verify_state``) are compared across ranks by the first collective call: where they differ
    it raises a ``ValueError`` on every rank naming each option and the ranks of each value, and
    so does every later call.

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
        replicate_keep_last: retention on ``replicate_to``: ``"same"`` (default) as ``keep_last``,
            ``None`` every step, or the newest N (a fast root keeping 2, object storage 20).
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
            rebuilds only these (:mod:`distckpt.state.safetypes`). Pass the same list on every rank
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
            training is blocked); ``False``: off. Sync saves prove each copy of an accelerator
            tensor to host memory alike (:mod:`distckpt.save.d2h`) unless ``False``.
        local_dir: the fast recovery tier (:mod:`distckpt.storage.local_tier`): a directory on
            each node (a tmpfs such as ``/dev/shm/JOB``; every rank of a node passes the same)
            where every committed step is also kept, each rank's files written there by its
            writer as they go to the root, and sent to its peer node. ``load`` then resumes
            from the newest step complete in the surviving nodes' tiers (files a node lost are
            sent by a node that has them), not older than the root's newest, without reading
            the root; else from the root. ``None`` (default): off.
        local_keep: committed steps each node keeps in ``local_dir``.
        local_peers: ``1``: each rank's files are also kept by the rank of the same local rank
            on the next node, so that losing one node loses no file; ``0``: no peer copies.
    """

    def __init__(
        self,
        root: str | os.PathLike,
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
        local_dir: str | os.PathLike | None = None,
        local_keep: int = 2,
        local_peers: int = 1,
        replicate_keep_last: int | None | str = "same",
    ) -> None:
        self.options = CheckpointerOptions(
            root, keep_last, storage_options, process_group, backend, timeout, thread_count, sync_files, checksum,
            save_rng, verify, background_nice, replicate_to, replicate_storage_options, fingerprint, on_replica_drift,
            verify_state, lease_s, skip_torch_record_crc, async_mode, verify_staging, job, safe_types, local_dir,
            local_keep, local_peers, replicate_keep_last,
        )  # fmt: skip
        options = self.options
        self.storage = Storage(options.root, options.storage_options)
        _refuse_root_in_a_step(self.storage)
        self._groups = GroupHolder(process_group, backend, options.timeout, agree=options.must_agree())
        self._lineage = Lineage(options.job)
        self.replica: Replicator | None = None
        if replicate_to is not None:
            remote = Storage(replicate_to, dict(replicate_storage_options or options.storage_options))
            _refuse_root_in_a_step(remote, "replicate_to")
            self.replica = Replicator(
                self.storage,
                remote,
                options.replicate_keep_last,  # type: ignore[arg-type]  # resolved from "same"
                # Upload from distckpt's coordinator (the group exists by the first submit).
                is_coordinator=lambda: self._groups.is_coordinator,
                owned=self._lineage.owns,
                forget=self._lineage.forget,
                unsubmitted=lambda: self._saver.in_flight_step,
            )
        self.local: LocalTier | None = None
        if options.local_dir is not None:
            _refuse_root_in_a_step(Storage(str(options.local_dir)), "local_dir")
            self.local = LocalTier(str(options.local_dir), options.local_keep, options.local_peers, root_mark(self.storage))
        self._saver = SaveDriver(options, self.storage, self._groups, self._lineage, self.replica, self.local)
        self._closed = False
        self._out_of_step: str | None = None  # (see _steps_kept)
        self._pid = os.getpid()
        self.last_load_report: LoadReport | None = None
        close_at_exit(self)

    def __getattr__(self, name: str) -> Any:
        # The options stay readable as attributes (ckpt.keep_last, ckpt.thread_count, ...).
        options = self.__dict__.get("options")
        if options is not None and name in CheckpointerOptions.__dataclass_fields__:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        replica = ""
        if self.replica is not None:  # where else the steps are, and what is kept there
            replica = f", replicate_to={self.replica.remote.url!r}, replicate_keep_last={self.options.replicate_keep_last}"
        return f"Checkpointer({self.storage.url!r}, keep_last={self.options.keep_last}{replica})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _tiers(self) -> list[Storage]:
        return [self.storage] + ([self.replica.remote] if self.replica is not None else [])

    def _open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"{call}() on a closed Checkpointer")
        self._forked(call)
        self._refuse_out_of_step(call)

    def _refuse_out_of_step(self, call: str) -> None:
        if self._out_of_step is not None:
            # (its next collective paired with a peer's leftover one: a gloo abort that killed
            # the peer, a peer taking this rank's arguments for its data and returning "saved")
            raise CheckpointError(
                f"{call}() refused: an interrupt (Ctrl-C, a signal handler's exception) stopped this Checkpointer's "
                f"{self._out_of_step} on this rank in its blocked part, where its peers may still wait in a collective; "
                "close() it and make a new Checkpointer, on every rank"
                + (
                    " (the process_group you gave it is out of step too: destroy it and make a new one with "
                    "torch.distributed.new_group on every rank, then the Checkpointer)"
                    if self._groups.user_pg is not None
                    else ""
                )
            )

    @contextlib.contextmanager
    def _steps_kept(self, call: str, midway: Callable[[], bool] = lambda: True) -> Iterator[None]:
        """Around a collective call: an interrupt that leaves it on this rank alone (not one
        every rank left alike, :func:`~distckpt._dist.interrupts_raised`) while ``midway()``
        (a save: inside its blocked collectives, not after its commit or in its wait for the
        previous save) marks this checkpointer out of step with its peers, so that its next call
        fails here (:meth:`_open`) instead of pairing its collectives with the ones they wait in."""
        try:
            yield
        except INTERRUPTS as exc:
            group = self._groups.group
            if not left_alike(exc) and midway() and group is not None and group.world_size > 1:  # (alone: no peers)
                self._out_of_step = call
            raise

    # -- listing (not collective) ---------------------------------------------------------------
    def steps(self, tier: str = "root") -> list[int]:
        """Committed steps, ascending. Not collective.

        Args:
            tier: ``"root"`` (default): under the root; ``"replica"``: under ``replicate_to``
                (the uploads done); ``"local"``: in this node's local tier (``local_dir``);
                ``"all"``: every step ``load(step=N)`` can read, from the root, the replica or
                this node's local tier.

        Raises:
            ValueError: another ``tier``, or ``"replica"`` without ``replicate_to``, or
                ``"local"`` without ``local_dir``.
            FileNotFoundError: the root's (or replica's) bucket does not exist or is not
                accessible, naming it (with ``tier="all"`` and a local tier holding steps: those
                steps, as ``latest_step()``).
        """
        if tier not in ("root", "replica", "local", "all"):
            raise ValueError(f'steps(tier=...) takes "root", "replica", "local" or "all", got {tier!r}')
        if tier == "replica" and self.replica is None:
            raise ValueError('steps(tier="replica"): this Checkpointer has no replica (replicate_to is not set)')
        if tier == "local" and self.local is None:
            raise ValueError('steps(tier="local"): this Checkpointer has no local tier (local_dir is not set)')
        local = self.local.committed() if self.local is not None and tier in ("local", "all") else []
        if tier == "local":
            return local
        tiers = self._tiers() if tier == "all" else [self.storage if tier == "root" else self.replica.remote]  # type: ignore[union-attr]
        found = set(local)
        for storage in tiers:
            try:
                listed = committed_steps(storage)
                if not listed:
                    # A misspelled bucket is no empty root: name it (as latest_step and load do).
                    storage.check_bucket()
                found.update(listed)
            except OSError as exc:
                if tier != "all" or self.local is None:
                    raise
                if not local and isinstance(exc, (FileNotFoundError, PermissionError)):
                    raise  # (a misspelled bucket or refused credentials, nothing local: as latest_step)
                # Unreachable (a stopped object store): a load reads the local tier's steps.
        return sorted(found)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` if there is none (local or replica): the step
        ``load(state)`` resumes. With ``job=`` given, the newest of that job's steps (and of
        steps that recorded no job): another job's on a shared root is not this run's to resume.
        With a local tier and neither the root nor the replica there (a missing mount, a stopped
        object store), the newest step of this node's tier, which ``load`` resumes from the
        tiers. Not collective.

        Raises:
            CheckpointError: without ``job=``, the root holds no committed step and the replica
                holds steps of several jobs (which is this run's cannot be told: pass ``job=``).
            FileNotFoundError: the root's bucket does not exist (or is not accessible), naming it.
        """
        tiers, eligible = self._tiers(), self._eligible()
        if self.local is None:
            try:
                return loading.locate(tiers, None, eligible)[1]
            except FileNotFoundError:  # (no root, or no step this job may resume)
                # A root in a bucket that does not exist is no new root: saves there fail. Said
                # now, naming the bucket, not after a fresh start trained until its first save.
                self.storage.check_bucket()
                return None
        # With a local tier: as load decides (local_tier.decide over _root_listing).
        try:
            found = self._root_listing()
        except OSError:  # unreachable while listing: the tier decides, as in load
            found = None
        held = [s for s in self.local.committed() if self._lineage.may_resume(self.local.storage, s)]
        local = max(held, default=None)
        if found is None:
            if local is None:
                try:
                    gone = not self.storage.root_exists()
                except PermissionError:
                    raise  # (credentials refused: as without a tier, not a fresh start)
                except OSError:  # unreachable: the tier decides (it holds nothing)
                    gone = False
                if gone:
                    self.storage.check_bucket()  # (a misspelled bucket, as without a tier)
            return local
        listed, steps, lagging = found
        newest = max(steps, default=None)
        if lagging and local is not None and (newest is None or local >= newest):
            return local  # a step the replica has not received yet
        if listed is not self.storage and eligible is None and steps and newest not in held:
            # The replica's, as load's fallback takes them: refused where it holds several jobs'
            # (not where this root's tier holds its newest: load serves that from the tier).
            loading.refuse_several_jobs(self.storage, listed, steps)
        return newest if newest is not None or not lagging else local

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest, as :meth:`latest_step`).
        ``FileNotFoundError`` if not committed. Not collective."""
        step = plain_int(step)  # type: ignore[assignment]
        if self.local is not None:
            # The step load reads, from the tier where neither the root nor the replica has it
            # (the root unreachable, or a step it no longer keeps).
            step = self.latest_step() if step is None else step
            if step is not None and step in self.local.committed():
                held = read_manifest(self.local.storage, step)
                try:  # (None where neither the root nor the replica holds it, or is there)
                    found = self._root_manifest(step)
                except OSError:
                    found = None
                if found is None:
                    return held
                # The commit load compares the tier's copy with (and then loads), as decide judges:
                # the root's; the replica's only where it is this root's and newer than the tier's.
                theirs = Manifest.from_json(found[0])
                if not found[1] or superseded_by(held, theirs.root, theirs.job, theirs.created_unix):
                    return theirs
                return held
        storage, step = loading.locate(self._tiers(), step, self._eligible())
        return read_manifest(storage, step)

    def _eligible(self) -> Callable[[Storage, int], bool] | None:
        """What ``step=None`` may resolve to (:meth:`Lineage.may_resume`); ``None``: any step."""
        return self._lineage.may_resume if self._lineage.fixed else None

    # -- saving ---------------------------------------------------------------------------------
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
            step: a non-negative int (NumPy's integers and 0-d integer tensors too), the same on
                every rank; must not be committed already.
            state: name -> module, optimizer, scheduler/scaler/any object with ``state_dict``,
                tensor, or plain value (same names on every rank).
            blocking: ``False`` returns once the state is copied to host memory and writes in
                the background; ``wait()`` commits it. A previous in-flight save is waited for
                first, and its error (if any) is raised here. The same on every rank.
            metadata: JSON values recorded in the manifest (``extra``).

        Raises:
            ValueError: the ranks passed different steps, entries or ``blocking`` (on every rank,
                naming each rank's).
            StepExistsError: ``step`` is already committed, or another writer is writing it (an
                async save finds the latter in its background part: raised by ``wait()``, the
                next ``save`` or ``close()``, like its other errors).
            CheckpointError: writing failed on some rank (same error on every rank).
        """
        self._open("save")
        with self._steps_kept(f"save of step {step}", lambda: self._saver.in_collectives):
            self._saver.save(plain_int(step), state, blocking, metadata)  # type: ignore[arg-type]

    def prepare_staging(self, state: Mapping[str, Any]) -> None:
        """(all ranks) Reserve, in the background, the host memory async saves of ``state`` will
        stage into, so that the first ``save(..., blocking=False)`` blocks no longer than later
        ones; returns at once.

        A first async save otherwise allocates its staging buffers while training waits: page
        faults over the whole state and, for CUDA tensors, registering it as pinned memory (most
        of its blocked time). Call it once the model and optimizer exist (after a first optimizer
        step, so that the optimizer's state exists too), e.g. right after ``load``; training
        goes on meanwhile. A later save of another structure allocates anew, as without it.
        With ``async_mode="process"`` it also starts the writer process (collective), so that
        its start-up does not delay the first async save's commit.

        Raises:
            The same errors a save of ``state`` would raise while preparing (on every rank).
        """
        self._open("prepare_staging")
        with self._steps_kept("prepare_staging", lambda: self._saver.in_collectives):
            self._saver.prepare_staging(state)

    @property
    def in_flight(self) -> bool:
        """True while an async save is still writing on this rank. Not collective, never blocks
        or raises: the save is committed (or its error raised) by the next ``wait``/``save``."""
        return self._saver.in_flight

    @property
    def last_save(self) -> SaveStats | None:
        """Timings of the last committed save (:class:`SaveStats`)."""
        return self._saver.last_save

    def wait(self) -> SaveStats | None:
        """(all ranks) Block until the in-flight save (if any) is committed.

        Returns its stats, or ``None`` if nothing was in flight. Raises the background save's
        error, identically on every rank.
        """
        self._forked("wait")
        self._refuse_out_of_step("wait")
        return self._saver.wait()

    def close(self) -> None:
        """(all ranks) Wait for the in-flight save and release staging buffers, threads, the
        writer process and distckpt's process group (also done at interpreter exit).

        Interrupted while it waits (Ctrl-C), the save stays in flight and nothing is released,
        as with :meth:`wait`: a second ``close()`` finishes it. In a child forked from the
        process that made the checkpointer it only marks it closed (all it holds is the
        parent's)."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True
            closed(self)
            return
        try:
            if self._out_of_step is None:
                self._saver.wait()
            elif self._saver.in_flight_step is not None:  # (not expected: the flag clears before one starts)
                warnings.warn(
                    f"distckpt: close() after an interrupt left this checkpointer out of step: the save of step "
                    f"{self._saver.in_flight_step} in flight is abandoned (not committed)",
                    stacklevel=2,
                )
        except Exception:
            self._release()
            raise
        # (a KeyboardInterrupt passes through with nothing released: the save is still running)
        self._release()

    def _release(self) -> None:
        self._closed = True
        try:
            if self.replica is not None:
                self.replica.close()  # (waits for the uploads)
                self._saver.retire_uploaded()
        finally:
            try:
                self._saver.close()
            finally:
                self._groups.release()
                closed(self)

    def _forked(self, call: str) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"{call}() in process {os.getpid()}, a child forked from process {self._pid}, which made this "
                "Checkpointer (its saves, writers and process group are the parent's): make a new one in the child"
            )

    # -- loading --------------------------------------------------------------------------------
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
            step: which step (an int, NumPy's integers too); ``None`` for the newest committed one
                (with ``job=`` given, that job's newest: :meth:`latest_step`).
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
            StepDeletedError: ``step`` (or, with ``strict=False``, the newest step) was deleted or
                committed anew while it was read, e.g. by the retention of a job saving to the
                same root; with ``step=None`` the newest committed step is loaded instead, with a
                warning, a few times before this is raised; with ``step=N``, step N from the
                replica (``replicate_to``) where it holds it (the same commit)
                (``last_load_report.tier`` is then ``"replica"``).
            ValueError: the ranks passed different ``step``, ``strict``, ``verify_state``, ``only``
                or ``exclude`` (on every rank, naming each and the ranks of each value).
            StateMismatchError: ``strict`` and keys/shapes differ (missing, unexpected, mismatched
                keys are listed).
            CheckpointError: reading failed on some rank.
        """
        self._open("load")
        step = plain_int(step)  # type: ignore[assignment]  # NumPy's integers too
        self.wait()  # the in-flight async save (outside the GC pause: it may take long)
        # A load that fails leaves no report: the previous load's would describe another step.
        self.last_load_report = None
        with self._steps_kept("load"), interrupts_raised(), gc_paused(), targets_undone_on_failure():
            group = self._groups.get()
            for storage in self._tiers():
                storage.refuse_unshared(group.world_size, "load")
            loaded = None
            if self.local is not None:
                loaded = self._load_local(group, state, step, strict, restore_rng, verify_state, only, exclude)
            if loaded is None:
                loaded = loading.moving_on(
                    lambda skip, expect: loading.load(
                        group, self.options, self._tiers()[skip:], state, step, strict, restore_rng, verify_state, only, exclude,
                        expect=expect, eligible=self._eligible(),
                    ),
                    step,
                    strict,
                )
            if self.replica is not None and loaded.storage is self.replica.remote:
                loaded.report.tier = "replica"
        if not (only or exclude):  # a resume (not a new run from part of it): continue its job
            self._lineage.adopt(loaded.manifest.job)
        self.last_load_report = loaded.report
        return loaded.step

    def _root_listing(self) -> tuple[Storage, list[int], bool] | None:
        """(coordinator, for the local tier and :meth:`latest_step`) Where the root's committed
        steps are listed from, those steps (with ``job=``: this job's, as ``load(step=None)``
        takes from the root) and whether they lag behind the saves the tier holds (see
        :func:`~distckpt.storage.local_tier.decide`). The root's, where it is there and holds
        any; else the replica's: lagging where the root is unreachable (its uploads follow the
        saves), not where the root is there but empty (its steps were deleted). Never the two
        merged: a replica's step newer than the root's newest was deleted at the root (a
        rollback) or is another job's on a shared replica, neither this run's to resume.
        ``None`` where neither is there (a root moved away or unreachable: the local tier
        decides)."""
        root_there = _there(self.storage)
        if root_there:
            steps = [s for s in committed_steps(self.storage) if self._lineage.may_resume(self.storage, s)]
            if steps or self.replica is None:
                return self.storage, steps, False
        if self.replica is not None and _there(self.replica.remote):
            remote = self.replica.remote
            return remote, [s for s in committed_steps(remote) if self._lineage.may_resume(remote, s)], not root_there
        return (self.storage, [], False) if root_there else None

    def _root_steps(self) -> tuple[list[int], bool] | None:
        """(coordinator, for the local tier) :meth:`_root_listing`'s steps and whether they lag."""
        found = self._root_listing()
        return None if found is None else (found[1], found[2])

    def _root_manifest(self, step: int) -> tuple[bytes, bool] | None:
        """(coordinator, for the local tier) The bytes of ``step``'s manifest at the root, else at
        its replica, and whether they are the replica's; ``None`` where neither holds it. The
        replica's count only where it records this root and is newer than the tier's copy
        (``local_tier.decide``): a shared replica holds other roots' steps of the same numbers."""
        for t in self._tiers():
            try:
                return t.read_bytes(step_dir(step), MANIFEST_NAME), t is not self.storage
            except FileNotFoundError:
                continue  # (the root no longer keeps the step): the replica's
            except OSError:
                if t is not self.storage:
                    raise
                # (the root cannot be reached): the replica's
        return None

    def _load_local(self, group: Any, state: MutableMapping[str, Any], step: int | None, *args: Any) -> loading.Loaded | None:
        """(all ranks) The load from the local tier, or ``None`` where the root must serve it (a
        warning said why). A state that does not match the checkpoint is raised as from the root.

        First attempt: the nodes' copies judged by their sizes (the load checks every byte it
        reads anyway). A damaged copy then fails that load with an ``IntegrityError`` on every
        rank; the second attempt checks every copy's checksum first and takes the intact one
        (a damaged copy is replaced by a peer's). Where that fails too and the root is
        unreachable, the tier's older steps, newest first (the step that failed passed by).
        Then the root."""
        local = self.local
        assert local is not None
        strict, restore_rng, _, only, exclude = args

        planned: dict[int, tuple[Manifest, loading.Planned]] = {}

        def needs(manifest: Manifest) -> set[str]:
            # What this rank's load will read: a node is sent only what its ranks read. Every
            # node holds the step's .metadata by now (recover() called this on every rank
            # alike): read and verified once, by the coordinator, as the root's load reads it.
            # Four ranks scanning it at once (its safety scans are pure Python) cost a recovery
            # a fifth of its time; another node's damaged copy goes unread (the load reads none).
            metadata = on_coordinator(group, "load", lambda: read_metadata(local.storage, manifest, verify=True))
            ahead = loading.plan_ahead(group, manifest, metadata, state, restore_rng, only, exclude)
            planned[manifest.step] = (manifest, ahead)  # the load reuses this plan and its metadata
            return set(ahead.files)

        # With verify=False the load checks nothing: the tier's copies are checked up front.
        checks = (False, True) if self.options.verify else (True,)
        attempt = 0
        failed: dict[int, str] = {}  # steps that could not be loaded from the tier, and why
        while True:
            check = checks[min(attempt, len(checks) - 1)]
            planned.clear()
            recovery = local.recover(
                group, step, self._root_steps, check, needs, agree=loading.arguments(step, args[0], args[2], only, exclude),
                root_manifest=self._root_manifest, job=self._lineage.job if self._lineage.fixed else None, failed=failed,
            )
            chosen, sources = recovery.step, recovery.sources
            if chosen is None and not recovery.failed:
                return None  # (recover said why, where the tier should have served)
            problem = recovery.failed
            if chosen is not None:
                # Every rank read and verified the step's .metadata to plan its files: the load
                # reuses it and the plan instead of reading and planning again (on every rank alike,
                # or on none: recover agreed on whether every rank's needs() succeeded). Only with a
                # checksum was the metadata checked against the agreed manifest.
                made = planned.get(chosen) if recovery.planned else None
                ready = (made[0], made[1].metadata) if made is not None and made[0].checksum_algorithm else None
                try:
                    loaded = loading.load(
                        group, self.options, [local.storage], state, chosen, *args, preread=ready,
                        planned=made[1] if ready is not None else None,
                        streams=recovery.streams if ready is not None else (),
                        # Named alike on every rank: a caller's mistake (a typo in only=) is then the
                        # same error everywhere, raised as such, not taken for damaged copies.
                        where=f"{self.storage.display(step_dir(chosen))} (the local tier's copy)",
                    )
                except Interrupted:  # Ctrl-C on some rank: no load from the root after it
                    raise
                except StateDivergedError as exc:
                    # Values other than the saved ones. With checksums the bytes read were the
                    # saved ones: the state's own doing (a load hook), raised as from the root.
                    # Without (checksum=None), only the fingerprints could catch a damaged copy.
                    if made is not None and made[0].checksum_algorithm:
                        raise
                    problem = one_line(exc)
                except (CheckpointError, OSError) as exc:  # damaged, unsafe or unreadable copies
                    problem = one_line(exc)
                else:
                    if recovery.older:  # never silently: latest_step() named the newer step
                        warnings.warn(
                            f"distckpt: recovered step {chosen} from the local tier, an older one: {recovery.older}, and "
                            "the root cannot be listed",
                            stacklevel=3,
                        )
                    loaded.report.tier = "local"
                    loaded.report.sources = sources
                    return loaded
            tried = recovery.tried
            if attempt < len(checks) - 1:
                then = "checking every local copy and retrying"
                attempt += 1
            elif recovery.later and tried is not None and tried not in failed and (chosen is None or strict):
                # The root cannot serve (unreachable): the tier's newest step that can serve is
                # loaded, not none (a file whose only copy is damaged fails its step alone). Not
                # after a strict=False load read part of the newer step: an older step need not
                # hold every key it wrote, and those would be reported as left as they were.
                then = "trying the tier's older steps"
                failed[tried] = f"loading it failed ({problem})"
            else:
                then = "loading from the root"
            # On every rank (the failure is the same on all): one turned into an error by the
            # caller's filters then ends the load on every rank alike, not on the coordinator alone.
            warnings.warn(f"distckpt: loading step {tried} from the local tier failed ({problem}); {then}", stacklevel=3)
            if then == "loading from the root":
                return None


def _there(storage: Storage) -> bool:
    """Whether ``storage``'s root is there; ``False`` where it cannot be reached (a missing mount,
    a stopped object store)."""
    try:
        return storage.root_exists()
    except OSError:
        return False
