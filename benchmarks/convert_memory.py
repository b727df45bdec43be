"""Peak memory of ``distckpt convert`` on a ~2 GiB checkpoint, against DCP's naive converter.

Builds a ~2 GiB fp32 model checkpoint (29 tensors: a 256 MiB embedding and 28 x 64 MiB linear
weights, plus biases) with :class:`distckpt.Checkpointer` under a temporary directory in /tmp,
then converts it in a child process per case and reads the child's peak resident set size from
``os.wait4`` (``ru_maxrss``). Cases:

* ``distckpt convert --to safetensors`` and ``--to torch --model-only`` (streaming);
* ``distckpt convert --to safetensors --dtype bf16``;
* DCP's ``format_utils.dcp_to_torch_save`` (whole state in memory), with ``--naive``.

Target (issue 7): peak RSS under 600 MB. A bare ``import torch`` plus DCP is ~280 MB here with
the CPU build; a CUDA build holds ~260 MB more before converting anything (~540 MB), so the
target is the larger of 600 MB and that baseline (measured in each run) plus 320 MB: what the
converter itself may hold stays the same under every build.

    python benchmarks/convert_memory.py [--naive] [--gib 2]     # --quick: a 64 MiB smoke run

Prints a table and writes ``benchmarks/results/convert_memory.json`` (and ``.md``), like the
other benchmarks (``--json PATH`` elsewhere; a ``--quick`` run without ``--json``: a new temporary
folder, printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_json_arg, existing_dir, exit_on_sigterm, machine_info, positive_float, publish, resolve_outputs, resolve_quick  # noqa: E402

TARGET_MB = 600
#: What the converter may hold above ``import torch`` + DCP (600 MB less the CPU build's ~280 MB).
OVER_BASELINE_MB = 320
HERE = os.path.dirname(os.path.abspath(__file__))


def build_checkpoint(root: str, gib: float) -> tuple[int, int]:
    """Save a model of about ``gib`` GiB; returns (bytes of tensors, bytes of largest tensor)."""
    import torch
    from torch import nn

    from distckpt import Checkpointer

    warnings.simplefilter("ignore")
    vocab = min(65536, max(1024, int(gib * 32768)))  # a 256 MiB embedding from 2 GiB on
    n_linear = max(1, int(round((gib * 1024 - vocab / 256) / 64)))
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(vocab, 1024), *[nn.Linear(4096, 4096) for _ in range(n_linear)])
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05, generator=gen)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    ckpt = Checkpointer(root, save_rng=False)
    ckpt.save(0, {"model": model})
    ckpt.close()
    return total, largest


def run_child(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd``; its wall time and peak RSS (MB, from the kernel's accounting of that child)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # SIGTERM or Ctrl-C: the child must not write on into a folder being removed
        proc.kill()
        proc.wait()
        raise
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.strip()[-2000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss * 1024 / 1e6, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # --gib defaults to None: --quick fills it only where the user left it out.
    parser.add_argument("--gib", type=positive_float, default=None, help="checkpoint size (default 2; --quick: 0.0625)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run (--gib 0.0625)")
    parser.add_argument("--naive", action="store_true", help="also run DCP's dcp_to_torch_save for contrast")
    parser.add_argument("--dir", type=existing_dir, default="/tmp",
                        help="an existing dir for the temporary checkpoint (a folder of this run's inside it; not /dev/shm)")
    add_json_arg(parser, "convert_memory")
    parser.add_argument("--build", metavar="ROOT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    resolve_quick(args, full={"gib": 2.0}, quick={"gib": 0.0625})
    if args.build:
        print(json.dumps(build_checkpoint(args.build, args.gib)))
        return 0

    resolve_outputs(args, "convert_memory")
    py = sys.executable
    exit_on_sigterm()  # a killed run left its whole checkpoint (2 GiB by default) in --dir
    work = tempfile.mkdtemp(prefix="distckpt-convert-bench-", dir=args.dir)
    try:
        root = os.path.join(work, "ckpt")
        t0 = time.perf_counter()
        # Built in a child: this process must stay small, since a forked child starts out with
        # the parent's resident pages counted in its ru_maxrss.
        built = subprocess.run([py, __file__, "--build", root, "--gib", str(args.gib)], check=True, capture_output=True, text=True)
        total, largest = json.loads(built.stdout.strip().splitlines()[-1])
        print(f"checkpoint: {total / 2**30:.2f} GiB of tensors, largest {largest / 2**20:.0f} MiB, saved in {time.perf_counter() - t0:.1f}s", flush=True)

        # Measured in quick runs too: the target depends on it (a CUDA build's import is larger).
        baseline = run_child([py, "-c", "import torch, torch.distributed.checkpoint, distckpt.tools.convert"])
        target_mb = max(TARGET_MB, baseline["peak_rss_mb"] + OVER_BASELINE_MB)
        cases: list[tuple[str, list[str], str]] = [
            ("import torch + distckpt (baseline)", [], ""),
            ("distckpt convert --to safetensors", ["--to", "safetensors"], "out.safetensors"),
            ("distckpt convert --to safetensors --dtype bf16", ["--to", "safetensors", "--dtype", "bf16"], "out_bf16.safetensors"),
            ("distckpt convert --to torch --model-only", ["--to", "torch", "--model-only"], "out.pt"),
        ]
        if args.quick:  # a smoke run: one conversion per format (each case is a fresh process)
            cases = [c for c in cases if c[1] and "--dtype" not in c[1]]
        results = []
        for name, extra, out_name in cases:
            if not extra:
                res = baseline
            else:
                out = os.path.join(work, out_name)
                res = run_child([py, "-m", "distckpt", "convert", os.path.join(root, "step_000000000"), *extra, out, "--quiet"])
                res["output_bytes"] = os.path.getsize(out)
                os.remove(out)
            res["case"] = name
            results.append(res)
            print(f"  {name}: {res}", flush=True)
        if args.naive:
            out = os.path.join(work, "naive.pt")
            code = (
                "import warnings; warnings.simplefilter('ignore');"
                "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save;"
                f"dcp_to_torch_save({os.path.join(root, 'step_000000000')!r}, {out!r})"
            )
            res = run_child([py, "-c", code])
            res["output_bytes"] = os.path.getsize(out)
            res["case"] = "DCP format_utils.dcp_to_torch_save (naive)"
            os.remove(out)
            results.append(res)
            print(f"  naive: {res}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lines = [
        f"Converting a {total / 2**30:.2f} GiB checkpoint (largest tensor {largest / 2**20:.0f} MiB); target: peak RSS under {target_mb:.0f} MB",
        "",
        "| case | peak RSS MB | wall s | GB/s | |",
        "|---|---:|---:|---:|---|",
    ]
    for r in results:
        gbps = f"{total / r['wall_s'] / 1e9:.2f}" if "output_bytes" in r else "-"
        verdict = "" if "output_bytes" not in r else ("ok" if r["peak_rss_mb"] < target_mb else "OVER")
        if r["case"].endswith("(naive)"):
            verdict = "(contrast)"
        lines.append(f"| {r['case']} | {r['peak_rss_mb']:.1f} | {r['wall_s']:.2f} | {gbps} | {verdict} |")
    streaming = [r for r in results if r["case"].startswith("distckpt convert")]
    result = {
        "benchmark": "convert_memory",
        "machine": machine_info(),
        "config": {"gib": args.gib, "naive": args.naive, "dir": args.dir},
        "checkpoint_tensor_bytes": total,
        "largest_tensor_bytes": largest,
        "target_peak_rss_mb": target_mb,
        "all_streaming_under_target": all(r["peak_rss_mb"] < target_mb for r in streaming),
        "results": results,
    }
    publish(result, "\n".join(lines), args.json)
    return 0 if result["all_streaming_under_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
