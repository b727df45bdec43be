"""distckpt checkpoints for Lightning: a ``CheckpointIO`` plugin and the DDP strategy it needs.

What a Lightning user adds::

    from distckpt.integrations.lightning import DistckptCheckpointIO, DistckptDDPStrategy
    trainer = Trainer(..., strategy=DistckptDDPStrategy(), plugins=[DistckptCheckpointIO("s3://b/run1", async_save=True)])
    trainer.fit(model, ckpt_path="last")

**The seam.** Lightning's ``Strategy.save_checkpoint`` and ``remove_checkpoint`` call the
``CheckpointIO`` on global rank 0 only, while the other ranks wait in a barrier; a distckpt save
is collective (every rank writes its share, and all agree on the commit). Lightning's own
strategies with collective checkpoints (FSDP, ModelParallel) override those two methods and
bypass the ``CheckpointIO``. :class:`DistckptDDPStrategy` is ``DDPStrategy`` with those two
overrides, calling the plugin on every rank when the plugin is a :class:`DistckptCheckpointIO`
(any other ``CheckpointIO`` keeps Lightning's rank-0 behaviour). ``load_checkpoint`` and
``teardown`` already run on every rank. A single-device ``Trainer`` needs no special strategy;
under another multi-process strategy the plugin refuses to run (it would hang), naming the fix.

**Paths and steps.** Lightning names checkpoints by path (``.../epoch=1-step=100.ckpt``,
``last.ckpt``). The plugin writes the state as distckpt step ``global_step`` under its root and,
once that step is committed, a small JSON *pointer* file at Lightning's path (root, step, the
job that saved it, the checkpoint's top-level keys). So everything Lightning does with its
files keeps working: ``ckpt_path="last"`` (it looks for ``last*.ckpt`` files), the version
counter of ``ModelCheckpoint`` and its existence checks. ``load_checkpoint(path)`` reads the
pointer and loads the step from the plugin's own root, after checking that the step there was
saved by the pointer's job (so a copied or moved root still loads, and a pointer from another
run never loads a different checkpoint). Several saves at one global step (two
``ModelCheckpoint`` callbacks, ``save_last`` beside a top-k save) write one distckpt step and
several pointers to it; a later save's values that differ from the step's (callbacks' and loops'
bookkeeping, the optimizers' ``param_groups``) are kept in its pointer
(:mod:`~distckpt.integrations.lightning_overlay`), and one whose model's or optimizers' tensors
changed since is refused.

**What is stored.** Every top-level item of Lightning's checkpoint dict is an entry of the
distckpt state (names escaped: distckpt reserves ``.`` and a leading ``_``): tensors as DCP
tensors, nested dicts and lists as distckpt trees, everything else as values distckpt stores
without pickling code (it refuses, naming the key, what it could not read back safely). The
structure (containers, key types, tensor shapes and dtypes) goes into the manifest
(``extra["lightning"]``), so a load rebuilds the dict without a live model: also for
``validate``/``test`` and at another world size (DDP state is replicated; distckpt's per-rank
RNG state is restored, or reseeded at another world size).

**Retention.** ``ModelCheckpoint`` (``save_top_k``, ``save_last``) deletes checkpoints through
``remove_checkpoint``: the plugin deletes the pointer, and deletes the step once no pointer it
can see refers to it any more (pointers in the trainer's checkpoint directories and in every
directory this process saved to or loaded from), only if the step is this job's (never another
job's step in a shared root), through the same primitives as distckpt's ``keep_last``. With
``async_save=True`` deletions and pointers wait until the in-flight save has committed, so a
removal never deletes the last good checkpoint while its replacement is still being written.

Which ranks call what: ``save_checkpoint``, ``remove_checkpoint``, ``load_checkpoint`` and
``teardown``/``close`` are collective (every rank, in the same order: with
:class:`DistckptDDPStrategy`, Lightning makes these calls on every rank); pointer files are read,
written and removed by global rank 0, which hands its outcome to every rank, so an error is
raised on every rank alike.

This module holds the plugin and the strategy; the checkpoint-dict layout is
:mod:`distckpt.integrations.lightning_layout`, the pointer files (and the deletion of steps none
refers to) :mod:`distckpt.integrations.lightning_pointers`.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

try:  # the optional dependency of this module (the [lightning] extra): imported here, at the top
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "distckpt.integrations.lightning needs Lightning (>= 2.4): pip install 'distckpt[lightning]'"
    ) from exc

import torch

from distckpt._compat import flatten_state_dict
from distckpt._dist import Group, all_ranks, exchange, interrupts_raised, on_coordinator
from distckpt._process import process_exists
from distckpt.checkpointer import Checkpointer
from distckpt.errors import (
    CheckpointError,
    IntegrityError,
    Interrupted,
    StateMismatchError,
    StepExistsError,
    one_line,
)
from distckpt.integrations import lightning_overlay as overlays
from distckpt.integrations.lightning_layout import (
    LAYOUT_KEY,
    entry_name,
    node_texts,
    prepare,
    rank_layouts,
    read_layout,
    template,
    with_rank_nodes,
)
from distckpt.integrations.lightning_pointers import (
    POINTER_FORMAT,
    _root_id,
    Pointer,
    PointerRecord,
    as_record,
    check_pointer_path,
    delete_unreferenced,
    dir_of,
    dir_url,
    exists,
    pointer_bytes,
    pending_of,
    pointer_files_in,
    read_pointer,
    record_path,
    register_dir,
    registered_dirs,
    remove_file,
    resolve,
    try_pointer,
    with_pending,
    write_pointer,
)
from distckpt.integrity.manifest import step_dir
from distckpt.state import fingerprint
from distckpt.storage.base import local_path
from distckpt.storage import ownership

__all__ = ["POINTER_FORMAT", "DistckptCheckpointIO", "DistckptDDPStrategy"]

#: (root, step) of the saves the plugins of this process have begun and not yet settled: a
#: pending pointer this process wrote is a stopped save's only where it is not among them.
_SAVING: set[tuple[str, int]] = set()

#: What waits for a save to commit, in order: ``("point", path, record)`` or ``("remove", path, None)``.
_Action = tuple[str, str, PointerRecord | None]


# --------------------------------------------------------------------------------------------
# the plugin
def _compared(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model's and the optimizers' tensors of a Lightning state (prepared), by flat key."""
    compared = {k: state[k] for k in (entry_name("state_dict"), entry_name("optimizer_states")) if k in state}
    return {k: v for k, v in flatten_state_dict(compared)[0].items() if isinstance(v, torch.Tensor)}


def _unchanged(before: tuple[weakref.ref, int] | None, t: torch.Tensor) -> bool:
    """Whether ``t`` is the tensor whose :func:`_identity` was ``before``, unchanged since (the same
    live storage, the same version counter)."""
    now = _identity(t)
    return before is not None and now is not None and before[0]() is not None and before[0]() is now[0]() and before[1] == now[1]


