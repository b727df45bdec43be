"""Loading a Hugging Face checkpoint into an FSDP2 model: memory per rank and time vs a raw read.

A sharded safetensors checkpoint of ``--size-gib`` (default 2 GiB, transformer-like tensor sizes,
``--shard-mib`` per file) is written once; then ``--world-size`` ranks (default 2) build the model
on the meta device, shard it with FSDP2 (``fully_shard``), allocate only their shards
(``to_empty``) and call ``distckpt.tools.hf.load_pretrained``. Measured per rank:

* resident memory: peak RSS during the load minus RSS before the model existed, so the rank's
  own shards are included; target **<= 0.6x the model size** (no rank materialises the model);
* bytes read from the files (each rank should read only its shards);
* load time (the first load, into fresh shards, and later ones), next to a raw sequential read of all files by one process (``readinto``, page cache
  warm for both, since the load runs right after the files were written or read).

Run ``python benchmarks/hf_load.py --help``; ``--quick`` is a small smoke run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_json_arg,
    GiB, MiB, current_rss, existing_dir, machine_info, median, peak_rss, positive_float, positive_int, publish, remove_scratch,
    reset_peak_rss, resolve_outputs, resolve_quick, run_folder, transformer_like_shapes,
)  # fmt: skip

TARGET_RSS = 0.6


def _module(shapes: list[tuple[str, tuple[int, ...]]]) -> Any:
    import torch
    from torch import nn

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i, (_, shape) in enumerate(shapes):
                self.register_parameter(f"p{i:04d}", nn.Parameter(torch.empty(shape)))

    return Flat()


def _write_checkpoint(directory: Path, shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> int:
    """A Hugging Face style sharded checkpoint (safetensors + index) of random tensors."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    files: list[dict[str, Any]] = [{}]
    size = 0
    for i, (_, shape) in enumerate(shapes):
        t = torch.randn(shape, generator=g)
        if files[-1] and size + t.numel() * 4 > shard_bytes:
            files.append({})
            size = 0
        files[-1][f"p{i:04d}"] = t
        size += t.numel() * 4
    weight_map = {}
    total = 0
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * 4
        tensors.clear()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _raw_read(directory: Path) -> float:
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for f in sorted(directory.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - t0


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distckpt.tools import hf

    shapes = [tuple(s) for s in cfg["shapes"]]
    before = current_rss()
    with torch.device("meta"):
        model = _module([("", s) for s in shapes])
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model.to_empty(device="cpu")
    records = []
    for rep in range(cfg["repeats"]):
        dist.barrier()
        reset_peak_rss()
        t0 = time.perf_counter()
        report = hf.load_pretrained(model, cfg["dir"])
        dist.barrier()
        records.append({"time_s": time.perf_counter() - t0, "peak_rss_over_start": peak_rss() - before, "bytes_read": report.bytes_read})
    return {"rank": rank, "records": records, "checked": _check_values(model, Path(cfg["dir"]))}


def _check_values(model: Any, directory: Path) -> list[str]:
    """Spot check, after the timed loads: this rank's shards of the first, a middle and the last
    parameter equal the rows of the safetensors files they come from, element for element (a
    fast load of wrong bytes must not pass as a measurement). Raises naming the first that differs."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    params = dict(model.named_parameters())
    names = sorted(params)
    checked = []
    for name in dict.fromkeys([names[0], names[len(names) // 2], names[-1]]):
        p = params[name]
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        with safe_open(str(directory / weight_map[name]), framework="pt") as f:
            rows = f.get_slice(name)[offset[0] : offset[0] + shape[0]]  # FSDP2: Shard(0), whole rows
        local = p.to_local()
        if tuple(local.shape) != tuple(rows.shape) or not torch.equal(local, rows):
            raise AssertionError(f"load_pretrained loaded wrong values into {name} (rows {offset[0]}..{offset[0] + shape[0]})")
        checked.append(name)
    return checked


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Options --quick changes default to None: it fills only those the user left out.
    p.add_argument("--size-gib", type=positive_float, default=None, help="model size (default 2 GiB; --quick: 64 MiB)")
    p.add_argument("--shard-mib", type=positive_int, default=None, help="bytes per safetensors file (default 512 MiB; --quick: 16)")
    p.add_argument("--world-size", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=None, help="loads per rank (default 4; --quick: 1)")
    p.add_argument("--dir", type=existing_dir, default=None,
                   help="an existing dir to work in (a folder of this run's inside it; default: benchmarks/.scratch)")
    add_json_arg(p, "hf_load")
    p.add_argument("--quick", action="store_true", help="small smoke run (64 MiB, 1 repeat)")
    args = p.parse_args(argv)
    resolve_quick(args, full={"size_gib": 2.0, "shard_mib": 512, "repeats": 4}, quick={"size_gib": 1 / 16, "shard_mib": 16, "repeats": 1})
    resolve_outputs(args, "hf_load")
    from dist_harness import run_ranks

    scratch, own = run_folder(args.dir, "hf")
    shapes = transformer_like_shapes(int(args.size_gib * GiB))
    t0 = time.perf_counter()
    try:
        model_bytes = _write_checkpoint(scratch / "hf", shapes, args.shard_mib * MiB)
        raw = [_raw_read(scratch / "hf") for _ in range(args.repeats)]
        cfg = {"dir": str(scratch / "hf"), "shapes": [list(s) for _, s in shapes], "repeats": args.repeats}
        per_rank = run_ranks(_rank, args.world_size, scratch / "harness", cfg, timeout=1800, pg_timeout=900)
    finally:
        remove_scratch(scratch, own)
    slowest = [max(pr["records"][i]["time_s"] for pr in per_rank) for i in range(args.repeats)]
    first_s = slowest[0]  # into freshly allocated shards: page faults and one-time setup included
    load_s = median(slowest[1:] or slowest)
    rss = [median([r["peak_rss_over_start"] for r in pr["records"]]) for pr in per_rank]
    read = [pr["records"][0]["bytes_read"] for pr in per_rank]
    raw_s = median(raw)
    worst = max(rss) / model_bytes
    result = {
        "benchmark": "hf_load",
        "machine": machine_info(),
        "config": {"size_gib": args.size_gib, "shard_mib": args.shard_mib, "world_size": args.world_size, "repeats": args.repeats},
        "model_bytes": model_bytes,
        "first_load_s": first_s,
        "load_s": load_s,
        "raw_read_s": raw_s,
        "load_vs_raw_read": raw_s / load_s,
        "peak_rss_per_rank_bytes": rss,
        "bytes_read_per_rank": read,
        "values_checked_per_rank": [pr["checked"] for pr in per_rank],  # compared with the files after the loads
        "wall_s": time.perf_counter() - t0,
        "targets": [
            {
                "target": "peak_rss_per_rank",
                "value": worst,
                "limit": TARGET_RSS,
                "met": worst <= TARGET_RSS,
                "what": "peak RSS per rank (own shards included) / model size (<=)",
            }
        ],
    }
    lines = [
        f"load_pretrained: {model_bytes / GiB:.2f} GiB Hugging Face checkpoint into FSDP2 at {args.world_size} ranks",
        "",
        "| | value |",
        "|---|---:|",
        f"| first load (fresh shards: page faults, one-time setup) | {first_s:.2f} s |",
        f"| later loads (slowest rank, median) | {load_s:.2f} s |",
        f"| raw sequential read of all files, one process | {raw_s:.2f} s |",
        f"| later loads vs raw read | {raw_s / load_s:.2f}x |",
        f"| peak RSS per rank / model size | {', '.join(f'{r / model_bytes:.2f}' for r in rss)} |",
        f"| bytes read per rank / model size | {', '.join(f'{b / model_bytes:.2f}' for b in read)} |",
        "",
        f"- peak RSS per rank <= {TARGET_RSS}x model: {worst:.2f} -> {'met' if worst <= TARGET_RSS else 'MISSED'}",
    ]
    table = "\n".join(lines)
    return publish(result, table, args.json)


if __name__ == "__main__":
    main()
