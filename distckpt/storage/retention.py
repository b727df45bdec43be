"""Retention: which old checkpoints to delete, and deleting them (one routine for the local root
and the replica)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable

from distckpt.integrity.manifest import MANIFEST_NAME, committed_steps, step_dir
from distckpt.storage.base import Storage
from distckpt.storage.ownership import mark_released, not_distckpts, remove_uncommitted


def check_keep_last(keep_last: object, name: str = "keep_last") -> None:
    """Raise ``ValueError`` (naming the option, ``name``) unless ``keep_last`` is ``None`` or an int >= 1."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {keep_last!r}")


def steps_to_delete(committed: Iterable[int], keep_last: int | None) -> list[int]:
    """Committed steps beyond the newest ``keep_last``; never the newest one.

    Retention runs only after a save has committed, so the newest committed step is the
    checkpoint just written and is always kept; an in-flight save is never in ``committed``.
    """
    check_keep_last(keep_last)
    if keep_last is None:
        return []
    ordered = sorted(set(committed))
    return ordered[: max(0, len(ordered) - keep_last)]


class Reaper:
    """Deletes tombstones of retired steps in a background thread (one per checkpointer's
    coordinator), so that a save returns without waiting for its predecessor's files to be
    unlinked (which takes time in proportion to their size; measured: benchmarks/README.md).

    What is handed over is garbage already: a directory renamed out of the root's step names,
    checked to hold no manifest (:func:`distckpt.storage.ownership.remove_uncommitted`). The
    decisions (what to delete, the manifest checks, the renames) stay synchronous; only the
    unlinking is deferred. Cleanup leaves :attr:`busy` alone; :meth:`drain` (at close) waits for
    the queue; a tombstone left by a crash or a failed delete is removed by the next cleanup.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Storage, str]] = []  # (storage, tombstone), the first one being deleted
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> frozenset[str]:
        """Tombstones queued or being deleted now."""
        with self._lock:
            return frozenset(name for _, name in self._pending)

    def dispose(self, storage: Storage) -> Callable[[str], None]:
        """A ``dispose`` callback for :func:`~distckpt.storage.ownership.remove_uncommitted` on ``storage``."""
        return lambda name: self._submit(storage, name)

    def _submit(self, storage: Storage, name: str) -> None:
        with self._lock:
            self._pending.append((storage, name))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="distckpt-reaper", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    self._idle.notify_all()
                    return
                storage, name = self._pending[0]
            try:
                storage.remove_tree(name)
            except OSError as exc:  # left for the next cleanup
                warnings.warn(f"distckpt: could not delete {storage.display(name)}: {exc}", stacklevel=1)
            with self._lock:
                self._pending.pop(0)

    def drain(self) -> None:
        """Wait until everything handed over is deleted."""
        with self._lock:
            while self._thread is not None:
                self._idle.wait()


def delete_old_steps(
    storage: Storage,
    keep_last: int | None,
    reaper: Reaper | None = None,
    owned: Callable[[int], bool] | None = None,
    keep: Callable[[int], bool] | None = None,
    forget: Callable[[int], None] | None = None,
) -> list[int]:
    """(one process: the coordinator) Delete committed steps beyond ``keep_last``; returns them.

    ``owned(step)``: whether a committed step is this job's (:class:`distckpt.storage.lineage.Lineage`);
    only those are counted and deleted, so jobs sharing a root never delete each other's steps.
    ``forget(step)``: drop what ``owned`` remembers of a step: called before a step is deleted
    (``owned`` is asked again, from its manifest as it is now: the number may have been deleted
    and saved again by another job since it was remembered) and after (it may be saved again).
    ``keep(step)``: a step beyond ``keep_last`` to keep for now (counted, not deleted): the step
    just committed, which a newer step left by an earlier run would otherwise retire at once (a
    resume from an older step), or a step whose upload to the replica is still to come.

    Each step is first marked released (a released owner record), then un-committed (manifest
    removed), then removed like any incomplete directory (:func:`distckpt.storage.ownership.remove_uncommitted`:
    on local roots through a tombstone). A crash at any point leaves a directory the next save's
    cleanup removes at once. Errors are warned about, never raised: a committed save must not fail
    over retention. With ``reaper``, the files of a step moved aside are deleted in its thread.

    A step that holds files distckpt does not write (a tokenizer or eval results copied in after
    the commit) is kept, committed, with one warning naming them: retention deletes only what
    distckpt wrote, and a step is deleted whole or not at all.
    """

    deleted = []
    if keep_last is None:
        return deleted
    mine = [s for s in committed_steps(storage) if owned is None or owned(s)]
    for old in steps_to_delete(mine, keep_last):
        if keep is not None and keep(old):
            continue
        if forget is not None:
            forget(old)
            if owned is not None and not owned(old):
                continue
        try:
            if retire_step(storage, old, reaper.dispose(storage) if reaper is not None else None):
                deleted.append(old)
        except FileNotFoundError:  # deleted meanwhile by another writer's retention
            deleted.append(old)
        except OSError as exc:
            warnings.warn(f"distckpt: could not delete old checkpoint {storage.display(step_dir(old))}: {exc}", stacklevel=2)
        if forget is not None:
            forget(old)  # (deleted, its number may be saved again; kept, asked again next time)
    return deleted


def retire_step(
    storage: Storage,
    step: int,
    dispose: Callable[[str], None] | None = None,
    *,
    why: str = "keep_last would delete",
    then: str = "move those files out and a later save retires it",
) -> bool:
    """(one process) Delete committed step ``step``: marked released (a released owner record),
    un-committed (manifest removed), then removed like any incomplete directory
    (:func:`~distckpt.storage.ownership.remove_uncommitted`, which takes ``dispose``). Returns
    False, and deletes nothing, where the step holds files distckpt does not write (warned once:
    ``why`` the step would go, and what ``then`` retires it).

    Raises:
        FileNotFoundError: the step is gone (another writer's retention).
        OSError: anything else the storage raised.
    """
    name = step_dir(step)
    foreign = not_distckpts(storage, name)
    if foreign is not None:
        where = storage.display(name)
        _warn_kept(where, f"{why} {where}, but it {foreign}; kept (delete it by hand, or {then})")
        return False
    mark_released(storage, name)
    storage.remove(name, MANIFEST_NAME)
    remove_uncommitted(storage, name, dispose)
    return True


_WARNED_KEPT: set[str] = set()


def _warn_kept(where: str, message: str) -> None:
    """Warn ``message`` about step directory ``where``, once per directory and process."""
    if where in _WARNED_KEPT:
        return
    _WARNED_KEPT.add(where)
    warnings.warn(f"distckpt: {message}", stacklevel=3)
