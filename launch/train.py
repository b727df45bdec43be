"""Train a small GPT on synthetic tokens with DDP, ZeRO or FSDP2, checkpointing with distckpt.

Every rank runs this file; ``torchrun`` sets RANK/LOCAL_RANK/WORLD_SIZE. ``--device auto``
(default): NCCL and ``cuda:LOCAL_RANK`` when this node has a GPU per rank, gloo and the CPU
otherwise (with one warning line where GPUs exist but are too few); ``--device cpu|cuda``
chooses (``cuda`` with too few GPUs is an error naming both counts). Every rank calls save/load
(they are collective); only rank 0 prints and writes ``--log-file``.

One node, 2 processes (CPU or GPU)::

    torchrun --standalone --nproc-per-node 2 launch/train.py --parallel fsdp --steps 200 \\
        --global-batch 12 --ckpt-dir /tmp/run1 --save-every 50 --async --log-file /tmp/run1.jsonl

Run the same command again with more ``--steps`` (or another ``--nproc-per-node`` dividing the
global batch) and it resumes from the newest committed checkpoint in ``--ckpt-dir``.

Two nodes (run on each, NODE_RANK 0 and 1, HOST:PORT reachable from both)::

    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id myjob \\
        --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \\
        launch/train.py --parallel zero --steps 1000 --global-batch 64 \\
        --ckpt-dir s3://bucket/run1 --save-every 100 --async --keep-last 3

Behaviour:

* The global batch ``--global-batch`` is the same at every world size (split evenly across
  ranks) and the sample order is global (:class:`distckpt.GlobalBatchSampler`), so a resumed job
  sees exactly the data the uninterrupted job would have seen, at any world size.
* Resuming at the same world size reproduces the uninterrupted losses bit for bit (dropout RNG
  included; on the CPU with the same ``OMP_NUM_THREADS`` per rank, which the launch scripts set
  to 1 unless it is set; under DDP and ZeRO a resume first runs one forward and backward whose
  gradients are dropped, so that DDP reduces in the bucket order the uninterrupted job had
  reached); at another world size (``--dropout 0``) they agree to floating-point reduction order.
* SIGTERM or SIGUSR1 on any rank: every rank finishes its step, saves synchronously and exits 0.
  ``torchrun`` forwards SIGTERM; add SIGUSR1 to ``--signals-to-handle`` for SLURM's warning.
* ``--local-dir /dev/shm/JOB`` (the same path on every node): every committed step is also kept
  in that node-local directory and each rank's files on the next node; a restart after a lost
  node (its directory empty) resumes from the peers' copies without reading the root, and says so.
* ``--log-file``: one JSON line per step from rank 0, ``{"step", "loss", "world_size"}`` (loss
  averaged over all ranks), appended across restarts (after a crash, steps since the last
  checkpoint appear again; the later line wins). Rank 0 prints steps/s and each save's blocking
  time and throughput (an async save's once it is committed, at the next save).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

# cuBLAS needs this before CUDA initializes to run deterministically.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # launch/model.py
sys.path.append(os.path.dirname(_HERE))  # a source checkout's distckpt, if it is not installed
import distckpt  # noqa: E402
from model import GPT, GPTConfig, MarkovTokens  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # allow_abbrev=False: "--weight 0.5" was taken for --weight-decay, and the resume's notice
    # that the flag does not apply (it looks for the flag as written) said nothing.
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0], allow_abbrev=False)
    p.add_argument("--parallel", choices=("ddp", "zero", "fsdp"), default="ddp")
    p.add_argument("--steps", type=int, required=True, help="train until this many optimizer steps in total")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    p.add_argument("--ckpt-dir", required=True, help="checkpoint root: local path or fsspec URL")
    p.add_argument("--save-every", type=int, default=100, help="save every K steps (and always at the last)")
    p.add_argument("--async", dest="async_save", action="store_true", help="save periodic checkpoints asynchronously")
    p.add_argument("--keep-last", type=int, default=None, help="keep only the newest k checkpoints")
    p.add_argument(
        "--local-dir", default=None,
        help="fast recovery tier: a node-local directory (a tmpfs such as /dev/shm/JOB) that keeps every "
        "committed step, its files also copied to the next node; a restart resumes from it (or from a peer "
        "node's copy after a lost node) before reading the checkpoint root",
    )  # fmt: skip
    p.add_argument("--local-keep", type=int, default=2, help="committed steps the fast recovery tier keeps per node")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: one GPU per rank if this node has enough, else the CPU (gloo)",
    )
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--log-file", default=None, help="rank 0 appends one JSON line per step")
    p.add_argument("--log-every", type=int, default=10, help="print progress every N steps")
    m = p.add_argument_group("model and data (defaults: ~3.4M parameters)")
    m.add_argument("--vocab", type=int, default=256)
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--d-model", type=int, default=256)
    m.add_argument("--n-layers", type=int, default=4)
    m.add_argument("--n-heads", type=int, default=4)
    m.add_argument("--num-samples", type=int, default=8192, help="size of the synthetic dataset")
    o = p.add_argument_group("optimizer")
    o.add_argument("--lr", type=float, default=3e-3)
    o.add_argument("--warmup", type=int, default=20)
    o.add_argument("--decay-steps", type=int, default=2000, help="cosine length (independent of --steps)")
    o.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep after each step (tests/demos of preemption)")
    args = p.parse_args(argv)
    # Checked here, as usage errors naming the flag: --log-every 0 passed and killed every rank
    # after its first step (modulo by zero), --seq-len 0 trained on NaN losses.
    bad = [f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}" for name, low in (
        ("steps", 0), ("warmup", 0), ("step_delay", 0), ("weight_decay", 0), ("save_every", 1), ("global_batch", 1),
        ("log_every", 1), ("vocab", 1), ("seq_len", 1), ("d_model", 1), ("n_layers", 1), ("n_heads", 1),
        ("num_samples", 1), ("decay_steps", 1), ("local_keep", 1),
    ) if not getattr(args, name) >= low]  # fmt: skip  (not >=: NaN fails it, NaN < low does not)
    if args.keep_last is not None and args.keep_last < 1:
        bad.append(f"--keep-last must be >= 1, got {args.keep_last}")
    if not 0 <= args.dropout < 1:
        bad.append(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.log_file:  # (rank 0 opens it after the process group and the load: a crash there hid it)
        folder = os.path.dirname(args.log_file) or "."  # (not normalised: "missing/../x" needs "missing")
        if args.log_file.endswith(("/", os.sep)) or os.path.isdir(args.log_file):
            bad.append(f"--log-file: {args.log_file} names a directory, not a file")
        elif os.path.exists(folder) and not os.path.isdir(folder):
            bad.append(f"--log-file: {folder} is not a directory")
        elif not os.path.isdir(folder):
            bad.append(f"--log-file: directory {folder} does not exist")
    if not 0 <= args.lr < math.inf:  # (NaN too; inf trained on NaN losses)
        bad.append(f"--lr must be finite and >= 0, got {args.lr}")
    if not 0 <= args.seed < 2**32:  # (torch's seeds are 64-bit: a larger one overflowed there)
        bad.append(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.num_samples >= 1 and args.global_batch >= 1 and args.num_samples < args.global_batch:
        bad.append(f"--num-samples ({args.num_samples}) must be at least --global-batch ({args.global_batch}): an epoch is whole global batches")
    if not args.ckpt_dir.strip():
        bad.append("--ckpt-dir must name a checkpoint root, got an empty string")
    elif args.log_file and os.path.abspath(args.log_file) == os.path.abspath(args.ckpt_dir):
        bad.append(f"--log-file {args.log_file} is the checkpoint root --ckpt-dir: name a file beside it")
    else:
        bad += _local_path_problems(args)
    if not math.isfinite(args.step_delay):  # inf would sleep for ever after the first step
        bad.append(f"--step-delay must be finite, got {args.step_delay}")
    if args.n_heads >= 1 and args.d_model % args.n_heads:
        bad.append(f"--n-heads ({args.n_heads}) must divide --d-model ({args.d_model})")
    if bad:
        p.error("; ".join(bad))
    return args


def _local_path_problems(args: argparse.Namespace) -> list[str]:
    """A local ``--ckpt-dir`` that is (or lies under) a file, and a ``--log-file`` inside a
    checkpoint step or the local tier: the first failed as a bare NotADirectoryError on every
    rank; the second appended its lines to whatever it named there (a step's manifest.json,
    which no command could read again)."""
    bad = []
    if "://" not in args.ckpt_dir:
        existing = os.path.abspath(args.ckpt_dir)
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            bad.append(f"--ckpt-dir {args.ckpt_dir}: {existing} is a file, not a folder (a checkpoint root is a folder)")
    if args.log_file:
        log = os.path.realpath(args.log_file)
        folder = os.path.dirname(log)
        places = [("--local-dir", args.local_dir, True)] if args.local_dir else []
        if "://" not in args.ckpt_dir:
            places.append(("--ckpt-dir", args.ckpt_dir, False))
        for flag, place, anywhere in places:
            root = os.path.realpath(place)
            inside = folder == root or folder.startswith(root.rstrip(os.sep) + os.sep)
            # In the root itself only a file a step could not be taken for (train.log, not step_5).
            if inside and (anywhere or folder != root or os.path.basename(log).startswith("step_")):
                bad.append(f"--log-file {args.log_file} lies inside {flag} {place} (a checkpoint's files): name a file outside it")
    return bad


def root_problem(ckpt_dir: str) -> str | None:
    """(each rank) Why a local checkpoint root cannot be written (made where missing), else
    ``None``; URLs are left to the store (a misspelled bucket is named by ``latest_step``)."""
    if "://" in ckpt_dir:
        return None
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or ckpt_dir})"
    if not os.access(ckpt_dir, os.W_OK | os.X_OK):
        return "no permission to write in it (or a read-only file system)"
    return None


#: Flags that change what the model computes or the schedule with the same weights: recorded in
#: every save's manifest (``train``), compared at a resume (other flags' changes are refused by
#: the load: shapes, the sampler's state).
RECORDED = ("n_heads", "dropout", "warmup", "decay_steps")


def resume_changes(args: argparse.Namespace, saved: object) -> tuple[list[str], list[str]]:
    """(refused, said): ``--n-heads`` changed since the save (the same weights split into other
    heads: a silently different model), and the schedule or dropout flags changed (applied, but
    the losses no longer repeat the saved run's); nothing for a checkpoint that records none."""
    if not isinstance(saved, dict):
        return [], []
    refused, said = [], []
    for name in RECORDED:
        if name in saved and saved[name] != getattr(args, name):
            flag = "--" + name.replace("_", "-")
            line = f"{flag} {getattr(args, name)!r} (the checkpoint's run had {saved[name]!r})"
            (refused if name == "n_heads" else said).append(line)
    return refused, said


# --------------------------------------------------------------------------------------------
# distributed setup
def pick_device(choice: str, local_rank: int, local_world: int, gpus: int) -> tuple[torch.device, str | None]:
    """The device of a rank and, where ``auto`` falls back to the CPU on a machine with GPUs,
    the warning to print (once per node). One GPU per rank or none: ranks sharing a GPU would
    fail in NCCL (``invalid device ordinal`` for the ranks beyond the GPUs)."""
    if choice == "cuda" and gpus < local_world:
        raise SystemExit(
            f"--device cuda: {local_world} rank(s) on this node need one GPU each, but {gpus} GPU(s) are visible "
            "(use fewer ranks per node, or --device cpu)"
        )
    if choice == "cuda" or (choice == "auto" and 0 < local_world <= gpus):
        return torch.device("cuda", local_rank), None
    warning = None
    if choice == "auto" and gpus:
        warning = (
            f"warning: {local_world} ranks on this node but {gpus} GPU(s): training on the CPU with gloo "
            "(--device cuda requires a GPU per rank; --device cpu silences this)"
        )
    return torch.device("cpu"), warning


def init_distributed(choice: str = "auto") -> tuple[int, int, int, torch.device]:
    """(rank, local_rank, world_size, device) from the torchrun environment; plain ``python`` = 1 rank."""
    if "RANK" not in os.environ:  # run without torchrun: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, warning = pick_device(choice, local_rank, local_world, gpus)
    if warning and local_rank == 0:
        print(f"[train] {warning}", flush=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))
    return rank, local_rank, world, device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(args: argparse.Namespace, world: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    cfg = GPTConfig(args.vocab, args.seq_len, args.d_model, args.n_layers, args.n_heads, args.dropout)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model: nn.Module = GPT(cfg).to(device)
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if args.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.parallel == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    return ddp, torch.optim.AdamW(ddp.parameters(), **adamw)


def settle_ddp_buckets(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """(every rank, after a resume, under DDP) One forward and backward whose gradients are
    dropped, under a forked random generator: DDP orders its gradient buckets by the order the
    first backward made gradients ready, and reduces in that order from the next step on. An
    uninterrupted job's step N+1 reduced in that order, a job resumed at step N in the initial
    one: with more than two gloo ranks a ring all-reduce then adds in another order, and the
    losses drifted by an ulp (seen at 4 ranks; FSDP has no such buckets). Costs one step's
    compute, once per start."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return
    with torch.random.fork_rng(devices=[x.device.index] if x.device.type == "cuda" else []):
        model.train()
        model(x, y).backward()
    for p in model.parameters():
        p.grad = None


def lr_lambda(warmup: int, decay_steps: int):
    """Linear warmup, then cosine down to 10% over ``decay_steps`` (then flat)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return f


# --------------------------------------------------------------------------------------------
# preemption
_preempted: list[str] = []


def _on_signal(signum: int, frame: Any) -> None:
    # A second Ctrl-C stops now (a step or a save that hangs). Under torchrun the terminal's
    # second Ctrl-C reaches only the agent, which then sends the ranks SIGTERM: after a SIGINT,
    # that is one too.
    if _preempted and (signum == signal.SIGINT or (signum == signal.SIGTERM and "SIGINT" in _preempted)):
        raise KeyboardInterrupt
    _preempted.append(signal.Signals(signum).name)


def install_preemption_handlers() -> None:
    """SIGTERM (torchrun forwards it), SIGINT (Ctrl-C, forwarded by torchrun and the launch
    scripts), SIGHUP (a closed terminal) and SIGUSR1 (SLURM's warning) only set a flag: the rank
    finishes its step, saves and exits 0. Ctrl-C killed every rank with KeyboardInterrupt,
    unsaved, though the launch scripts say each saves."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, _on_signal)


# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_preemption_handlers()
    rank, _, world, device = init_distributed(args.device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must divide evenly across {world} ranks")

    def say(msg: str) -> None:
        if rank == 0:
            try:
                print(f"[train] {msg}", flush=True)
            except OSError:  # a terminal hung up (SIGHUP): the save that follows must still run
                pass

    data = MarkovTokens(args.num_samples, args.seq_len, args.vocab, seed=args.seed)
    model, optim = build(args, world, device)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(args.warmup, args.decay_steps))
    sampler = distckpt.GlobalBatchSampler(len(data), args.global_batch, rank, world, seed=args.seed)
    torch.manual_seed(args.seed * 1_000_003 + 1 + rank)  # per-rank dropout stream (restored on resume)
    state = {"model": model, "optim": optim, "sched": sched, "sampler": sampler}

    try:
        ckpt = distckpt.Checkpointer(args.ckpt_dir, keep_last=args.keep_last, local_dir=args.local_dir, local_keep=args.local_keep)
    except ValueError as exc:  # (a root inside a committed step, a --local-dir inside the root ...)
        raise SystemExit(f"train.py: {exc}") from None
    n_params = sum(p.numel() for p in model.parameters())  # DTensor.numel() is the global size
    try:
        t = time.perf_counter()
        step = ckpt.load(state)
        report = ckpt.last_load_report
        tier = report is not None and report.tier == "local"
        say(
            f"resumed from step {step} of {args.ckpt_dir} at world size {world} in {time.perf_counter() - t:.2f}s"
            + (" (from the local tier)" if tier else "")
        )
        fetched = [f for f, source in report.sources.items() if source != "local"] if tier and report is not None else []
        if fetched and os.environ.get("LOCAL_RANK", "0") == "0":  # one line per node that lost its copy
            print(f"[train] rank {rank}: {len(fetched)} file(s) of step {step} fetched from a peer node", flush=True)
    except FileNotFoundError:
        # A misspelled bucket is no empty root: latest_step() names it here, on every rank,
        # instead of a fresh start that fails at its first save.
        ckpt.latest_step()
        step = 0
        say(f"no checkpoint in {args.ckpt_dir}: starting from scratch")
    except (ValueError, KeyError) as exc:
        # Another --global-batch, --seed, --num-samples (the sampler refuses its state) or model
        # size (shapes differ) than the checkpoint's: one line. Anything else stays a traceback.
        if not isinstance(exc, distckpt.StateMismatchError) and "sampler state has" not in str(exc):
            raise
        why = distckpt.errors.one_line(exc).split(" (tensors read before the failure")[0]
        raise SystemExit(f"train.py: cannot resume from {args.ckpt_dir}: {why}\n(start a new run with another --ckpt-dir, or resume with the flags it was saved with)") from None
    unwritable = root_problem(args.ckpt_dir)
    # Agreed: a root no rank can write failed only at the first save, --save-every steps of
    # training later, as a bare FileNotFoundError (a missing mount, a read-only tree).
    seen = torch.tensor([0.0 if unwritable is None else 1.0], device=device)
    dist.all_reduce(seen)
    if seen.item():
        raise SystemExit(f"train.py: --ckpt-dir {args.ckpt_dir} cannot be written" + (f": {unwritable}" if unwritable else " on some rank"))
    say(
        f"{args.parallel} on {world} x {device.type}, ~{n_params / 1e6:.2f}M params, global batch "
        f"{args.global_batch}, steps {step} -> {args.steps}, loss floor ~{data.entropy():.3f}"
    )
    log_file = open(args.log_file, "a") if rank == 0 and args.log_file else None

    def log_save(stats: distckpt.SaveStats, mode: str) -> None:
        tp = stats.throughput_gbps
        say(
            f"saved step {stats.step} ({mode}): blocked {stats.blocking_s:.3f}s, committed after "
            f"{stats.total_s or 0.0:.3f}s, {(stats.bytes_written or 0) / 1e6:.1f} MB"
            + (f", {tp * 1e3:.1f} MB/s" if tp else "")
        )

    def save(step: int, blocking: bool) -> None:
        done = ckpt.wait()  # commit the previous async save (if any) and report it
        if done is not None:
            log_save(done, "async")
        ckpt.save(step, state, blocking=blocking, metadata={"train": {name: getattr(args, name) for name in RECORDED}})
        if blocking:
            log_save(ckpt.last_save, "sync")  # type: ignore[arg-type]

    if step > 0:
        try:  # (every rank reads the step it loaded: all refuse alike)
            saved = ckpt.manifest(step).extra.get("train")
        except Exception:  # noqa: BLE001 - unreadable here (damaged, gone since): said as unrecorded
            saved = None
        if not isinstance(saved, dict):  # (saved by an earlier train.py: taken as given, and recorded from now on)
            say(f"step {step} records no {', '.join('--' + n.replace('_', '-') for n in RECORDED)}: not checked against this run's")
        refused, said = resume_changes(args, saved)
        if refused:
            raise SystemExit(
                f"train.py: cannot resume from {args.ckpt_dir}: {'; '.join(refused)}: the same weights would compute "
                "another model\n(start a new run with another --ckpt-dir, or resume with the flags it was saved with)"
            )
        for line in said:
            say(f"{line} applied from step {step}: the losses no longer repeat that run's")
        # The optimizer's and schedule's state come from the checkpoint: flags for them given
        # other values now do not apply (said, not silently dropped).
        named = {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv)}
        kept = {"--lr": (args.lr, sched.base_lrs[0]), "--weight-decay": (args.weight_decay, optim.param_groups[0]["weight_decay"])}
        for flag, (given, saved) in kept.items():
            if flag in named and given != saved:
                say(f"{flag} {given!r} not applied: resumed with the checkpoint's {saved!r} (its optimizer and schedule state)")
    if 0 < step < args.steps:
        x, y = data.batch([0] * (args.global_batch // world))
        settle_ddp_buckets(model, x.to(device), y.to(device))
    flags = torch.zeros(2, dtype=torch.float64, device=device)
    t_window, steps_window = time.perf_counter(), 0
    stopped_by = None
    while step < args.steps:
        x, y = data.batch(sampler.next_batch())
        model.train()
        loss = model(x.to(device), y.to(device))  # mean over local tokens; DDP/FSDP average grads
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        step += 1
        if args.step_delay:
            time.sleep(args.step_delay)

        # One collective per step: the global mean loss and "has any rank been signalled?".
        flags[0] = loss.detach().double()
        flags[1] = 1.0 if _preempted else 0.0
        dist.all_reduce(flags)
        mean_loss = float(flags[0].item() / world)
        if math.isnan(mean_loss):
            raise FloatingPointError(f"loss is NaN at step {step}")
        stop = flags[1].item() > 0
        if log_file is not None:
            log_file.write(json.dumps({"step": step, "loss": mean_loss, "world_size": world}) + "\n")
            log_file.flush()
        steps_window += 1
        if step % args.log_every == 0 or step == args.steps or stop:
            now = time.perf_counter()
            say(
                f"step {step}/{args.steps} loss {mean_loss:.4f} lr {sched.get_last_lr()[0]:.2e} "
                f"{steps_window / (now - t_window):.2f} steps/s"
            )
            t_window, steps_window = now, 0

        last = step == args.steps or stop
        if step % args.save_every == 0 or last:
            save(step, blocking=last or not args.async_save)
        if stop:
            stopped_by = _preempted[0] if _preempted else "a signal on another rank"
            break

    if step >= args.steps and stopped_by is None and ckpt.latest_step() != step:
        save(step, blocking=True)  # e.g. resumed past --steps without a checkpoint at the end
    ckpt.close()
    if stopped_by:
        say(f"preempted by {stopped_by}: saved step {step}, exiting 0; relaunch to resume")
    else:
        say(f"done at step {step}")
    if log_file is not None:
        log_file.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
