"""What each rank reads to load an FSDP2 model with AdamW and an LR scheduler, against its share.

distckpt verifies every file it reads from whole (size and checksum), so what a rank reads is
every file holding anything it needs. At 4 ranks (default), each rank saves and then loads:

* ``distckpt_load``: ``Checkpointer.load`` of the state (checksums verified);
* ``dcp_load``: plain ``dcp.load`` of the same step (DCP's ``FileSystemReader``, which reads only
  each item's byte range and checks nothing), with torch's ``get_state_dict``/``set_state_dict``.

Per method: the median load time of ``--repeats`` (methods alternated), and the bytes each rank
read (``rchar`` of ``/proc/self/io``) against its share (the bytes of its own shards of the model
and optimizer state). Target: a rank reads at most 1.25x its share (plus a fixed 1 MiB for
``.metadata``, the manifest and the small files of shared values).

Run ``python benchmarks/read_share.py --help``; ``--quick`` is a tiny smoke run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_json_arg, MiB, existing_dir, machine_info, median, positive_int, publish, remove_scratch, resolve_outputs, resolve_quick, run_folder  # noqa: E402

TARGET = 1.25
SLACK = MiB


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import distckpt
    from distckpt.integrity.manifest import step_dir

    torch.set_num_threads(1)
    torch.manual_seed(0)
    d, layers = cfg["hidden"], cfg["layers"]
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10)
    model(torch.randn(4, d)).square().mean().backward()
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)

    def local_bytes(t: Any) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    share = sum(local_bytes(p) for p in model.parameters())
    share += sum(local_bytes(v) for s in optim.state.values() for v in s.values() if isinstance(v, DTensor))
    root = Path(cfg["dir"]) / "root"
    state = {"model": model, "optim": optim, "sched": sched, "step": 1}
    with distckpt.Checkpointer(str(root)) as ckpt:
        ckpt.save(1, state)
    step = str(root / step_dir(1))
    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def distckpt_load() -> None:
        with distckpt.Checkpointer(str(root)) as ck:
            ck.load(state, step=1)

    def dcp_load() -> None:
        msd, osd = get_state_dict(model, optim, options=options)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=step)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=options)

    methods = {"distckpt_load": distckpt_load, "dcp_load": dcp_load}
    distckpt_load()  # first-call costs (imports, groups), untimed
    records: list[dict[str, Any]] = []
    for rep in range(cfg["repeats"]):
        for name in list(methods) if rep % 2 == 0 else list(reversed(methods)):
            dist.barrier()
            r0, t0 = _rchar(), time.perf_counter()
            methods[name]()
            read = _rchar() - r0
            dist.barrier()
            records.append({"rep": rep, "method": name, "time_s": time.perf_counter() - t0, "read": read})
    files = sorted(p for p in Path(step).iterdir() if p.name.endswith(".distcp"))
    return {
        "share": share,
        "records": records,
        "checkpoint_bytes": sum(p.stat().st_size for p in files),
        "files": len(files),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Options --quick changes default to None: it fills only those the user left out.
    p.add_argument("--world-size", type=positive_int, default=None, help="default 4 (--quick: 2)")
    p.add_argument("--hidden", type=positive_int, default=None, help="default 2048 (--quick: 64)")
    p.add_argument("--layers", type=positive_int, default=None, help="Linear(hidden, hidden) layers (default 16: ~800 MB with AdamW; --quick: 2)")
    p.add_argument("--repeats", type=positive_int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--dir", type=existing_dir, default=None,
                   help="an existing dir to work in (a folder of this run's inside it; default: benchmarks/.scratch)")
    add_json_arg(p, "read_share")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (2 ranks, small model, 1 repeat)")
    args = p.parse_args(argv)
    resolve_quick(args, full={"world_size": 4, "hidden": 2048, "layers": 16, "repeats": 3},
                  quick={"world_size": 2, "hidden": 64, "layers": 2, "repeats": 1})  # fmt: skip
    resolve_outputs(args, "read_share")
    from dist_harness import run_ranks

    scratch, own = run_folder(args.dir, "read-share")
    cfg = {"dir": str(scratch), "hidden": args.hidden, "layers": args.layers, "repeats": args.repeats}
    t0 = time.perf_counter()
    try:
        per_rank = run_ranks(_rank, args.world_size, scratch / "harness", cfg, timeout=900, pg_timeout=600)
    finally:
        remove_scratch(scratch, own)
    methods: dict[str, Any] = {}
    for m in ("distckpt_load", "dcp_load"):
        reads = [median([r["read"] for r in pr["records"] if r["method"] == m]) for pr in per_rank]
        methods[m] = {
            "time_s": median([r["time_s"] for r in per_rank[0]["records"] if r["method"] == m]),
            "read_mib_per_rank": [round(b / MiB, 1) for b in reads],
            # (0 at least: at small sizes a rank reads less than the slack, which is no ratio)
            "max_read_vs_share": max(max(0.0, b - SLACK) / pr["share"] for b, pr in zip(reads, per_rank)),
        }
    value = methods["distckpt_load"]["max_read_vs_share"]
    targets = [{
        "target": "distckpt_read_vs_share",
        "value": value,
        "limit": TARGET,
        "met": value <= TARGET,
        "what": "distckpt_load: max over ranks of (bytes read - 1 MiB) / the rank's share (<=)",
    }]  # fmt: skip
    result = {
        "benchmark": "read_share",
        "machine": machine_info(),
        "config": {"world_size": args.world_size, "hidden": args.hidden, "layers": args.layers, "repeats": args.repeats},
        "checkpoint_bytes": per_rank[0]["checkpoint_bytes"],
        "files": per_rank[0]["files"],
        "share_bytes_per_rank": [pr["share"] for pr in per_rank],
        "share_mib_per_rank": [round(pr["share"] / MiB, 1) for pr in per_rank],
        "wall_s": time.perf_counter() - t0,
        "methods": methods,
        "targets": targets,
    }
    lines = [
        f"FSDP2 + AdamW + StepLR at {args.world_size} ranks: checkpoint {result['checkpoint_bytes'] / MiB:.0f} MiB in "
        f"{result['files']} data files; each rank's share {', '.join(f'{s:.0f}' for s in result['share_mib_per_rank'])} MiB",
        "",
        "| method | median load s | MiB read per rank | max (read - 1 MiB) / share |",
        "|---|---:|---|---:|",
    ]
    for m, v in methods.items():
        lines.append(f"| {m} | {v['time_s']:.3f} | {', '.join(f'{b:.0f}' for b in v['read_mib_per_rank'])} | {v['max_read_vs_share']:.2f} |")
    lines.append("")
    for t in targets:
        lines.append(f"- {t['what']}: {t['value']:.2f} (limit {t['limit']}) -> {'met' if t['met'] else 'MISSED'}")
    return publish(result, "\n".join(lines), args.json)


if __name__ == "__main__":
    main()
