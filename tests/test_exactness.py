"""Saves are bit-exact while training goes on (the CUDA tier's bodies, ``tests/exactness.py``,
on the CPU at small sizes): five async saves of one Checkpointer in both modes and sync saves,
fp32 and bf16, a plain and an FSDP2 model, files read back by plain DCP and loads compared bit
for bit with snapshots taken at each call; NaN, infinities and -0.0 round trip exactly."""

from __future__ import annotations

import pytest
import torch

import exactness
from dist_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")

CPU = torch.device("cpu")


def _exact(out: dict) -> None:
    assert out["finite"], "the training recipe must keep the state finite"
    assert out["files_bad"] == {} and out["loaded_bad"] == [] and out["in_place"], out


@pytest.mark.parametrize("mode,dtype", [("process", torch.float32), ("thread", torch.bfloat16)])
def test_async_saves_are_exact(tmp_path, mode, dtype):
    out = exactness.saves_are_exact(str(tmp_path), CPU, dtype, 2e6, 64, blocking=False, async_mode=mode)
    _exact(out)
    assert out["staged_checked"] == [False] * 5  # verify_staging="auto" digests accelerator tensors only


def test_sync_saves_are_exact(tmp_path):
    _exact(exactness.saves_are_exact(str(tmp_path), CPU, torch.float32, 2e6, 64, blocking=True, saves=3))


def test_fsdp2_saves_are_exact(tmp_path):
    out = run_ranks(exactness.fsdp_rank, 1, tmp_path, str(tmp_path / "ck"), "cpu", "float32", 2e6, 64, "process")[0]
    _exact(out)


def test_special_values_are_exact(tmp_path):
    assert exactness.special_values_are_exact(str(tmp_path), CPU) == []


def test_the_oracle_sees_one_flipped_bit_and_not_a_nan(tmp_path):
    # Negative control of the files' side: read_files (plain DCP, no checksums) and differing
    # (bits) report a tensor whose file holds one flipped bit, and never a NaN equal to itself.
    import distckpt

    w = torch.arange(1000, dtype=torch.float32) * 1.5
    w[3] = float("nan")
    state = {"w": w, "v": torch.ones(7)}
    distckpt.Checkpointer(tmp_path, save_rng=False).save(1, {"t": state})
    step = next(tmp_path.glob("step_*"))
    expected = {f"t.{k}": v.clone() for k, v in state.items()}
    assert exactness.differing(expected, exactness.read_files(str(step))) == []
    exactness.flip_a_stored_bit(step, w, at=2001)
    assert exactness.differing(expected, exactness.read_files(str(step))) == ["t.w"]
