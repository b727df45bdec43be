"""The arithmetic of fingerprints: sums over contiguous runs of a tensor's elements, per version.

:mod:`distckpt.state.fingerprint` says what a fingerprint is and how shards combine; this module
computes the one primitive everything else is made of: the sum, modulo 2**64, of a per-element
function ``f(g, b)`` over a run of *global* indices ``g = start .. start + n - 1`` whose raw
bits are ``b``. Two constructions exist; a manifest records which one its fingerprints use.

**Version 1** (manifests written before distckpt 0.9, and the staging digest of an async save):
``b`` is an element's bits as a signed integer of its width, ``f = M1[g >> 20] * wrap_w(b *
T1[g & (2**20 - 1)])`` with 32-bit odd weights, ``w = max(32, element bits)``. Cheap (one
multiply and one add per element) and it always sees a single changed
element, but it is linear with 32-bit products: a sign flip moves a product by exactly
``+-2**31`` whatever the weight, so two sign flips cancel half of the time (``x`` and ``-x`` of
two elements collide 54% of the time).

**Version 2** (what saves record now): the tensor is read as a stream of words of at most 32
bits (an 8-byte element is two words, low word first; elements of 1, 2 or 4 bytes are one word
each, zero-extended), and word ``g`` contributes::

    y = u * T2[g & (2**16 - 1)]            (mod 2**64; T2: odd 64-bit weights)
    f = M2[g >> 16] * (y ^ (y >> 32))     (mod 2**64; M2: odd 64-bit block multipliers)

``u -> y`` is injective for ``u < 2**32`` (odd weight), ``y -> y ^ (y >> 32)`` is a bijection
that folds the high half (where a flip of a high bit lands after the multiply) into the low
half, and the odd block multiplier keeps every nonzero difference nonzero: a single changed
word always changes the sum, and the differences of several changed words are spread over all
64 bits instead of sharing trailing zeros, so that changes of a few elements (sign flips, bit
flips, swaps, one ulp) cancel only by a ~2**-64 accident (measured: ``tests/test_fingerprint.py``).
It costs three vector operations per word more than version 1 (throughput of both:
benchmarks/README.md).

Both are sums of a function of (global index, bits): any split of a tensor into disjoint runs
sums to the same total, which is what makes fingerprints independent of sharding.

Host (CPU) memory is summed with NumPy (vectorised, releases the GIL); accelerator memory with
torch on its device, *without synchronizing*: :func:`device_run_sum` returns a 0-dim int64
tensor on the device, so many tensors can be summed and brought back with one transfer
(:func:`settle`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

VERSIONS = (1, 2)
MASK64 = (1 << 64) - 1

# version -> log2 of the weight table's length
_TABLE_BITS = {1: 20, 2: 16}
# NumPy chunk, in elements: keeps the products of one multiply in cache until they are summed.
_CHUNK = 1 << 16
# Device work is done in groups of whole table blocks of at most this many elements (bounds the
# temporaries: 8 bytes per element for version 2).
_DEVICE_GROUP = 1 << 24


def check_version(version: int) -> None:
    if version not in VERSIONS:
        raise ValueError(f"fingerprint version {version!r} is not one this distckpt computes ({VERSIONS}); upgrade distckpt")


# ---------------------------------------------------------------------------------------------
# splitmix64, the source of every weight (the same numbers on every machine and device)
def _splitmix64_int(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 on an int64 tensor (wrapping arithmetic, logical shifts)."""

    def shr(v: torch.Tensor, k: int) -> torch.Tensor:
        return (v >> k) & ((1 << (64 - k)) - 1)  # torch shifts int64 arithmetically

    z = x + _signed(0x9E3779B97F4A7C15)
    z = (z ^ shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ shr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ shr(z, 31)


def _signed(u: int) -> int:
    u &= MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def _odd32(x: torch.Tensor) -> torch.Tensor:
    """Low 32 bits of ``x`` as int32, forced odd."""
    low = x & 0xFFFFFFFF
    low = torch.where(low >= 1 << 31, low - (1 << 32), low)
    return low.to(torch.int32) | 1


# Seeds of version 2's tables, apart from version 1's (which used 0 and 2**40).
_V2_TABLE_SEED = 0x5EED_0002_0000_0000
_V2_BLOCK_SEED = 0x5EED_0002_8000_0000


@functools.lru_cache(maxsize=8192)
def block_multiplier(version: int, q: int) -> int:
    """``M[q]`` of ``version`` as a Python int (odd; < 2**32 for version 1, < 2**64 for 2)."""
    if version == 1:
        return (_splitmix64_int(q + (1 << 40)) & 0xFFFFFFFF) | 1
    return _splitmix64_int(q + _V2_BLOCK_SEED) | 1


def block_multipliers(version: int, blocks: torch.Tensor) -> torch.Tensor:
    """``M[q]`` for an int64 tensor of block numbers (values in ``[0, 2**40)``), as int64 (version
    2's 64-bit values wrapped to two's complement)."""
    if version == 1:
        return _odd32(_splitmix64_torch(blocks + (1 << 40))).to(torch.int64) & 0xFFFFFFFF
    return _splitmix64_torch(blocks + _signed(_V2_BLOCK_SEED)) | 1


_tables: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def table(version: int, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight table ``T`` of ``version`` on ``device``, built once per device: version 1's as
    int32 (or sign-extended int64 with ``dtype=torch.int64``), version 2's as int64 (the
    two's-complement form of its unsigned 64-bit weights)."""
    dtype = dtype or (torch.int32 if version == 1 else torch.int64)
    key = (version, torch.device(device), dtype)
    t = _tables.get(key)
    if t is None:
        idx = torch.arange(1 << _TABLE_BITS[version], dtype=torch.int64)
        if version == 1:
            cpu = _odd32(_splitmix64_torch(idx))
        else:
            cpu = _splitmix64_torch(idx + _signed(_V2_TABLE_SEED)) | 1
        t = _tables[key] = cpu.to(dtype).to(device)
    return t


#: Block multipliers kept on each device for the first blocks (tensors of up to 2**32 elements,
#: or words for version 2, from index 0): a digest of a tensor then takes four kernels instead
#: of ~25 (computing ``M`` with splitmix64 is ~19 small ones), and each launch costs a writer
#: thread the GIL (a sync save's copy proof digests every tensor it copies).
_MULT_BLOCKS = {1: 1 << 12, 2: 1 << 16}
_mult_tables: dict[tuple[int, torch.device], torch.Tensor] = {}


def _multipliers(version: int, first: int, last: int, device: torch.device) -> torch.Tensor:
    """``M[first:last]`` as :func:`block_multipliers` gives it, on ``device``: a view of the
    device's cached table where it covers them, else computed there (no host transfer, which
    would synchronize the stream)."""
    if last <= _MULT_BLOCKS[version]:
        key = (version, device)
        t = _mult_tables.get(key)
        if t is None:
            # Computed on the host and copied synchronously, as ``table`` is: kernels queued on
            # this thread's stream could still be running when another thread's stream reads it.
            cpu = block_multipliers(version, torch.arange(_MULT_BLOCKS[version], dtype=torch.int64))
            t = _mult_tables[key] = cpu.to(device)
        return t[first:last]
    return block_multipliers(version, torch.arange(first, last, dtype=torch.int64, device=device))


_host_tables: dict[tuple[int, str], np.ndarray] = {}


def _host_table(version: int, kind: str) -> np.ndarray:
    """``T`` as a NumPy array: version 1 as int32 (``kind="32"``) or int64 (``"64"``), version 2 as uint64."""
    key = (version, kind)
    t = _host_tables.get(key)
    if t is None:
        if version == 1:
            t = table(1, torch.device("cpu"), torch.int64 if kind == "64" else torch.int32).numpy()
        else:
            t = table(2, torch.device("cpu")).numpy().view(np.uint64)
        _host_tables[key] = t
    return t


# ---------------------------------------------------------------------------------------------
# what is summed
def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as same-width signed integers (a view where possible), flattened;
    complex tensors as their real view, booleans as uint8."""
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.reshape(-1).view(torch.uint8)
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if as_int is None:
        raise TypeError(f"cannot fingerprint dtype {t.dtype}")
    return t.reshape(-1).view(as_int)


def _words(b: torch.Tensor, start: int, version: int) -> tuple[torch.Tensor, int]:
    """The run in the units ``version`` sums over: elements (1), 32-bit words (2)."""
    if version == 2 and b.dtype == torch.int64:
        return b.view(torch.int32), start * 2
    return b, start


def _runs(start: int, n: int, version: int) -> list[tuple[int, int, int]]:
    """``(position, length, block)`` of the pieces of ``[start, start + n)`` that stay in one table block."""
    size = 1 << _TABLE_BITS[version]
    out = []
    pos = 0
    while pos < n:
        g = start + pos
        take = min(n - pos, size - (g & (size - 1)))
        out.append((pos, take, g >> _TABLE_BITS[version]))
        pos += take
    return out


# ---------------------------------------------------------------------------------------------
# host: NumPy
def host_run_sum(b: torch.Tensor, start: int, version: int, chunk: int | None = None) -> int:
    """(host tensor) Sum of ``f`` over the elements ``b`` (from :func:`bits`) at global indices
    ``[start, start + len(b))``, as an int in ``[0, 2**64)``. ``chunk``: elements per NumPy call
    (default :data:`_CHUNK`; any size gives the same sum)."""
    check_version(version)
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
    step = chunk or _CHUNK
    b, start = _words(b, start, version)
    n = b.numel()
    if n == 0:
        return 0
    host = b.detach().numpy()
    size = 1 << _TABLE_BITS[version]
    total = 0
    if version == 1:
        weights = _host_table(1, "64" if host.dtype == np.int64 else "32")
        buf = np.empty(min(n, step), dtype=weights.dtype)
        for pos, length, q in _runs(start, n, 1):
            lo = (start + pos) & (size - 1)
            sub = 0
            for c in range(0, length, step):
                take = min(step, length - c)
                np.multiply(host[pos + c : pos + c + take], weights[lo + c : lo + c + take], out=buf[:take])
                sub += int(np.add.reduce(buf[:take], dtype=np.int64))
            total = (total + block_multiplier(1, q) * sub) & MASK64
        return total
    words = host.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[host.dtype.itemsize])
    weights = _host_table(2, "u64")
    prod = np.empty(min(n, step), dtype=np.uint64)
    high = np.empty_like(prod)
    shift = np.uint64(32)
    for pos, length, q in _runs(start, n, 2):
        lo = (start + pos) & (size - 1)
        sub = 0
        for c in range(0, length, step):
            take = min(step, length - c)
            y, h = prod[:take], high[:take]
            np.multiply(words[pos + c : pos + c + take], weights[lo + c : lo + c + take], out=y)
            np.right_shift(y, shift, out=h)
            np.bitwise_xor(y, h, out=y)
            sub += int(np.add.reduce(y))  # uint64: wraps modulo 2**64, as the definition does
        total = (total + block_multiplier(2, q) * sub) & MASK64
    return total


# ---------------------------------------------------------------------------------------------
# device: torch, no synchronization
def _device_terms(chunk: torch.Tensor, weights: torch.Tensor, version: int) -> torch.Tensor:
    """``f`` before the block multiplier, elementwise, for a chunk shaped like ``weights``."""
    if version == 1:
        if chunk.dtype == torch.int64:
            return chunk * weights.to(torch.int64)
        return chunk * weights  # int8/int16/uint8/int32 x int32: wraps at 32 bits
    mask = {torch.int8: 0xFF, torch.uint8: 0xFF, torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}[chunk.dtype]
    y = chunk.to(torch.int64).bitwise_and_(mask).mul_(weights)
    return y.bitwise_xor_(torch.bitwise_right_shift(y, 32).bitwise_and_(0xFFFFFFFF))


def device_run_sum(b: torch.Tensor, start: int, version: int) -> torch.Tensor:
    """(any device) The sum :func:`host_run_sum` computes, as a 0-dim int64 tensor on ``b``'s
    device (two's complement of the unsigned sum), computed without synchronizing: whole table
    blocks in a few batched kernels, the partial blocks at either end on their own."""
    check_version(version)
    b, start = _words(b, start, version)
    device = b.device
    n = b.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    parts: list[torch.Tensor] = []  # added at the end: no kernel for a zero to start from
    bits_per = _TABLE_BITS[version]
    size = 1 << bits_per
    weights = table(version, device)
    pos = 0
    head = min(n, (-start) % size)
    if head:  # the end of a block the run starts inside
        lo = start & (size - 1)
        terms = _device_terms(b[:head], weights[lo : lo + head], version)
        parts.append(terms.sum(dtype=torch.int64) * _signed(block_multiplier(version, start >> bits_per)))
        pos = head
    full = (n - pos) // size
    per_group = max(1, _DEVICE_GROUP // size)
    for g0 in range(0, full, per_group):
        g1 = min(full, g0 + per_group)
        rows = b[pos + g0 * size : pos + g1 * size].view(g1 - g0, size)
        sums = _device_terms(rows, weights, version).sum(1, dtype=torch.int64)
        first = (start + pos) >> bits_per
        parts.append((sums * _multipliers(version, first + g0, first + g1, device)).sum())
    pos += full * size
    if pos < n:  # the start of the block the run ends inside
        tail = n - pos
        terms = _device_terms(b[pos:], weights[:tail], version)
        parts.append(terms.sum(dtype=torch.int64) * _signed(block_multiplier(version, (start + pos) >> bits_per)))
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc


def settle(values: Sequence[int | torch.Tensor]) -> list[int]:
    """Sums from :func:`host_run_sum` (ints) and :func:`device_run_sum` (device tensors) as ints in
    ``[0, 2**64)``, with one transfer per device (which waits for the device's work)."""
    out: list[int | None] = [v if isinstance(v, int) else None for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if not isinstance(v, int):
            by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        got = torch.stack([values[i] for i in idx]).cpu().tolist()  # type: ignore[misc]
        for i, v in zip(idx, got):
            out[i] = int(v) & MASK64
    return out  # type: ignore[return-value]


def run_sum(b: torch.Tensor, start: int, version: int) -> int:
    """Sum of ``f`` over a run, wherever ``b`` lives (an int in ``[0, 2**64)``)."""
    if b.device.type == "cpu":
        return host_run_sum(b, start, version)
    return settle([device_run_sum(b, start, version)])[0]


# ---------------------------------------------------------------------------------------------
# many short runs (a column-split shard): vectorised over rows
def rows_sum(b: torch.Tensor, starts: list[int], run: int, version: int) -> int:
    """Sum of ``f`` over rows ``b.view(-1, run)[r]`` placed at global ``starts[r]``; rows inside one
    table block are done together (their weight windows gathered row by row), the rest one by one.
    An accelerator tensor's is :func:`device_rows_sum`, brought back with one transfer."""
    if b.device.type != "cpu":
        return settle([device_rows_sum(b, starts, run, version)])[0]
    values, starts, run, inside, outside = _rows(b, starts, run, version)
    total = 0
    for r in outside:
        total = (total + host_run_sum(values[r], starts[r], version)) & MASK64
    if inside:
        total = (total + _host_rows(values, starts, inside, run, version)) & MASK64
    return total


def device_rows_sum(b: torch.Tensor, starts: list[int], run: int, version: int) -> torch.Tensor:
    """(any device) The sum :func:`rows_sum` computes, as a 0-dim int64 tensor on ``b``'s device
    (two's complement of the unsigned sum), computed without synchronizing: a column-split
    shard's rows are summed by kernels queued behind the work that made them, and the writer
    thread that asked does not wait for the device (one wait per shard stalled it)."""
    values, starts, run, inside, outside = _rows(b, starts, run, version)
    acc = torch.zeros((), dtype=torch.int64, device=b.device)
    for r in outside:  # int64 additions wrap: the sum mod 2**64, as on the host
        acc = acc + device_run_sum(values[r], starts[r], version)
    if inside:
        acc = acc + _device_rows(values, starts, inside, run, version)
    return acc


def _rows(b: torch.Tensor, starts: list[int], run: int, version: int) -> tuple[torch.Tensor, list[int], int, list[int], list[int]]:
    """``b`` as rows of ``run`` units of ``version`` (32-bit words for version 2's 64-bit
    elements, ``starts`` and ``run`` in them too), and which rows lie inside one table block
    (summed together) and which not (one by one; all of them where rows are long: few, and most
    cross a block boundary)."""
    check_version(version)
    if version == 2 and b.dtype == torch.int64:
        b = b.view(torch.int32)
        starts = [2 * s for s in starts]
        run *= 2
    size = 1 << _TABLE_BITS[version]
    values = b.view(-1, run)
    inside = [] if run > size // 2 else [r for r, s in enumerate(starts) if (s & (size - 1)) + run <= size]
    outside = sorted(set(range(len(starts))) - set(inside))
    return values, starts, run, inside, outside


def _host_rows(values: torch.Tensor, starts: list[int], inside: list[int], run: int, version: int) -> int:
    size = 1 << _TABLE_BITS[version]
    host = values.numpy()
    if version == 1:
        weights = _host_table(1, "64" if host.dtype == np.int64 else "32")
        wide = weights.dtype
    else:
        host = host.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[host.dtype.itemsize])
        weights = _host_table(2, "u64")
        wide = np.uint64
    windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([weights, weights[:run]]), run)
    per = max(1, _CHUNK // run)
    total = 0
    idx = np.asarray(inside, dtype=np.int64)
    st = np.asarray([starts[r] for r in inside], dtype=np.int64)
    for c in range(0, len(idx), per):
        rows = idx[c : c + per]
        s = st[c : c + per]
        w = windows[s & (size - 1)]
        prod = np.multiply(host[rows], w, dtype=wide)
        if version == 1:
            sums = np.add.reduce(prod, axis=1, dtype=np.int64)
        else:
            np.bitwise_xor(prod, prod >> np.uint64(32), out=prod)
            sums = np.add.reduce(prod, axis=1)
        for q, v in zip((s >> _TABLE_BITS[version]).tolist(), sums.tolist()):
            total = (total + block_multiplier(version, q) * int(v)) & MASK64
    return total


def _device_rows(values: torch.Tensor, starts: list[int], inside: list[int], run: int, version: int) -> torch.Tensor:
    size = 1 << _TABLE_BITS[version]
    device = values.device
    weights = table(version, device)
    windows = torch.cat([weights, weights[:run]]).unfold(0, run, 1)  # windows[j] = T[j : j + run]
    rows = torch.tensor(inside, dtype=torch.int64, device=device)
    st = torch.tensor([starts[r] for r in inside], dtype=torch.int64, device=device)
    mult = block_multipliers(version, st >> _TABLE_BITS[version])
    per = max(1, _CHUNK // run)
    acc = torch.zeros((), dtype=torch.int64, device=device)
    for c in range(0, len(inside), per):
        w = windows[st[c : c + per] & (size - 1)]
        terms = _device_terms(values[rows[c : c + per]], w, version)
        acc += (terms.sum(1, dtype=torch.int64) * mult[c : c + per]).sum()
    return acc
