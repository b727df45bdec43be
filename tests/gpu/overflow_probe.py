"""Does the GPU probes' training recipe (``../shared/gpu/gpu_*.py``: stacks of
``nn.Linear(4096, 4096)``, no normalization, fused AdamW at lr 1e-2) overflow, so that the state
holds NaN at the later saves those probes compared with ``torch.equal``?

usage: python tests/gpu/overflow_probe.py [LAYERS ...]     (default: 6 12 16 24; GPU if present)

For each depth, prints per optimizer step how many parameters and optimizer-state tensors hold
NaN or infinities, and how many tensors ``torch.equal`` calls unequal to their own exact clone
(NaN != NaN), i.e. what those probes counted as "corrupted" whatever was saved. On the CPU of
the development machine, 24 fp32 layers hold NaN in every parameter from step 5 (the probes
compared the third save, after step 12: "144/192 tensors differ" = all but the 48 step counters).
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def probe(layers: int, dtype: torch.dtype, steps: int = 12) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1)
    d = 4096
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)]).to(dev, dtype)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=dev.type == "cuda")
    x = torch.randn(64, d, device=dev, dtype=dtype)
    for step in range(1, steps + 1):
        model(x).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        params = list(model.parameters())
        states = [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]
        nan = sum(bool(torch.isnan(t).any()) for t in params + states)
        inf = sum(bool(torch.isinf(t).any()) for t in params + states)
        unequal = sum(not torch.equal(t, t.clone()) for t in params + states)
        print(f"{layers:3d} layers {str(dtype):15s} step {step:2d}: tensors with NaN {nan:3d}, with inf {inf:3d}, "
              f"torch.equal(t, t.clone()) False for {unequal}/{len(params) + len(states)}", flush=True)
    del model, optim


if __name__ == "__main__":
    depths = [int(a) for a in sys.argv[1:]] or [6, 12, 16, 24]
    for n in depths:
        probe(n, torch.float32)
    probe(16, torch.bfloat16)
