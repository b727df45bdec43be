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
  writes (the rank at coordinate 0 of the mesh dimensions that replicate it, as a save picks
  its writer: :func:`distckpt.save.plan.writes_dtensor`): the partial fingerprint sums, the
  elements covered and a hash of each partial sum (:func:`~distckpt.state.fingerprint.mix_value`);
  over all copies: the same hash, the number of copies and the number of meshes holding the
  key (their ranks at coordinate 0). The holders then judge: the designated blocks cover the
  tensor exactly, their sum gives the saved fingerprint, there are ``R x M`` copies of each
  (``R``: the replication factor within a mesh, ``M``: the meshes) and the hash over all copies
  is ``R x M`` times the designated copies' (the hash is not linear, so copies that differ
  cannot cancel out, except by a 2**-64 accident). Empty blocks (uneven sharding) hold nothing
  and take no part.
* Keys that several meshes hold (``M > 1``: a DTensor on a sub-mesh, replicated along the job's
  other mesh dimensions, as FSDP-only parameters of an FSDP x TP job) have a designated copy of
  each block on every one of them. Two more all-reduces, run only then (every rank sees the
  same ``M``), keep one mesh's: the lowest rank of each holding mesh (a max over negated ranks),
  then the designated slots again over that mesh alone.
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
_COPIES, _DESIGNATED, _COVERED, _BAD, _ALL_HI, _ALL_LO, _MINE_HI, _MINE_LO, _SUM_HI, _SUM_LO, _MESHES = range(11)
_SLOTS = 11
# The designated-copy slots, recomputed over one mesh for keys that several meshes hold.
_PER_MESH = (_DESIGNATED, _COVERED, _MINE_HI, _MINE_LO, _SUM_HI, _SUM_LO)


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
    # key index -> (lowest rank of the block's mesh, elements, hash, partial sum) of the blocks
    # this rank is the designated holder of.
    blocks: dict[int, tuple[int, int, int, int]] = {}

    def local() -> torch.Tensor:
        slots = [[0] * len(judged) for _ in range(_SLOTS)]
        flat = extract()
        mine = {k: v for k, v in flat.items() if k in index}
        lowest: dict[int, int] = {}  # id(mesh) -> its lowest global rank
        for key, offsets, shape, global_shape, dtype, total in fingerprint.local_parts(mine, threads=threads, version=version):
            i = index[key]
            if tuple(shape) == tuple(global_shape) and not any(offsets):
                slots[_COPIES][i] += 1
                slots[_BAD][i] |= fingerprint.digest(total, global_shape, dtype, version) != saved[key]
                continue
            if not numel(shape):
                continue  # an empty block of uneven sharding: nothing to count or sum
            # Plain tensors come whole from local_parts: only a DTensor's block is partial.
            value = flat[key]
            replicas, coord = replication(value, key)
            sharded[i] = (replicas, tuple(global_shape), dtype)
            h = fingerprint.mix_value(total)
            slots[_COPIES][i] += 1
            slots[_MESHES][i] += coord is not None and not any(coord)
            _add64(slots, _ALL_HI, i, h)
            if writes_dtensor(value, key):
                mesh = value.device_mesh
                if id(mesh) not in lowest:
                    lowest[id(mesh)] = int(mesh.mesh.min())
                blocks[i] = (lowest[id(mesh)], numel(shape), h, total)
                slots[_DESIGNATED][i] += 1
                slots[_COVERED][i] += numel(shape)
                _add64(slots, _MINE_HI, i, h)
                _add64(slots, _SUM_HI, i, total)
        return torch.tensor(slots, dtype=torch.int64).reshape(-1)

    summed = group.all_reduce(all_ranks(group, what, local), "sum").reshape(_SLOTS, len(judged)).tolist()
    bad = [1 if summed[_BAD][i] or not summed[_COPIES][i] else 0 for i in range(len(judged))]
    several = [i for i in range(len(judged)) if summed[_MESHES][i] > 1]  # the same list on every rank
    if several:
        _one_mesh(group, several, blocks, summed)
    if any(summed[_DESIGNATED]):  # every rank sees the same sums, so all take part or none
        for i, (replicas, global_shape, dtype) in sharded.items():
            s = [row[i] for row in summed]
            copies = replicas * max(1, s[_MESHES])  # of each block, over every mesh holding the key
            total = ((s[_SUM_HI] << 32) + s[_SUM_LO]) & _MASK64
            every = ((s[_ALL_HI] << 32) + s[_ALL_LO]) & _MASK64
            designated = ((s[_MINE_HI] << 32) + s[_MINE_LO]) & _MASK64
            if (
                s[_COVERED] != numel(global_shape)
                or s[_COPIES] != copies * s[_DESIGNATED]
                or every != (copies * designated) & _MASK64
                or fingerprint.digest(total, global_shape, dtype, version) != saved[judged[i]]
            ):
                bad[i] = 1
        bad = group.all_reduce(torch.tensor(bad, dtype=torch.uint8), "max").tolist()
    return [k for k, b in zip(judged, bad) if b]


def _one_mesh(
    group: Group, several: list[int], blocks: Mapping[int, tuple[int, int, int, int]], summed: list[list[int]]
) -> None:
    """(all ranks, collective: two all-reduces) For the keys ``several`` (indices) that several
    meshes hold, replace the designated-copy slots of ``summed`` by those of one mesh: the one
    holding the lowest rank (a max over negated ranks; a rank holding no designated block of a
    key offers the lowest possible value)."""
    none = -(1 << 62)
    offered = [-blocks[i][0] if i in blocks else none for i in several]
    first = group.all_reduce(torch.tensor(offered, dtype=torch.int64), "max").tolist()
    slots = [[0] * len(several) for _ in range(_SLOTS)]
    for j, i in enumerate(several):
        block = blocks.get(i)
        if block is None or -block[0] != first[j]:
            continue
        _, elements, h, total = block
        slots[_DESIGNATED][j] += 1
        slots[_COVERED][j] += elements
        _add64(slots, _MINE_HI, j, h)
        _add64(slots, _SUM_HI, j, total)
    redone = group.all_reduce(torch.tensor([slots[row] for row in _PER_MESH], dtype=torch.int64), "sum").tolist()
    for row, values in zip(_PER_MESH, redone):
        for j, i in enumerate(several):
            summed[row][i] = values[j]


def _add64(slots: list[list[int]], hi: int, i: int, value: int) -> None:
    """Add a 64-bit value to the 32-bit halves at rows ``hi`` and ``hi + 1``."""
    slots[hi][i] += value >> 32
    slots[hi + 1][i] += value & _LOW32
