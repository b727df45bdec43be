"""Which old checkpoints to delete: pure logic, no I/O."""

from __future__ import annotations

from collections.abc import Iterable


def steps_to_delete(committed: Iterable[int], keep_last: int | None) -> list[int]:
    """Committed steps beyond the newest ``keep_last``; never the newest one.

    Retention runs only after a save has committed, so the newest committed step is the
    checkpoint just written and is always kept; an in-flight save is never in ``committed``.
    """
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"keep_last must be None or >= 1, got {keep_last}")
    ordered = sorted(set(committed))
    return ordered[: max(0, len(ordered) - keep_last)]
