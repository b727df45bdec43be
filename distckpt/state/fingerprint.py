"""Sharding-independent fingerprints of tensors: proof that a loaded state equals the saved one.

Checksums prove that files are intact; they do not prove that the tensors a job holds after a
load are the tensors that were saved (a wrong shard mapping, a dropped chunk, a dtype cast or a
per-rank value taken from the wrong rank all load "successfully"). A fingerprint is a function
of a *logical* tensor's dtype, shape and values only, computable piecewise by the ranks that
hold its shards, whatever the layout (DDP replica, FSDP2/DTensor shards, ZeRO partition, 2-D).

Construction. For a tensor of global shape ``G`` and dtype ``D``, element ``i`` is the ``i``-th
element in row-major order of the *global* tensor (complex numbers as two real elements, i.e.
the ``view_as_real`` tensor). A per-element function ``f`` of the element's global index and raw
bits (:mod:`distckpt.state.fpkernels` defines it, per version) is summed modulo 2**64 over all
elements, and::

    fingerprint = sha256("distckpt-fp<version>|D|G|sum")[:16 hex digits]

Why it does not depend on the layout: ``f`` depends only on an element's *global* index and its
bits, and a sum mod 2**64 does not depend on order or grouping. A rank holding a shard at global
offsets ``O`` sums ``f`` over its elements (their global indices follow from ``O`` and ``G``);
partial sums of disjoint shards add up (one all-reduce) to exactly the sum over the whole
tensor. Replicas are counted once.

Why it catches divergence (version 2, what saves record): each element's bits and position pass
through a 64-bit mixing step before the sum, so a single changed element always changes the sum,
and changes of several elements (sign flips, bit flips, swaps, one ulp, shards moved to other
offsets) cancel only by a ~2**-64 accident. Version 1, recorded by checkpoints written before
it (the manifest's ``fingerprint_version``), used a linear 32-bit-weighted sum in which two sign
flips cancel half of the time; those checkpoints are still checked with it. Neither is a
cryptographic hash: they detect accidents, not an attacker who can also rewrite the manifest.

Cost: a few vectorised integer operations per element, in NumPy for host memory (throughput:
benchmarks/README.md) and torch on the tensor's own device for accelerator memory (summed
there without synchronizing, brought back once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from distckpt._compat import as_byte_viewable
from distckpt.state import fpkernels
from distckpt.state.casts import cast_back
from distckpt.state.fpkernels import MASK64 as _MASK64
from distckpt.state.fpkernels import VERSIONS
from distckpt.state.shape import contiguous_strides, numel

#: The construction new saves record (``Manifest.fingerprint_version``); :data:`VERSIONS` are
#: the ones this distckpt can check.
VERSION = 2

__all__ = [
    "VERSION", "VERSIONS", "Part", "add", "combine", "digest", "local_parts", "mix", "mix_value",
    "lazy_partial_sum", "of_tensor", "part_of", "partial_sum", "run_sum", "settled", "supported",
]


def supported(t: torch.Tensor) -> bool:
    """Whether ``t`` can be fingerprinted (dense, strided, not quantized, not meta)."""
    return (
        t.layout == torch.strided
        and not t.is_quantized
        and t.device.type != "meta"
        and (t.dtype.is_complex or t.dtype == torch.bool or t.element_size() in (1, 2, 4, 8))
    )


def partial_sum(local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int], version: int = VERSION) -> int:
    """(any rank, not collective) This shard's contribution to its tensor's fingerprint sum.

    Args:
        local: the shard (any device); its elements sit at ``offsets`` of the global tensor.
        global_shape: shape of the whole logical tensor.
        offsets: the shard's offset in each dimension.
        version: the construction (:data:`VERSION` for new saves; a manifest's recorded one to check it).

    Returns:
        An int in ``[0, 2**64)``; add the partial sums of disjoint shards mod ``2**64``.
    """
    return _partial(local, global_shape, offsets, version, lazy=False)  # type: ignore[return-value]


def _partial(
    local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int], version: int, lazy: bool
) -> int | torch.Tensor:
    """:func:`partial_sum`; with ``lazy``, summed by the device kernels and left a 0-dim tensor on
    ``local``'s device (:func:`lazy_partial_sum`; on a host tensor, the tests' stand-in for a
    device), whatever its layout."""
    fpkernels.check_version(version)
    # A lazy conjugate or negative view (``t.conj()``, ``t.conj().imag``) resolved into its values,
    # as DCP saves them (view_as_real refuses the view; its memory holds the unconjugated ones).
    local = local.detach().resolve_conj().resolve_neg()
    if local.dtype.is_complex:
        local = torch.view_as_real(local)
        global_shape, offsets = (*global_shape, 2), (*offsets, 0)
    shape = [int(d) for d in local.shape]
    gshape = [int(d) for d in global_shape]
    offs = [int(o) for o in offsets]
    if len(shape) != len(gshape) or len(offs) != len(gshape):
        raise ValueError(f"shard of shape {shape} at offsets {offs} does not fit global shape {gshape}")
    if local.numel() == 0:
        return 0
    local = as_byte_viewable(local)
    bits = fpkernels.bits(local)
    run_sum = fpkernels.device_run_sum if lazy else fpkernels.run_sum
    if not gshape:  # a scalar
        return run_sum(bits, 0, version)
    strides = contiguous_strides(gshape)  # no zero-sized dimension here: numel() > 0
    # Dimensions after ``split`` are whole: the shard is a set of runs that are contiguous in
    # the global row-major order, each ``run`` elements long.
    split = 0
    for d in range(len(gshape) - 1, -1, -1):
        if shape[d] != gshape[d] or offs[d] != 0:
            split = d
            break
    run = shape[split] * strides[split]
    base = sum(o * s for o, s in zip(offs, strides))
    outer = shape[:split]
    n_runs = 1
    for d in outer:
        n_runs *= d
    if n_runs == 1:
        return run_sum(bits, base, version)
    starts = [base]
    for d, n in enumerate(outer):
        starts = [s + i * strides[d] for s in starts for i in range(n)]
    return (fpkernels.device_rows_sum if lazy else fpkernels.rows_sum)(bits, starts, run, version)


def digest(total: int, global_shape: Sequence[int], dtype: torch.dtype | str, version: int = VERSION) -> str:
    """The fingerprint recorded in a manifest, from the combined sum of all shards (``dtype``: a
    torch dtype or its name, as parts carry it)."""
    return _digest_named(total, global_shape, str(dtype), version)


def run_sum(values: torch.Tensor, start: int, version: int = VERSION) -> int:
    """(not collective) The sum over a contiguous run of a tensor's elements in row-major order,
    ``values`` (any shape) sitting at flat index ``start`` of the whole tensor. Lets a reader
    that streams a tensor in blocks (``convert``) check it without holding it whole."""
    if values.dtype.is_complex:
        values, start = torch.view_as_real(values), start * 2
    return fpkernels.run_sum(fpkernels.bits(values.contiguous()), start, version)


def add(total: int, part: int) -> int:
    """Partial sums combine by addition modulo 2**64 (any order)."""
    return (total + part) & _MASK64


def of_tensor(t: torch.Tensor, version: int = VERSION) -> str:
    """Fingerprint of a whole (non-distributed) tensor. Not collective."""
    return digest(partial_sum(t, t.shape, [0] * t.dim(), version), t.shape, t.dtype, version)


# --------------------------------------------------------------------------------------------------
# A whole state, across ranks
Part = tuple  # (key, offsets, local shape, global shape, dtype name, partial sum)


def local_parts(flat: dict, threads: int = 1, version: int = VERSION, as_dtype: Mapping[str, torch.dtype] | None = None) -> list[Part]:
    """(each rank, not collective) The fingerprint parts of every tensor this rank holds.

    ``flat`` maps flattened state-dict keys to values (DCP's flattening). A DTensor contributes
    its local shard at the offsets DCP itself would write it at; a plain tensor is a whole
    tensor (offsets 0). Values that are not tensors, and tensors that cannot be fingerprinted
    (sparse, quantized, meta), are left out. Accelerator tensors are summed on their device
    without synchronizing per tensor (one transfer per device at the end); host tensors by
    single-threaded NumPy loops that release the GIL, over ``threads`` Python threads. The parts
    come back in key order. ``as_dtype``: keys whose tensors are fingerprinted cast to that dtype
    (one block at a time: a load that cast a checkpoint's values exactly, proven by casting back).
    """
    from torch.distributed.tensor import DTensor

    blocks: list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]] = []
    for key, value in flat.items():
        if isinstance(value, DTensor):
            local = value.to_local()
            if not numel(value.shape):
                # Empty: nothing to sum, wherever its blocks lie (FSDP2 gives a rank's empty
                # block no chunk); one part per rank, so that a check counts its copies.
                blocks.append((key, local, (0,) * value.dim(), tuple(int(d) for d in value.shape)))
                continue
            chunks = value.__create_chunk_list__()  # the chunk DCP writes for this rank
            if len(chunks) != 1 or tuple(int(d) for d in chunks[0].sizes) != tuple(local.shape):
                continue  # a layout DCP does not write as one block: not fingerprinted
            blocks.append((key, local, tuple(int(o) for o in chunks[0].offsets), tuple(int(d) for d in value.shape)))
        elif isinstance(value, torch.Tensor):
            blocks.append((key, value, (0,) * value.dim(), tuple(int(d) for d in value.shape)))
    blocks = [b for b in blocks if supported(b[1])]
    on_device = [b for b in blocks if b[1].device.type != "cpu"]
    on_host = [b for b in blocks if b[1].device.type == "cpu"]
    sums: dict[int, int] = {}
    cast = as_dtype or {}

    def values(block: tuple) -> torch.Tensor:
        dtype = cast.get(block[0])
        return block[1] if dtype is None else cast_back(block[1], dtype)

    if on_device:
        lazy = [_lazy_sum(values(b), b[2], b[3], version) for b in on_device]
        sums.update({id(b): v for b, v in zip(on_device, fpkernels.settle(lazy))})

    def one(block: tuple) -> int:
        return partial_sum(values(block), block[3], block[2], version)

    if threads > 1 and len(on_host) > 1:
        from concurrent.futures import ThreadPoolExecutor

        # Largest first, so that the threads finish together.
        order = sorted(on_host, key=lambda b: -b[1].numel())
        with ThreadPoolExecutor(threads, thread_name_prefix="distckpt-fingerprint") as pool:
            sums.update({id(b): v for b, v in zip(order, pool.map(one, order))})
    else:
        sums.update({id(b): one(b) for b in on_host})
    return [
        (key, offsets, tuple(local.shape), shape, str(cast.get(key, local.dtype)), sums[id(b)])
        for b in blocks
        for key, local, offsets, shape in (b,)
    ]


def _lazy_sum(local: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int], version: int) -> int | torch.Tensor:
    """A device block's partial sum without synchronizing, whatever its layout (a whole tensor,
    a row shard, a column shard of a tensor-parallel layout, a non-contiguous or complex one)."""
    return _partial(local, global_shape, offsets, version, lazy=True)


def part_of(
    key: str,
    local: torch.Tensor,
    offsets: Sequence[int],
    global_shape: Sequence[int],
    version: int = VERSION,
    lazy: bool = False,
) -> Part | None:
    """The fingerprint part of one block DCP writes (``local`` at ``offsets`` of a tensor of
    ``global_shape``), as :func:`local_parts` gives it; ``None`` if it cannot be fingerprinted.

    ``lazy``: an accelerator block's sum may be left a device tensor, computed without waiting
    for the device (one wait per tensor would stall the writer thread calling it);
    :func:`settled` turns such parts into ints, with one transfer per device."""
    if not isinstance(local, torch.Tensor) or not supported(local):
        return None
    offsets = tuple(int(o) for o in offsets)
    global_shape = tuple(int(d) for d in global_shape)
    total = lazy_partial_sum(local, global_shape, offsets, version) if lazy else partial_sum(local, global_shape, offsets, version)
    return (key, offsets, tuple(local.shape), global_shape, str(local.dtype), total)


def lazy_partial_sum(
    local: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int], version: int = VERSION
) -> int | torch.Tensor:
    """:func:`partial_sum`, left a 0-dim device tensor for an accelerator block (any layout): no
    wait for the device. Give such sums to :func:`distckpt.state.fpkernels.settle` (or parts to
    :func:`settled`)."""
    if local.device.type == "cpu":
        return partial_sum(local, global_shape, offsets, version)
    return _lazy_sum(local, tuple(int(o) for o in offsets), global_shape, version)


def settled(parts: Sequence[Part]) -> list[Part]:
    """``parts`` (from :func:`part_of` with ``lazy``) with every sum an int in ``[0, 2**64)``:
    device sums are brought back with one transfer per device, which waits for their kernels."""
    totals = fpkernels.settle([p[5] for p in parts])
    return [tuple(p[:5]) + (t,) for p, t in zip(parts, totals)]


def combine(parts_by_rank: Sequence[Sequence[Part]], version: int = VERSION) -> tuple[dict[str, str], dict[str, list[list[int]]]]:
    """(any rank, not collective) Fingerprints from every rank's :func:`local_parts`.

    Copies of the same block (replicas: DDP parameters, replicated DTensor dimensions, values
    every rank holds) are counted once; copies that disagree are reported instead.

    Returns:
        ``(fingerprints, drifted)``: key -> fingerprint for every tensor whose blocks cover it
        exactly; and key -> groups of ranks holding different values of the same block.
    """
    by_key: dict[str, dict[tuple[int, ...], dict[int, list[int]]]] = {}
    meta: dict[str, set[tuple]] = {}
    sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for rank, parts in enumerate(parts_by_rank):
        for key, offsets, shape, global_shape, dtype, total in parts:
            by_key.setdefault(key, {}).setdefault(tuple(offsets), {}).setdefault(int(total), []).append(rank)
            meta.setdefault(key, set()).add((tuple(global_shape), dtype))
            sizes[(key, tuple(offsets))] = tuple(shape)
    fingerprints: dict[str, str] = {}
    drifted: dict[str, list[list[int]]] = {}
    for key, blocks in by_key.items():
        if len(meta[key]) > 1:
            drifted[key] = [ranks for values in blocks.values() for ranks in values.values()]
            continue
        global_shape, dtype = next(iter(meta[key]))
        total, covered = 0, 0
        for offsets, values in blocks.items():
            if len(values) > 1:
                drifted[key] = sorted(values.values())
            total = (total + next(iter(values))) & _MASK64
            covered += numel(sizes[(key, offsets)])
        if key not in drifted and covered == numel(global_shape):
            fingerprints[key] = _digest_named(total, global_shape, dtype, version)
    return fingerprints, drifted


def _digest_named(total: int, global_shape: Sequence[int], dtype_name: str, version: int = VERSION) -> str:
    fpkernels.check_version(version)
    text = f"distckpt-fp{version}|{dtype_name}|{[int(d) for d in global_shape]}|{total & _MASK64}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mix(part: Part) -> int:
    """A 64-bit hash of a part's partial sum (splitmix64's finalizer; a bijection).

    Replica checks add these up across ranks (:func:`distckpt.state.statecheck.replica_vector`):
    because the hash is not linear, copies that differ cannot cancel out in the sum (two
    replicas off by ``+d`` and ``-d`` would, with the raw partial sums), except by a 2**-64
    accident. Shape and dtype are not mixed in: ranks compare a key's copies only after agreeing
    on its shape and dtype.
    """
    return mix_value(int(part[5]))


def mix_value(value: int) -> int:
    """:func:`mix` of a bare 64-bit value (a replica digest, see :func:`distckpt.state.statecheck.copy_digest`)."""
    z = (int(value) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
