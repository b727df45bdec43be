"""Verified resume: the state a job holds after a load is the state that was saved.

At save, every rank computes :mod:`distckpt.state.fingerprint` parts of the tensors it holds; the parts
of what it *writes* travel with the write results the coordinator gathers anyway, and the manifest
records one fingerprint per tensor key (``Manifest.fingerprints``). Copies of a tensor that should
be identical (DDP replicas, replicated DTensor dimensions, global values) are compared on the way:
copies that differ are reported (``on_drift="warn"`` or ``"error"``), naming the key and the ranks
on each side, and get no fingerprint, since only one of them is written.

The comparison costs O(items) per rank, not O(world x items) (:func:`replica_vector`): every rank
adds, per replicated key, a hash of its copy's digest (:func:`copy_digest`: a CRC-32C of a host
copy's bytes, which runs at memory speed, or the fingerprint sum of an accelerator copy, summed
on its device) to one slot and, if it writes that copy, to a second slot; one all-reduce sums
the slots; a key whose first sum is not ``R`` times its second (``R`` copies) has copies that
differ. Only then are the drifted keys' digests gathered, to name the ranks on each side
(:func:`name_drift`); drifted keys get no fingerprint. Items held by some ranks only (ZeRO
partitions, per-rank entries) send the fingerprint part of every copy they hold, so copies held
twice are compared by :func:`record` as before.

After a load, the same parts are computed over what the objects now hold (re-extracted through
the same state-dict functions a save uses) and judged against the manifest with O(keys) bytes per
rank (:mod:`distckpt.load.verify`; :func:`diverged` is the same verdict over gathered parts): a
difference raises :class:`StateDivergedError` on every rank, naming the keys.

Not collective by itself: the checkpointer gathers the parts.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from distckpt._compat import as_byte_viewable
from distckpt.state import fingerprint, fpkernels
from distckpt.errors import StateMismatchError
from distckpt.integrity.shards import ShardSource
from distckpt.integrity.checksums import new_hasher

DRIFT_POLICIES = ("warn", "error", "ignore")


class StateDivergedError(StateMismatchError):
    """After a load, tensors differ from what was saved (their fingerprints do not match).

    Attributes:
        diverged: the keys whose loaded values differ from the saved ones.
    """

    def __init__(self, diverged: Sequence[str], where: str = "") -> None:
        self.diverged = sorted(diverged)
        self.where = where
        self.missing, self.unexpected, self.mismatched, self.per_rank, self.kinds = [], [], {}, {}, {}
        self.unread_on: dict[str, list[int]] = {}  # (every attribute StateMismatchError documents)
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


def record(
    parts_by_rank: Sequence[Sequence[fingerprint.Part]],
    on_drift: str,
    step: int,
    drifted: Mapping[str, list[list[int]]] | None = None,
) -> dict[str, str]:
    """(coordinator, or any rank: pure) Fingerprints to record in the manifest of ``step``
    (:data:`distckpt.state.fingerprint.VERSION`, the construction the parts were computed with).

    Args:
        drifted: replicated keys whose copies the replica check found to differ, with the
            groups of ranks holding equal copies (:func:`name_drift`); they get no fingerprint.

    Raises:
        ReplicaDriftError: ``on_drift="error"`` and replicas differ.
    """
    prints, found = fingerprint.combine(parts_by_rank, fingerprint.VERSION)
    drifted = {**found, **(drifted or {})}
    for key in drifted:
        prints.pop(key, None)
    report_drift(f"save of step {step}", "DCP writes only one copy", drifted, on_drift)
    return prints


def report_drift(what: str, written: str, drifted: Mapping[str, list[list[int]]], on_drift: str, stacklevel: int = 4) -> None:
    """(each rank that judged the copies) Warn about, or raise for, ``drifted`` (key -> groups of
    ranks holding equal copies) per ``on_drift``; ``written``: which copy is kept.

    Raises:
        ReplicaDriftError: ``on_drift="error"`` and ``drifted`` is not empty.
    """
    if drifted and on_drift != "ignore":
        message = f"{what}: copies of the same tensor differ between ranks (replicas drifted; {written}): {describe_drift(drifted)}"
        if on_drift == "error":
            raise ReplicaDriftError(message)
        warnings.warn(f"distckpt: {message}", stacklevel=stacklevel)


def diverged(
    parts_by_rank: Sequence[Sequence[fingerprint.Part]],
    saved: Mapping[str, str],
    keys: Iterable[str],
    version: int = fingerprint.VERSION,
) -> list[str]:
    """(any rank: pure, identical on every rank) Keys among ``keys`` whose loaded fingerprint
    differs from the saved one (``version``: the construction of ``saved`` and of the parts).
    Keys without a saved fingerprint are not judged."""
    got, drifted = fingerprint.combine(parts_by_rank, version)
    out = []
    for key in keys:
        want = saved.get(key)
        if want is None:
            continue
        if key in drifted or got.get(key) != want:
            out.append(key)
    return sorted(out)


def from_files(source: ShardSource, version: int = fingerprint.VERSION, unsupported: set[str] | None = None) -> dict[str, str]:
    """(one process, not collective) Fingerprints recomputed from a checkpoint's files.

    ``source`` reads the stored shards (:class:`distckpt.integrity.shards.CheckpointSource`); every
    stored shard of every tensor is read once (one shard in memory at a time) and its part added,
    exactly as the ranks that saved it did, with the construction ``version`` (the manifest's).
    What ``distckpt verify --state`` compares with the manifest. ``unsupported``: gets the keys
    of tensors no fingerprint is made of (quantized; a save records none for them either).
    """
    parts: list[fingerprint.Part] = []
    for key, info in source.tensors.items():
        for offsets, shard in source.iter_shards(key):
            if not fingerprint.supported(shard):
                if unsupported is not None:
                    unsupported.add(key)
                break
            total = fingerprint.partial_sum(shard, info.shape, offsets, version)
            parts.append((key, tuple(offsets), tuple(shard.shape), tuple(info.shape), str(info.dtype), total))
    prints, _ = fingerprint.combine([parts], version)
    return prints


class FileCheck(NamedTuple):
    """What :func:`compare_files` found."""

    bad: list[str]  # keys whose stored values differ from their recorded fingerprint
    checked: int  # keys compared
    lacking: list[str]  # stored tensors that could have one, without a recorded fingerprint
    unsupported: list[str]  # stored tensors no fingerprint is made of (quantized): checksums only


def compare_files(source: ShardSource, saved: Mapping[str, str], version: int = fingerprint.VERSION) -> FileCheck:
    """The stored shards ``source`` reads (see :func:`from_files`) against the fingerprints the
    manifest records (``version``: its ``fingerprint_version``). ``lacking`` is what the
    fingerprints do not prove (replicas that drifted at save get none; otherwise the manifest
    or ``.metadata`` was altered): a caller says so instead of passing them silently."""
    unsupported: set[str] = set()
    recomputed = from_files(source, version, unsupported)
    checked = [k for k in saved if k in recomputed]
    bad = sorted(k for k in saved if recomputed.get(k) != saved[k])
    lacking = sorted(k for k in source.tensors if k not in saved and k not in unsupported)
    return FileCheck(bad, len(checked), lacking, sorted(k for k in unsupported if k not in saved))


_LOW32 = (1 << 32) - 1

Copy = tuple  # (shard offsets, digest): one copy of a compared tensor on one rank


def copy_digest(local: torch.Tensor, offsets: Sequence[int], on_device: bool = False, lazy: bool = False) -> Copy | None:
    """(any rank, not collective) The digest of one copy of a replicated tensor (or of one
    replicated shard, at ``offsets``) for the replica check, which needs only equal copies to
    give equal digests: a CRC-32C of the bytes of a host copy (cheaper than a fingerprint on one
    core; measured: benchmarks/README.md), the fingerprint sum of an accelerator copy (summed on its device,
    no copy to the host). ``on_device``: the copy was taken from an accelerator tensor (a copy
    staged to host memory takes its replicas' kind of digest). ``None``: not comparable
    (sparse, quantized, meta). ``lazy``: an accelerator copy's digest may be left a device
    tensor (no wait for the device; :func:`settled_copies` turns them into ints)."""
    if not fingerprint.supported(local):
        return None
    local = local.detach().resolve_conj().resolve_neg()  # a lazy conj/neg view's values, as saved
    if on_device or local.device.type != "cpu":
        zeros = (0,) * local.dim()
        lazy_sum = fingerprint.lazy_partial_sum if lazy else fingerprint.partial_sum
        value = lazy_sum(local, local.shape, zeros)
    else:

        flat = as_byte_viewable(local).reshape(-1)
        if flat.dtype.is_complex:
            flat = torch.view_as_real(flat).reshape(-1)
        hasher = new_hasher("crc32c")
        if flat.numel():
            hasher.update(memoryview(flat.view(torch.uint8).numpy()))
        value = int(hasher.hexdigest(), 16)
    return (tuple(int(o) for o in offsets), value)


def settled_copies(copies: Mapping[str, Copy]) -> dict[str, Copy]:
    """``copies`` (from :func:`copy_digest` with ``lazy``) with every digest an int: device digests
    brought back with one transfer per device."""
    keys = list(copies)
    values = fpkernels.settle([copies[k][1] for k in keys])
    return {k: (copies[k][0], v) for k, v in zip(keys, values)}


def copy_digests(flat: Mapping[str, object], on_device: Iterable[str] = (), threads: int = 1) -> dict[str, Copy]:
    """(each rank, not collective) :func:`copy_digest` of every tensor in ``flat`` (DCP's flat
    keys; a DTensor by its local shard at the offsets DCP writes it at), in ``threads`` threads
    (CRC-32C and NumPy release the GIL)."""
    from torch.distributed.tensor import DTensor

    device = set(on_device)
    jobs: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []
    for key, value in flat.items():
        if isinstance(value, DTensor):
            chunks = value.__create_chunk_list__()
            if len(chunks) == 1:
                jobs.append((key, value.to_local(), tuple(int(o) for o in chunks[0].offsets)))
        elif isinstance(value, torch.Tensor):
            jobs.append((key, value, (0,) * value.dim()))

    def one(job: tuple) -> Copy | None:
        key, local, offsets = job
        return copy_digest(local, offsets, key in device)

    if threads > 1 and len(jobs) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads, thread_name_prefix="distckpt-digest") as pool:
            done = list(pool.map(one, jobs))
    else:
        done = [one(j) for j in jobs]
    return {job[0]: d for job, d in zip(jobs, done) if d is not None}


def name_drift(copies_by_rank: Sequence[Mapping[str, Copy]], keys: Iterable[str]) -> dict[str, list[list[int]]]:
    """(coordinator, pure) For each drifted key, the groups of ranks whose copies are equal
    (copies of one shard grouped by digest; shards at other offsets are not compared)."""
    out: dict[str, list[list[int]]] = {}
    for key in keys:
        groups: dict[Copy, list[int]] = {}
        for rank, copies in enumerate(copies_by_rank):
            if key in copies:
                groups.setdefault(tuple(copies[key]), []).append(rank)
        by_offsets: dict[tuple, list[list[int]]] = {}
        for (offsets, _), ranks in groups.items():
            by_offsets.setdefault(offsets, []).append(ranks)
        out[key] = sorted(g for gs in by_offsets.values() if len(gs) > 1 for g in gs) or sorted(groups.values())
    return out


def replica_vector(
    held: Mapping[str, Copy],
    checked: Sequence[str],
    dchecked: Sequence[tuple[str, int]],
    written: set[str] | frozenset[str],
) -> torch.Tensor:
    """(each rank, not collective) This rank's slots for the replica check, to be summed over
    ranks (``all_reduce``) and judged by :func:`replica_mismatches`.

    Args:
        held: key -> :func:`copy_digest` of every compared copy this rank holds (written or not).
        checked: replicated plain tensors (every rank holds one copy), sorted, the same list on
            every rank.
        dchecked: DTensors with replicated mesh dimensions and their replication factor.
        written: keys this rank writes.

    Returns:
        int64 tensor ``[all_hi, all_lo, written_hi, written_lo]``, each ``n`` long: 32-bit
        halves of the slot sums, so that a sum over any number of ranks fits without overflow.
    """
    index = {k: i for i, k in enumerate(checked)}
    for k, _ in dchecked:
        index.setdefault(k, len(index))
    n = len(index)
    every = [0] * n
    mine = [0] * n
    mask = (1 << 64) - 1
    for key, (_, digest) in held.items():
        i = index.get(key)
        if i is None:
            continue
        h = fingerprint.mix_value(digest)
        every[i] = (every[i] + h) & mask
        if key in written:
            mine[i] = (mine[i] + h) & mask
    return torch.tensor(
        [v >> 32 for v in every] + [v & _LOW32 for v in every] + [v >> 32 for v in mine] + [v & _LOW32 for v in mine],
        dtype=torch.int64,
    )


def replica_mismatches(
    summed: torch.Tensor, checked: Sequence[str], dchecked: Sequence[tuple[str, int]], world_size: int
) -> list[str]:
    """(any rank, pure) Keys whose copies differ, from the summed :func:`replica_vector`: those
    whose hash sum over all copies is not the number of copies times the written copies' sum."""
    factor = {k: world_size for k in checked}
    for k, r in dchecked:
        factor.setdefault(k, r)
    keys = list(factor)
    n = len(keys)
    values = summed.tolist()
    mask = (1 << 64) - 1
    out = []
    for i, key in enumerate(keys):
        every = ((values[i] << 32) + values[n + i]) & mask
        mine = ((values[2 * n + i] << 32) + values[3 * n + i]) & mask
        if every != (factor[key] * mine) & mask:
            out.append(key)
    return out


def parts_to_send(
    held: Sequence[fingerprint.Part],
    written: set[str] | frozenset[str],
    replicated: Mapping[str, int] | set[str],
    dchecked: Sequence[tuple[str, int]] | None,
) -> list[fingerprint.Part]:
    """(each rank) The fingerprint parts this rank hands the coordinator for :func:`record`:
    those of what it writes; every copy of items that only some ranks hold (their duplicates are
    compared there) and of DTensor replicas the ranks could not compare by slots. (Keys that
    drifted are named from their copies' digests, :func:`name_drift`.)"""
    compared = {k for k, _ in dchecked} if dchecked is not None else set()
    out = []
    for part in held:
        key = part[0]
        if key in written or (key not in replicated and key not in compared):
            out.append(part)
    return out
