"""Sync and async saves write the same checkpoint: same ``.metadata`` keys and nesting, and torch's own
``dcp_to_torch_save`` gives the same dictionary for both."""

from __future__ import annotations

import pickle

import pytest
import torch

import distckpt
from dist_harness import run_ranks
from distckpt.integrity.manifest import step_dir
from models import make_model, make_optimizer, train_steps, wrap


def _body(rank: int, world: int, root: str) -> None:
    model = wrap(make_model(0), "ddp", world)
    optim = make_optimizer(model, "ddp")
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3)
    train_steps(model, optim, range(2), rank, world)
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "extra": {"ema": {"w": torch.arange(6.0).reshape(2, 3)}, "count": 3},
        "step": 2,
    }
    ckpt = distckpt.Checkpointer(root, save_rng=False)
    ckpt.save(1, state)
    ckpt.save(2, state, blocking=False)
    ckpt.close()


def _metadata(root, step: int):
    return pickle.loads((root / step_dir(step) / ".metadata").read_bytes())


@pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")
def test_async_save_writes_the_same_checkpoint_as_sync(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = tmp_path / "ck"
    run_ranks(_body, 2, tmp_path, str(root))
    sync, asyn = _metadata(root, 1), _metadata(root, 2)
    assert sorted(sync.state_dict_metadata) == sorted(asyn.state_dict_metadata)
    assert sync.planner_data == asyn.planner_data, "the nesting DCP records must not depend on blocking="
    assert any(len(path) > 1 for path in sync.planner_data.values()), "nested entries are recorded as nested"
    outs = []
    for step in (1, 2):
        out = tmp_path / f"s{step}.pt"
        dcp_to_torch_save(str(root / step_dir(step)), str(out))
        outs.append(torch.load(out, weights_only=False))  # our own file, just written

    def same(a, b, where="") -> None:
        assert type(a) is type(b), where
        if isinstance(a, dict):
            assert sorted(a) == sorted(b), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), where
        else:
            assert a == b, where

    same(outs[0], outs[1])
    assert isinstance(outs[0]["model"], dict) and isinstance(outs[0]["extra"]["ema"], dict)
