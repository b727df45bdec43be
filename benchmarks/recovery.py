"""Time to resume from the fast recovery tier (``Checkpointer(local_dir=...)``, issue 33) against
the persistent root, and what the tier costs a training job.

Four ranks as two simulated nodes of two (``LOCAL_WORLD_SIZE=2``; each node's ``local_dir`` in
``/dev/shm``), a transformer-like fp32 state (default 1 GiB in all) sharded over the four ranks as
DTensors (``Shard(0)``, as FSDP2 shards) and, unless ``--no-values``, the plain values an
optimizer and a scheduler add (per-parameter hyper-parameters, a step: written once by some rank
and read back by every rank), one run; each repetition alternates the methods and every figure
is the median over ``--repeats`` (>= 3) repetitions:

* ``recover_local_s``: ``load`` on every rank from the node's own tier (nothing transferred);
* ``recover_peer_s``: the same after node 1's tier was wiped (a lost node): what node 1's ranks
  read is streamed by node 0's ranks over the process group (gloo) into their load, tensors'
  bytes straight into their destinations (``distckpt.storage.stream``);
* ``recover_disk_cold_s``: ``load`` from the root on local disk, its files evicted from the page
  cache first (``posix_fadvise``); ``recover_s3_s``: from the root on S3 (a moto server on
  127.0.0.1), same state;
* ``save_blocked_with_tier_s`` / ``save_blocked_without_tier_s``: how long an async save blocks
  training with and without the tier (a warm checkpointer: staging buffers and writer reused;
  two saves of each per repetition, in ABBA order, so that each goes first equally often);
* ``train_ratio_with_tier``: steps/s of a small DDP model while an async save with the tier is in
  flight (writer, tee, manifest and peer transfer) over steps/s while one without it is;
* ``wire_peer_warm_s`` / ``wire_peer_fresh_s``: the floor under the peer row's transfer, measured
  in the same run: plain gloo point-to-point, each rank of node 0 sending one rank's share of the
  state (``size / world`` bytes, in the transfer's pieces) to its peer on node 1, received into
  memory already touched (what the peer row's streams pay, receiving into the load's destination tensors) and into
  freshly allocated memory (what landing the bytes in new pages costs, a tier file or a buffer).

Targets (issue 33, this 2-core machine): peer recovery >= 5x faster than S3 and >= 2x faster than
the cold disk; the tier adds <= 10% to the blocked time and costs training <= 3% steps/s.

    python benchmarks/recovery.py [--gib 1] [--repeats 3] [--no-s3]    # --quick: a tiny smoke run (async saves from threads)

Writes ``benchmarks/results/recovery.json`` (``rows``: the figures above) and ``.md`` (``--json``
elsewhere; a ``--quick`` run without ``--json``: a new temporary folder, printed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_json_arg,
    GiB,
    REPO,
    drop_cache,
    existing_dir,
    machine_info,
    make_tensors,
    median,
    nbytes,
    positive_float,
    positive_int,
    publish,
    remove_scratch,
    resolve_outputs,
    resolve_quick,
    run_folder,
    steps_while_in_flight,
    transformer_like_shapes,
)

HERE = Path(__file__).resolve().parent
WORLD = 4
PER_NODE = 2
TARGETS = {"peer_vs_s3": 5.0, "peer_vs_disk_cold": 2.0, "blocked_with_vs_without": 1.10, "train_ratio": 0.97}


def _values(keys: list[str], lr: float = 1e-3) -> dict[str, Any]:
    """What an optimizer and a scheduler add beside the tensors (``--values``): hyper-parameters
    per parameter, as DCP's flat optimizer state holds them, and a step. Each is written once,
    by some rank, and every rank reads them all back."""
    hyper = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "maximize": False}
    return {"hyper": {k: dict(hyper) for k in keys}, "sched": {"last_epoch": 100, "base_lrs": [lr]}, "step": 100}


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import distckpt

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    full = make_tensors(transformer_like_shapes(int(cfg["size_bytes"])))
    built = nbytes(full)  # what the shapes came to (recorded), not what --gib asked for
    # Every rank built the same tensors: no broadcast, each keeps a copy of its shard only (a
    # view would keep the whole tensor alive: four ranks x the state).
    shards = {}
    for k in list(full):
        v = full.pop(k)
        d = distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None)
        shards[k] = DTensor.from_local(d.to_local().clone(), mesh, [Shard(0)], run_check=False, shape=d.shape, stride=d.stride())
        del v, d
    state: dict[str, Any] = {"model": shards}
    if cfg["values"]:
        state.update(_values(list(shards)))

    def blank() -> dict[str, Any]:
        """A state of the same structure to load into: zeros, and values other than the saved."""
        out: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in shards.items()}}
        if cfg["values"]:
            out.update(_values(list(shards), lr=0.0))
        return out

    scratch = Path(cfg["dir"])
    shm = Path(cfg["shm"])
    node = rank // PER_NODE
    records: list[dict[str, Any]] = []

    def barrier() -> None:
        dist.barrier()

    def timed(rep: int, name: str, fn: Any) -> Any:
        barrier()
        t0 = time.perf_counter()
        out = fn()
        barrier()
        records.append({"rep": rep, "method": name, "time_s": time.perf_counter() - t0})
        return out

    def on_rank0(fn: Any) -> None:
        if rank == 0:
            fn()
        barrier()

    from distckpt.storage.transfer import PIECE

    share = int(cfg["size_bytes"]) // world
    peer = (rank + PER_NODE) % world
    # Node 0: the bytes it sends (resident, like its tier files); node 1: memory touched before.
    sent = torch.ones(share, dtype=torch.uint8) if node == 0 else None
    warm_into = torch.zeros(share, dtype=torch.uint8) if node == 1 else None

    def wire(into: torch.Tensor | None) -> None:
        """One rank's share from each rank of node 0 to its peer on node 1, in the transfer's
        pieces; node 1 receives into ``into`` (``None``: memory allocated now, never touched)."""
        buf = sent if sent is not None else (into if into is not None else torch.empty(share, dtype=torch.uint8))
        op = dist.isend if node == 0 else dist.irecv
        ops = [dist.P2POp(op, buf[o : o + PIECE], peer) for o in range(0, share, PIECE)]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    root, tier = scratch / "root", shm / f"node{node}"
    mode = cfg["async_mode"]
    with_tier = distckpt.Checkpointer(str(root), local_dir=str(tier), keep_last=2, async_mode=mode)
    without = distckpt.Checkpointer(str(scratch / "plain"), keep_last=2, async_mode=mode)
    s3_ck = None
    if cfg.get("s3"):
        s3_ck = distckpt.Checkpointer(f"s3://{cfg['s3']['bucket']}/recovery", storage_options=cfg["s3"]["storage_options"])
        s3_ck.save(0, state)  # once, untimed: the S3 root's checkpoint of the same state
    # Warm: groups, writer processes, staging buffers (and how long a save takes, below).
    save_s = 0.0
    for ck in (with_tier, without):
        ck.save(0, state, blocking=False)
        stats = ck.wait()
        save_s = max(save_s, stats.total_s or 0.0)

    # A small DDP model for the training-cost rows.
    torch.manual_seed(0)
    h = cfg["train_hidden"]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, h)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(cfg["train_batch"], h)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    # The first load of a process pays one-off costs (imports, first reads): untimed, here.
    warm = blank()
    with distckpt.Checkpointer(str(root)) as ck:
        ck.load(warm, step=0)
    del warm
    for _ in range(3):
        train_step()
    t0 = time.perf_counter()
    for _ in range(10):
        train_step()
    steps_per_s = 10 / (time.perf_counter() - t0)
    # Every rank runs the same number of steps (DDP all-reduces in each): enough to outlast a
    # save; only those taken while the save is in flight are counted.
    n = torch.tensor([int(min(3000, max(20, 2.0 * save_s * steps_per_s)))])
    dist.broadcast(n, 0)
    n_during = int(n.item())

    step = 0
    for rep in range(cfg["repeats"]):
        # -- saves: blocked time, and training while the save is in flight ----------------------
        # ABBA: each method first in a repetition as often as the other (the first save after
        # the recoveries below was the slower: with 3 repetitions of AB/BA, one method went first
        # twice, which alone moved the blocked ratio from 1.07 to 1.2-1.4 between runs).
        pair = [("with_tier", with_tier), ("without_tier", without)]
        for name, ck in (pair + pair[::-1]) if rep % 2 == 0 else (pair[::-1] + pair):
            step += 1
            barrier()
            t0 = time.perf_counter()
            ck.save(step, state, blocking=False)
            blocked = time.perf_counter() - t0
            done, seconds = steps_while_in_flight(ck, train_step, n_during)
            ck.wait()
            barrier()
            records.append({"rep": rep, "step": step, "method": f"save_blocked_{name}", "time_s": blocked})
            records.append({"rep": rep, "method": f"train_{name}", "steps_per_s": done / seconds if done and seconds > 0 else None})
        # -- recoveries (fresh checkpointers: a restarted job) ----------------------------------
        # Node 1's tier as this rep's saves left it: a peer recovery streams into the load and
        # leaves node 1's tier without the step, so the "local" row restores it first (untimed).
        pristine = shm / "node1.pristine"
        on_rank0(lambda: (shutil.rmtree(pristine, ignore_errors=True), shutil.copytree(shm / "node1", pristine)))
        order = ["local", "peer", "disk_cold", "s3"]
        if rep % 2:
            order.reverse()
        for what in order:
            fresh = blank()
            if what == "local":
                on_rank0(lambda: (shutil.rmtree(shm / "node1", ignore_errors=True), shutil.copytree(pristine, shm / "node1")))
                ck = distckpt.Checkpointer(str(root), local_dir=str(tier))
            elif what == "peer":
                on_rank0(lambda: shutil.rmtree(shm / "node1", ignore_errors=True))
                ck = distckpt.Checkpointer(str(root), local_dir=str(tier))
            elif what == "disk_cold":
                on_rank0(lambda: drop_cache(root))
                ck = distckpt.Checkpointer(str(root))
            else:
                if s3_ck is None:
                    continue
                ck = distckpt.Checkpointer(f"s3://{cfg['s3']['bucket']}/recovery", storage_options=cfg["s3"]["storage_options"])
            ck._groups.get()  # a restarted job's group exists before it loads
            timed(rep, f"recover_{what}", lambda: ck.load(fresh))
            if what in ("local", "peer"):
                assert ck.last_load_report is not None and ck.last_load_report.tier == "local", what
                if what == "peer" and node == 1:
                    assert any(s != "local" for s in ck.last_load_report.sources.values())
            ck.close()
            for k, v in shards.items():  # what was loaded is the state: a cheap spot check
                if not torch.equal(fresh["model"][k].to_local() if hasattr(fresh["model"][k], "to_local") else fresh["model"][k], v.to_local()):
                    raise AssertionError(f"recover_{what}: {k} differs from the saved state")
                break
            if cfg["values"] and fresh["hyper"] != state["hyper"]:
                raise AssertionError(f"recover_{what}: the hyper-parameters differ from the saved ones")
        # -- the wire's floor under the peer row ------------------------------------------------
        for what in ("warm", "fresh") if rep % 2 == 0 else ("fresh", "warm"):
            timed(rep, f"wire_peer_{what}", lambda: wire(warm_into if what == "warm" else None))
        # The next rep's saves find node 1's tier as it was (its older steps, for retention).
        on_rank0(lambda: (shutil.rmtree(shm / "node1", ignore_errors=True), shutil.move(str(pristine), str(shm / "node1"))))
    for ck in (with_tier, without, s3_ck):
        if ck is not None:
            ck.close()
    return {"records": records, "state_bytes": built}


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    recs = per_rank[0]["records"]

    def med(method: str, key: str = "time_s") -> float | None:
        return median([r[key] for r in recs if r["method"] == method and r.get(key) is not None])

    def worst_blocked(name: str) -> float | None:
        # Blocked time: the slowest rank's, per save (two per repetition and method).
        by_save: dict[int, float] = {}
        for pr in per_rank:
            for r in pr["records"]:
                if r["method"] == name:
                    by_save[r["step"]] = max(by_save.get(r["step"], 0.0), r["time_s"])
        return median(list(by_save.values()))

    def train(name: str) -> float | None:
        vals = [r["steps_per_s"] for pr in per_rank for r in pr["records"] if r["method"] == name and r.get("steps_per_s")]
        return median(vals)

    with_s, without_s = train("train_with_tier"), train("train_without_tier")
    return {
        "recover_local_s": med("recover_local"),
        "recover_peer_s": med("recover_peer"),
        "recover_disk_cold_s": med("recover_disk_cold"),
        "recover_s3_s": med("recover_s3"),
        "save_blocked_with_tier_s": worst_blocked("save_blocked_with_tier"),
        "save_blocked_without_tier_s": worst_blocked("save_blocked_without_tier"),
        "train_ratio_with_tier": (with_s / without_s) if with_s and without_s else None,
        "wire_peer_warm_s": med("wire_peer_warm"),
        "wire_peer_fresh_s": med("wire_peer_fresh"),
    }


def targets(rows: dict[str, Any]) -> list[dict[str, Any]]:
    def ratio(a: str, b: str) -> float | None:
        return rows[b] / rows[a] if rows.get(a) and rows.get(b) else None

    out = []
    for name, value, target, higher in (
        ("peer_vs_s3", ratio("recover_peer_s", "recover_s3_s"), TARGETS["peer_vs_s3"], True),
        ("peer_vs_disk_cold", ratio("recover_peer_s", "recover_disk_cold_s"), TARGETS["peer_vs_disk_cold"], True),
        ("blocked_with_vs_without", ratio("save_blocked_without_tier_s", "save_blocked_with_tier_s"), TARGETS["blocked_with_vs_without"], False),
        ("train_ratio", rows.get("train_ratio_with_tier"), TARGETS["train_ratio"], True),
    ):
        met = None if value is None else (value >= target if higher else value <= target)
        out.append({"name": name, "value": value, "target": target, "higher_is_better": higher, "met": met})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Options --quick changes default to None: it fills only those the user left out.
    p.add_argument("--gib", type=positive_float, default=None, help="state size, all ranks together (default 1; --quick: 1/64)")
    p.add_argument("--repeats", type=positive_int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True, help="include the S3 row (moto)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (16 MiB, 1 repetition)")
    p.add_argument(
        "--values", action=argparse.BooleanOptionalAction, default=True,
        help="the state also holds an optimizer's and a scheduler's plain values (written once, read by every rank)",
    )  # fmt: skip
    p.add_argument("--dir", type=existing_dir, default=None,
                   help="an existing directory on disk to work in (a folder of this run's inside it; default benchmarks/.scratch)")
    add_json_arg(p, "recovery")
    args = p.parse_args(argv)
    resolve_quick(args, full={"gib": 1.0, "repeats": 3}, quick={"gib": 1 / 64, "repeats": 1})
    resolve_outputs(args, "recovery")
    sys.path.insert(0, str(REPO / "tests"))
    from dist_harness import run_ranks

    scratch, own_dir = run_folder(args.dir, "recovery")
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else scratch
    shm = Path(tempfile.mkdtemp(prefix=f"distckpt-recovery-{os.getpid()}-", dir=shm_base))
    server = None
    cfg: dict[str, Any] = {
        "dir": str(scratch),
        "shm": str(shm),
        "size_bytes": int(args.gib * GiB),
        "repeats": args.repeats,
        "train_hidden": 128 if args.quick else 512,
        "train_batch": 16 if args.quick else 64,
        # --quick (the suite's smoke run) writes from threads: 8 writer processes would be most of its time.
        "async_mode": "thread" if args.quick else "process",
        "values": args.values,
    }
    try:
        if args.s3:
            import logging

            from s3_server import S3Server

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            server = S3Server().start()
            cfg["s3"] = {"bucket": server.make_bucket("distckpt-recovery"), "storage_options": server.storage_options}
        t0 = time.perf_counter()
        per_rank = run_ranks(_rank, WORLD, scratch / "harness", cfg, timeout=1800, pg_timeout=900)
        wall = time.perf_counter() - t0
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        remove_scratch(scratch, own_dir)
    rows = summarize(per_rank)
    state_bytes = per_rank[0]["state_bytes"]
    result = {
        "benchmark": "recovery",
        "machine": machine_info(),
        # state_bytes: the tensors built (transformer-like shapes come close to, not exactly, --gib).
        "config": {"world_size": WORLD, "nodes": WORLD // PER_NODE, "state_bytes": state_bytes, "requested_bytes": cfg["size_bytes"], "repeats": args.repeats, "s3": args.s3, "local_dir": str(shm_base), "values": args.values},
        "rows": rows,
        "targets": targets(rows),
        "wall_s": round(wall, 1),
    }
    lines = [
        f"Recovery of {state_bytes / GiB:.2f} GiB at world size {WORLD} (2 simulated nodes), medians of {args.repeats}",
        "",
        "| row | value |",
        "|---|---:|",
    ]
    for k, v in rows.items():
        lines.append(f"| {k} | {'-' if v is None else f'{v:.3f}'} |")
    lines += ["", "| target | value | target | met |", "|---|---:|---:|---|"]
    for t in result["targets"]:
        val = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"| {t['name']} | {val} | {'>=' if t['higher_is_better'] else '<='} {t['target']} | {t['met']} |")
    return publish(result, "\n".join(lines), args.json)


if __name__ == "__main__":
    main()
