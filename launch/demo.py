"""Demo: train on 2 ranks with async saves, preempt it, resume on 3 ranks, show what happened.

    python launch/demo.py                 # ~3.4M-parameter GPT, CPU or GPU, a minute or two on CPU
    python launch/demo.py --quick         # tiny model, a few seconds

1. ``torchrun --nproc-per-node 2 launch/train.py --async ...``; once the log reaches
   ``--stop-at``, the torchrun agent gets SIGTERM (as from a scheduler): every rank finishes its
   step, saves synchronously and exits 0.
2. ``torchrun --nproc-per-node 3 ...`` with the same arguments resumes from that checkpoint,
   resharding model and optimizer, and continues with the same global batch and data order.
3. Prints the loss curve of both phases (ASCII) and each save's blocking time and throughput.

Uses only what is installed (torch, distckpt) and a temporary directory (``--workdir`` keeps it,
and a run that fails keeps it for the transcripts its error names).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAVE_RE = re.compile(
    r"saved step (\d+) \((\w+)\): blocked ([\d.]+)s, committed after ([\d.]+)s, ([\d.]+) MB(?:, ([\d.]+) MB/s)?"
)
QUICK = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--vocab", "64", "--num-samples", "1024"]
FULL = ["--seq-len", "64", "--num-samples", "4096"]  # d_model 256, 4 layers, vocab 256: ~3.3M params


def torchrun(nproc: int, args: list[str], transcript: Path, stop_at: int | None = None, log: Path | None = None) -> str:
    """Run train.py on ``nproc`` local ranks, echoing rank 0's lines; SIGTERM at step ``stop_at``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(HERE / "train.py"), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"\n$ torchrun --standalone --nproc-per-node={nproc} launch/train.py {' '.join(args)}", flush=True)
    with transcript.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sent = False
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.startswith("[train]"):
                print("   " + line.rstrip(), flush=True)
            if stop_at is not None and not sent and log is not None and _last_step(log) >= stop_at:
                print(f"   >>> step {stop_at} reached: sending SIGTERM to torchrun (preemption)", flush=True)
                proc.send_signal(signal.SIGTERM)
                sent = True
        rc = proc.wait()
    text = transcript.read_text()
    if stop_at is None and rc != 0:
        sys.exit(f"torchrun failed (exit {rc}); see {transcript}:\n{text[-3000:]}")
    if stop_at is not None and "exiting 0" not in text:
        sys.exit(f"the preempted run did not save and exit cleanly; see {transcript}:\n{text[-3000:]}")
    return text


def _last_step(log: Path) -> int:
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def ascii_curve(points: list[tuple[int, float, int]], width: int = 72, height: int = 16) -> str:
    """Steps on x, loss on y; each point marked by the world size that computed it."""
    steps = [s for s, _, _ in points]
    vals = [v for _, v, _ in points]
    lo, hi = min(vals), max(vals)
    s0, s1 = min(steps), max(steps)
    grid = [[" "] * width for _ in range(height)]
    for s, v, w in points:
        x = round((s - s0) / max(1, s1 - s0) * (width - 1))
        y = round((hi - v) / max(1e-12, hi - lo) * (height - 1))
        grid[y][x] = str(w) if w < 10 else "#"
    rows = []
    for i, row in enumerate(grid):
        label = hi - (hi - lo) * i / (height - 1)
        rows.append(f"{label:8.3f} |" + "".join(row))
    rows.append(" " * 9 + "+" + "-" * width)
    rows.append(" " * 10 + f"step {s0}".ljust(width - len(f"step {s1}")) + f"step {s1}")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--stop-at", type=int, default=None, help="preempt phase 1 here (default: steps/2)")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--parallel", choices=("ddp", "zero", "fsdp"), default="fsdp")
    p.add_argument("--global-batch", type=int, default=12, help="must divide by 2 and 3")
    p.add_argument("--quick", action="store_true", help="tiny model (a few seconds)")
    p.add_argument("--workdir", default=None, help="keep checkpoints and logs here (default: a temp dir)")
    a = p.parse_args()
    stop_at = a.steps // 2 if a.stop_at is None else a.stop_at
    # (A --stop-at at or past --steps, or a --workdir of an earlier demo, ended a run that had
    # done nothing wrong with "the preempted run did not save and exit cleanly".)
    if not 0 < stop_at < a.steps:
        p.error(f"--stop-at must be in (0, --steps={a.steps}), got {stop_at}: phase 1 is preempted there")
    if a.global_batch < 6 or a.global_batch % 6:
        p.error(f"--global-batch must be a positive multiple of 6 (split over 2, then 3 ranks), got {a.global_batch}")
    if a.workdir and any((Path(a.workdir) / name).exists() for name in ("ckpt", "loss.jsonl")):
        p.error(f"--workdir {a.workdir} holds an earlier demo's ckpt/ or loss.jsonl: pass a new folder (or remove them)")

    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="distckpt-demo-"))
    code = _run(a, work, stop_at)  # (a failed run exits naming its transcript there: kept)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return code


def _run(a: argparse.Namespace, work: Path, stop_at: int) -> int:
    work.mkdir(parents=True, exist_ok=True)
    ckpt, log = work / "ckpt", work / "loss.jsonl"
    args = [
        "--parallel", a.parallel, "--steps", str(a.steps), "--global-batch", str(a.global_batch),
        "--ckpt-dir", str(ckpt), "--save-every", str(a.save_every), "--async", "--keep-last", "3",
        "--dropout", "0", "--log-file", str(log), "--log-every", str(max(1, a.save_every // 2)),
        *(QUICK if a.quick else FULL),
    ]  # fmt: skip
    print(f"distckpt demo in {work}")
    t0 = time.perf_counter()
    first = torchrun(2, [*args, "--step-delay", "0.05"] if a.quick else args, work / "phase1.txt", stop_at, log)
    second = torchrun(3, args, work / "phase2.txt")

    records = [json.loads(line) for line in log.read_text().splitlines()]
    points = [(r["step"], r["loss"], r["world_size"]) for r in records]
    stopped = max(s for s, _, w in points if w == 2)
    print(f"\nLoss per step (digit = world size that computed it; preempted at step {stopped}, resumed on 3 ranks):")
    print(ascii_curve(points))

    print("\nSaves (rank 0's view):")
    print(f"  {'step':>6} {'ranks':>5} {'mode':>5} {'blocked s':>10} {'total s':>8} {'MB':>7} {'MB/s':>8}")
    for ranks, text in ((2, first), (3, second)):
        for m in SAVE_RE.finditer(text):
            step, mode, blocked, total, mb, mbps = m.groups()
            print(f"  {step:>6} {ranks:>5} {mode:>5} {float(blocked):>10.3f} {float(total):>8.3f} {float(mb):>7.1f} {mbps or '-':>8}")
    print(f"\nkept checkpoints: {sorted(d.name for d in ckpt.iterdir() if d.name.startswith('step_'))}")
    print(f"first loss {points[0][1]:.4f} -> last {points[-1][1]:.4f} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
