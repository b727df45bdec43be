"""Peak memory per rank for checkpointing ZeRO-1 (``ZeroRedundancyOptimizer``) state.

Side by side, at 4 ranks (default):

* ``distckpt_save`` / ``distckpt_load``: each rank writes and reads only the AdamW state of the
  parameters it owns (plus the model), through DCP;
* ``consolidate_save``: ZeRO's own path, ``consolidate_state_dict(to=0)`` then ``torch.save`` of
  ``state_dict()`` on rank 0 (fsync'd);
* ``consolidate_load``: every rank ``torch.load``s that file and calls ``load_state_dict`` (which
  needs the full state on every rank).

Memory is the growth of each rank's resident set during the operation (kernel high-water mark
``VmHWM`` after ``/proc/self/clear_refs``), against the size of the *full* optimizer state. The
target (issue 3): distckpt stays within its own shard plus a bounded buffer, at most 0.35x the
full optimizer state.

Run ``python benchmarks/zero_memory.py --help``; ``--quick`` is a tiny smoke run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_json_arg,
    MiB, existing_dir, machine_info, median, peak_rss, positive_int, publish, remove_scratch, reset_peak_rss, resolve_outputs,
    resolve_quick, run_folder,
)  # fmt: skip

TARGET = 0.35


def _zero_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import distckpt

    torch.manual_seed(0)
    d, layers, vocab = cfg["hidden"], cfg["layers"], cfg["vocab"]
    mods: list[torch.nn.Module] = [torch.nn.Embedding(vocab, d)]
    for _ in range(layers):
        mods += [torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)]
    model = torch.nn.Sequential(*mods)
    zero = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-3)
    x = torch.randint(0, vocab, (8, 16))
    model(x).square().mean().backward()
    zero.step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    local_opt_bytes = sum(
        v.numel() * v.element_size() for s in zero.optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )
    full = torch.tensor([local_opt_bytes], dtype=torch.int64)
    dist.all_reduce(full)
    full_opt_bytes = int(full.item())
    base = Path(cfg["dir"])
    records: list[dict[str, Any]] = []
    ck = distckpt.Checkpointer(str(base / "distckpt"))
    state = {"model": model, "optim": zero}
    ck.save(10**6, state)  # warm-up (group creation, first-call costs), untimed

    def measure(rep: int, method: str, fn: Any) -> None:
        dist.barrier()
        before = reset_peak_rss()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        records.append(
            {"rep": rep, "method": method, "time_s": time.perf_counter() - t0, "growth": peak_rss() - before}
        )

    def consolidate_save(rep: int) -> None:
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            sd = zero.state_dict()
            with open(base / f"zero{rep}.pt", "wb") as f:
                torch.save({"model": model.state_dict(), "optim": sd}, f)
                f.flush()
                os.fsync(f.fileno())
            del sd
        # ZeRO keeps the consolidated copy on rank 0 until the next consolidation: that memory
        # stays resident after the call; drop it so later methods start from the same baseline.
        zero._all_state_dicts = []

    def consolidate_load(rep: int) -> None:
        sd = torch.load(base / f"zero{rep}.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(sd["model"])
        zero.load_state_dict(sd["optim"])
        del sd

    for rep in range(cfg["repeats"]):
        measure(rep, "distckpt_save", lambda: ck.save(rep, state))
        measure(rep, "consolidate_save", lambda: consolidate_save(rep))
        measure(rep, "distckpt_load", lambda: ck.load(state, step=rep))
        measure(rep, "consolidate_load", lambda: consolidate_load(rep))
        dist.barrier()
        if rank == 0:
            (base / f"zero{rep}.pt").unlink(missing_ok=True)
        dist.barrier()
    ck.close()
    return {
        "rank": rank,
        "param_bytes": param_bytes,
        "local_opt_bytes": local_opt_bytes,
        "full_opt_bytes": full_opt_bytes,
        "records": records,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Options --quick changes default to None: it fills only those the user left out.
    p.add_argument("--world-size", type=positive_int, default=None, help="default 4 (--quick: 2)")
    p.add_argument("--hidden", type=positive_int, default=None, help="default 1024 (--quick: 64)")
    p.add_argument("--layers", type=positive_int, default=None, help="default 8 (--quick: 2)")
    p.add_argument("--vocab", type=positive_int, default=None, help="default 16384 (--quick: 512)")
    p.add_argument("--repeats", type=positive_int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--dir", type=existing_dir, default=None,
                   help="an existing dir to work in (a folder of this run's inside it; default: benchmarks/.scratch)")
    add_json_arg(p, "zero_memory")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (2 ranks, small model, 1 repeat)")
    args = p.parse_args(argv)
    resolve_quick(args, full={"world_size": 4, "hidden": 1024, "layers": 8, "vocab": 16384, "repeats": 3},
                  quick={"world_size": 2, "hidden": 64, "layers": 2, "vocab": 512, "repeats": 1})  # fmt: skip
    resolve_outputs(args, "zero_memory")
    from dist_harness import run_ranks

    scratch, own = run_folder(args.dir, "zero")
    cfg = {"dir": str(scratch), "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "repeats": args.repeats}
    t0 = time.perf_counter()
    try:
        per_rank = run_ranks(_zero_rank, args.world_size, scratch / "harness", cfg, timeout=900, pg_timeout=600)
    finally:
        remove_scratch(scratch, own)
    full = per_rank[0]["full_opt_bytes"]
    methods: dict[str, Any] = {}
    for m in ("distckpt_save", "consolidate_save", "distckpt_load", "consolidate_load"):
        growth = [median([r["growth"] for r in pr["records"] if r["method"] == m]) for pr in per_rank]
        times = [r["time_s"] for r in per_rank[0]["records"] if r["method"] == m]
        methods[m] = {
            "time_s": median(times),
            "peak_growth_mib_per_rank": [round(g / MiB, 1) for g in growth],
            "max_growth_vs_full_optimizer_state": max(growth) / full,
        }
    targets = [
        {
            "target": f"{m}_memory",
            "value": methods[m]["max_growth_vs_full_optimizer_state"],
            "limit": TARGET,
            "met": methods[m]["max_growth_vs_full_optimizer_state"] <= TARGET,
            "what": f"{m}: max per-rank peak growth / full optimizer state (<=)",
        }
        for m in ("distckpt_save", "distckpt_load")
    ]
    result = {
        "benchmark": "zero_memory",
        "machine": machine_info(),
        "config": {"world_size": args.world_size, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "repeats": args.repeats},
        "param_bytes": per_rank[0]["param_bytes"],
        "full_opt_bytes": full,
        "local_opt_bytes_per_rank": [pr["local_opt_bytes"] for pr in per_rank],
        "wall_s": time.perf_counter() - t0,
        "methods": methods,
        "targets": targets,
    }
    lines = [
        f"ZeRO-1 AdamW at {args.world_size} ranks: parameters {result['param_bytes'] / MiB:.0f} MiB, full optimizer state "
        f"{full / MiB:.0f} MiB (per-rank shards {', '.join(f'{b / MiB:.0f}' for b in result['local_opt_bytes_per_rank'])} MiB)",
        "",
        "| method | median s | peak RSS growth per rank (MiB) | max growth / full optimizer state |",
        "|---|---:|---|---:|",
    ]
    for m, v in methods.items():
        lines.append(
            f"| {m} | {v['time_s']:.3f} | {', '.join(f'{g:.0f}' for g in v['peak_growth_mib_per_rank'])} | "
            f"{v['max_growth_vs_full_optimizer_state']:.2f} |"
        )
    lines.append("")
    for t in targets:
        lines.append(f"- {t['what']}: {t['value']:.2f} (limit {t['limit']}) -> {'met' if t['met'] else 'MISSED'}")
    table = "\n".join(lines)
    return publish(result, table, args.json)


if __name__ == "__main__":
    main()
