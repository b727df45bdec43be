"""GPU save/load benchmark: distckpt beside plain DCP and the hardware's floors, in one run.

usage::

    python benchmarks/gpu.py                      # one GPU, ~4.0 GB of fp32 model + AdamW state
    python benchmarks/gpu.py --nproc 8            # one process per GPU, each with its own state
    python benchmarks/gpu.py --device cpu --size-gb 0.05 --repeats 1   # anywhere
    python benchmarks/gpu.py --quick              # a smoke run: tiny state, 1 repeat, results in a temporary folder

Each process holds a transformer-like fp32 model (``Linear(d, d)`` + GELU blocks) with AdamW
state on its device, trains a few steps, then times, alternating methods within each repeat
(this benchmark's machines are shared: only ratios within one run mean anything):

* floors: ``d2h_floor_s`` (every state tensor into pinned host buffers), ``raw_write_s`` (those
  bytes, one file, one stream, fsync), ``raw_write_parallel_s`` (the same bytes from
  ``--threads`` threads into as many files, fsync), ``raw_read_h2d_s`` (the files read back into
  pinned buffers and copied to the device);
* ``distckpt_sync_s`` / ``dcp_sync_s``: a blocking save (``distckpt_sync_unproven_s``: with
  ``verify_staging=False``, what proving each device-to-host copy costs). ``dcp_sync_s`` is plain
  DCP as a user calls it, ``dcp.save(state, checkpoint_id=path)``: its default ``FileSystemWriter``,
  one writer thread (issue 32's "plain DCP" and the target's baseline); ``dcp_sync_same_threads_s``
  is DCP's ``FileSystemWriter`` with ``thread_count=--threads``, distckpt's thread count
  (informational, no target): what of the difference is the thread count. ``distckpt_load_s`` /
  ``dcp_load_s``: a load at the same world size, into the live objects, whose every bit was set
  first (untimed); the benchmark stops unless a load restored every tensor (the optimizer's step
  counters too) bit for bit, by name (against copies kept on the GPU where it has room for them,
  else in host memory); ``distckpt_sync_ab_chunk_s`` (``--ab-proof-chunk N``): the
  proven save again, its proof's host digest in NumPy calls of N elements;
* ``distckpt_async_blocked_first_s`` (a new Checkpointer's first async save, after
  ``prepare_staging(state)`` was called before the training steps that precede it, as the README
  recommends; ``distckpt_async_blocked_first_unprepared_s``: without it, informational, with
  ``--unprepared-repeats`` samples, 1 by default),
  ``distckpt_async_blocked_steady_s`` (its second and third), ``dcp_async_blocked_steady_s``
  (after one untimed first ``dcp.async_save`` of the process); a new prepared Checkpointer per
  repeat, so each of these rows has ``--repeats`` samples or more;
* ``train_ratio_distckpt`` / ``train_ratio_dcp``: training steps/s while an async save runs in the
  background over steps/s without one (the baseline never taken while ``prepare_staging`` still
  reserves memory in the background);
* ``phases`` in the JSON and a table: each kind of save's ``SaveStats.phases`` (medians).

Rows are medians over ``--repeats`` (>= 3 for published numbers). Results go to ``--json`` (alias
``--out``; default ``benchmarks/results/gpu.json``, with ``--quick`` a new temporary folder):
``device``, ``torch``, ``state_bytes``, ``dir``, ``rows`` and the raw samples, and a markdown table
beside it (.md); the process count, threads and sizes are recorded too. The targets (issue 32) are
printed with each ratio. The files go into a folder made for this run inside ``--dir`` (an
existing directory; default ``benchmarks/.scratch``), removed at the end: nothing else in
``--dir`` is touched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import _common  # noqa: E402 - this checkout's distckpt on the path, unless PYTHONPATH names another


#: The phases the table shows (all are in the JSON): an async save blocks for prepare + stage.
_SHOWN = ("prepare", "stage", "verify_staging", "write", "serialize", "checksum", "io_write", "fsync",
          "d2h_issue", "d2h_wait", "proof_wait", "commit", "total_s")  # fmt: skip


def _bits(t: Any) -> Any:
    """``t``'s elements as same-width integers (compared, filled), whatever its dtype."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _phases(stats: Any) -> dict[str, float]:
    """A save's ``SaveStats``: its blocked time and phases (``prepare`` and ``stage`` are what an
    async save blocks for), in seconds."""
    if stats is None:
        return {}
    return {"blocking_s": stats.blocking_s, "total_s": stats.total_s, **stats.phases}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: Any) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


