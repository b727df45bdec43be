"""The CUDA tier: saves and loads of GPU state are bit-exact (``tests/exactness.py``'s bodies on
a GPU, at 0.1 GB and >= 2.5 GB of model + AdamW state), and every async save proved its staging
(``verify_staging="auto"`` digests CUDA tensors). Skipped without CUDA; ``bash tests/run.sh``
runs them on a GPU machine (one xdist worker, so the tests take the GPU in turn)."""

from __future__ import annotations

import pytest
import torch

import exactness
from dist_harness import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.xdist_group("cuda"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(900),
]

SIZES = {"0.1GB": 1e8, "2.5GB": 2.6e9}
WIDTH = {"0.1GB": 1024, "2.5GB": 4096}


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _exact(out: dict, nbytes: float) -> None:
    assert out["finite"], "the training recipe must keep the state finite"
    assert out["files_bad"] == {}, out["files_bad"]
    assert out["loaded_bad"] == [], out["loaded_bad"]
    assert out["in_place"]
    assert out["state_bytes"] >= 0.9 * nbytes


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_async_saves_are_exact(tmp_path, mode, dtype, size):
    out = exactness.saves_are_exact(str(tmp_path), _cuda(), dtype, SIZES[size], WIDTH[size], blocking=False, async_mode=mode)
    _exact(out, SIZES[size])
    assert out["staged_checked"] == [True] * 5  # every save proved its staging


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_saves_are_exact(tmp_path, dtype, size):
    _exact(exactness.saves_are_exact(str(tmp_path), _cuda(), dtype, SIZES[size], WIDTH[size], blocking=True, saves=3), SIZES[size])


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_fsdp2_saves_are_exact(tmp_path, mode):
    out = run_ranks(
        exactness.fsdp_rank, 1, tmp_path, str(tmp_path / "ck"), "cuda", "float32", 1e8, 1024, mode,
        backend="cpu:gloo,cuda:nccl", timeout=600,
    )[0]
    _exact(out, 1e8)


def test_special_values_are_exact(tmp_path):
    assert exactness.special_values_are_exact(str(tmp_path), _cuda()) == []