def _identity(t: torch.Tensor) -> tuple[weakref.ref, int] | None:
    """The storage of ``t`` (held weakly: its Python object lives as long as the storage does,
    and a dead one never equals a new one at the same address) and its version counter, which
    every in-place change moves; ``None`` for a tensor without a storage (sparse, nested)."""
    try:
        return weakref.ref(t.untyped_storage()), t._version
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class DistckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves and loads distckpt checkpoints.

    Use it with :class:`DistckptDDPStrategy` (multi-process) or on a single device. Every rank
    constructs it with the same arguments.

    Args:
        root: distckpt root for the step checkpoints: a local path or an fsspec URL
            (``s3://bucket/run1``). Lightning's paths (``ModelCheckpoint(dirpath=...)``) hold the
            pointer files; they may be anywhere, the root included.
        async_save: save with ``blocking=False``: training goes on once the state is staged in
            host memory; the pointer appears, and removals asked for meanwhile run, when the
            plugin next sees the save committed (the next save, removal or load, or teardown).
            Lightning's ``AsyncCheckpointIO`` wrapper is refused: it would run this collective
            save in a thread, beside removals on the main thread.
        restore_rng: restore the RNG states saved with the checkpoint (same world size: exactly;
            another: reseeded deterministically). ``False`` leaves the RNG as it is.
        **options: passed to :class:`~distckpt.Checkpointer` (``storage_options``, ``keep_last``,
            ``checksum``, ``replicate_to``, ``job``, ...). ``keep_last`` deletes steps by age,
            beside ``ModelCheckpoint``'s own deletions: a pointer to a step it retired then
            fails to load (``FileNotFoundError`` naming both); leave it unset with ``save_top_k``.

    Raises:
        ValueError, TypeError: invalid options (checked here, by constructing the checkpointer).
    """

    def __init__(
        self, root: str | os.PathLike, *, async_save: bool = False, restore_rng: bool = True, **options: Any
    ) -> None:
        super().__init__()
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}")
        if not isinstance(restore_rng, bool):
            raise TypeError(f"restore_rng must be True or False, got {restore_rng!r}")
        self._ckpt: Checkpointer | None = Checkpointer(root, **options)  # validates root and options now
        self.root = os.fspath(root)
        self.async_save = async_save
        self.restore_rng = restore_rng
        self._options = dict(options)
        # The job this process saves as (its steps are the ones ModelCheckpoint may delete): the
        # given one, else that of the steps it saved or resumed from (distckpt's lineage).
        self._job: str | None = options.get("job")
        self._strategy: Callable[[], DDPStrategy | None] | None = None  # weakref to the attached strategy
        self._steps: dict[int, frozenset[str]] = {}  # steps saved or loaded here -> Lightning keys they hold
        self._earlier: dict[int, frozenset[str]] = {}  # the same, before the last teardown
        # The last step saved here -> the model's and optimizers' tensors as saved: (their
        # storage, held weakly, and version counter) by key; see _same_as_saved.
        self._saved_tensors: dict[int, dict[str, tuple[weakref.ref, int] | None]] = {}
        # The same step -> this rank's digests of the model's and optimizers' values that are not
        # tensors (a module's get_extra_state(); lightning_overlay.model_values), ``None`` where
        # they could not be made: a later save at the step must hold them alike, as its tensors.
        self._saved_values: dict[int, dict[str, str] | None] = {}
        # The last step saved or loaded here -> its values beyond the model's and optimizers' state
        # (this rank's digests, lightning_overlay.digest): what a later save at it is compared with.
        self._snapshot: tuple[int, dict[str, str]] | None = None
        self._inflight: int | None = None  # step of the async save being written
        self._pending: list[_Action] = []
        self._dirs: set[str] = set()  # directories of every path seen: where pointers are looked for
        self._registered: set[str] = set()  # directories this process recorded in the root (register_dir)
        self._kept: set[int] = set()  # orphaned steps kept for files the user added (retried)
        # (rank 0) Final pointers written here at local paths -> (step, job, mtime_ns): one removed
        # or replaced behind the plugin's back orphans its step too (see _replaced_elsewhere).
        self._written: dict[str, tuple[int, str | None, int]] = {}
        self._thread: int | None = None

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def checkpointer(self) -> Checkpointer:
        """The :class:`~distckpt.Checkpointer` behind the plugin (created again after teardown).
        Its listing calls (``steps()``, ``manifest()``) may be used on any rank."""
        if self._ckpt is None:
            options = dict(self._options)
            if options.get("job") is None and self._job is not None:
                # A new checkpointer after teardown (fit, then fit again): it continues this
                # process's job, so that its saves retire the earlier ones as before.
                options["job"] = self._job
            self._ckpt = Checkpointer(self.root, **options)
        return self._ckpt

    def attach(self, strategy: DDPStrategy) -> None:
        """(every rank) Called by :class:`DistckptDDPStrategy` once the process group exists: the
        strategy calls this plugin on every rank, and its trainer names the checkpoint directories."""
        self._strategy = weakref.ref(strategy)

    def __getstate__(self) -> dict[str, object]:
        # Spawn launchers pickle the plugin into each rank: the checkpointer (threads, locks) and
        # the strategy reference are made again there.
        state = self.__dict__.copy()
        state.update(_ckpt=None, _strategy=None, _thread=None)
        return state

    def teardown(self) -> None:
        """(every rank) Lightning calls this at the end of fit/validate/test: wait for the
        in-flight save, write its pointer, run the removals that waited for it, and close the
        checkpointer (staging memory, writer processes, distckpt's process group)."""
        try:
            if self._ckpt is not None:
                self._settle()
        finally:
            ckpt = self._ckpt
            self._thread = None
            # A save at a step seen before skips the save (one more pointer to it); that holds
            # within one fit. After teardown the plugin may serve another run (a sweep or a
            # notebook reusing it), whose save at a step the earlier run saved or loaded pointed
            # at the earlier run's state, silently: such a step is taken again only for the very
            # tensors it saved, unchanged (trainer.save_checkpoint after fit), see _same_as_saved.
            self._earlier.update(self._steps)
            self._steps.clear()
            try:
                if ckpt is not None:
                    ckpt.close()
                    self._retire_at_teardown(ckpt)
            finally:
                self._ckpt = None

    def _retire_at_teardown(self, ckpt: Checkpointer) -> None:
        """(rank 0 where it has any; not collective) After ``close()``, whose wait let the uploads
        end: the steps this process's removals held (for their upload to the replica, or for the
        user's files in them) and those of pointers replaced behind its back since its last removal
        (:meth:`_replaced_elsewhere`: ModelCheckpoint(save_last="link") links last.ckpt after the
        run's last save) are deleted where no pointer names them. Without it the root kept them for
        good: no removal of a later process looks at them. Those still held (an upload that failed:
        the next run uploads it; the user's files) stay."""
        self._delete_orphans(ckpt, set())

    close = teardown

    # -- CheckpointIO -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: object = None) -> None:
        """(every rank) Save Lightning's checkpoint dict as distckpt step ``global_step`` and point
        ``path`` at it.

        Raises:
            TypeError: ``storage_options`` given (configure storage in the constructor), or a
                value distckpt cannot store safely (its key named).
            ValueError: no valid ``global_step``; a full save after a weights-only save at the
                same global step; a ``path`` inside a checkpoint (the root's step directories or
                any folder holding ``manifest.json``/``.metadata``), the root itself, or a directory.
            StepExistsError: the root holds this global step from another run or job.
            RuntimeError: called on one rank of several (a strategy other than
                :class:`DistckptDDPStrategy`).
        """
        self._enter("save_checkpoint")
        if storage_options is not None:
            raise TypeError(
                "DistckptCheckpointIO.save_checkpoint does not take storage_options: pass them to "
                "DistckptCheckpointIO(root, storage_options=...)"
            )
        step = checkpoint.get("global_step") if isinstance(checkpoint, Mapping) else None
        if type(step) is not int or step < 0:
            raise ValueError(f"a Lightning checkpoint must hold 'global_step', an int >= 0, got {step!r}")
        keys, state, layout, every_rank_keys = self._prepare(checkpoint, path)
        # Before anything is saved, on every rank alike: a pointer must not land in a checkpoint
        # (it would replace a committed step's files) nor be refused after the step committed.
        on_coordinator(Group(), f"checking Lightning checkpoint path {os.fspath(path)}", lambda: check_pointer_path(path, self.root))
        self._remember(path)
        ckpt = self.checkpointer
        epoch = checkpoint.get("epoch")
        record: PointerRecord = {"step": step, "keys": keys, "epoch": epoch if type(epoch) is int else None}
        known = self._steps.get(step)
        if known is None and step in self._earlier and self._same_as_saved(ckpt, step, state, checkpoint):
            known = self._steps[step] = self._earlier[step]
        if known is not None:
            missing = sorted({k for k in every_rank_keys if k not in known})  # (every rank's keys: raised on every rank)
            if missing:
                raise ValueError(
                    f"global step {step} was already saved without {missing} (a weights-only save?); a second "
                    f"save at the same step cannot be stored as another distckpt step: let the callback that "
                    f"saves the full state come first, or save them at different steps"
                )
            self._refuse_changed_tensors(step, state, path, checkpoint)
            overlay = self._overlay(step, checkpoint, path)
            if overlay:
                record["overlay"] = overlay
            # The same state again (two ModelCheckpoint callbacks at one step): one more pointer,
            # written when the step is committed (without waiting for an async save here).
            if step == self._inflight:
                self._placeholder(path, record)
                self._pending.append(("point", os.fspath(path), record))
            else:
                self._settle()
                self._run_on_rank0([("point", os.fspath(path), record)])
            return
        self._settle()  # the previous async save commits before anything points at or deletes for it
        self._placeholder(path, record)
        saving = (_root_id(self.root), step)
        _SAVING.add(saving)  # (another plugin of this process loading meanwhile: see _settle_leftovers)
        try:
            ckpt.save(step, state, blocking=not self.async_save, metadata={LAYOUT_KEY: layout})
        except Exception as exc:  # (raised on every rank alike; an interrupt leaves the pending pointer: it resolves)
            _SAVING.discard(saving)
            self._unplace([os.fspath(path)], step)
            if not isinstance(exc, StepExistsError):
                raise
            why = " (a run resumed from an older checkpoint and trained past newer ones?)"
            named = self._pointers_to(step)
            if step in self._earlier:
                why = (
                    " (this plugin saved or loaded it before its last teardown, but the model's and optimizers' state "
                    "is not the one it saved (other tensors, or other values such as a module's get_extra_state()): another run reusing the plugin, or a model moved to another device or "
                    "changed since)"
                )
            elif named:
                # This job's newer state is there (a run that stopped after committing it, before
                # the pointer this run resumed from caught up), named by a checkpoint file.
                why = f" (this job committed it before: resume from {named[0]}, which names it)"
            raise StepExistsError(
                f"{exc}. Lightning saves global step {step} into {self.root}, which holds that step from an earlier "
                f"run or another job{why}; distckpt never overwrites a committed step: use a new root for this run, "
                f"or resume from the newest checkpoint"
            ) from exc
        self._steps[step] = frozenset(keys)
        self._snapshot = self._snapshot_of(step, checkpoint)
        # Only the last save's tensors can still be unchanged (kept for one step: a long run
        # would otherwise hold an entry per tensor per step).
        self._saved_tensors = {step: {k: _identity(t) for k, t in _compared(state).items()}}
        self._saved_values = {step: self._model_values(checkpoint)}
        if self.async_save:
            self._inflight = step
            self._pending.append(("point", os.fspath(path), record))
        else:
            try:
                self._run_on_rank0([("point", os.fspath(path), record)])
            finally:
                _SAVING.discard(saving)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """(every rank) Delete the pointer at ``path``, and its step once nothing points at it
        (this job's steps only). Waits for an in-flight async save's commit (queued, not
        blocking). A file at ``path`` that is not a pointer is left alone, with a warning."""
        self._enter("remove_checkpoint")
        self._remember(path)
        if self._inflight is not None:
            self._pending.append(("remove", os.fspath(path), None))
            return
        self._run_on_rank0([("remove", os.fspath(path), None)])

    @interrupts_raised()  # Ctrl-C on one rank: the interrupt on its rank, Interrupted on its peers
    def load_checkpoint(
        self, path: str | os.PathLike, map_location: object = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """(every rank) The checkpoint dict saved for ``path``, tensors on the CPU (Lightning moves
        them into the model and optimizers). ``map_location`` and ``weights_only`` are ignored:
        distckpt reads without unpickling code in any case.

        Raises:
            FileNotFoundError: no file at ``path``, or the step it points to is not committed
                in this root.
            ValueError: ``path`` is not a distckpt pointer (e.g. a ``torch.save`` checkpoint),
                or names a step of another job than the one in this root.
            IntegrityError: a damaged file (named), or a damaged manifest layout.
            StateMismatchError: per-rank state loaded at another world size (see its note).
            Interrupted: on the other ranks, where one rank was interrupted (Ctrl-C, a signal
                handler's exit), which gets its own interrupt.
        """
        self._enter("load_checkpoint")
        self._remember(path)
        self._settle()
        ckpt = self.checkpointer
        where = os.fspath(path)
        step, keys, all_keys, nodes, ranks, budget, job, overlay = on_coordinator(Group(), f"loading {where}", lambda: self._locate(where))
        group = Group()

        def build() -> dict[str, Any]:
            tree = nodes
            if ranks is not None and len(ranks) == group.world_size:
                # This rank's structure of the entries that differed between ranks (the saved world
                # size: at another, distckpt refuses those per-rank entries, naming them).
                tree = with_rank_nodes(all_keys, tree, ranks[group.rank], f"{where} (step {step})")
            return template(keys_of=all_keys, nodes_json=tree, budget=budget, where=f"{where} (step {step})")

        # On every rank alike: an error or a Ctrl-C while one rank builds its (possibly large)
        # template left its peers in the load's first collective until the group's timeout.
        state = all_ranks(group, f"building the load target of {where}", build)
        try:
            ckpt.load(state, step=step, strict=True, restore_rng=self.restore_rng)
        except StateMismatchError as exc:
            if exc.per_rank:
                _note(
                    exc,
                    f"resuming {where}: entries {sorted(exc.per_rank)} differed between ranks when saved (e.g. "
                    "ModelCheckpoint/EarlyStopping monitoring a metric logged without sync_dist=True), so they were "
                    "stored per rank and cannot be resharded: resume at the saved world size, or log with sync_dist=True",
                )
            raise
        except (CheckpointError, OSError, ValueError) as exc:
            _note(exc, f"while loading Lightning checkpoint {where} (step {step} of {self.root})")
            raise
        self._steps[step] = frozenset(all_keys)
        loaded = {k: state[entry_name(k)] for k in all_keys}
        self._snapshot = self._snapshot_of(step, loaded)  # (the step's own values, before the pointer's)
        if overlay:
            self._read_overlay(overlay, f"{where} (step {step})", loaded)
        if self._options.get("job") is None:
            self._job = job  # distckpt's full load continues the loaded step's job
        self._settle_leftovers()
        return {k: loaded[k] for k in keys}

    def _settle_leftovers(self) -> None:
        """(every rank) After a resume: the pending pointers of this job that a stopped run left
        in the directories known are settled as their save did: made final where the step
        committed, else put back to their previous target (removed where they had none). Left
        pending, one made ModelCheckpoint version the resumed run's file of that name, and kept
        a step the resumed run saves again from retention as long as it stayed."""
        job = self._job
        ckpt = self.checkpointer
        mine = _root_id(self.root)

        def in_flight(pending: Mapping[str, Any], committed: set[int]) -> bool:
            # A save still writing it (another process of this job: an evaluation loading while
            # training saves): its writer is alive (this host), or wrote it less than a lease ago
            # (another host; an async save makes the step folder only after staging), or its
            # step folder is there, uncommitted, under a live lease.
            step = pending["step"]
            if step in committed:
                return False
            who = pending.get("writer")
            if isinstance(who, Mapping):
                if who.get("host") == socket.gethostname() and type(who.get("pid")) is int:
                    if who["pid"] == os.getpid():
                        if (mine, step) in _SAVING:  # another plugin of this process is saving it
                            return True
                    elif process_exists(who["pid"]):
                        return True
                elif isinstance(who.get("time"), (int, float)) and time.time() - who["time"] < ckpt.options.lease_s:
                    return True
            name = step_dir(step)
            return ckpt.storage.exists(name) and not ownership.is_stale(ckpt.storage, name, ckpt.options.lease_s)

        def settle() -> None:
            if job is None:
                return
            try:
                found = list(self._pointer_files())
            except OSError as exc:
                warnings.warn(f"distckpt: could not settle the pointers a stopped run left: {exc}", stacklevel=4)
                return
            # Only this job's, of this root (a fork's copied root holds other steps).
            ours = []
            for where, pointer in found:
                pending = pending_of(pointer)
                if pending is not None and pending.get("job") == job and pointer.get("root") == mine:
                    ours.append((where, pointer, pending))
            committed = set(ckpt.steps()) if ours else set()
            for where, pointer, pending in ours:
                try:
                    if in_flight(pending, committed):
                        continue
                    try:
                        target = resolve(pointer, self._committed_job)
                    except FileNotFoundError:
                        remove_file(where)  # its save never committed, and it named nothing before
                        continue
                    write_pointer(where, pointer_bytes(self.root, target.get("job"), as_record(target)))
                except (OSError, ValueError, KeyError, CheckpointError) as exc:
                    warnings.warn(f"distckpt: could not settle {where}, left by a stopped run: {exc}", stacklevel=4)

        try:
            on_coordinator(Group(), "settling Lightning checkpoint pointers of a stopped run", settle)
        except Interrupted:
            raise  # (a Ctrl-C on a rank, exchanged: no warning, see interrupts_raised)
        except Exception as exc:  # noqa: BLE001 - the resume itself succeeded
            warnings.warn(f"distckpt: could not settle the pointers a stopped run left: {exc}", stacklevel=3)

    # -- internals ----------------------------------------------------------------------------
    def _enter(self, what: str) -> None:
        """Refuse calls that would deadlock or race: from a second thread, or on one rank of several."""
        ident = threading.get_ident()
        if self._thread is None:
            self._thread = ident
        elif ident != self._thread:
            raise RuntimeError(
                f"DistckptCheckpointIO.{what} was called from another thread than before (is it wrapped in "
                "Lightning's AsyncCheckpointIO?): use DistckptCheckpointIO(..., async_save=True) instead"
            )
        group = Group()
        if group.world_size > 1 and self._strategy is None:
            raise RuntimeError(
                f"DistckptCheckpointIO.{what} on rank {group.rank} of {group.world_size}: distckpt saves are collective, "
                "but this strategy calls the CheckpointIO on global rank 0 only. Use "
                "Trainer(strategy=DistckptDDPStrategy(...), plugins=[DistckptCheckpointIO(...)])"
            )

    def _same_as_saved(self, ckpt: Checkpointer, step: int, state: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> bool:
        """(every rank) Whether the model's and the optimizers' tensors in ``state`` are the very
        tensors this plugin last saved, as ``step`` (the same storages, still alive), unchanged
        since (the same version counters: an optimizer step or an in-place re-initialisation moves
        them) and of the values the manifest's fingerprints record (writes through ``p.data``
        move no version counter: an EMA swapped in at the end of fit), on every rank. A save at a
        step of an earlier fit of this plugin is then the same run's (``trainer.save_checkpoint``
        after ``fit``, also weights only), not another run's, whatever else differs (callbacks'
        scores, loops, a scheduler stepped at the epoch's end, as between callbacks saving at one
        step within a fit). Equal values alone are not enough: another run of a sweep can reach
        the same weights with another schedule. A step only loaded here is never the same. With
        ``fingerprint=False`` the values are not compared (writes through ``.data`` go unseen).
        The state's values that are not tensors (a module's ``get_extra_state()``) must be equal
        to the saved ones too."""

        def here() -> bool:
            saved = self._saved_tensors.get(step)
            tensors = _compared(state)
            if not saved or not tensors or not tensors.keys() <= saved.keys():
                return False
            if self._changed_values(step, checkpoint):
                return False
            if not all(_unchanged(saved[key], t) for key, t in tensors.items()):
                return False
            try:
                manifest = ckpt.manifest(step)
            except (CheckpointError, OSError, ValueError):
                return False  # deleted since, or unreadable: saving it again is refused as before
            prints, version = manifest.fingerprints, manifest.fingerprint_version
            return all(prints[k] == fingerprint.of_tensor(t, version) for k, t in tensors.items() if k in prints)

        return all(exchange(Group(), f"comparing the state with step {step}", lambda: (None, here()))[1])

    def _refuse_changed_tensors(
        self, step: int, state: Mapping[str, Any], path: str | os.PathLike, checkpoint: Mapping[str, Any]
    ) -> None:
        """(every rank) A second save at ``step``, which this plugin saved: refused where the model's
        or the optimizers' tensors are not the ones it saved, unchanged (their storages and version
        counters, as :meth:`_same_as_saved`; a callback that changed the weights between two saves
        at one global step, such as a clamp or pruning at the epoch's end after a top-k save in the
        last batch's end). The step holds the first save's tensors: a pointer to it would load other
        weights than this save's, silently. Tensors that are not the very ones saved, unchanged, are
        compared by value with the step's fingerprints (a save in flight is waited for first).
        A step only loaded here is not judged (its tensors were copied into the model). Writes
        through ``.data`` move no version counter; with ``fingerprint=False`` other tensors, or
        tensors changed in place, are refused, their values unproven. The state's values that are
        not tensors (a module's ``get_extra_state()``, a calibration scale set after ``fit``) are
        compared with the saved ones' digests: one that changed is refused alike (the pointer
        would load the step's)."""
        saved = self._saved_tensors.get(step)
        if saved is None:
            return

        def changed() -> tuple[list[str], list[str]]:
            tensors = [key for key, t in _compared(state).items() if not _unchanged(saved.get(key), t)]
            return tensors, self._changed_values(step, checkpoint)

        _, both = exchange(Group(), f"comparing the state with step {step}", lambda: (None, changed()))
        values = sorted({k for _, keys in both for k in keys})
        if values:
            ranks = [r for r, (_, keys) in enumerate(both) if keys]
            named = self._pointers_to(step)
            raise StepExistsError(
                f"global step {step} was saved before in this run{f' ({named[0]})' if named else ''}, and values of the "
                f"model's or optimizers' state that are not tensors changed since on rank(s) {ranks} (e.g. {values[:3]}: "
                f"a module's get_extra_state()): distckpt keeps one step per global step and never overwrites it, so "
                f"{os.fspath(path)} would load the earlier values. Save once the change is made, or at another global step"
            )
        found = [tensors for tensors, _ in both]
        if not any(found):
            return
        # Other tensors, or changed in place since: judged by their values against the step's
        # fingerprints (a save in flight is waited for: its manifest holds them). Equal values
        # are the same state (a dict rebuilt with copies, a change undone).
        self._settle()
        ckpt = self.checkpointer

        def differ() -> list[str]:
            try:
                manifest = ckpt.manifest(step)
            except (CheckpointError, OSError, ValueError):
                return list(found[Group().rank])
            prints, version = manifest.fingerprints, manifest.fingerprint_version
            tensors = _compared(state)
            # A tensor without a fingerprint (fingerprint=False) cannot be proven the same: changed.
            return [k for k in found[Group().rank] if k not in prints or prints[k] != fingerprint.of_tensor(tensors[k], version)]

        _, found = exchange(Group(), f"comparing the state with step {step}", lambda: (None, differ()))
        bad = sorted({k for keys in found for k in keys})
        if bad:
            ranks = [r for r, keys in enumerate(found) if keys]
            named = self._pointers_to(step)
            raise StepExistsError(
                f"global step {step} was saved before in this run{f' ({named[0]})' if named else ''}, and the "
                f"model's or optimizers' tensors changed since on rank(s) {ranks} (e.g. {bad[:3]}): a callback changed "
                f"them between two saves at one global step. distckpt keeps one step per global step and never "
                f"overwrites it, so {os.fspath(path)} would load the earlier weights. Save once the change is made "
                f"(one ModelCheckpoint at the epoch's end, or every_n_train_steps that avoids the epoch's last step), "
                f"or make the change before the first save"
            )

    def _model_values(self, checkpoint: Mapping[str, Any]) -> dict[str, str] | None:
        """(each rank) :func:`~distckpt.integrations.lightning_overlay.model_values` of
        ``checkpoint``; ``None`` where they cannot be made (the save itself succeeded)."""
        try:
            return overlays.model_values(checkpoint, self.checkpointer.options.safe_types)
        except Exception:  # noqa: BLE001 - not compared then, as before
            return None

    def _changed_values(self, step: int, checkpoint: Mapping[str, Any]) -> list[str]:
        """(each rank) Where the model's and optimizers' values that are not tensors differ from
        those saved as ``step`` here (added, removed or changed, in the parts of the state
        ``checkpoint`` holds); ``[]`` where the step's were not
        recorded (a step only loaded here, or values that could not be digested)."""
        saved = self._saved_values.get(step)
        if saved is None:
            return []
        now = self._model_values(checkpoint)
        if now is None:
            return []
        # A save holding a part of the state only (weights only: no optimizers) is judged on it.
        held = {k for k in overlays.MODEL_KEYS if k in checkpoint}
        return sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k) and k.split(".", 1)[0] in held)

    def _prepare(
        self, checkpoint: Mapping[str, Any], path: str | os.PathLike
    ) -> tuple[list[str], dict[str, Any], dict[str, object], set[str]]:
        """(every rank) :func:`~distckpt.integrations.lightning_layout.prepare` on every rank, an
        error on any raised on every rank; where the structure of some top-level entries differs
        between ranks (per-rank state: a callback's ``best_k_models`` keyed by file names holding
        each rank's own metric), the layout also records every rank's nodes of those entries, so
        that each rank loads its own at the same world size (only the coordinator's layout
        reaches the manifest)."""
        made: list[tuple[list[str], dict[str, Any], dict[str, object]]] = []

        def run() -> tuple[None, tuple[list[str], list[str]]]:
            made.append(prepare(checkpoint, copy_values=self.async_save))
            texts = node_texts(made[0][2])
            return None, (made[0][0], [hashlib.sha256(t.encode()).hexdigest() for t in texts])

        _, seen = exchange(Group(), f"preparing Lightning checkpoint {os.fspath(path)}", run)
        keys, state, layout = made[0]
        every_rank = {k for ks, _ in seen for k in ks}  # (judged alike on every rank)
        if all(s == seen[0] for s in seen):
            return keys, state, layout, every_rank
        if any(k != keys for k, _ in seen):
            return keys, state, layout, every_rank  # (other top-level keys: the coordinator's layout, as before)
        differ = [i for i in range(len(keys)) if len({d[i] for _, d in seen}) > 1]
        texts = node_texts(layout)
        _, ranks = exchange(Group(), "gathering the per-rank layout", lambda: (None, {keys[i]: texts[i] for i in differ}))
        return keys, state, {**layout, "ranks": ranks}, every_rank

    def _snapshot_of(self, step: int, checkpoint: Mapping[str, Any]) -> tuple[int, dict[str, str]] | None:
        """(each rank) ``step`` and the digests of ``checkpoint``'s values beyond the model's and
        optimizers' state (this rank's); ``None`` where they cannot be made (a later save at the
        step then keeps all of its values)."""
        try:
            forms = overlays.snapshot(checkpoint, self.checkpointer.options.safe_types)
            return step, {k: overlays.digest(f) for k, f in forms.items()}
        except Exception:  # noqa: BLE001 - the save or load itself succeeded
            return None

    def _overlay(self, step: int, checkpoint: Mapping[str, Any], path: str | os.PathLike) -> overlays.Overlay:
        """(every rank) The values of a later save at ``step`` that differ from the step's (on any
        rank), as its pointer keeps them (:mod:`~distckpt.integrations.lightning_overlay`): one
        record where every rank holds the same value, one per rank where they differ. Without
        the digests of the step's values (a step saved before a teardown), every value of the save.

        Raises:
            TypeError: a value distckpt cannot store safely (on every rank).
            ValueError: ranks whose dicts hold different top-level keys, or values too large
                for a pointer (on every rank).
        """
        base = self._snapshot[1] if self._snapshot is not None and self._snapshot[0] == step else None
        forms: dict[str, Any] = {}
        group = Group()

        def digests() -> tuple[None, tuple[dict[str, str], list[str]]]:
            forms.update(overlays.snapshot(checkpoint, self.checkpointer.options.safe_types))
            mine = {k: overlays.digest(f) for k, f in forms.items()}
            # Changed against this rank's own record of the step's values (ranks may have held
            # different ones): the union of every rank's is the same on all ranks.
            return None, (mine, [k for k, d in mine.items() if base is None or base.get(k) != d])

        _, gathered_digests = exchange(group, f"comparing the values saved at step {step}", digests)
        seen = [d for d, _ in gathered_digests]
        union: list[str] = []  # (from what every rank sent, never this rank's dict: alike on every rank)
        for _, changed in gathered_digests:
            union.extend(k for k in changed if k not in union)
        if not union:
            return {}
        absent = sorted({k for k in union for d in seen if k not in d})
        if absent:
            raise ValueError(f"the Lightning checkpoint for {os.fspath(path)} holds {absent} on some ranks only")
        per_rank = {k for k in union if len({d[k] for d in seen}) > 1}

        def records() -> tuple[None, dict[str, bytes]]:
            # Rank 0's record of a value every rank holds alike; every rank's of one they differ in.
            keys = union if group.rank == 0 else [k for k in union if k in per_rank]
            return None, {k: overlays.record(forms[k]) for k in keys}

        _, gathered = exchange(group, f"gathering the values saved at step {step}", records)
        overlay: overlays.Overlay = {}
        for k in union:
            overlay[k] = [overlays.as_text(g[k]) for g in gathered] if k in per_rank else overlays.as_text(gathered[0][k])
        size = sum(len(v) if isinstance(v, str) else sum(map(len, v)) for v in overlay.values())
        if size > overlays.MAX_OVERLAY_CHARS:
            raise ValueError(
                f"a second save at global step {step} ({os.fspath(path)}) holds other values of {union} than the step's "
                f"first save, {size} characters encoded: more than a pointer keeps ({overlays.MAX_OVERLAY_CHARS}). "
                "Save them at different global steps, or keep large values out of on_save_checkpoint"
            )
        return overlay

    def _read_overlay(self, overlay: overlays.Overlay, where: str, loaded: dict[str, Any]) -> None:
        """(every rank) Put the values a pointer keeps (this rank's where they differ between
        ranks) into ``loaded``; an error on any rank is raised on every rank."""
        group = Group()

        def read() -> tuple[None, None]:
            for key, text in overlay.items():
                if isinstance(text, list):
                    if len(text) != group.world_size:
                        exc = StateMismatchError([], [], {}, where, per_rank={key: (len(text), group.world_size)})
                        _note(exc, f"resuming {where}: {key!r} differed between ranks when saved (e.g. a callback monitoring "
                              "a metric logged without sync_dist=True): resume at the saved world size, or log with sync_dist=True")
                        raise exc
                    text = text[group.rank]
                overlays.apply(loaded, key, overlays.decode(text, key, where, self.checkpointer.options.safe_types), where)
            return None, None

        exchange(group, f"reading the values kept in {where}", read)

    def _remember(self, path: str | os.PathLike) -> None:
        self._dirs.add(dir_of(path))

    def _settle(self) -> None:
        """(every rank) Commit the in-flight async save, then run what waited for it."""
        if self._inflight is None:
            return
        step, self._inflight = self._inflight, None
        pending, self._pending = self._pending, []
        try:
            try:
                self.checkpointer.wait()  # raises the save's error on every rank alike
            finally:
                _SAVING.discard((_root_id(self.root), step))
        except BaseException as exc:
            # Nothing may point at the failed step, and the removals queued after it are dropped:
            # they were to make room for it, and could delete the last good checkpoint.
            self._steps.pop(step, None)
            self._saved_tensors.pop(step, None)
            self._saved_values.pop(step, None)
            if isinstance(exc, Exception):  # (an interrupt leaves the pending pointers: they resolve)
                self._unplace([path for kind, path, _ in pending if kind == "point"], step)
            raise
        self._run_on_rank0(pending)

    def _pointers_to(self, step: int) -> list[str]:
        """(any rank, not collective) The checkpoint files in the directories known that a load
        follows to this job's ``step`` (pending ones resolved), sorted; ``[]`` where none can be
        read."""
        job = self.checkpointer._lineage.job
        try:
            found = []
            for path, pointer in self._pointer_files():
                try:
                    target = resolve(pointer, self._committed_job)
                except (FileNotFoundError, ValueError, CheckpointError):
                    continue
                if target["step"] == step and target.get("job") == job:
                    found.append(path)
            return sorted(found)
        except OSError:
            return []

    def _placeholder(self, path: str | os.PathLike, record: PointerRecord) -> None:
        """(every rank) Rank 0 writes the pending pointer of a save about to start (see
        :mod:`~distckpt.integrations.lightning_pointers`): the file exists from now on, as
        ModelCheckpoint expects, and names the file's previous target until the step commits."""
        job = self.checkpointer._lineage.job  # what the step's manifest will record
        writer = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}

        def write() -> None:
            where = os.fspath(path)
            check_pointer_path(where, self.root)
            previous = try_pointer(where)
            if previous is None and exists(where):
                return  # a file of the user's: replaced only by the final pointer, once the step commits
            if previous is not None:  # (a pending one left by a crash: its own resolution is its target)
                try:
                    previous = resolve(previous, self._committed_job)
                except FileNotFoundError:
                    previous = None
            if previous is None:
                data = pointer_bytes(self.root, job, record, pending=(job, record), alone=True, writer=writer)
            else:
                data = pointer_bytes(self.root, previous.get("job"), as_record(previous), pending=(job, record), writer=writer)
            self._register(where)
            write_pointer(where, data)

        on_coordinator(Group(), f"writing Lightning checkpoint pointer {os.fspath(path)}", write)

    def _unplace(self, paths: list[str], step: int) -> None:
        """(every rank) After the save of ``step`` failed: rank 0 puts the pending pointers at
        ``paths`` back as they were (the previous target; removed where there was none). Raises
        only ``Interrupted`` (a Ctrl-C on a rank inside a load, see interrupts_raised); otherwise
        the save's error is the one to see: a failure is warned about, and a pointer left pending
        resolves to its previous target anyway."""

        def undo() -> None:
            for where in paths:
                try:
                    old = try_pointer(where)
                    pending = pending_of(old) if old is not None else None
                    if old is None or pending is None or pending["step"] != step:
                        continue
                    if pending.get("alone"):
                        remove_file(where)
                    else:
                        write_pointer(where, pointer_bytes(self.root, old.get("job"), as_record(old)))
                except OSError as exc:
                    warnings.warn(f"distckpt: could not restore {where} after the failed save of step {step}: {exc}", stacklevel=4)

        try:
            on_coordinator(Group(), "restoring Lightning checkpoint pointers", undo)
        except Interrupted:
            raise  # (a Ctrl-C on a rank, exchanged: see interrupts_raised)
        except Exception as exc:  # noqa: BLE001 - never hides the save's error
            warnings.warn(f"distckpt: could not restore the pointers of the failed save of step {step}: {exc}", stacklevel=3)

    def _run_on_rank0(self, actions: list[_Action]) -> None:
        """(every rank) Rank 0 writes/removes pointers and deletes unreferenced steps; every rank
        learns the job of the steps pointed at and which steps were deleted."""
        if not actions:
            return
        job, deleted = on_coordinator(Group(), "writing Lightning checkpoint pointers", lambda: self._apply(actions))
        if self._options.get("job") is None and job is not None:
            self._job = job
        for step in deleted:
            self._steps.pop(step, None)
            self._earlier.pop(step, None)
            self._saved_tensors.pop(step, None)
            self._saved_values.pop(step, None)
            if self._snapshot is not None and self._snapshot[0] == step:
                self._snapshot = None

    def _apply(self, actions: Iterable[_Action]) -> tuple[str | None, list[int]]:
        """(rank 0) Pointer writes and removals in order, then deletion of steps they orphaned."""
        ckpt = self.checkpointer
        # (step, job) of the pointers replaced or removed: a pointer names a step of ITS job (of
        # another root, maybe); only this job's steps can be orphaned by it, never a step of this
        # root that merely has the same number.
        orphans: set[tuple[int, str | None]] = set()
        job = None
        for kind, path, record in actions:
            old = try_pointer(path)
            if kind == "point" and record is not None:
                check_pointer_path(path, self.root)  # again, right before writing (checked before the save)
                job = ckpt.manifest(record["step"]).job  # committed: read back what it recorded
                if self._options.get("job") is None:
                    self._job = job
                self._register(path)
                write_pointer(path, pointer_bytes(self.root, job, record))
                self._wrote(path, record["step"], job)
                if old is not None and (old["step"], old.get("job")) != (record["step"], job):
                    orphans.add((old["step"], old.get("job")))
            elif old is not None:
                remove_file(path)
                self._written.pop(path, None)
                orphans.add((old["step"], old.get("job")))
            elif exists(path):
                warnings.warn(f"distckpt: {path} is not a distckpt pointer; left in place", stacklevel=2)
        return job, self._delete_orphans(ckpt, orphans)

    def _delete_orphans(self, ckpt: Checkpointer, orphans: set[tuple[int, str | None]]) -> list[int]:
        """(rank 0) Delete the steps of this job among ``orphans`` ((step, job) of the pointers
        replaced or removed), of the pointers replaced behind the plugin's back
        (:meth:`_replaced_elsewhere`) and those kept before, where no pointer names them
        (:func:`delete_unreferenced`); returns the deleted ones."""
        orphans = orphans | self._replaced_elsewhere()
        if self._job is None:
            return []
        # With the steps kept before (files the user added to them, an upload still to end):
        # retried, until deleted (or pointed at again: then orphaned anew when that pointer goes).
        mine = {step for step, of in orphans if of == self._job} | self._kept
        kept: set[int] = set()
        deleted = delete_unreferenced(ckpt, mine, self._job, self._visible_pointers, kept)
        self._kept = kept
        return deleted

    def _wrote(self, path: str, step: int, job: str | None) -> None:
        """(rank 0) Remember the final pointer just written at ``path`` (local paths only: see
        :meth:`_replaced_elsewhere`)."""
        local = local_path(path)
        if local is None:
            return
        try:
            self._written[path] = (step, job, os.lstat(local).st_mtime_ns)
        except OSError:
            self._written.pop(path, None)

    def _replaced_elsewhere(self) -> set[tuple[int, str | None]]:
        """(rank 0) ``(step, job)`` of the final pointers this process wrote at local paths that
        something other than this plugin replaced since, by a link or a pointer to another step:
        ModelCheckpoint(save_last="link") removes last.ckpt with ``os.remove`` and links it to the
        newest top-k file, never calling remove_checkpoint, so the step the file named stayed in
        the root for good. A pointer that is gone is forgotten, its step kept (a user may have
        moved it). One ``lstat`` per such pointer; a file changed since is read. The caller deletes
        these steps only where no pointer names them (:func:`delete_unreferenced`)."""
        out: set[tuple[int, str | None]] = set()
        for path, (step, job, stamp) in list(self._written.items()):
            try:
                st = os.lstat(local_path(path) or path)
            except FileNotFoundError:
                del self._written[path]  # (removed, or moved elsewhere by the user: kept, as before)
                continue
            except OSError:
                continue  # (unreadable now: judged at the next removal)
            if stat.S_ISREG(st.st_mode):
                if st.st_mtime_ns == stamp:
                    continue
                try:
                    now = try_pointer(path)  # (rewritten: by this plugin's pending pointer, say)
                except (OSError, ValueError):
                    continue  # (unreadable now: judged at the next removal)
                # The same step (a pending pointer naming its previous target), or no pointer at
                # all (a file of the user's in its place): its step kept, as for a removed one.
                if now is None or (now["step"], now.get("job")) == (step, job):
                    self._written[path] = (step, job, st.st_mtime_ns)
                    continue
            elif not stat.S_ISLNK(st.st_mode):
                continue
            del self._written[path]
            out.add((step, job))
        return out

    def _visible_pointers(self) -> Iterable[Pointer]:
        """(rank 0) Every pointer in the directories known (seen paths' directories and the
        trainer's ModelCheckpoint directories). Raises ``OSError`` if a directory or a file in it
        cannot be read (a missing directory holds no pointers)."""
        return with_pending(pointer for _, pointer in self._pointer_files())

    def _register(self, path: str) -> None:
        """(rank 0) Record the directory of the pointer about to be written at ``path`` in the root
        (:func:`~distckpt.integrations.lightning_pointers.register_dir`), once per process: every
        later process then finds the pointer before deleting a step. A failure is warned about
        (the pointer is written all the same; only that search misses it)."""
        where = dir_of(path)
        if where in self._registered:
            return
        try:
            register_dir(self.checkpointer.storage, where)
        except OSError as exc:
            warnings.warn(
                f"distckpt: could not record {where} in {self.root} as a folder of Lightning checkpoints ({exc}); "
                "a later process deletes a step that only pointers there name",
                stacklevel=3,
            )
            return
        self._registered.add(where)

    def _pointer_files(self) -> Iterator[tuple[str, Pointer]]:
        """(rank 0) ``(path, pointer)`` of every pointer in the directories this process knows
        (:meth:`_pointer_dirs`; ``OSError`` where one cannot be read) and in every other one a
        pointer to the root was written in (recorded in the root, see
        :func:`~distckpt.integrations.lightning_pointers.register_dir`). A recorded directory
        that cannot be read (a permission, a store's hiccup) raises ``OSError`` naming it and its
        record, as one of this process's own: its pointers may name any step, so nothing is
        deleted meanwhile (a removal keeps its steps and retries them at the next one). Only a
        missing directory holds none."""
        own = self._pointer_dirs()
        yield from pointer_files_in(own)
        storage = self.checkpointer.storage
        for d in sorted(registered_dirs(storage) - own):
            try:
                found = list(pointer_files_in([d]))
            except Exception as exc:  # noqa: BLE001 - any filesystem's error (a store's own types too)
                raise OSError(
                    f"could not read {d}, a folder of Lightning checkpoints that {self.root} records ({one_line(exc)}); "
                    f"delete {record_path(storage, d)} if that folder is gone for good"
                ) from exc
            yield from found

    def _pointer_dirs(self) -> set[str]:
        """The directories this process knows to hold this plugin's pointers: those of the paths
        it saw and the trainer's checkpoint callbacks' (see :meth:`_pointer_files`)."""
        dirs = set(self._dirs)
        strategy = self._strategy() if self._strategy is not None else None
        try:
            trainer = strategy.lightning_module.trainer if strategy is not None else None
            callbacks = trainer.checkpoint_callbacks if trainer is not None else []
        except (AttributeError, RuntimeError):  # no module or trainer attached (yet)
            callbacks = []
        for cb in callbacks:
            dirpath = getattr(cb, "dirpath", None)
            if dirpath:
                dirs.add(dir_url(dirpath))
        return dirs

    def _committed_job(self, step: int) -> str | None:
        """The job committed ``step`` of this root records (:func:`resolve`); ``FileNotFoundError``
        where it is not committed."""
        return self.checkpointer.manifest(step).job

    def _locate(
        self, path: str
    ) -> tuple[int, list[str], list[str], str, list[dict[str, str]] | None, int, str | None, overlays.Overlay]:
        """(rank 0) Read and check the pointer at ``path`` and the layout of its step."""
        ckpt = self.checkpointer
        record = read_pointer(path)
        try:  # a pending pointer (a crash during its save): its step where it committed, else its previous one
            record = resolve(record, self._committed_job)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{path}: {exc}") from None
        step = record["step"]
        try:
            manifest = ckpt.manifest(step)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{path} points to step {step} (saved under {record['root']}), which is not committed in {self.root}: "
                f"deleted (keep_last?), or its save never committed ({exc})"
            ) from None
        if record.get("job") is not None and manifest.job != record["job"]:
            raise ValueError(
                f"{path} names step {step} of job {record['job']!r} (saved under {record['root']}), but step {step} in "
                f"{self.root} was saved by job {manifest.job!r}: another checkpoint. Point DistckptCheckpointIO at the "
                f"root that pointer was written for"
            )
        all_keys, nodes = read_layout(manifest.extra, f"step {step} of {self.root}")
        ranks = rank_layouts(manifest.extra, f"step {step} of {self.root}")
        keys = record["keys"]
        if not set(keys) <= set(all_keys):
            raise IntegrityError(f"{path} lists keys {sorted(set(keys) - set(all_keys))} that step {step} does not hold")
        # Tensors are allocated from the layout before distckpt checks them against .metadata:
        # a layout may not claim more bytes than the step's files hold.
        budget = manifest.total_bytes + (1 << 20)
        overlay = record.get("overlay") or {}
        if not set(overlay) <= set(keys):
            raise IntegrityError(f"{path} holds values of keys {sorted(set(overlay) - set(keys))} it does not list")
        return step, keys, all_keys, nodes, ranks, budget, manifest.job, overlay


