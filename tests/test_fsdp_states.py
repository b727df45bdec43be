"""FSDP2 models save and load in every state a training loop leaves them in.

A root module with parameters of its own (like a Hugging Face model's embeddings and head) stays
unsharded after a forward under ``torch.no_grad()``, after ``unshard()`` or with
``reshard_after_forward=False``: its parameters are then plain tensors while the optimizer holds
the sharded DTensors. Saves must still work and write the *sharded* values (what the optimizer
steps), and loads must not leave stale unsharded copies for the next forward to use.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distckpt
from dist_harness import run_ranks


def _build(world: int, seed: int, reshard_after_forward: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 6))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[2], mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)  # root owns [0] and [4]
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _sharded_full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full values of the sharded parameters the optimizer steps (test-only gather)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: v.full_tensor().clone() for k, v in get_model_state_dict(model).items()}


def _probe(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.ones(2, 10)).clone()


def _leave_in(state: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    if state == "after_step":
        model.train()
    elif state == "eval_no_grad":
        model.eval()
        _probe(model)
    elif state == "train_no_grad":
        model.train()
        _probe(model)
    elif state == "unshard":
        model.unshard()


CASES = [
    # (state left in, reshard_after_forward, async)
    ("after_step", True, False),
    ("eval_no_grad", True, False),
    ("eval_no_grad", True, True),
    ("train_no_grad", True, True),
    ("unshard", True, False),
    ("eval_no_grad", False, True),
    ("after_step", False, False),
]


def _body(rank: int, world: int, root: str) -> list[str]:
    problems = []
    for i, (state, raf, blocking_async) in enumerate(CASES):
        model, optim = _build(world, 0, raf)
        for s in range(2):
            _step(model, optim, s)
        _leave_in(state, model, optim)
        ckpt = distckpt.Checkpointer(f"{root}/{i}")
        try:
            ckpt.save(1, {"model": model, "optim": optim}, blocking=not blocking_async)
            ckpt.wait()
        except Exception as exc:  # noqa: BLE001 - reported with its case
            problems.append(f"{CASES[i]}: save failed: {type(exc).__name__}: {exc}")
            continue
        expected = _sharded_full(model)
        expected_out = _probe(model)
        # Load into a model left in the same state (its root unsharded, with other values).
        fresh, fresh_optim = _build(world, 7, raf)
        _step(fresh, fresh_optim, 5)
        _leave_in(state, fresh, fresh_optim)
        ckpt.load({"model": fresh, "optim": fresh_optim})
        got = _sharded_full(fresh)
        for k, v in expected.items():
            if not torch.equal(got[k], v):
                problems.append(f"{CASES[i]}: {k} differs after load")
        if not torch.equal(_probe(fresh), expected_out):
            problems.append(f"{CASES[i]}: the forward after load does not use the loaded values")
        # Training goes on identically from the original and the loaded copy.
        _step(model, optim, 9)
        _step(fresh, fresh_optim, 9)
        if not all(torch.equal(a, b) for a, b in zip(_sharded_full(model).values(), _sharded_full(fresh).values())):
            problems.append(f"{CASES[i]}: a step after load diverges from the original")
        ckpt.close()
    return problems


@pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")
def test_fsdp2_saves_and_loads_in_every_training_loop_state(tmp_path):
    for r, problems in enumerate(run_ranks(_body, 2, tmp_path, str(tmp_path / "ck"))):
        assert problems == [], f"rank {r}:\n" + "\n".join(problems)