class Bench:
    """One process's state, its floors and the methods timed on it."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        import torch
        from torch import nn

        self.torch, self.args, self.rank = torch, args, rank
        self.device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        d = args.width
        layers = max(1, round(args.size_gb * 1e9 / (3 * 4 * d * d)))  # fp32 weights + 2 Adam moments
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Sequential(nn.Linear(d, d, bias=False), nn.GELU()) for _ in range(layers)]).to(self.device)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=self.device.type == "cuda")
        self.x = torch.randn(args.batch, d, device=self.device)
        for _ in range(2):
            self.step()
        self.tensors = self.live()
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        pin = self.device.type == "cuda"
        self.pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in self.tensors]
        # Inside the folder main() made for this run (args.run_dir), never a folder of --dir
        # itself: what the user keeps there is not this benchmark's to delete.
        self.dir = Path(args.run_dir) / f"rank{rank}"
        self.dir.mkdir(parents=True)
        self.n = 0
        self.phases: dict[str, list[dict[str, float]]] = {}  # SaveStats.phases per kind of save
        self.t0 = time.perf_counter()

    def log(self, what: str) -> None:
        """One line as soon as it is known: a run cut short by a device's time limit still tells."""
        print(f"[{self.rank} +{time.perf_counter() - self.t0:.0f}s] {what}", flush=True)

    def record(self, kind: str, stats: Any) -> None:
        """Keep (and print) the phases of one save of ``kind``."""
        p = _phases(stats)
        self.phases.setdefault(kind, []).append(p)
        self.log(f"phases {kind}: " + " ".join(f"{k}={v:.3f}" for k, v in p.items()))

    def live(self) -> list[Any]:
        """The state's tensors with data (not the 0-dim step counters), as the model and optimizer
        hold them now (a load may replace the optimizer's), in :meth:`named`'s order: parameter
        order, which a load cannot change, so ``self.pinned`` stays paired with them."""
        return [t for t in self.named().values() if t.dim()]

    def named(self) -> dict[str, Any]:
        """Every tensor of the state by name (parameters, then each one's optimizer state, the
        0-dim ``step`` counters too), as the objects hold them now."""
        torch = self.torch
        out = {}
        for name, p in self.model.named_parameters():
            out[name] = p.detach()
            for k, v in sorted(self.optim.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    out[f"{name}/{k}"] = v
        return out

    def scrambled(self) -> dict[str, Any]:
        """Host copies of the state's tensors, then every bit of the live ones set (no saved
        value is all ones: NaN payloads with every bit set do not come out of arithmetic): a
        load that skipped or misplaced anything is caught by :meth:`check_restored`. Untimed."""
        keep = self.expected_device()
        expected = {k: t.to(keep, copy=True) for k, t in self.named().items()}
        for t in self.named().values():
            _bits(t).fill_(-1)
        return expected

    def expected_device(self) -> Any:
        """Where :meth:`scrambled` keeps its copies: beside the state on the GPU when it has room
        for them (comparing there takes milliseconds; a host copy and comparison of a 4 GB state
        took ~5 s per load on the H100 disk runs of 2026-11-27), else host memory."""
        torch = self.torch
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if free >= 2 * self.state_bytes + (2 << 30):  # (a load's own buffers beside them)
                return self.device
        return torch.device("cpu")

    def check_restored(self, expected: dict[str, Any], who: str) -> None:
        """Stop the benchmark unless the state equals ``expected`` bit for bit, tensor by name."""
        torch = self.torch
        now = self.named()
        bad = [k for k in expected if k not in now or not torch.equal(_bits(now[k].to(expected[k].device)), _bits(expected[k]))]
        if bad or len(now) != len(expected):
            raise SystemExit(f"{who}: the load restored wrong values in {len(bad)}/{len(expected)} tensors, e.g. {bad[:3]}")
        self.tensors = self.live()  # a load may have replaced the optimizer's tensors

    def step(self) -> None:
        torch = self.torch
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(self.x).float().pow(2).mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optim}

    def fresh(self, name: str) -> Path:
        self.n += 1
        path = self.dir / f"{name}-{self.n}"
        shutil.rmtree(path, ignore_errors=True)
        return path

    # -- floors
    def d2h(self) -> None:
        for h, t in zip(self.pinned, self.tensors):
            h.copy_(t, non_blocking=True)

    def raw_write(self, parts: int) -> list[Path]:
        files = [self.fresh("raw") for _ in range(parts)]
        shares = [self.pinned[i::parts] for i in range(parts)]

        def write(path: Path, share: list[Any]) -> None:
            with open(path, "wb") as f:
                for h in share:
                    f.write(memoryview(h.view(-1).view(self.torch.uint8).numpy()))
                f.flush()
                os.fsync(f.fileno())

        threads = [threading.Thread(target=write, args=(p, s)) for p, s in zip(files, shares)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return files

    def raw_read_h2d(self, files: list[Path]) -> None:
        parts = len(files)
        for i, path in enumerate(files):
            with open(path, "rb") as f:
                for h, t in zip(self.pinned[i::parts], self.tensors[i::parts]):
                    f.readinto(memoryview(h.view(-1).view(self.torch.uint8).numpy()))
                    t.copy_(h, non_blocking=True)

    # -- distckpt and DCP
    def distckpt_sync(self, verify_staging: bool | str = "auto", kind: str | None = None) -> None:
        import distckpt

        root = str(self.fresh("distckpt"))
        with distckpt.Checkpointer(root, thread_count=self.args.threads, verify_staging=verify_staging) as ckpt:
            ckpt.save(self.n, self.state())
        self.last_distckpt = ckpt.storage.path
        self.record(kind or f"sync_verify_staging_{verify_staging}", ckpt.last_save)

    def with_proof_chunk(self, chunk: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` with the sync save's proof digesting in NumPy calls of ``chunk`` elements."""
        from distckpt.save import d2h

        kept, d2h.PROOF_CHUNK = d2h.PROOF_CHUNK, chunk
        try:
            return fn()
        finally:
            d2h.PROOF_CHUNK = kept

    def distckpt_load(self) -> None:
        import distckpt

        with distckpt.Checkpointer(self.last_distckpt, thread_count=self.args.threads) as ckpt:
            ckpt.load(self.state())

    def dcp_sync(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        path = self.fresh("dcp")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        self.last_dcp = path

    def dcp_sync_same_threads(self) -> None:
        """DCP's save with ``--threads`` writer threads, as distckpt gets (``dcp_sync`` is plain
        DCP's default, one thread). No load reads it: the caller removes it, untimed."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        path = self.fresh("dcp-threads")
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(str(path), thread_count=self.args.threads))
        self.last_dcp_threads = path

    def dcp_load(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=str(self.last_dcp))
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def steps_per_s(self, n: int) -> float:
        _sync(self.device)
        t = time.perf_counter()
        for _ in range(n):
            self.step()
        _sync(self.device)
        return n / (time.perf_counter() - t)

    def async_runs(self, repeats: int) -> dict[str, list[float]]:
        """First and steady blocked times of one Checkpointer, DCP's steady blocked time, and
        training speed during each background save."""
        import distckpt
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        out: dict[str, list[float]] = {
            k: [] for k in ("first", "unprepared", "steady", "dcp_steady", "train_distckpt", "train_dcp", "train_base")
        }

        def add(key: str, value: float) -> None:
            out[key].append(value)
            self.log(f"async {key} {value:.4f}")

        # Informational (no target): each sample waits for a whole background save at close.
        for _ in range(self.args.unprepared_repeats):
            with distckpt.Checkpointer(str(self.fresh("first")), thread_count=self.args.threads) as cold:
                t = time.perf_counter()
                cold.save(0, self.state(), blocking=False)
                add("unprepared", time.perf_counter() - t)
            shutil.rmtree(cold.storage.path, ignore_errors=True)
        # Plain DCP's first async save in this process pays its one-off costs: untimed, as
        # distckpt's first saves above are measured apart from its steady ones.
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        path = self.fresh("dcp-async")
        dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path)).result()
        shutil.rmtree(path, ignore_errors=True)
        # A new, prepared Checkpointer per repeat (so that the first save has `repeats` samples
        # too), saving three times: its first save, then two steady ones (they reuse its
        # buffers). Plain DCP's async save runs once per repeat, after the second.
        ckpt = None
        for i in range(3 * repeats):
            first, with_dcp = i % 3 == 0, i % 3 == 1
            if first:
                if ckpt is not None:
                    ckpt.close()
                    shutil.rmtree(ckpt.storage.path, ignore_errors=True)
                ckpt = distckpt.Checkpointer(str(self.fresh("async")), keep_last=1, thread_count=self.args.threads)
                ckpt.prepare_staging(self.state())  # reserved while the steps below run
            base = self.steps_per_s(self.args.train_steps)
            if not first:  # (not while prepare_staging still reserves in the background)
                add("train_base", base)
            t = time.perf_counter()
            ckpt.save(i, self.state(), blocking=False)
            add("first" if first else "steady", time.perf_counter() - t)
            speed = self.steps_per_s(self.args.train_steps)
            still = ckpt.in_flight
            stats = ckpt.wait()
            self.record("async_first" if first else "async_steady", stats)
            if not first and still:  # the save was still writing through the whole measurement
                add("train_distckpt", speed)
            if not with_dcp:
                continue
            model_sd, optim_sd = get_state_dict(self.model, self.optim)
            path = self.fresh("dcp-async")
            t = time.perf_counter()
            future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
            blocked = time.perf_counter() - t
            speed = self.steps_per_s(self.args.train_steps)
            still = not future.done()
            future.result()
            add("dcp_steady", blocked)
            if still:
                add("train_dcp", speed)
            shutil.rmtree(path, ignore_errors=True)
        if ckpt is not None:
            ckpt.close()
        return out


def run(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """One process: every measurement (of ``--parts``), methods alternated within each repeat."""
    b = Bench(args, rank)
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)
        b.log(f"{name} {value:.4f}")

    for _ in range(args.repeats):
        add("d2h_floor_s", _timed(b.d2h, b.device))
        if "sync" not in args.parts:
            continue
        files: list[Path] = []
        add("raw_write_s", _timed(lambda: files.extend(b.raw_write(1)), b.device))
        add("raw_read_h2d_s", _timed(lambda: b.raw_read_h2d(files), b.device))
        for f in files:
            f.unlink()
        files = []
        add("raw_write_parallel_s", _timed(lambda: files.extend(b.raw_write(args.threads)), b.device))
        for f in files:
            f.unlink()
        # What proving each device-to-host copy costs a sync save (verify_staging, distckpt/save/d2h.py).
        add("distckpt_sync_unproven_s", _timed(lambda: b.distckpt_sync(verify_staging=False), b.device))
        shutil.rmtree(b.last_distckpt, ignore_errors=True)
        add("distckpt_sync_s", _timed(b.distckpt_sync, b.device))
        if args.ab_proof_chunk:
            # The same proven save with the proof's host digest in calls of another size: an A/B
            # of distckpt.save.d2h.PROOF_CHUNK within this run.
            shutil.rmtree(b.last_distckpt, ignore_errors=True)

            def ab_save() -> None:
                b.with_proof_chunk(args.ab_proof_chunk, lambda: b.distckpt_sync(kind="sync_ab_chunk"))

            add("distckpt_sync_ab_chunk_s", _timed(ab_save, b.device))
        add("dcp_sync_s", _timed(b.dcp_sync, b.device))
        if b.args.dcp_same_threads:
            add("dcp_sync_same_threads_s", _timed(b.dcp_sync_same_threads, b.device))
            shutil.rmtree(b.last_dcp_threads, ignore_errors=True)
        # Each load starts from a scrambled state and must restore the saved values exactly.
        expected = b.scrambled()
        add("distckpt_load_s", _timed(b.distckpt_load, b.device))
        b.check_restored(expected, "distckpt")
        del expected
        expected = b.scrambled()
        add("dcp_load_s", _timed(b.dcp_load, b.device))
        b.check_restored(expected, "plain DCP")
        del expected
        shutil.rmtree(b.last_distckpt, ignore_errors=True)
        shutil.rmtree(b.last_dcp, ignore_errors=True)
    if "async" not in args.parts:
        shutil.rmtree(b.dir, ignore_errors=True)
        return _result(b, rank, samples)
    runs = b.async_runs(args.repeats)
    samples["distckpt_async_blocked_first_s"] = runs["first"]
    if runs["unprepared"]:  # (--unprepared-repeats 0: no such row)
        samples["distckpt_async_blocked_first_unprepared_s"] = runs["unprepared"]
    samples["distckpt_async_blocked_steady_s"] = runs["steady"]
    samples["dcp_async_blocked_steady_s"] = runs["dcp_steady"]
    base = statistics.median(runs["train_base"])
    samples["train_ratio_distckpt"] = [s / base for s in runs["train_distckpt"]] or [float("nan")]
    samples["train_ratio_dcp"] = [s / base for s in runs["train_dcp"]] or [float("nan")]
    shutil.rmtree(b.dir, ignore_errors=True)
    return _result(b, rank, samples)


def _result(b: Bench, rank: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    import torch

    return {
        "rank": rank,
        "state_bytes": b.state_bytes,
        "samples": samples,
        # Medians of each phase per kind of save: where the blocked and the total time go.
        "phases": {
            kind: {k: statistics.median(p[k] for p in runs_ if k in p) for k in sorted({k for p in runs_ for k in p})}
            for kind, runs_ in b.phases.items()
        },
        "device": torch.cuda.get_device_name(b.device) if b.device.type == "cuda" else "cpu",
    }


TARGETS = [
    ("distckpt_sync_s", "raw_write_parallel_s", ">= 0.8x the parallel raw write", lambda r: r["raw_write_parallel_s"] / r["distckpt_sync_s"] >= 0.8),
    ("distckpt_sync_s", "dcp_sync_s", ">= 1.5x faster than plain DCP", lambda r: r["dcp_sync_s"] / r["distckpt_sync_s"] >= 1.5),
    ("distckpt_load_s", "raw_read_h2d_s", ">= 0.8x the raw read + H2D", lambda r: r["raw_read_h2d_s"] / r["distckpt_load_s"] >= 0.8),
    ("distckpt_load_s", "dcp_load_s", ">= 2x faster than plain DCP", lambda r: r["dcp_load_s"] / r["distckpt_load_s"] >= 2.0),
    ("distckpt_async_blocked_first_s", "distckpt_async_blocked_steady_s", "first async save <= 1.5x a steady one",
     lambda r: r["distckpt_async_blocked_first_s"] <= 1.5 * r["distckpt_async_blocked_steady_s"]),
    ("distckpt_async_blocked_steady_s", "d2h_floor_s", "steady blocked <= 1.2x the D2H floor",
     lambda r: r["distckpt_async_blocked_steady_s"] <= 1.2 * r["d2h_floor_s"]),
    ("train_ratio_distckpt", None, "training >= 0.98x during a background save", lambda r: r["train_ratio_distckpt"] >= 0.98),
]  # fmt: skip


def targets(rows: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each target of :data:`TARGETS` whose rows were measured: its ratio, as the target reads
    ("<= N x" targets: a over b, at most N; ">= N x" ones: b over a, at least N, a speed-up or
    a fraction of a floor's speed), and whether it is met (a NaN, no sample, is not)."""
    out: dict[str, dict[str, Any]] = {}
    for a, b, text, ok in TARGETS:
        if a not in rows or (b is not None and b not in rows):
            continue  # a part not run (--parts)
        ratio = rows[a] if b is None else rows[a] / rows[b] if "<=" in text else rows[b] / rows[a]
        out[text] = {"ratio": ratio, "met": ratio == ratio and bool(ok(rows))}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--nproc", type=_common.positive_int, default=1, help="processes, one GPU each")
    # Options --quick changes default to None: it fills only those the user left out.
    p.add_argument("--size-gb", type=_common.positive_float, default=None, help="model + AdamW state per process (GB; default 4, --quick: 0.02)")
    p.add_argument("--width", type=_common.positive_int, default=None,
                   help="Linear width (default 4096 on a GPU, 256 on the CPU and with --quick)")
    p.add_argument("--batch", type=_common.positive_int, default=None,
                   help="training batch rows (default 8192 on a GPU, 16 on the CPU and with --quick)")
    p.add_argument("--threads", type=_common.positive_int, default=None,
                   help="writer/reader threads (distckpt, dcp_sync_same_threads_s) and parallel raw writes (default 8; --quick: 2)")
    p.add_argument("--repeats", type=_common.positive_int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--unprepared-repeats", type=_common.nonnegative_int, default=1, metavar="N",
                   help="samples of distckpt_async_blocked_first_unprepared_s (informational, no target; each "
                        "waits for a whole background save; 0: none)")
    p.add_argument("--train-steps", type=_common.positive_int, default=None, help="steps per training-speed measurement (default 10; --quick: 2)")
    p.add_argument("--parts", default="sync,async", type=_common.choice_list(("sync", "async")),
                   help="which rows: sync (floors, sync saves, loads), async (async saves, training), or both")
    p.add_argument("--ab-proof-chunk", type=_common.nonnegative_int, default=0, metavar="N",
                   help="also time each proven sync save with the proof's host digest in calls of N elements "
                        "(distckpt_sync_ab_chunk_s; distckpt.save.d2h.PROOF_CHUNK is the default; 0: not)")
    p.add_argument("--dir", type=_common.existing_dir, default=None,
                   help="an existing directory to work in: a folder of this run's is made inside it and removed "
                        "at the end (default: benchmarks/.scratch)")
    _common.add_json_arg(p, "gpu", "--out")
    p.add_argument("--dcp-same-threads", action="store_true",
                   help="also time dcp_sync_same_threads_s (DCP's FileSystemWriter with --threads threads; off by "
                        "default: one more full save per repeat, and the GPU run must finish in 4 minutes)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 0.02 GB, width 256, batch 16, 1 repeat, 2 threads, 2 training steps")
    args = p.parse_args(argv)
    _common.resolve_quick(args, full={"size_gb": 4.0, "threads": 8, "repeats": 3, "train_steps": 10},
                          quick={"size_gb": 0.02, "threads": 2, "repeats": 1, "train_steps": 2, "width": 256, "batch": 16})
    _common.resolve_outputs(args, "gpu")
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        p.error(f"--nproc {args.nproc} needs {args.nproc} GPUs, {torch.cuda.device_count()} visible")
    args.width = args.width or (4096 if args.device == "cuda" else 256)
    args.batch = args.batch or (8192 if args.device == "cuda" else 16)
    # Every file of this run goes into a new folder of its own (the processes' rank<N> inside
    # it), removed at the end: --dir may hold the user's own files, rank0/ included.
    run_dir, own_parent = _common.run_folder(args.dir, "gpu")
    args.run_dir = str(run_dir)
    args.dir = args.dir or str(run_dir.parent)
    t0 = time.perf_counter()
    try:
        if args.nproc == 1:
            results = [run(0, args)]
        else:
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            with ctx.Pool(args.nproc) as pool:
                results = pool.starmap(run, [(r, args) for r in range(args.nproc)])
    finally:
        _common.remove_scratch(run_dir, own_parent)
    rows = {k: statistics.median([v for r in results for v in r["samples"][k]]) for k in results[0]["samples"]}
    out = {
        "device": results[0]["device"],
        "torch": torch.__version__,
        "nproc": args.nproc,
        "threads": args.threads,
        "parts": sorted(args.parts),
        "state_bytes": results[0]["state_bytes"],
        "dir": args.dir,
        "run_dir": args.run_dir,  # this run's folder inside dir (removed)
        "rows": rows,
        "samples": [r["samples"] for r in results],
        "phases": [r["phases"] for r in results],  # per process: median SaveStats phases per kind of save
        "targets": {},
        "wall_s": time.perf_counter() - t0,
        "date": time.strftime("%Y-%m-%d"),
    }
    lines = [f"# GPU benchmark: {out['device']}, torch {out['torch']}, {out['state_bytes'] / 1e9:.2f} GB state per process, "
             f"{args.nproc} process(es), {args.threads} threads, {out['date']}", "", "| row | seconds / ratio |", "|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v:.4f} |" for k, v in rows.items()]
    if "dcp_sync_s" in rows:
        lines += ["", "`dcp_sync_s`: plain DCP as called by default, `dcp.save(state, checkpoint_id=path)` (its default "
                  "`FileSystemWriter`, 1 writer thread): issue 32's plain DCP and the target's baseline."
                  + (f" `dcp_sync_same_threads_s`: DCP's `FileSystemWriter(path, thread_count={args.threads})`, distckpt's "
                     "thread count (informational, no target)." if "dcp_sync_same_threads_s" in rows else
                     f" distckpt ran with {args.threads} threads (`--dcp-same-threads` times DCP with as many).")]  # fmt: skip
    phases = results[0]["phases"]
    if phases:  # the first process's: where a save's time goes
        lines += ["", "Phases (`SaveStats.phases`, process 0): each column its own median; serialize, checksum, "
                  "io_write, fsync and the d2h/proof parts are summed over the writer threads, not wall time.", ""]  # fmt: skip
        lines += ["| save | blocked | " + " | ".join(_SHOWN) + " |", "|---|---|" + "---|" * len(_SHOWN)]
        for kind, p in phases.items():
            lines.append(f"| {kind} | {p.get('blocking_s', float('nan')):.4f} | " + " | ".join(f"{p.get(k, float('nan')):.4f}" for k in _SHOWN) + " |")
    lines += ["", "| target | ratio | met |", "|---|---|---|"]
    out["targets"] = targets(rows)
    lines += [f"| {text} | {t['ratio']:.2f} | {'yes' if t['met'] else 'no'} |" for text, t in out["targets"].items()]
    _common.publish(out, "\n".join(lines), args.json)
    return out


if __name__ == "__main__":
    main()
