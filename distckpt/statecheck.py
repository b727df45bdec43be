"""Verified resume: the state a job holds after a load is the state that was saved.

At save, every rank computes :mod:`distckpt.fingerprint` parts of the tensors it writes; the parts
travel with the write results the coordinator gathers anyway, and the manifest records one
fingerprint per tensor key (``Manifest.fingerprints``). Copies of a tensor that should be
identical (DDP replicas, replicated DTensor dimensions, global values) are compared on the way:
copies that differ are reported (``on_drift="warn"`` or ``"error"``), naming the key and the ranks
on each side, and get no fingerprint, since DCP writes only one of them.

After a load, the same parts are computed over what the objects now hold (re-extracted through
the same state-dict functions a save uses), gathered once on distckpt's group, and compared
with the manifest: a difference raises :class:`StateDivergedError` on every rank, naming the keys.

Not collective by itself: the checkpointer gathers the parts.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence

from . import fingerprint
from .errors import StateMismatchError

DRIFT_POLICIES = ("warn", "error", "ignore")


class StateDivergedError(StateMismatchError):
    """After a load, tensors differ from what was saved (their fingerprints do not match).

    Attributes:
        diverged: the keys whose loaded values differ from the saved ones.
    """

    def __init__(self, diverged: Sequence[str], where: str = "") -> None:
        self.diverged = sorted(diverged)
        self.where = where
        self.missing, self.unexpected, self.mismatched, self.per_rank = [], [], {}, {}
        shown = ", ".join(self.diverged[:20]) + (f", ... (+{len(self.diverged) - 20} more)" if len(self.diverged) > 20 else "")
        message = (
            f"the loaded state differs from the state saved{(' in ' + where) if where else ''}: "
            f"{len(self.diverged)} tensor(s) have other values than were saved: {shown}"
        )
        KeyError.__init__(self, message)

    def __reduce__(self) -> tuple:
        return (self.__class__, (self.diverged, self.where))

    def __str__(self) -> str:
        return str(self.args[0])


class ReplicaDriftError(ValueError):
    """At save, copies of a tensor that should be identical on every rank hold different values."""


def describe_drift(drifted: Mapping[str, list[list[int]]]) -> str:
    parts = []
    for key, groups in sorted(drifted.items())[:20]:
        parts.append(f"{key} (ranks {' vs '.join(str(g) for g in groups)})")
    more = f", ... (+{len(drifted) - 20} more)" if len(drifted) > 20 else ""
    return ", ".join(parts) + more


def record(parts_by_rank: Sequence[Sequence[fingerprint.Part]], on_drift: str, step: int) -> dict[str, str]:
    """(coordinator, or any rank: pure) Fingerprints to record in the manifest of ``step``.

    Raises:
        ReplicaDriftError: ``on_drift="error"`` and replicas differ.
    """
    prints, drifted = fingerprint.combine(parts_by_rank)
    if drifted and on_drift != "ignore":
        message = (
            f"save of step {step}: copies of the same tensor differ between ranks (replicas drifted; "
            f"DCP writes only one copy): {describe_drift(drifted)}"
        )
        if on_drift == "error":
            raise ReplicaDriftError(message)
        warnings.warn(f"distckpt: {message}", stacklevel=3)
    return prints


def diverged(
    parts_by_rank: Sequence[Sequence[fingerprint.Part]], saved: Mapping[str, str], keys: Iterable[str]
) -> list[str]:
    """(any rank: pure, identical on every rank) Keys among ``keys`` whose loaded fingerprint
    differs from the saved one. Keys without a saved fingerprint are not judged."""
    got, drifted = fingerprint.combine(parts_by_rank)
    out = []
    for key in keys:
        want = saved.get(key)
        if want is None:
            continue
        if key in drifted or got.get(key) != want:
            out.append(key)
    return sorted(out)


def from_files(source: object) -> dict[str, str]:
    """(one process, not collective) Fingerprints recomputed from a checkpoint's files.

    ``source`` is a :class:`distckpt.convert.CheckpointSource`; every stored shard of every tensor
    is read once (one shard in memory at a time) and its part added, exactly as the ranks that
    saved it did. What ``distckpt verify --state`` compares with the manifest.
    """
    parts: list[fingerprint.Part] = []
    for key, info in source.tensors.items():  # type: ignore[attr-defined]
        for offsets, shard in source.iter_shards(key):  # type: ignore[attr-defined]
            if not fingerprint.supported(shard):
                break
            total = fingerprint.partial_sum(shard, info.shape, offsets)
            parts.append((key, tuple(offsets), tuple(shard.shape), tuple(info.shape), str(info.dtype), total))
    prints, _ = fingerprint.combine([parts])
    return prints


def compare_files(source: object, saved: Mapping[str, str]) -> tuple[list[str], int]:
    """``(keys whose stored values differ from their recorded fingerprint, keys checked)``."""
    recomputed = from_files(source)
    checked = [k for k in saved if k in recomputed]
    bad = sorted(k for k in saved if recomputed.get(k) != saved[k])
    return bad, len(checked)
