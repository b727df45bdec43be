"""Small models and training helpers shared by the distributed tests (rank bodies import these)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    # Dimensions not divisible by 3 (or 2): FSDP2 shards them unevenly.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 11))


def _ddp(model: nn.Module) -> nn.Module:
    ddp = nn.parallel.DistributedDataParallel(model)
    # DDP re-orders its gradient buckets after the first backward, which changes the float
    # summation order of the all-reduce. One warm-up backward (no optimizer step) puts a fresh
    # job and a long-running one in the same bucket layout, so their steps match bit for bit.
    ddp(torch.zeros(1, 10)).sum().backward()
    ddp.zero_grad(set_to_none=True)
    return ddp


def wrap(model: nn.Module, parallel: str, world_size: int) -> nn.Module:
    if parallel == "ddp":
        return _ddp(model)
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if parallel in ("zero", "plain"):
        return _ddp(model) if parallel == "zero" else model
    raise ValueError(parallel)


def make_optimizer(model: nn.Module, parallel: str) -> torch.optim.Optimizer:
    params = list(model.parameters())
    groups = [
        {"params": params[:2], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[2:], "lr": 5e-3, "weight_decay": 0.0},
    ]
    if parallel == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(groups)


def batch(step: int, rank: int, world_size: int, global_batch: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a globally defined batch (the same data at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, 10, generator=g)
    y = torch.randn(global_batch, 11, generator=g)
    per = global_batch // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: range, rank: int, world_size: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, rank, world_size)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copy of the model state (test oracle only: gathers DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model)
    return {k: _full(v) for k, v in sd.items()}


def full_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, object]:
    """Unsharded, FQN-keyed flat optimizer state (test oracle; ZeRO via consolidate_state_dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optim, ZeroRedundancyOptimizer):
        optim.consolidate_state_dict(to=0)
        if dist.get_rank() == 0:
            sd = optim.state_dict()
        else:
            sd = None
        box = [sd]
        dist.broadcast_object_list(box, src=0)
        sd = box[0]
        names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
        out: dict[str, object] = {}
        for idx, st in sd["state"].items():
            for k, v in st.items():
                out[f"state.{names[idx]}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
        for g in sd["param_groups"]:
            for idx in g["params"]:
                for k, v in g.items():
                    if k != "params":
                        out[f"param_groups.{names[idx]}.{k}"] = v
        return out
    osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {k: _full(v) for k, v in osd.items()}


def _full(v: object) -> object:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        from torch.distributed._tensor import DTensor
    if isinstance(v, DTensor):
        return v.full_tensor().clone()
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return v


def assert_same(expected: dict, actual: dict, what: str) -> None:
    assert sorted(expected) == sorted(actual), f"{what}: keys differ: {sorted(set(expected) ^ set(actual))}"
    for k in expected:
        a, b = expected[k], actual[k]
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{what}: {k} differs"
        else:
            assert a == b, f"{what}: {k}: {a!r} != {b!r}"
