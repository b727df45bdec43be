"""What verified resume costs: fingerprinting the loaded state, next to the load it checks.

A load with ``verify_state=True`` recomputes a sharding-independent fingerprint of every loaded
tensor (``distckpt.state.fingerprint``), gathers the parts on distckpt's group and compares them with
the manifest. This benchmark measures, for a GPT-shaped fp32 state (default 1 GiB) at world sizes
1 and 2 in one run:

* ``load``          ``Checkpointer.load(state, verify_state=False)`` (files evicted from the page
  cache first, as in ``save_throughput.py``); crc32 checks on, as by default;
* ``load_verified`` the same load with ``verify_state=True``;
* ``fingerprint``   the fingerprint alone: ``fingerprint.local_parts`` over the state this rank
  holds plus one all-gather of the parts (what the check adds, without the load);
* ``fingerprint_colsplit`` the same over a column-split (``Shard(1)``) copy at world size 2,
  the slowest layout (many short runs per shard).

At world size 1 the state is plain tensors; at world size N every tensor is a DTensor sharded
by rows (``Shard(0)``, FSDP2's layout), so each rank loads and fingerprints its own 1/N.
Methods alternate inside every repetition; figures are medians. Target (issue #17): the check
adds at most 30% to a 1 GiB load, i.e. ``load_verified / load <= 1.30``.

``--device cuda`` puts the state on the rank's GPU (fingerprints are computed there).
Run ``python benchmarks/verify_cost.py --help``; ``--quick`` is a tiny smoke run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_json_arg,
    GiB,
    drop_cache,
    existing_dir,
    machine_info,
    make_tensors,
    median,
    positive_float,
    positive_int,
    positive_ints,
    publish,
    remove_scratch,
    resolve_outputs,
    resolve_quick,
    run_folder,
    transformer_like_shapes,
)

TARGET = 1.30


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from distckpt._compat import flatten_state_dict

    import distckpt
    from distckpt.state import fingerprint

    threads = max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    full = make_tensors(transformer_like_shapes(cfg["size_bytes"]))

    def layout(placement: Any) -> dict[str, Any]:
        if world == 1:
            return {k: v.to(device) for k, v in full.items()}
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh(device.type, (world,))
        # src_data_rank=None: every rank holds the same full tensor already; no broadcast.
        out = {}
        for k, v in full.items():
            dim = placement.dim if v.dim() > placement.dim else 0
            out[k] = distribute_tensor(v.to(device), mesh, [type(placement)(dim)], src_data_rank=None)
        return out

    from torch.distributed.tensor import Shard

    state = {"model": layout(Shard(0))}
    colsplit = {"model": layout(Shard(1))} if world > 1 else None
    full = {}  # frees the full tensors (not del: layout() above closes over the name)
    root = cfg["root"]
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, state)
    local_bytes = sum(
        (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in state["model"].values()
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def timed(fn: Callable[[], None], evict: bool) -> float:
        if evict and rank == 0:
            drop_cache(root)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def fingerprint_of(st: dict[str, Any]) -> Callable[[], None]:
        def run() -> None:
            parts = fingerprint.local_parts(flatten_state_dict(st)[0])
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, parts)

        return run

    methods: dict[str, tuple[Callable[[], None], bool]] = {
        "load": (lambda: ckpt.load(state, verify_state=False), True),
        "load_verified": (lambda: ckpt.load(state, verify_state=True), True),
        "fingerprint": (fingerprint_of(state), False),
    }
    if colsplit is not None:
        methods["fingerprint_colsplit"] = (fingerprint_of(colsplit), False)
    times: dict[str, list[float]] = {m: [] for m in methods}
    fingerprint_of(state)()  # warm-up: builds the weight table on this device
    for _ in range(cfg["repeats"]):
        for name, (fn, evict) in methods.items():
            times[name].append(timed(fn, evict))
    ckpt.close()
    return {"times": times, "local_bytes": local_bytes, "threads": threads}


def _summarize(world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    times = per_rank[0]["times"]
    med = {m: median(ts) for m, ts in times.items()}
    total = sum(r["local_bytes"] for r in per_rank)
    load, verified, fp = med["load"], med["load_verified"], med["fingerprint"]
    out: dict[str, Any] = {
        "world_size": world,
        "bytes": total,
        "threads_per_rank": per_rank[0]["threads"],
        "median_s": med,
        "gb_per_s": {m: total / t / 1e9 for m, t in med.items()},
        "verified_over_plain": verified / load,
        "fingerprint_over_load": fp / load,
    }
    out["target_met"] = out["verified_over_plain"] <= TARGET
    return out


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"verify_cost: {result['config']['size_gib']} GiB fp32, device {result['config']['device']}, "
        f"{result['config']['repeats']} repeats, medians",
        "",
        "| world size | load (s) | load, verified (s) | fingerprint alone (s) | fingerprint, column split (s) "
        "| verified / plain | target <= 1.30 |",
        "|---|---|---|---|---|---|---|",
    ]
    for ws in result["world_sizes"]:
        m = ws["median_s"]
        col = f"{m['fingerprint_colsplit']:.3f}" if "fingerprint_colsplit" in m else "-"
        lines.append(
            f"| {ws['world_size']} | {m['load']:.3f} | {m['load_verified']:.3f} | {m['fingerprint']:.3f} "
            f"({ws['gb_per_s']['fingerprint']:.2f} GB/s) | {col} | {ws['verified_over_plain']:.2f} "
            f"| {'met' if ws['target_met'] else 'missed'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Options --quick changes default to None: it fills only those the user left out.
    p.add_argument("--size-gib", type=positive_float, default=None, help="state size (default 1 GiB; --quick: 8 MiB)")
    p.add_argument("--world-sizes", type=positive_ints, default="1,2", help="comma-separated (default 1,2)")
    p.add_argument("--repeats", type=positive_int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dir", type=existing_dir, default=None,
                   help="an existing dir to work in (a folder of this run's inside it; default: benchmarks/.scratch on the repo's disk)")
    add_json_arg(p, "verify_cost")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (8 MiB, 1 repeat, world sizes 1,2)")
    args = p.parse_args(argv)
    resolve_quick(args, full={"size_gib": 1.0, "repeats": 3}, quick={"size_gib": 8 / 1024, "repeats": 1})
    resolve_outputs(args, "verify_cost")
    worlds = args.world_sizes
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < max(worlds):
            p.error(f"--device cuda needs {max(worlds)} GPU(s)")
    from dist_harness import run_ranks

    scratch, own_dir = run_folder(args.dir, "verify")
    t_start = time.perf_counter()
    results = []
    try:
        for w in worlds:
            cfg = {"root": str(scratch / f"ws{w}"), "size_bytes": int(args.size_gib * GiB), "repeats": args.repeats, "device": args.device}
            print(f"[verify_cost] world size {w} ...", flush=True)
            per_rank = run_ranks(_rank, w, scratch / "harness", cfg, timeout=900, pg_timeout=600)
            results.append(_summarize(w, per_rank))
    finally:
        remove_scratch(scratch, own_dir)
    result = {
        "benchmark": "verify_cost",
        "machine": machine_info(),
        "config": {"size_gib": args.size_gib, "world_sizes": worlds, "repeats": args.repeats, "device": args.device},
        "wall_s": time.perf_counter() - t_start,
        "world_sizes": results,
    }
    return publish(result, _table(result), args.json)


if __name__ == "__main__":
    main()
