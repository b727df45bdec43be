"""Small models and training helpers shared by the distributed tests (rank bodies import these)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    # Dimensions not divisible by 3 (or 2): FSDP2 shards them unevenly.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 11))


def make_wide_model(seed: int = 0) -> nn.Module:
    """:func:`make_model`'s inputs and outputs, with four 500x500 layers between: ~4 MB of
    parameters, so that each of 4 ranks holds megabytes of shards or of a ZeRO partition."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(10, 500), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(500, 500), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(500, 11))


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


# -------------------------------------------------------------------------------------------------
# A toy transformer and the parallel layouts of a torchtitan-style job (tests/test_layout_matrix.py)
TOY_VOCAB, TOY_DIM, TOY_HEADS, TOY_HIDDEN, TOY_SEQ, TOY_BATCH = 32, 16, 4, 24, 8, 4

#: Layouts ``toy_layout`` builds, with the world sizes each runs at.
TOY_LAYOUTS = {
    "fsdp_tp": (4,),  # torchtitan's 2-D default: TP (+ sequence parallel) on "tp", then FSDP2 on "dp"
    "fsdp_tp_plain_norms": (4,),  # TP without sequence parallel: norms stay FSDP-only (dp sub-mesh)
    "hsdp": (4,),  # fully_shard on a ("replicate", "shard") mesh
    "tp": (2, 4),  # TP only, norms and embeddings replicated plain tensors
    "tp_sp": (4,),  # TP with sequence parallel norms, a row-wise embedding and a loss-parallel output
    "fsdp_nrf": (2, 4),  # FSDP2, reshard_after_forward=False
    "ddp": (2, 3, 4),
    "plain": (1,),
}


class ToyAttention(nn.Module):
    """wq/wk/wv/wo projections; heads are counted from the local width, so that a column-wise
    split of wq/wk/wv gives every TP rank whole heads (as in torchtitan)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class ToyFeedForward(nn.Module):
    """Biases on both projections: under TP, w1's is sharded and w2's replicated."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.gelu(self.w1(x)))


class ToyBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = ToyAttention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = ToyFeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class ToyTransformer(nn.Module):
    """Two blocks of a transformer-ish model, small enough for CPU gloo in milliseconds."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(TOY_VOCAB, TOY_DIM)
        self.blocks = nn.ModuleList(ToyBlock(TOY_DIM, TOY_HEADS, TOY_HIDDEN) for _ in range(n_blocks))
        self.norm = nn.RMSNorm(TOY_DIM)
        self.output = nn.Linear(TOY_DIM, TOY_VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h))


def make_toy(seed: int = 0, frozen: bool = False) -> ToyTransformer:
    """The toy model; ``frozen``: block 0's attention does not train (requires_grad False)."""
    torch.manual_seed(seed)
    model = ToyTransformer()
    if frozen:
        model.blocks[0].attention.requires_grad_(False)
    return model


def _toy_tp_plan(model: ToyTransformer, tp_mesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Tensor parallelism on ``tp_mesh`` as torchtitan applies it to Llama (with
    ``sequence_parallel``: norms as SequenceParallel, activations sharded on the sequence between
    blocks, and a row-wise embedding; ``loss_parallel``: the output stays sharded on the vocabulary)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if sequence_parallel:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        })  # fmt: skip
    else:
        parallelize_module(model, tp_mesh, {"output": ColwiseParallel(output_layouts=Replicate())})
    for block in model.blocks:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
        }
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })  # fmt: skip
        parallelize_module(block, tp_mesh, plan)


class ToyJob:
    """A toy model in one layout with its AdamW optimizer, on every rank of the job.

    Attributes:
        model, optim: what a training job hands ``Checkpointer`` as ``{"model": ..., "optim": ...}``.
        dp_rank, dp_size: this rank's share of the global batch.
        loss_parallel: the output is vocabulary-sharded; the loss runs under ``loss_parallel()``.
    """

    def __init__(self, layout: str, world_size: int, frozen: bool = False, seed: int = 0) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if world_size not in TOY_LAYOUTS[layout]:
            raise ValueError(f"layout {layout!r} is not built at world size {world_size}")
        rank = dist.get_rank() if dist.is_initialized() else 0
        model = make_toy(seed, frozen)
        self.layout, self.loss_parallel = layout, False
        self.dp_rank, self.dp_size = rank, world_size
        if layout in ("fsdp_tp", "fsdp_tp_plain_norms"):
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
            _toy_tp_plan(model, mesh["tp"], sequence_parallel=layout == "fsdp_tp", loss_parallel=False)
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            self.dp_rank, self.dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        elif layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif layout in ("tp", "tp_sp"):
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
            self.loss_parallel = layout == "tp_sp"
            _toy_tp_plan(model, mesh, sequence_parallel=layout == "tp_sp", loss_parallel=self.loss_parallel)
            self.dp_rank, self.dp_size = 0, 1
        elif layout == "fsdp_nrf":
            mesh = init_device_mesh("cpu", (world_size,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=False)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
        elif layout == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        elif layout != "plain":
            raise ValueError(layout)
        self.model = model
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)

    def train(self, steps: range) -> None:
        """(every rank of the job) AdamW steps on a globally defined batch; each data-parallel
        rank takes its rows, tensor-parallel ranks the same ones."""
        import contextlib

        from torch.distributed.tensor.parallel import loss_parallel

        for step in steps:
            g = torch.Generator().manual_seed(2000 + step)
            tokens = torch.randint(0, TOY_VOCAB, (TOY_BATCH, TOY_SEQ + 1), generator=g)
            per = TOY_BATCH // self.dp_size
            rows = tokens[self.dp_rank * per : (self.dp_rank + 1) * per]
            with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
                logits = self.model(rows[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
                loss.backward()
            self.optim.step()
            self.optim.zero_grad()

    def state(self) -> dict[str, object]:
        return {"model": self.model, "optim": self.optim}

    def full_state(self) -> dict[str, object]:
        """(every rank, collective: gathers DTensors; test oracle only) Model weights and AdamW
        state as whole tensors keyed by FQN (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...)."""
        out: dict[str, object] = {f"model.{k}": v for k, v in full_model_state(self.model).items()}
        out.update({f"optim.{k}": v for k, v in full_optim_state(self.model, self.optim).items()})
        return out
