"""Cost of DCP's save planning for simulated world sizes (8 .. 4096), without real processes.

Every ``dcp.save`` (and so every distckpt save) runs, before writing a byte:

1. on every rank, ``create_local_plan``: one WriteItem per tensor (or shard) it holds;
2. a gather of all local plans to the coordinator (pickled);
3. on the coordinator, ``create_global_plan``: deduplicate replicated items (spreading them over
   ranks), build the global ``Metadata`` (one chunk record per written piece) and validate it;
   then the writer's ``prepare_global_plan`` (file prefixes per rank);
4. a scatter of the final plans; at the end the coordinator pickles ``.metadata``.

This script builds the local plans of ``W`` simulated ranks for a ~1,000-tensor GPT-like model
(meta tensors: no memory) and times step 3 on one process, plus the pickled sizes of what steps
2 and 4 move. Two layouts:

* ``replicated`` (DDP-like): every rank's plan lists every tensor; dedup keeps one copy of each.
* ``sharded`` (FSDP-like): every tensor split along dim 0 over the ranks; no duplicates, but the
  metadata holds ``tensors x W`` chunks.

Run ``python benchmarks/plan_scaling.py --help``; ``--quick`` is a tiny smoke run.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, layer_shapes, machine_info, save_figure, publish  # noqa: E402


def model_shapes(n_tensors: int, d: int) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-like: embeddings, then layers of 4 matrices + 8 vectors until ``n_tensors``."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_emb", (32000, d)), ("lm_head", (32000, d))]
    layer = 0
    while len(shapes) + 12 <= n_tensors - 2:
        shapes += layer_shapes(f"layers.{layer}", d)
        layer += 1
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def replicated_plans(shapes: list[tuple[str, tuple[int, ...]]], world: int) -> tuple[list[Any], float]:
    """Every rank's local plan via DefaultSavePlanner on meta tensors (identical on each rank)."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint import DefaultSavePlanner

    state = {"model": {n: torch.empty(s, device="meta") for n, s in shapes}}
    times = []
    plans = []
    for r in range(min(world, 2)):  # rank 0 (coordinator) and one other; the rest are copies
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=r == 0)
        t0 = time.perf_counter()
        plans.append(planner.create_local_plan())
        times.append(time.perf_counter() - t0)
    others = plans[-1]
    all_plans = [plans[0]] + [dataclasses.replace(others, items=list(others.items)) for _ in range(world - 1)]
    return all_plans, max(times)


