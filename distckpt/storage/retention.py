"""Retention: which old checkpoints to delete, and deleting them (one routine for the local root
and the replica)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any


def check_keep_last(keep_last: Any) -> None:
    """Raise ``ValueError`` unless ``keep_last`` is ``None`` or an int >= 1."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")


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


def delete_old_steps(storage: Any, keep_last: int | None) -> list[int]:
    """(one process: the coordinator) Delete committed steps beyond ``keep_last``; returns them.

    Each step is first marked released (a released owner record), then un-committed (manifest
    removed), then removed like any incomplete directory (:func:`distckpt.storage.ownership.remove_uncommitted`:
    on local roots through a tombstone). A crash at any point leaves a directory the next save's
    cleanup removes at once. Errors are warned about, never raised: a committed save must not fail
    over retention.
    """
    from distckpt.integrity.manifest import MANIFEST_NAME, committed_steps, step_dir
    from distckpt.storage.ownership import mark_released, remove_uncommitted

    deleted = []
    for old in steps_to_delete(committed_steps(storage), keep_last):
        try:
            try:
                mark_released(storage, step_dir(old))
            except FileNotFoundError:  # deleted meanwhile by another writer's retention
                deleted.append(old)
                continue
            storage.remove(step_dir(old), MANIFEST_NAME)
            remove_uncommitted(storage, step_dir(old))
            deleted.append(old)
        except OSError as exc:
            warnings.warn(f"distckpt: could not delete old checkpoint {storage.display(step_dir(old))}: {exc}", stacklevel=2)
    return deleted
