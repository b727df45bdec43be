"""Partial loads: only some entries or key patterns of a checkpoint (``load(only=, exclude=)``)."""

from __future__ import annotations

import pytest
import torch

import distckpt
from models import make_model, make_optimizer, train_steps, wrap

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


class Position:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def _saved(tmp_path):
    model = make_model(0)
    optim = make_optimizer(model, "plain")
    train_steps(model, optim, range(2), 0, 1)
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"model": model, "optim": optim, "loader": Position(7), "step": 1})
    return ckpt, model


def test_only_the_model_for_a_new_fine_tuning_run(tmp_path):
    ckpt, model = _saved(tmp_path)
    fresh = make_model(5)
    new_optim = torch.optim.SGD(fresh.parameters(), lr=0.1)  # a different optimizer: not loaded
    ckpt.load({"model": fresh, "optim": new_optim}, only="model")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert not new_optim.state and new_optim.param_groups[0]["lr"] == 0.1
    assert ckpt.last_load_report.clean


def test_exclude_an_entry_and_key_patterns(tmp_path):
    ckpt, model = _saved(tmp_path)
    fresh = make_model(5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    state = {"model": fresh, "optim": make_optimizer(fresh, "plain"), "step": 0}
    ckpt.load(state, exclude=["loader", "model.0.*"])  # no loader in state: strict still passes
    assert state["step"] == 1 and state["optim"].state
    assert torch.equal(fresh[0].weight, before["0.weight"]), "excluded keys stay untouched"
    assert torch.equal(fresh[2].weight, model[2].weight)
    # strictness applies to the selection: a missing selected entry is still an error
    with pytest.raises(distckpt.StateMismatchError, match="unexpected keys .*loader"):
        ckpt.load({"model": make_model(1)}, only=["model", "loader"])
    with pytest.raises(ValueError, match="selects nothing"):
        ckpt.load({"model": make_model(1)}, only="modle")