def sharded_plans(shapes: list[tuple[str, tuple[int, ...]]], world: int) -> tuple[list[Any], float]:
    """Every rank's local plan of an FSDP-like dim-0 sharding, built as DCP builds DTensor items."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.float32)
    items: list[list[Any]] = [[] for _ in range(world)]
    mappings = {f"model.{n}": ("model", n) for n, _ in shapes}
    t0 = time.perf_counter()
    for name, shape in shapes:
        fqn = f"model.{name}"
        rows = shape[0]
        per = -(-rows // world)  # torch.chunk / FSDP2 sizes; trailing ranks may get nothing
        size = torch.Size(shape)
        for r in range(world):
            start = r * per
            if start >= rows:
                break
            n = min(per, rows - start)
            offsets = torch.Size((start,) + (0,) * (len(shape) - 1))
            items[r].append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((n,) + tuple(shape[1:]))),
                        properties=props,
                        size=size,
                    ),
                )
            )
    local_s = (time.perf_counter() - t0) / world  # one rank's share of building the items
    return [SavePlan(items[r], planner_data=mappings) for r in range(world)], local_s


def measure(layout: str, shapes: list[tuple[str, tuple[int, ...]]], world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    build = replicated_plans if layout == "replicated" else sharded_plans
    plans, local_s = build(shapes, world)
    one_plan = len(pickle.dumps(plans[-1], protocol=pickle.HIGHEST_PROTOCOL))
    plan0 = len(pickle.dumps(plans[0], protocol=pickle.HIGHEST_PROTOCOL))
    planner = DefaultSavePlanner()
    planner.set_up_planner({}, is_coordinator=True)
    writer = FileSystemWriter("/nonexistent-plan-scaling", single_file_per_rank=True)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        global_plan, metadata = planner.create_global_plan(plans)
        t1 = time.perf_counter()
        global_plan = writer.prepare_global_plan(global_plan)
        t2 = time.perf_counter()
        meta_bytes = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        t3 = time.perf_counter()
    finally:
        gc.enable()
    items_total = sum(len(p.items) for p in plans)
    written = sum(len(p.items) for p in global_plan)
    ranks_writing = sum(1 for p in global_plan if p.items)
    out = {
        "layout": layout,
        "world_size": world,
        "tensors": len(shapes),
        "local_items_total": items_total,
        "items_written": written,
        "ranks_writing": ranks_writing,
        "local_plan_s": local_s,
        "global_plan_s": t1 - t0,
        "prepare_global_plan_s": t2 - t1,
        "metadata_pickle_s": t3 - t2,
        "coordinator_s": t3 - t0,
        "gathered_plans_bytes": plan0 + one_plan * (world - 1),
        "metadata_bytes": len(meta_bytes),
    }
    del plans, global_plan, metadata, meta_bytes
    gc.collect()
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | W | local items (all ranks) | items written | local plan ms | global plan s | "
        "writer prep s | metadata pickle s | gathered plans MB | .metadata MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['world_size']} | {r['local_items_total']:,} | {r['items_written']:,} | "
            f"{r['local_plan_s'] * 1e3:.1f} | {r['global_plan_s']:.3f} | {r['prepare_global_plan_s']:.3f} | "
            f"{r['metadata_pickle_s']:.3f} | {r['gathered_plans_bytes'] / 1e6:.1f} | {r['metadata_bytes'] / 1e6:.2f} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], png: Path, info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for layout, marker in (("replicated", "o"), ("sharded", "s")):
        rs = [r for r in rows if r["layout"] == layout]
        if not rs:
            continue
        w = [r["world_size"] for r in rs]
        a1.loglog(w, [r["coordinator_s"] for r in rs], marker=marker, label=f"{layout}: coordinator (global plan + metadata)")
        a1.loglog(w, [r["local_plan_s"] for r in rs], marker=marker, ls="--", label=f"{layout}: local plan (per rank)")
        a2.loglog(w, [r["gathered_plans_bytes"] / 1e6 for r in rs], marker=marker, label=f"{layout}: gathered plans")
        a2.loglog(w, [r["metadata_bytes"] / 1e6 for r in rs], marker=marker, ls="--", label=f"{layout}: .metadata")
    a1.set_xlabel("simulated world size")
    a1.set_ylabel("seconds")
    a1.legend(fontsize=8)
    a1.grid(True, which="both", alpha=0.3)
    a2.set_xlabel("simulated world size")
    a2.set_ylabel("MB")
    a2.legend(fontsize=8)
    a2.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"DCP save planning, {rows[0]['tensors']} tensors — {info['cpu']}, torch {info['torch']}", fontsize=10)
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="8,32,128,512,1024,2048,4096")
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layouts", default="replicated,sharded")
    p.add_argument("--json", default=str(REPO / "benchmarks/results/plan_scaling.json"))
    p.add_argument("--png", default=str(REPO / "benchmarks/results/plan_scaling.png"))
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.world_sizes, args.tensors = "8,32", 50
    shapes = model_shapes(args.tensors, args.hidden)
    rows = []
    t_start = time.perf_counter()
    for layout in args.layouts.split(","):
        for w in [int(x) for x in args.world_sizes.split(",")]:
            r = measure(layout, shapes, w)
            print(
                f"[plan_scaling] {layout:10s} W={w:5d}: global plan {r['global_plan_s']:.3f}s, "
                f"metadata {r['metadata_bytes'] / 1e6:.2f} MB",
                flush=True,
            )
            rows.append(r)
    info = machine_info()
    result = {"benchmark": "plan_scaling", "machine": info, "tensors": len(shapes), "wall_s": time.perf_counter() - t_start, "rows": rows}
    table = _table(rows)
    publish(result, table, args.json)
    if args.png:
        _plot(rows, Path(args.png), info)
    return result


if __name__ == "__main__":
    main()