# --------------------------------------------------------------------------------------------
# the strategy
class DistckptDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that calls a :class:`DistckptCheckpointIO` on every rank to save and remove
    checkpoints (Lightning calls ``CheckpointIO`` on global rank 0 only; distckpt saves are
    collective). Takes ``DDPStrategy``'s arguments; with any other ``CheckpointIO`` it behaves
    exactly as ``DDPStrategy``."""

    def setup_environment(self) -> None:
        """(every rank) DDP's setup (the process group), then attach the plugin."""
        super().setup_environment()
        io, wrapped_async = self.checkpoint_io, False
        while isinstance(io, _WrappingCheckpointIO):
            wrapped_async = wrapped_async or isinstance(io, AsyncCheckpointIO)
            io = io.checkpoint_io
        if isinstance(io, DistckptCheckpointIO):
            if wrapped_async:
                raise ValueError(
                    "AsyncCheckpointIO(DistckptCheckpointIO(...)) would run collective saves in a thread: use "
                    "DistckptCheckpointIO(..., async_save=True) without the wrapper"
                )
            io.attach(self)

    def _distckpt_io(self) -> DistckptCheckpointIO | None:
        io = self.checkpoint_io
        return io if isinstance(io, DistckptCheckpointIO) else None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: object = None) -> None:
        """(every rank) ``DistckptCheckpointIO.save_checkpoint`` on every rank; other plugins: rank 0."""
        io = self._distckpt_io()
        if io is None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        else:
            io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """(every rank) ``DistckptCheckpointIO.remove_checkpoint`` on every rank; other plugins: rank 0."""
        io = self._distckpt_io()
        if io is None:
            super().remove_checkpoint(filepath)
        else:
            io.remove_checkpoint(filepath)


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(text)
