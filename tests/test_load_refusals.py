"""A load refused after its read (the objects' own checks): what the refusal leaves changed.
Tensors are read in place, so the model holds the checkpoint's values whatever happens next; but
an entry refusing after others took their state left the scheduler (and the rest before it)
loaded and the entries after it not, under a plain refusal. Found by a helper (2026-12-06)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import distckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _trained(groups: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.01}] if groups else model.parameters()
    optim = torch.optim.AdamW(params, lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    for _ in range(3):
        model(torch.randn(8, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return model, optim, sched


def test_optimizer_groups_changed_since_the_save_are_refused_before_any_entry_takes_its_state(tmp_path):
    model, optim, sched = _trained(groups=True)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "sched": sched, "optim": optim, "step": 7})
    model2, optim2, sched2 = _trained(groups=False)  # one group now: refused (README)
    before = sched2.state_dict()
    state = {"model": model2, "sched": sched2, "optim": optim2, "step": 0}
    with distckpt.Checkpointer(tmp_path) as ckpt, pytest.raises(distckpt.StateMismatchError, match="param.group"):
        ckpt.load(state)
    assert sched2.state_dict() == before and state["step"] == 0  # the scheduler before it in state: untouched


def test_an_object_refusing_its_state_says_what_the_load_already_changed(tmp_path):
    model, optim, sched = _trained(groups=False)
    sampler = distckpt.GlobalBatchSampler(100, 4, rank=0, world_size=1)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "sched": sched, "sampler": sampler, "step": 7})
    model2, _, sched2 = _trained(groups=False)
    other = distckpt.GlobalBatchSampler(120, 4, rank=0, world_size=1)  # another dataset size: refused (README)
    with distckpt.Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError, match="num_samples=100") as caught:
        ckpt.load({"model": model2, "sched": sched2, "sampler": other, "step": 0})
    if sys.version_info >= (3, 11):
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        assert "stopped handing state['sampler'] its state" in notes and "'sched'" in notes and "load again" in notes, notes


def test_a_failed_load_leaves_no_report_of_the_load_before(tmp_path):
    """``last_load_report`` after a load that failed was the previous load's, describing another
    step as if it were this one's. Found by a helper (2026-12-06)."""
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
        ckpt.load({"w": torch.zeros(2), "extra": torch.zeros(1)}, strict=False)
        assert ckpt.last_load_report is not None and ckpt.last_load_report.missing == ["extra"]
        with pytest.raises(distckpt.StateMismatchError):
            ckpt.load({"w": torch.zeros(3)})
        assert ckpt.last_load_report is None


def _zero_groups_body(rank: int, world: int, root: str) -> int:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build(seed: int, split: bool):
        torch.manual_seed(seed)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        w, b = model.module.weight, model.module.bias
        groups = [{"params": [w], "lr": 0.1}, {"params": [b], "lr": 0.2}] if split else [{"params": [w, b], "lr": 0.1}]
        return model, ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.Adam, lr=0.1)

    model, optim = build(0, split=True)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1)
    for i in range(2):
        torch.manual_seed(i)
        model(torch.randn(8, 4)).square().sum().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model, "sched": sched, "optim": optim})
    fresh, fresh_optim = build(1, split=False)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_optim, 1)
    # (refused as the scheduler's groups now, before the optimizer's own check of param_groups)
    with distckpt.Checkpointer(root) as ckpt, pytest.raises(distckpt.StateMismatchError, match="param.group"):
        ckpt.load({"model": fresh, "sched": fresh_sched, "optim": fresh_optim})
    return fresh_sched.last_epoch


@pytest.mark.timeout(120)
def test_zero_groups_changed_since_the_save_are_refused_before_any_entry_takes_its_state(tmp_path):
    """As above for ZeRO: its wrapper's groups (not its partition's) are checked first. Found by
    a review helper (2026-12-06)."""
    from dist_harness import run_ranks

    assert run_ranks(_zero_groups_body, 2, tmp_path, str(tmp_path / "root"), timeout=100) == [0, 0]
