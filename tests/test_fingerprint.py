"""Fingerprints (distckpt.state.fingerprint): independent of how a tensor is split, sensitive to its values."""

from __future__ import annotations

import itertools

import pytest
import torch

from distckpt.state import fingerprint as fp

MASK = (1 << 64) - 1


def _split_sum(t: torch.Tensor, cuts: list[list[int]]) -> int:
    """Fingerprint sum of ``t`` computed from the hyper-rectangular blocks that ``cuts`` define
    (``cuts[d]``: boundaries along dimension d), as ranks holding those shards would."""
    total = 0
    ranges = [list(zip([0, *c], [*c, t.shape[d]])) for d, c in enumerate(cuts)]
    for box in itertools.product(*ranges):
        view = t
        for d, (a, b) in enumerate(box):
            view = view.narrow(d, a, b - a)
        total = (total + fp.partial_sum(view.clone(), t.shape, [a for a, _ in box])) & MASK
    return total


def _whole(t: torch.Tensor) -> int:
    return fp.partial_sum(t, t.shape, [0] * t.dim())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64, torch.uint8]
)
def test_sum_does_not_depend_on_the_split(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(37, 11, 5, generator=g)
    t = (base * 100).to(dtype) if not dtype.is_complex else torch.complex(base, base.flip(0)).to(dtype)
    whole = _whole(t)
    assert _split_sum(t, [[], [], []]) == whole
    assert _split_sum(t, [[7, 20, 36], [], []]) == whole  # FSDP-style row blocks, uneven
    assert _split_sum(t, [[], [3, 4], []]) == whole  # column split: many short runs
    assert _split_sum(t, [[18], [5], [2]]) == whole  # 2-D/3-D grid
    assert _split_sum(t, [[1, 2, 3], [10], [1, 4]]) == whole


def test_many_runs_path_matches_the_loop_path():
    # > 64 runs takes the vectorised path; it must agree with the run-by-run definition.
    t = torch.randn(300, 9)
    left = fp.partial_sum(t[:, :4].clone(), t.shape, [0, 0])
    right = fp.partial_sum(t[:, 4:].clone(), t.shape, [0, 4])
    assert (left + right) & MASK == _whole(t)
    by_rows = sum(fp.partial_sum(t[r : r + 1, :4].clone(), t.shape, [r, 0]) for r in range(300)) & MASK
    assert by_rows == left


def test_long_runs_cross_table_blocks():
    # Runs longer than the weight table (2**20) and starting mid-block use the block multipliers.
    t = torch.randn(3 * (1 << 20) + 5)
    cut = (1 << 20) + 12345
    parts = (fp.partial_sum(t[:cut], t.shape, [0]) + fp.partial_sum(t[cut:], t.shape, [cut])) & MASK
    assert parts == _whole(t)


def test_column_split_rows_that_cross_table_blocks():
    # The vectorised many-runs path: rows of a column split that straddle a 2**20 block boundary
    # (summed on the contiguous path), and rows longer than half the table (run by run).
    t = (torch.randn(1100, 2000) * 50).to(torch.int16)
    left = fp.partial_sum(t[:, :700].clone(), t.shape, [0, 0])
    right = fp.partial_sum(t[:, 700:].clone(), t.shape, [0, 700])
    assert (left + right) & MASK == _whole(t)
    wide = (torch.randn(70, 600_000) * 50).to(torch.int8)
    parts = (fp.partial_sum(wide[:, :100].clone(), wide.shape, [0, 0]) + fp.partial_sum(wide[:, 100:].clone(), wide.shape, [0, 100])) & MASK
    assert parts == _whole(wide)


def test_block_multipliers_agree_between_python_and_torch():
    qs = [0, 1, 2, 3, 1000, 123456, (1 << 32) - 1]
    vectorised = fp._block_multipliers(torch.tensor(qs, dtype=torch.int64)).tolist()
    assert [fp._block_multiplier(q) for q in qs] == vectorised
    assert all(m % 2 == 1 and 0 < m < 1 << 32 for m in vectorised)


def test_every_single_element_change_is_seen():
    t = torch.randn(64, 64)
    ref = fp.of_tensor(t)
    for i in range(0, t.numel(), 97):
        u = t.clone().view(-1)
        u[i] = torch.nextafter(u[i], torch.tensor(float("inf")))  # one ulp
        assert fp.of_tensor(u.view(64, 64)) != ref, i


def test_layout_faults_are_seen():
    t = torch.randn(40, 16)
    ref = _whole(t)
    # a shard placed one row off: rows 20.. stored as if they started at row 21 (last row lost)
    shifted = (fp.partial_sum(t[:20], t.shape, [0, 0]) + fp.partial_sum(t[20:39], t.shape, [21, 0])) & MASK
    assert shifted != ref
    # two equal-sized shards swapped
    swapped = (fp.partial_sum(t[20:], t.shape, [0, 0]) + fp.partial_sum(t[:20], t.shape, [20, 0])) & MASK
    assert swapped != ref
    # a skipped chunk (left at its initial zeros)
    assert (fp.partial_sum(t[:20], t.shape, [0, 0]) + fp.partial_sum(torch.zeros(20, 16), t.shape, [20, 0])) & MASK != ref
    # a bf16 round-trip of an fp32 tensor
    assert fp.of_tensor(t.bfloat16().float()) != fp.of_tensor(t)
    # same bits, other dtype or shape
    assert fp.of_tensor(t.view(torch.int32)) != fp.of_tensor(t)
    assert fp.of_tensor(t.view(16, 40)) != fp.of_tensor(t)


def test_fingerprint_is_stable_across_versions():
    # The construction is recorded in manifests: changing it silently would make every saved
    # checkpoint fail its check. Bump fingerprint.VERSION instead.
    t = torch.arange(-50, 50, dtype=torch.float32).reshape(10, 10) / 7
    assert fp.of_tensor(t) == fp.of_tensor(t.clone())
    assert fp.of_tensor(t) == GOLDEN


def test_non_contiguous_and_scalars():
    t = torch.randn(8, 6)
    assert fp.of_tensor(t.t()) == fp.of_tensor(t.t().contiguous())
    assert fp.of_tensor(torch.tensor(3.5)) != fp.of_tensor(torch.tensor(3.25))
    assert fp.partial_sum(torch.empty(0, 6), (8, 6), (8, 0)) == 0


GOLDEN = "c7950f3456618ae8"

# Computed by the torch-only implementation, before host tensors were summed with NumPy:
# 8-byte elements (the int64 path), 1- and 2-byte ones, booleans and complex numbers.
GOLDEN_DTYPES = {
    "int64": "9d476b04a96194a3",
    "int8": "2a5592e8b14c976d",
    "bfloat16": "bd19d58894db2f2a",
    "bool": "98c72dbc3f2ab4b3",
    "complex64": "ce37098524ab01d9",
}


def test_fingerprints_of_every_element_width_are_stable():
    base = torch.arange(-3000, 3000, dtype=torch.int64) * 2654435761
    tensors = {
        "int64": base.clone(),
        "int8": (base % 251).to(torch.int8),
        "bfloat16": (base.double() / 1e9).to(torch.bfloat16),
        "bool": (base % 3) == 0,
        "complex64": torch.complex(base.float() / 1e6, -base.float() / 1e7),
    }
    assert {k: fp.of_tensor(t) for k, t in tensors.items()} == GOLDEN_DTYPES
    # A run that crosses a 2**20 table block, far into a large tensor.
    t = torch.arange(3 << 19, dtype=torch.int32) * 40503
    start = (1 << 33) + 12345
    assert fp.partial_sum(t, (start + (3 << 19),), (start,)) == 11169577224366995298


def test_combine_counts_replicas_once_and_reports_drift():
    t = torch.randn(10, 4)
    u = torch.randn(6)
    ref = fp.of_tensor(t)
    # rank 0 and 1 both hold u whole (a DDP replica); t is split in rows between them
    r0 = fp.local_parts({"u": u})
    r1 = fp.local_parts({"u": u.clone()})
    half0 = ("t", (0, 0), (4, 4), (10, 4), str(t.dtype), fp.partial_sum(t[:4], t.shape, (0, 0)))
    half1 = ("t", (4, 0), (6, 4), (10, 4), str(t.dtype), fp.partial_sum(t[4:], t.shape, (4, 0)))
    prints, drifted = fp.combine([[*r0, half0], [*r1, half1]])
    assert prints == {"t": ref, "u": fp.of_tensor(u)} and drifted == {}
    # one replica perturbed by one ulp: reported with the ranks on each side, no fingerprint
    bumped = u.clone()
    bumped[3] = torch.nextafter(bumped[3], torch.tensor(float("inf")))
    prints, drifted = fp.combine([r0, fp.local_parts({"u": bumped}), r0])
    assert "u" not in prints and sorted(drifted["u"]) == [[0, 2], [1]]
    # a block missing (only part of t present): no fingerprint rather than a wrong one
    prints, _ = fp.combine([[half0]])
    assert "t" not in prints
