"""Bodies of the exactness tests, for any device: the CUDA tier (``tests/gpu/``) runs them on a
GPU at sizes that cross real thresholds, ``tests/test_exactness.py`` on the CPU at small sizes.

Each body trains a model whose training stays finite (residual blocks with LayerNorm, a small
learning rate: the state is checked to hold no NaN, whose bits a comparison could not trust),
saves it several times with one Checkpointer while training goes on between the saves without
any synchronization the user would not do, and compares, bit for bit:

* what the files hold, read back by plain DCP on the CPU (no distckpt read path), with a
  snapshot taken on the device at each ``save`` call (a clone queued on the same stream as
  training, so it is exactly the state the call saw);
* what ``load`` restores into fresh objects on the same device, compared on the device right
  after ``load`` returns (no synchronize: what the default stream sees), in place where the
  objects live.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distckpt


class Block(nn.Module):
    """``x + tanh(W LayerNorm(x))``: bounded updates, so the state stays finite under training."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


def layers_for(nbytes: float, width: int, dtype: torch.dtype) -> int:
    """Blocks for a model + AdamW state of about ``nbytes``."""
    per_block = 3 * (width * width + 3 * width) * torch.empty((), dtype=dtype).element_size()
    return max(1, round(nbytes / per_block))


def build(
    device: torch.device, dtype: torch.dtype, layers: int, width: int, seed: int, fsdp: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[Block(width) for _ in range(layers)]).to(device=device, dtype=dtype)
    if fsdp:
        _fully_shard(model, device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, optim


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, width: int) -> None:
    """``steps`` optimizer steps, queued without synchronizing."""
    p = next(model.parameters())
    for _ in range(steps):
        x = torch.randn(16, width, device=p.device, dtype=p.dtype)
        model(x).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Clones (on the tensors' devices, queued after training's kernels) of every tensor a save
    writes, under the flattened keys a distckpt checkpoint stores them by; DTensors whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model.{k}": whole(v) for k, v in get_model_state_dict(model).items()}
    osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    out.update({f"optim.{k}": whole(v) for k, v in osd.items() if isinstance(v, torch.Tensor)})
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (so that NaN payloads, -0.0 and infinities compare exactly)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differing(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in dtype, shape or any bit (missing keys included)."""
    bad = []
    for k, e in expected.items():
        a = actual.get(k)
        if a is None or a.dtype != e.dtype or a.shape != e.shape:
            bad.append(k)
            continue
        if a.device != e.device:
            a = a.to(e.device)
        if not torch.equal(bits(a), bits(e)):
            bad.append(k)
    return sorted(bad)


def nonfinite(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def flip_a_stored_bit(root: Path, t: torch.Tensor, at: int = 5) -> None:
    """Flip one bit of the stored bytes of ``t`` (found by its exact bytes in a ``.distcp`` file
    under ``root``): a corruption for negative controls."""
    raw = t.numpy().tobytes()
    for f in root.rglob("*.distcp"):
        data = bytearray(f.read_bytes())
        found = data.find(raw)
        if found >= 0:
            data[found + at] ^= 0x10
            f.write_bytes(bytes(data))
            return
    raise AssertionError("tensor bytes not found")


def read_files(step_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint step as plain DCP reads it, on the CPU, by flattened key:
    what ``dcp_to_torch_save`` loads, without its round trip through a ``torch.save`` file (two
    thirds of the I/O of a 2.6 GB CUDA-tier test)."""
    raw: dict[str, Any] = {}
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        _load_state_dict(raw, storage_reader=FileSystemReader(step_dir), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except (ImportError, TypeError):  # private API: a torch where it moved takes the public way
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        fd, path = tempfile.mkstemp(suffix=".pt")
        os.close(fd)
        try:
            dcp_to_torch_save(step_dir, path)
            raw = torch.load(path, weights_only=False)
        finally:
            os.remove(path)
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            out[prefix] = value

    walk("", raw)
    return out


def saves_are_exact(
    root: str,
    device: torch.device,
    dtype: torch.dtype,
    nbytes: float,
    width: int,
    *,
    blocking: bool,
    async_mode: str = "process",
    saves: int = 5,
    fsdp: bool = False,
) -> dict[str, Any]:
    """(every rank of the job: collective) ``saves`` saves of one Checkpointer with training
    between them; returns the mismatches found (all lists empty when exact) and facts to check."""
    layers = layers_for(nbytes, width, dtype)
    model, optim = build(device, dtype, layers, width, seed=1, fsdp=fsdp)
    train(model, optim, 2, width)
    files_bad: dict[int, list[str]] = {}
    staged_checked = []
    ckpt = distckpt.Checkpointer(root, async_mode=async_mode)
    snap: dict[str, torch.Tensor] = {}
    for step in range(saves):
        snap = snapshot(model, optim)
        ckpt.save(step, {"model": model, "optim": optim}, blocking=blocking)
        train(model, optim, 3, width)  # at once: in place, no synchronize
        stats = ckpt.wait() if not blocking else ckpt.last_save
        staged_checked.append("verify_staging" in (stats.phases if stats else {}))
        files = read_files(os.path.join(root, f"step_{step:09d}"))
        files_bad[step] = differing({k: v.cpu() for k, v in snap.items()}, files)
    finite = not nonfinite(snap)
    ckpt.close()
    # Load the last step into fresh objects on the device, compared at once on the device.
    fresh, fresh_optim = build(device, dtype, layers, width, seed=7, fsdp=fsdp)
    train(fresh, fresh_optim, 1, width)
    pointers = {n: _local(p).data_ptr() for n, p in fresh.named_parameters()}
    with distckpt.Checkpointer(root) as again:
        again.load({"model": fresh, "optim": fresh_optim})
    loaded_bad = differing(snap, snapshot(fresh, fresh_optim))
    in_place = all(_local(p).data_ptr() == pointers[n] and p.device == device for n, p in fresh.named_parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in snap.values())
    return {
        "files_bad": {s: b for s, b in files_bad.items() if b},
        "loaded_bad": loaded_bad,
        "finite": finite,
        "in_place": in_place,
        "staged_checked": staged_checked,
        "state_bytes": state_bytes,
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fully_shard(model: nn.Module, device: torch.device) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp_rank(rank: int, world: int, root: str, device_type: str, dtype_name: str, nbytes: float, width: int, mode: str) -> dict:
    """:func:`saves_are_exact` of an FSDP2 model, as one rank of a (one-rank) job."""
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return saves_are_exact(
        root, device, getattr(torch, dtype_name), nbytes, width, blocking=False, async_mode=mode, saves=3, fsdp=True
    )


def special_values_are_exact(root: str, device: torch.device) -> list[str]:
    """Async and sync saves of tensors holding NaN payloads of both signs, infinities, -0.0 and
    subnormals (what an overflowing run holds), loaded back on ``device``: keys not bit-exact."""
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 3.0])
    payload = torch.tensor([0x7FC00001, 0x7F800001, -0x400000, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    state = {
        "f32": torch.cat([special, payload]).repeat(1000).to(device),
        "bf16": special.to(torch.bfloat16).repeat(1000).to(device),
        "f64": special.double().to(device),
    }
    bad = []
    for mode, blocking in (("process", False), ("thread", False), ("process", True)):
        where = os.path.join(root, f"{mode}-{blocking}")
        with distckpt.Checkpointer(where, async_mode=mode) as ckpt:
            for step in range(3):
                ckpt.save(step, state, blocking=blocking)
            ckpt.wait()
            back = {k: torch.zeros_like(v) for k, v in state.items()}
            ckpt.load(back, verify_state=True)
        bad += [f"{mode}/{blocking}/{k}" for k in differing(state, back)]
        bad += [f"{mode}/{blocking}/files/{k}" for k in differing({k: v.cpu() for k, v in state.items()}, read_files(os.path.join(where, "step_000000002")))]
    return bad
