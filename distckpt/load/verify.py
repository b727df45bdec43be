"""The state check after a load (verified resume), with O(keys) bytes per rank at any world size.

Every rank fingerprints what its objects hold (:func:`distckpt.state.fingerprint.local_parts`),
and the loaded state must give back every fingerprint the manifest recorded. Gathering every
rank's parts would cost each rank O(world x keys) bytes (at 4,096 FSDP ranks and 1,000 tensors,
hundreds of MB per rank on every resharded resume). Instead:

* A tensor a rank holds whole (a plain or DDP tensor, a ZeRO partition's state, a per-rank value,
  a fully replicated DTensor) is judged by that rank alone: its digest against the manifest's.
  Every copy is checked, so a replica that differs is caught where it lives.
* A sharded DTensor's blocks add up across ranks. Per key, one all-reduce sums slots of 32-bit
  halves (no overflow at any world size): over the copies the designated holder of each block
  writes (the rank at coordinate 0 of the mesh dimensions that do not shard it, as a save picks
  its writer): the partial fingerprint sums, the elements covered and a hash of each partial
  sum (:func:`~distckpt.state.fingerprint.mix_value`); over all copies: the same hash and the
  number of copies. The holders then judge: the designated blocks cover the tensor exactly,
  their sum gives the saved fingerprint, there are ``R`` copies of each (``R``: the replication
  factor) and the hash over all copies is ``R`` times the designated copies' (the hash is not
  linear, so copies that differ cannot cancel out, except by a 2**-64 accident).
* A second all-reduce (a byte per key) hands every rank the same verdict. A key that nobody
  holds in a form that can be fingerprinted counts as diverged, as does one no rank can cover.

The verdict equals :func:`distckpt.state.statecheck.diverged` over gathered parts (pinned by tests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from distckpt._dist import Group, all_ranks
from distckpt.save.plan import replication, writes_dtensor
from distckpt.state import fingerprint
from distckpt.state.shape import numel

_LOW32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
# Slots per key of the summed vector, in this order.
_COPIES, _DESIGNATED, _COVERED, _BAD, _ALL_HI, _ALL_LO, _MINE_HI, _MINE_LO, _SUM_HI, _SUM_LO = range(10)
_SLOTS = 10


def diverged_keys(
    group: Group,
    extract: Callable[[], Mapping[str, Any]],
    saved: Mapping[str, str],
    keys: Sequence[str],
    what: str,
    threads: int = 1,
    version: int = fingerprint.VERSION,
) -> list[str]:
    """(all ranks, collective) The keys among ``keys`` whose loaded values differ from the
    saved ones, sorted, identical on every rank.

    Args:
        extract: gives this rank's state, flattened (DCP's keys), re-extracted from the live
            objects (called once, inside the check's error agreement).
        saved: the manifest's fingerprints; keys without one are not judged.
        keys: the keys to judge, the same list on every rank.
        what: names the check in errors (a failure on one rank fails every rank alike).
        threads: fingerprinting threads.
        version: the fingerprint construction of ``saved`` (the manifest's ``fingerprint_version``).
    """
    judged = sorted(k for k in keys if k in saved)
    index = {k: i for i, k in enumerate(judged)}
    sharded: dict[int, tuple[int, tuple[int, ...], str]] = {}  # key index -> (replicas, global shape, dtype)

    def local() -> torch.Tensor:
        slots = [[0] * len(judged) for _ in range(_SLOTS)]
        flat = extract()
        mine = {k: v for k, v in flat.items() if k in index}
        for key, offsets, shape, global_shape, dtype, total in fingerprint.local_parts(mine, threads=threads, version=version):
            i = index[key]
            if tuple(shape) == tuple(global_shape) and not any(offsets):
                slots[_COPIES][i] += 1
                slots[_BAD][i] |= fingerprint.digest(total, global_shape, dtype, version) != saved[key]
                continue
            # Plain tensors come whole from local_parts: only a DTensor's block is partial.
            replicas, designated = replication(flat[key])[0], writes_dtensor(flat[key])
            sharded[i] = (replicas, tuple(global_shape), dtype)
            h = fingerprint.mix_value(total)
            slots[_COPIES][i] += 1
            _add64(slots, _ALL_HI, i, h)
            if designated:
                slots[_DESIGNATED][i] += 1
                slots[_COVERED][i] += numel(shape)
                _add64(slots, _MINE_HI, i, h)
                _add64(slots, _SUM_HI, i, total)
        return torch.tensor(slots, dtype=torch.int64).reshape(-1)

    summed = group.all_reduce(all_ranks(group, what, local), "sum").reshape(_SLOTS, len(judged)).tolist()
    bad = [1 if summed[_BAD][i] or not summed[_COPIES][i] else 0 for i in range(len(judged))]
    if any(summed[_DESIGNATED]):  # every rank sees the same sums, so all take part or none
        for i, (replicas, global_shape, dtype) in sharded.items():
            s = [row[i] for row in summed]
            total = ((s[_SUM_HI] << 32) + s[_SUM_LO]) & _MASK64
            every = ((s[_ALL_HI] << 32) + s[_ALL_LO]) & _MASK64
            designated = ((s[_MINE_HI] << 32) + s[_MINE_LO]) & _MASK64
            if (
                s[_COVERED] != numel(global_shape)
                or s[_COPIES] != replicas * s[_DESIGNATED]
                or every != (replicas * designated) & _MASK64
                or fingerprint.digest(total, global_shape, dtype, version) != saved[judged[i]]
            ):
                bad[i] = 1
        bad = group.all_reduce(torch.tensor(bad, dtype=torch.uint8), "max").tolist()
    return [k for k, b in zip(judged, bad) if b]


def _add64(slots: list[list[int]], hi: int, i: int, value: int) -> None:
    """Add a 64-bit value to the 32-bit halves at rows ``hi`` and ``hi + 1``."""
    slots[hi][i] += value >> 32
    slots[hi + 1][i] += value & _LOW32
