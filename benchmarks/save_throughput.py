"""Save/load throughput of distckpt against the physical limit and what users would pick instead.

For a transformer-like state of fp32 tensors (default 1 GiB) and world sizes (default 1 and 2), all
in one run, the methods alternate round-robin inside every repetition so that noise (other jobs,
the disk's write-back) hits all of them alike. Every figure is a median over ``--repeats`` runs
and is also given as a ratio to the raw limit (``raw time / method time``; 1.0 = as fast as raw).

Methods (all ranks run each; time = wall time from a barrier before to a barrier after):

* ``raw_write``  each rank writes its share of the bytes (the same split DCP's dedup makes) to
  one file with large sequential writes, then fsync: the physical limit for saves.
  ``raw_write_t2`` the same share in ``thread_count`` files from as many threads (the fair
  limit for distckpt's multi-threaded writer).
* ``torch_save`` rank 0 ``torch.save``s the whole state to one file, then fsync.
* ``dcp_save``   plain ``torch.distributed.checkpoint.save`` with the default FileSystemWriter
  (1 thread, fsync); ``dcp_save_t2`` the same with ``thread_count=2`` (distckpt's default).
* ``distckpt_sync``  ``Checkpointer(...).save(step, state)`` with the library defaults
  (2 threads, fsync, crc32c checksums, fingerprints, manifest commit, RNG states), the state
  being ``{"model": module}`` (the tensors as an ``nn.Module``'s parameters, as a DDP job passes
  its model); ``distckpt_sync_torchcrc`` the same with ``skip_torch_record_crc=False`` (torch.save's
  per-record CRC-32 written too, as plain DCP does; distckpt leaves it out by default). The last
  repetition's save is broken down into phases (``SaveStats.phases``, rank 0).
* ``small_<N>MiB_dcp`` / ``small_<N>MiB_distckpt``: the fixed cost of a save, plain ``dcp.save``
  (2 threads) against ``Checkpointer.save`` of a state of ``N`` MiB (``--small-mib``).
* ``distckpt_async`` ``save(blocking=False)``: ``blocking`` (time until training may go on) and
  ``total`` (until committed), on a fresh Checkpointer (``cold``: buffers allocated and writer
  process started on that save) and the median of its next three saves (``warm``: buffers and
  writer reused, the steady state of a training job); the notes break the median warm save's
  blocking time into ``prepare`` (state dicts, views) and ``stage`` (the copy, and the replica
  digests of what this rank does not stage); the claim of the step directory runs afterwards,
  in the background.
* ``staging_copy`` a plain copy of every tensor of the state into already-allocated buffers:
  the floor for what an async save that copies must block for.
* ``raw_read``   each rank reads the bytes it needs (replicated state: all of them) into the
  state's own tensors with ``readinto``, after evicting the files from the page cache (cold);
  ``raw_read_warm`` the same again with the files in the page cache.
* ``raw_read_crc`` / ``raw_read_crc_warm`` the same reads, each 1 MiB block hashed with CRC-32C
  as it arrives: the floor of a load that verifies every byte it uses, on every rank.
* ``dcp_load`` / ``distckpt_load`` load the checkpoint written at this world size (cold);
  ``distckpt_load_warm`` again from the page cache; ``distckpt_load_resharded`` loads the one
  written at the other world size (cold), with the state check a change of world size turns on;
  ``distckpt_load_resharded_nocheck`` the same with ``verify_state=False``.
* ``train_*`` a small MLP (DDP at world size 2) trained with and without an async save of the
  state running in the background: steps/s and the slowdown.
* S3 (a moto server on 127.0.0.1): ``s3_raw_put`` / ``s3_raw_get`` move the same bytes with
  s3fs and the same concurrency as distckpt (thread_count objects per rank, 32 MiB parts);
  ``distckpt_s3_save`` / ``distckpt_s3_load``.

``--device cuda`` keeps the state on each rank's GPU (raw I/O then goes through a pinned host
buffer, as any save of GPU state must); ``--dir /dev/shm`` puts every file in memory, where the
disk cannot hide CPU cost. For the GPU figures and targets (issue 32) run ``benchmarks/gpu.py``
instead: one process per GPU, every row in under 4 minutes; ``--device cuda`` here runs this
whole matrix (S3, training, several world sizes) on GPU state and is not bounded in time
(``--quick`` or ``--only`` narrows it).

Peak resident memory per rank is measured for every method with the kernel's high-water mark
(``/proc/self/clear_refs`` + ``VmHWM``) and given as the growth over the RSS before the method.

Run ``python benchmarks/save_throughput.py --help``; ``--quick`` is a tiny smoke run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_json_arg,
    as_module,
    publish,
    GiB,
    MiB,
    choice_list,
    drop_cache,
    existing_dir,
    machine_info,
    make_tensors,
    median,
    nbytes,
    peak_rss,
    positive_float,
    positive_int,
    positive_ints,
    positive_ints_or_none,
    reset_peak_rss,
    resolve_outputs,
    resolve_quick,
    run_folder,
    split_greedy,
    steps_while_in_flight,
    remove_scratch,
    save_figure,
    transformer_like_shapes,
)

THREADS = 2  # distckpt's default thread_count; also the raw S3 concurrency per rank
S3_PART = 32 * MiB

# Method groups (--only): which rows each produces.
GROUPS = ("save", "small", "async", "load", "reshard", "train", "s3")

TARGETS = {
    "sync_vs_raw": 0.9,
    "overhead_vs_dcp_same_threads": 1.15,
    "async_block_vs_copy": 1.2,
    "load_vs_raw_cold": 0.9,
    "load_vs_raw_warm": 0.85,
    "s3_vs_raw": 0.8,
    "train_during_vs_without": 0.85,
}


# ==========================================================================================
# rank side
class _Rank:
    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world, self.cfg = rank, world, cfg
        self.base = Path(cfg["dir"]) / f"ws{world}"
        self.shapes = transformer_like_shapes(int(cfg["size_bytes"]))
        self.device = self._device(cfg.get("device", "cpu"))
        # replicated (DDP-like): identical on every rank
        self.tensors = {k: v.to(self.device) for k, v in make_tensors(self.shapes).items()}
        self.bytes = nbytes(self.tensors)
        self.state = {"model": as_module(self.tensors)}
        self.share = split_greedy(self.tensors, world)[rank]
        self._host: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []

    def _device(self, kind: str) -> Any:
        if kind == "cuda":
            self.torch.cuda.set_device(self.rank % self.torch.cuda.device_count())
            return self.torch.device("cuda", self.torch.cuda.current_device())
        return self.torch.device("cpu")

    def host(self, name: str) -> Any:
        """The bytes of tensor ``name`` in host memory: itself on CPU; on a GPU a reused pinned
        buffer (copied from the device on the way out by :meth:`to_host`)."""
        t = self.tensors[name]
        if t.device.type == "cpu":
            return t
        if name not in self._host:
            self._host[name] = self.torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return self._host[name]

    def to_host(self, name: str) -> Any:
        buf = self.host(name)
        if buf is not self.tensors[name]:
            buf.copy_(self.tensors[name])
        return buf

    def from_host(self, name: str) -> None:
        buf = self.host(name)
        if buf is not self.tensors[name]:
            self.tensors[name].copy_(buf)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    # -- measurement -----------------------------------------------------------------------
    def barrier(self) -> None:
        self.sync()
        self.dist.barrier()

    def timed(self, rep: int, method: str, fn: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
        self.barrier()
        before = reset_peak_rss()
        t0 = time.perf_counter()
        extra = fn() or {}
        self.barrier()
        dt = time.perf_counter() - t0
        rec = {"rep": rep, "method": method, "time_s": dt, "rss_before": before, "rss_peak": peak_rss(), **extra}
        self.records.append(rec)
        return rec

    def rank0(self, fn: Callable[[], Any]) -> None:
        if self.rank == 0:
            fn()
        self.barrier()

    # -- raw -------------------------------------------------------------------------------
    def raw_path(self, rep: int, r: int) -> Path:
        return self.base / f"rep{rep}" / "raw" / f"rank{r}.bin"

    def _write_file(self, path: Path, names: list[str]) -> None:
        with open(path, "wb", buffering=0) as f:
            for name in names:
                mv = memoryview(self.to_host(name).numpy()).cast("B")
                while mv:
                    n = f.write(mv)
                    mv = mv[n:]
            os.fsync(f.fileno())

    def raw_write(self, rep: int) -> None:
        path = self.raw_path(rep, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._write_file(path, self.share)

    def raw_write_parallel(self, rep: int, streams: int) -> None:
        """This rank's share in ``streams`` files written side by side (one thread each)."""
        parts = split_greedy({n: self.tensors[n] for n in self.share}, streams)
        base = self.raw_path(rep, self.rank).with_suffix("")
        base.mkdir(parents=True, exist_ok=True)
        ts = [threading.Thread(target=self._write_file, args=(base / f"part{i}.bin", names)) for i, names in enumerate(parts)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def raw_read(self, rep: int, shares: list[list[str]], crc: bool = False) -> None:
        """Replicated state: every rank needs every byte, so it reads every rank's file. ``crc``:
        each block is also hashed with CRC-32C right after it arrives (the floor of any load that
        verifies every byte it uses on every rank)."""
        import crc32c

        block = 1 << 20
        for r, names in enumerate(shares):
            with open(self.raw_path(rep, r), "rb", buffering=0) as f:
                value = 0
                for name in names:
                    mv = memoryview(self.host(name).numpy()).cast("B")
                    while mv:
                        n = f.readinto(mv[:block] if crc else mv)
                        if not n:
                            raise EOFError(name)
                        if crc:
                            value = crc32c.crc32c(mv[:n], value)
                        mv = mv[n:]
                    self.from_host(name)

    # -- baselines -------------------------------------------------------------------------
    def torch_save(self, rep: int) -> None:
        if self.rank == 0:
            path = self.base / f"rep{rep}" / "torch_save.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                self.torch.save(self.tensors, f)
                f.flush()
                os.fsync(f.fileno())

    def dcp_save(self, rep: int, threads: int) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.base / f"rep{rep}" / f"dcp_t{threads}"
        writer = dcp.FileSystemWriter(path, thread_count=threads)
        dcp.save({"model": self.tensors}, storage_writer=writer)

    def dcp_load(self, rep: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load({"model": self.tensors}, checkpoint_id=self.base / f"rep{rep}" / "dcp_t2")

    def staging_copy(self) -> float:
        pin = self.device.type == "cuda"
        bufs = {k: self.torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in self.tensors.items()}
        for b in bufs.values():
            b.zero_()  # fault the pages in: "already-allocated buffers"
        self.barrier()
        t0 = time.perf_counter()
        for k, t in self.tensors.items():
            bufs[k].copy_(t, non_blocking=pin)
        self.sync()
        return time.perf_counter() - t0

    # -- training --------------------------------------------------------------------------
    def make_trainer(self) -> Callable[[], None]:
        torch = self.torch
        torch.manual_seed(0)
        h = self.cfg["train_hidden"]
        model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(h, h), torch.nn.ReLU())])
        model = model.to(self.device)
        if self.world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(self.cfg["train_batch"], h, device=self.device)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            self.sync()

        for _ in range(3):
            step()
        return step


def _bench_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import distckpt
    from distckpt.integrity.manifest import step_dir

    b = _Rank(rank, world, cfg)
    torch = b.torch
    reps = cfg["repeats"]
    shares = split_greedy(b.tensors, world)
    other = cfg.get("reshard_from")  # root of a checkpoint written at another world size
    only_reshard = cfg.get("only_reshard", False)
    rootdir = b.base / "distckpt"
    only = set(cfg.get("only") or ())

    def want(group: str) -> bool:
        return not only or group in only

    sync_ck = distckpt.Checkpointer(str(rootdir / "sync"))
    # No keep_last, as the sync checkpointer (no retention in either); removed in each cleanup.
    crc_ck = distckpt.Checkpointer(str(rootdir / "torchcrc"), skip_torch_record_crc=False)
    reshard_ck = distckpt.Checkpointer(other) if other else None
    s3 = cfg.get("s3")
    if s3 is not None:
        s3_tensors: dict[str, Any] = {}
        for name in sorted(b.tensors, key=lambda n: -b.tensors[n].numel()):
            if nbytes(s3_tensors) + nbytes({name: b.tensors[name]}) <= s3["size_bytes"]:
                s3_tensors[name] = b.to_host(name)
        s3_ck = distckpt.Checkpointer(f"s3://{s3['bucket']}/ws{world}/ckpt", storage_options=s3["storage_options"])
        import s3fs

        s3_fs = s3fs.S3FileSystem(**s3["storage_options"])
    step_fn = b.make_trainer() if cfg["train"] and not only_reshard else None
    # A training job creates its Checkpointer once; its process group is set up on first use.
    # Pay that up front so that every repetition measures the steady state.
    for ck in (sync_ck, crc_ck, reshard_ck, s3_ck if s3 is not None else None):
        if ck is not None:
            ck._groups.get()
    # First-call costs (lazy imports, first DCP save) are a one-off too: one tiny untimed save.
    sync_ck.save(10**9, {"warmup": torch.zeros(4)})
    b.rank0(lambda: shutil.rmtree(rootdir / "sync", ignore_errors=True))
    # Fixed cost of small saves: states of a few MiB, the same module form.
    small: dict[int, tuple[dict[str, Any], dict[str, Any], Any]] = {}
    for mib in cfg.get("small_mib", []) if not only_reshard else []:
        tensors = {k: v.to(b.device) for k, v in make_tensors(transformer_like_shapes(mib * MiB), seed=1).items()}
        small[mib] = (tensors, {"model": as_module(tensors)}, distckpt.Checkpointer(str(rootdir / f"small{mib}"), keep_last=1))
        small[mib][2]._groups.get()

    for rep in range(reps):
        if only_reshard:
            b.rank0(lambda: (b.base / f"rep{rep}").mkdir(parents=True, exist_ok=True))
            b.raw_write(rep)  # untimed: the files raw_read reads
            b.barrier()
            b.rank0(lambda: drop_cache(b.base))
            b.timed(rep, "raw_read", lambda: b.raw_read(rep, shares))
            b.rank0(lambda: drop_cache(other))
            b.timed(rep, "distckpt_load_resharded", lambda: reshard_ck.load(b.state, step=0) and None)
            b.rank0(lambda: drop_cache(other))
            b.timed(rep, "distckpt_load_resharded_nocheck", lambda: reshard_ck.load(b.state, step=0, verify_state=False) and None)
            b.rank0(lambda: shutil.rmtree(b.base / f"rep{rep}", ignore_errors=True))
            continue

        # ---------------- saves (round-robin inside the repetition) ----------------
        if want("save"):
            b.timed(rep, "raw_write", lambda: b.raw_write(rep))
            b.timed(rep, f"raw_write_t{THREADS}", lambda: b.raw_write_parallel(rep, THREADS))
            b.timed(rep, "torch_save", lambda: b.torch_save(rep))
            b.timed(rep, "dcp_save", lambda: b.dcp_save(rep, 1))
            b.timed(rep, "dcp_save_t2", lambda: b.dcp_save(rep, 2))
            rec = b.timed(rep, "distckpt_sync", lambda: sync_ck.save(rep, b.state))
            rec["phases"] = dict(getattr(sync_ck.last_save, "phases", None) or {})
            b.timed(rep, "distckpt_sync_torchcrc", lambda: crc_ck.save(rep, b.state))
        elif want("load") or want("train"):
            # What the loads read (and the training part's estimate of a save's length), untimed.
            b.rank0(lambda: (b.base / f"rep{rep}").mkdir(parents=True, exist_ok=True))
            b.raw_write(rep)
            b.dcp_save(rep, 2)
            t0 = time.perf_counter()
            sync_ck.save(rep, b.state)
            b.records.append({"rep": rep, "method": "_sync_untimed", "time_s": time.perf_counter() - t0})
        for mib, (tensors, st, ck) in small.items() if want("small") else ():
            import torch.distributed.checkpoint as dcp

            for i in range(cfg["small_repeats"]):
                k = rep * cfg["small_repeats"] + i
                path = b.base / f"rep{rep}" / f"small{mib}_{i}"
                writer = dcp.FileSystemWriter(path, thread_count=THREADS)
                b.timed(rep, f"small_{mib}MiB_dcp", lambda: dcp.save({"model": tensors}, storage_writer=writer) and None)
                b.timed(rep, f"small_{mib}MiB_distckpt", lambda: ck.save(k, st))

        def async_save() -> dict[str, Any]:
            ck = distckpt.Checkpointer(str(rootdir / f"async{rep}"), keep_last=1)
            ck.save(0, b.state, blocking=False)
            cold = ck.wait()
            warm = []
            for step in (1, 2, 3):  # the steady state: buffers and writer process reused
                ck.save(step, b.state, blocking=False)
                warm.append(ck.wait())
            ck.close()
            return {
                "blocking_cold_s": cold.blocking_s,
                "total_cold_s": cold.total_s,
                "blocking_s": median([w.blocking_s for w in warm]),
                "total_s": median([w.total_s for w in warm]),
                # The blocking part of the warm save whose blocking time is the median.
                "blocking_phases": {
                    k: v
                    for k, v in sorted(warm, key=lambda w: w.blocking_s)[len(warm) // 2].phases.items()
                    if k in ("prepare", "stage")  # claim: in the background since async saves claim after staging
                },
            }

        if want("async"):
            b.timed(rep, "distckpt_async", async_save)
            rec = b.timed(rep, "staging_copy", lambda: {"copy_s": b.staging_copy()})
            rec["time_s"] = rec["copy_s"]  # the copy itself, not the allocation around it

        # ---------------- loads ----------------
        if want("load"):
            b.rank0(lambda: drop_cache(b.base / f"rep{rep}"))
            b.timed(rep, "raw_read", lambda: b.raw_read(rep, shares))
            b.timed(rep, "raw_read_warm", lambda: b.raw_read(rep, shares))
            b.timed(rep, "raw_read_crc_warm", lambda: b.raw_read(rep, shares, crc=True))
            b.rank0(lambda: drop_cache(b.base / f"rep{rep}"))
            b.timed(rep, "raw_read_crc", lambda: b.raw_read(rep, shares, crc=True))
            b.rank0(lambda: drop_cache(b.base / f"rep{rep}"))
            b.timed(rep, "dcp_load", lambda: b.dcp_load(rep))
            b.rank0(lambda: drop_cache(rootdir / "sync"))
            b.timed(rep, "distckpt_load", lambda: sync_ck.load(b.state, step=rep) and None)
            b.timed(rep, "distckpt_load_warm", lambda: sync_ck.load(b.state, step=rep) and None)
        if reshard_ck is not None and want("reshard"):
            b.rank0(lambda: drop_cache(other))
            b.timed(rep, "distckpt_load_resharded", lambda: reshard_ck.load(b.state, step=0) and None)
            b.rank0(lambda: drop_cache(other))
            b.timed(rep, "distckpt_load_resharded_nocheck", lambda: reshard_ck.load(b.state, step=0, verify_state=False) and None)

        # ---------------- training slowdown ----------------
        if step_fn is not None and want("train"):
            n_base = cfg["train_steps"]

            def baseline() -> dict[str, Any]:
                t0 = time.perf_counter()
                for _ in range(n_base):
                    step_fn()
                return {"steps_per_s": n_base / (time.perf_counter() - t0)}

            base_rec = b.timed(rep, "train_baseline", baseline)
            # Enough steps to outlast the background save (estimated from the sync save).
            sync_s = next(r["time_s"] for r in reversed(b.records) if r["method"] in ("distckpt_sync", "_sync_untimed"))
            n_during = int(min(2000, max(10, 2.0 * sync_s * base_rec["steps_per_s"])))
            t = torch.tensor([n_during])
            b.dist.broadcast(t, 0)
            n_during = int(t.item())
            ck = distckpt.Checkpointer(str(rootdir / f"train{rep}"))
            ck.save(0, b.state, blocking=False)  # warm the staging buffers
            ck.wait()

            def during() -> dict[str, Any]:
                t0 = time.perf_counter()
                ck.save(1, b.state, blocking=False)
                t1 = time.perf_counter()
                done, seconds = steps_while_in_flight(ck, step_fn, n_during)
                stats = ck.wait()
                return {
                    "blocking_s": t1 - t0,
                    "steps_in_flight": done,
                    "steps_per_s": done / seconds if done and seconds > 0 else None,
                    "total_s": stats.total_s if stats else None,
                }

            b.timed(rep, "train_during_async", during)
            ck.close()
            b.rank0(lambda: shutil.rmtree(rootdir / f"train{rep}", ignore_errors=True))

        # ---------------- S3 ----------------
        if s3 is not None and want("s3"):
            s3_shares = split_greedy(s3_tensors, world * THREADS)
            prefix = f"{s3['bucket']}/ws{world}/raw{rep}"

            def put_part(i: int) -> None:
                with s3_fs.open(f"{prefix}/part{i}", "wb", block_size=S3_PART) as f:
                    for name in s3_shares[i]:
                        f.write(memoryview(s3_tensors[name].numpy()).cast("B"))

            def get_part(i: int) -> None:
                data = memoryview(s3_fs.cat_file(f"{prefix}/part{i}"))
                off = 0
                for name in s3_shares[i]:
                    mv = memoryview(s3_tensors[name].numpy()).cast("B")
                    mv[:] = data[off : off + len(mv)]
                    off += len(mv)

            def in_threads(fn: Callable[[int], None], parts: list[int]) -> None:
                # THREADS workers per rank, like distckpt's thread_count.
                def worker(k: int) -> None:
                    for i in parts[k::THREADS]:
                        fn(i)

                ts = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()

            mine = [b.rank * THREADS + j for j in range(THREADS)]
            every = list(range(world * THREADS))
            s3_state = {"model": as_module(s3_tensors)}
            b.timed(rep, "s3_raw_put", lambda: in_threads(put_part, mine))
            b.timed(rep, "distckpt_s3_save", lambda: s3_ck.save(rep, s3_state))
            # Replicated state: every rank needs every object; split reads like DCP does (per rank).
            b.timed(rep, "s3_raw_get", lambda: in_threads(get_part, every))
            b.timed(rep, "distckpt_s3_load", lambda: s3_ck.load(s3_state, step=rep) and None)

        # ---------------- cleanup ----------------
        def cleanup() -> None:
            shutil.rmtree(b.base / f"rep{rep}", ignore_errors=True)
            shutil.rmtree(rootdir / f"async{rep}", ignore_errors=True)
            for mib in small:
                shutil.rmtree(rootdir / f"small{mib}", ignore_errors=True)
            # The library's own step folder name (step_{step:09d}): a hand-written format that
            # differs leaves every repetition's checkpoints on the disk until the end.
            shutil.rmtree(rootdir / "sync" / step_dir(rep), ignore_errors=True)
            shutil.rmtree(rootdir / "torchcrc" / step_dir(rep), ignore_errors=True)
            for d in (rootdir / "sync").glob("*"):
                if d.is_dir() and d.name != "step_ref":
                    shutil.rmtree(d, ignore_errors=True)
            if s3 is not None:
                s3_fs.rm(f"{s3['bucket']}/ws{world}", recursive=True)

        b.rank0(cleanup)

    if cfg.get("keep_ref") and not only_reshard and want("reshard"):
        # A checkpoint for the resharded load of another world size.
        ref = distckpt.Checkpointer(cfg["keep_ref"])
        ref.save(0, b.state)
        ref.close()
    sync_ck.close()
    crc_ck.close()
    for _, _, ck in small.values():
        ck.close()
    return {
        "rank": rank,
        "bytes": b.bytes,
        "tensors": len(b.tensors),
        "shapes": len(b.shapes),
        "records": b.records,
        "s3_bytes": nbytes(s3_tensors) if s3 is not None else None,
    }


# ==========================================================================================
# driver side
def _summarize(world: int, per_rank: list[dict[str, Any]], s3_bytes: int | None) -> dict[str, Any]:
    """Per method: median time (rank 0's barrier-to-barrier wall) and max per-rank memory growth."""
    state_bytes = per_rank[0]["bytes"]
    methods: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    for rec in per_rank[0]["records"]:
        if rec["method"] not in order and not rec["method"].startswith("_"):  # "_": untimed helpers
            order.append(rec["method"])
    for m in order:
        rows0 = [r for r in per_rank[0]["records"] if r["method"] == m]
        out: dict[str, Any] = {"runs": len(rows0), "time_s": median([r["time_s"] for r in rows0])}
        out["times_s"] = [round(r["time_s"], 4) for r in rows0]
        phases = [r["phases"] for r in rows0 if r.get("phases")]
        if phases:
            out["phases_s"] = phases[-1]  # one save, broken down (the last repetition's)
        blocked = [r["blocking_phases"] for r in rows0 if r.get("blocking_phases")]
        if blocked:
            out["blocking_phases_s"] = blocked[-1]
        for key in ("blocking_s", "total_s", "blocking_cold_s", "total_cold_s", "steps_per_s", "copy_s"):
            vals = [r.get(key) for r in rows0 if r.get(key) is not None]
            if vals:
                # steps/s: median over repetitions of the slowest rank (DDP is lockstep anyway)
                if key == "steps_per_s":
                    vals = [
                        min(pr["records"][i].get(key) or 0 for pr in per_rank)
                        for i, r in enumerate(per_rank[0]["records"])
                        if r["method"] == m
                    ]
                out[key] = median(vals)
        growth = []
        peaks = []
        for pr in per_rank:
            rows = [r for r in pr["records"] if r["method"] == m]
            growth.append(median([r["rss_peak"] - r["rss_before"] for r in rows]))
            peaks.append(median([r["rss_peak"] for r in rows]))
        out["peak_rss_growth_mib_per_rank"] = [round(g / MiB, 1) for g in growth]
        out["peak_rss_mib_per_rank"] = [round(p / MiB, 1) for p in peaks]
        methods[m] = out

    def ratio(m: str, raw: str, key: str = "time_s") -> float | None:
        if m in methods and raw in methods and methods[m].get(key) and methods[raw].get("time_s"):
            return methods[raw]["time_s"] / methods[m][key]
        return None

    raw_of = {
        "raw_write": "raw_write", f"raw_write_t{THREADS}": "raw_write", "torch_save": "raw_write", "dcp_save": "raw_write",
        "dcp_save_t2": "raw_write", "distckpt_sync": "raw_write", "distckpt_sync_torchcrc": "raw_write", "distckpt_async": "raw_write",
        "staging_copy": "raw_write", "raw_read": "raw_read", "raw_read_warm": "raw_read_warm", "dcp_load": "raw_read",
        "raw_read_crc": "raw_read", "raw_read_crc_warm": "raw_read_warm",
        "distckpt_load": "raw_read", "distckpt_load_warm": "raw_read_warm", "distckpt_load_resharded": "raw_read", "distckpt_load_resharded_nocheck": "raw_read",
        "s3_raw_put": "s3_raw_put", "distckpt_s3_save": "s3_raw_put",
        "s3_raw_get": "s3_raw_get", "distckpt_s3_load": "s3_raw_get",
    }
    for m, out in methods.items():
        raw = raw_of.get(m)
        if raw:
            key = "total_s" if m == "distckpt_async" else "time_s"
            out["ratio_to_raw"] = ratio(m, raw, key)
            moved = (s3_bytes or 0) if m.startswith(("s3_", "distckpt_s3")) else state_bytes
            t = out.get(key)
            # Loads of a replicated state: every rank reads all bytes; throughput counts them all.
            loads = ("raw_read", "raw_read_warm", "raw_read_crc", "raw_read_crc_warm", "dcp_load", "distckpt_load", "distckpt_load_warm", "distckpt_load_resharded",
                     "distckpt_load_resharded_nocheck")
            factor = world if m in loads + ("s3_raw_get", "distckpt_s3_load") else 1
            out["gb_per_s"] = moved * factor / t / 1e9 if t else None
    return {"world_size": world, "state_bytes": state_bytes, "tensors": per_rank[0]["tensors"], "methods": methods}


def _targets(ws: dict[str, Any]) -> list[dict[str, Any]]:
    m = ws["methods"]
    out = []

    def add(name: str, value: float | None, target: float, higher_better: bool, what: str) -> None:
        ok = None if value is None else (value >= target if higher_better else value <= target)
        out.append({"target": name, "value": value, "limit": target, "higher_is_better": higher_better, "met": ok, "what": what})

    g = lambda a, k="time_s": m.get(a, {}).get(k)  # noqa: E731
    add("sync_save_vs_raw", m.get("distckpt_sync", {}).get("ratio_to_raw"), TARGETS["sync_vs_raw"], True,
        "distckpt sync save throughput / raw write, one stream (>=)")
    par = f"raw_write_t{THREADS}"
    if g("distckpt_sync") and g(par):
        add("sync_save_vs_raw_parallel", g(par) / g("distckpt_sync"), TARGETS["sync_vs_raw"], True,
            f"distckpt sync save throughput / raw write, {THREADS} streams (>=, informational)")
    if g("distckpt_sync") and g("dcp_save_t2"):
        add("overhead_vs_dcp_t2", g("distckpt_sync") / g("dcp_save_t2"), TARGETS["overhead_vs_dcp_same_threads"], False,
            "distckpt sync time / plain DCP with 2 threads, this state (<=)")
    for name in m:
        if name.startswith("small_") and name.endswith("_distckpt"):
            ref = name[: -len("_distckpt")] + "_dcp"
            if g(name) and g(ref):
                mib = name[len("small_") : -len("MiB_distckpt")]
                add(f"fixed_cost_{mib}MiB", g(name) / g(ref), TARGETS["overhead_vs_dcp_same_threads"], False,
                    f"distckpt sync time / plain DCP with 2 threads, {mib} MiB state (<=)")
    if g("distckpt_async", "blocking_s") and g("staging_copy"):
        add("async_block_vs_copy", g("distckpt_async", "blocking_s") / g("staging_copy"), TARGETS["async_block_vs_copy"], False,
            "async blocking (warm) / plain copy into allocated buffers (<=)")
    add("load_vs_raw_cold", m.get("distckpt_load", {}).get("ratio_to_raw"), TARGETS["load_vs_raw_cold"], True,
        "distckpt load / raw read, cold page cache (>=)")
    add("load_vs_raw_warm", m.get("distckpt_load_warm", {}).get("ratio_to_raw"), TARGETS["load_vs_raw_warm"], True,
        "distckpt load / raw read, warm page cache (>=)")
    if g("distckpt_load") and g("raw_read_crc") and g("distckpt_load_warm") and g("raw_read_crc_warm"):
        add("load_vs_raw_crc_cold", g("raw_read_crc") / g("distckpt_load"), TARGETS["load_vs_raw_cold"], True,
            "distckpt load / raw read + CRC-32C of every byte, cold (>=, informational: the floor of a verified read)")
        add("load_vs_raw_crc_warm", g("raw_read_crc_warm") / g("distckpt_load_warm"), TARGETS["load_vs_raw_warm"], True,
            "distckpt load / raw read + CRC-32C of every byte, warm (>=, informational)")
    if "distckpt_load_resharded" in m:
        add("load_resharded_vs_raw", m["distckpt_load_resharded"].get("ratio_to_raw"), TARGETS["load_vs_raw_cold"], True,
            "distckpt resharded load / raw read, cold (>=)")
    if "distckpt_load_resharded_nocheck" in m:
        add("load_resharded_nocheck_vs_raw", m["distckpt_load_resharded_nocheck"].get("ratio_to_raw"), TARGETS["load_vs_raw_cold"],
            True, "the same without the state check (verify_state=False) (>=, informational)")
    if "distckpt_s3_save" in m:
        add("s3_save_vs_raw", m["distckpt_s3_save"].get("ratio_to_raw"), TARGETS["s3_vs_raw"], True, "distckpt S3 save / raw s3fs put (>=)")
        add("s3_load_vs_raw", m["distckpt_s3_load"].get("ratio_to_raw"), TARGETS["s3_vs_raw"], True, "distckpt S3 load / raw s3fs get (>=)")
    if g("train_baseline", "steps_per_s") and g("train_during_async", "steps_per_s"):
        add("train_during_vs_without", g("train_during_async", "steps_per_s") / g("train_baseline", "steps_per_s"),
            TARGETS["train_during_vs_without"], True, "steps/s during a background save / steps/s without (>=)")
    return out


def _table(result: dict[str, Any]) -> str:
    lines = []
    for ws in result["world_sizes"]:
        lines.append(
            f"\n### world size {ws['world_size']}: {ws['state_bytes'] / GiB:.2f} GiB in {ws['tensors']} fp32 tensors"
            + (f"; S3 part: {ws['s3_bytes'] / GiB:.2f} GiB" if ws.get("s3_bytes") else "")
        )
        lines.append("")
        lines.append("| method | median s | GB/s | x raw | peak RSS growth MiB/rank | notes |")
        lines.append("|---|---:|---:|---:|---:|---|")
        for name, m in ws["methods"].items():
            t = m.get("total_s") if name == "distckpt_async" else m.get("time_s")
            notes = []
            if name == "distckpt_async":
                notes.append(f"blocked {m.get('blocking_s', 0):.3f}s warm / {m.get('blocking_cold_s', 0):.3f}s cold; "
                             f"committed {m.get('total_s', 0):.3f}s warm / {m.get('total_cold_s', 0):.3f}s cold")
                if m.get("blocking_phases_s"):
                    notes.append("blocked in " + ", ".join(f"{k} {v:.3f}s" for k, v in m["blocking_phases_s"].items()))
            if name.startswith("train_"):
                sps = m.get("steps_per_s")
                notes.append(f"{sps:.1f} steps/s" if sps else "no step overlapped the save")
                if name == "train_during_async" and m.get("total_s"):
                    notes.append(f"save committed after {m['total_s']:.2f}s")
            gbps = m.get("gb_per_s")
            r = m.get("ratio_to_raw")
            growth = max(m["peak_rss_growth_mib_per_rank"])
            lines.append(
                f"| {name} | {t:.3f} | {gbps:.2f} | {r:.2f} | {growth:.0f} | {'; '.join(notes)} |"
                if gbps is not None and r is not None
                else f"| {name} | {t:.3f} | | | {growth:.0f} | {'; '.join(notes)} |"
            )
        phases = ws["methods"].get("distckpt_sync", {}).get("phases_s")
        if phases:
            lines.append("")
            lines.append("One `distckpt_sync` save, phase by phase (rank 0; thread-seconds inside the writer):")
            lines.append("")
            lines.append("| " + " | ".join(phases) + " |")
            lines.append("|" + "---:|" * len(phases))
            lines.append("| " + " | ".join(f"{v:.3f}" for v in phases.values()) + " |")
        lines.append("")
        lines.append("| target | value | limit | met |")
        lines.append("|---|---:|---:|---|")
        for tg in ws["targets"]:
            v = "n/a" if tg["value"] is None else f"{tg['value']:.3f}"
            met = "n/a" if tg["met"] is None else ("yes" if tg["met"] else "**MISSED**")
            lines.append(f"| {tg['what']} | {v} | {tg['limit']} | {met} |")
    return "\n".join(lines)


def _plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wss = result["world_sizes"]
    fig, axes = plt.subplots(1, len(wss), figsize=(7 * len(wss), 5), squeeze=False)
    for ax, ws in zip(axes[0], wss):
        names, vals, colors = [], [], []
        for name, m in ws["methods"].items():
            if m.get("ratio_to_raw") is None or name in ("raw_write", "raw_read", "raw_read_warm", "s3_raw_put", "s3_raw_get"):
                continue
            names.append(name)
            vals.append(m["ratio_to_raw"])
            colors.append("tab:blue" if name.startswith("distckpt") else "tab:gray")
        ax.barh(names, vals, color=colors)
        ax.axvline(1.0, color="k", lw=1)
        for x, ls in ((0.9, "--"), (0.85, ":")):
            ax.axvline(x, color="tab:red", lw=1, ls=ls)
        ax.set_xlabel("throughput / raw limit (1.0 = raw; red: 0.9 save/cold load and 0.85 warm load targets)")
        ax.set_title(f"world size {ws['world_size']}, {ws['state_bytes'] / GiB:.2f} GiB")
        ax.invert_yaxis()
    info = result["machine"]
    fig.suptitle(f"distckpt save/load vs raw I/O — {info['cpu']}, {info['cores']} cores, torch {info['torch']}", fontsize=10)
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Options --quick changes default to None: it fills only those the user left out.
    p.add_argument("--size-gib", type=positive_float, default=None, help="state size (default 1 GiB; --quick: 8 MiB)")
    p.add_argument("--world-sizes", type=positive_ints, default=None, help="comma-separated (default 1,2; --quick: 1)")
    p.add_argument("--repeats", type=positive_int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--dir", type=existing_dir, default=None,
                   help="an existing dir to work in (a folder of this run's inside it; default: benchmarks/.scratch on the repo's disk; /dev/shm works)")
    p.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True, help="include the S3 part")
    p.add_argument("--s3-size-gib", type=positive_float, default=None, help="bytes moved in the S3 part (moto is slow; default 0.25, --quick: 2 MiB)")
    p.add_argument("--train", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives (cuda: one GPU per rank)")
    p.add_argument("--small-mib", type=positive_ints_or_none, default=None,
                   help="sizes of the fixed-cost saves, MiB (comma-separated; '' to skip; default 10,100, --quick: 1)")
    p.add_argument("--small-repeats", type=positive_int, default=None, help="fixed-cost saves per size and repetition (default 3; --quick: 1)")
    add_json_arg(p, "save_throughput")
    p.add_argument("--png", default=None, help="the plot (default: beside --json, same name, .png; '' to skip)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (8 MiB, 1 repeat, world size 1)")
    p.add_argument(
        "--only",
        type=choice_list(GROUPS, allow_empty=True),
        default="",
        help=f"comma-separated method groups to run (default all): {','.join(GROUPS)}; "
        "loads and training save what they need untimed",
    )
    args = p.parse_args(argv)
    resolve_quick(
        args,
        full={"size_gib": 1.0, "world_sizes": [1, 2], "repeats": 3, "s3_size_gib": 0.25, "small_mib": [10, 100], "small_repeats": 3},
        quick={"size_gib": 8 / 1024, "world_sizes": [1], "repeats": 1, "s3_size_gib": 2 / 1024, "small_mib": [1], "small_repeats": 1},
    )
    resolve_outputs(args, "save_throughput", png=True)
    worlds = args.world_sizes
    only = args.only
    if len(set(worlds)) != len(worlds):
        p.error(f"--world-sizes must be distinct, got {','.join(map(str, worlds))}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < max(worlds):
            p.error(f"--device cuda needs {max(worlds)} GPU(s)")
        print("save_throughput: for the GPU rows and targets of issue 32 run benchmarks/gpu.py (< 4 min on one GPU)", file=sys.stderr)
    from dist_harness import run_ranks

    scratch, own_dir = run_folder(args.dir, "run")
    size_bytes = int(args.size_gib * GiB)
    server = None
    s3cfg = None
    if args.s3 and (not only or "s3" in only):
        import logging

        from s3_server import S3Server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request log lines

        server = S3Server().start()
        bucket = server.make_bucket("distckpt-bench")
        s3cfg = {"bucket": bucket, "storage_options": server.storage_options, "size_bytes": int(args.s3_size_gib * GiB)}
    base_cfg = {
        "dir": str(scratch),
        "size_bytes": size_bytes,
        "repeats": args.repeats,
        "train": args.train,
        "train_hidden": 256 if args.quick else 1024,
        "train_batch": 16 if args.quick else 64,
        "train_steps": 5 if args.quick else 30,
        "s3": s3cfg,
        "device": args.device,
        "small_mib": args.small_mib,
        "small_repeats": args.small_repeats,
        "only": only,
    }
    t_start = time.perf_counter()
    results = []
    raw: dict[int, list[dict[str, Any]]] = {}
    try:
        prev_ref = None
        for w in worlds:
            ref = str(scratch / "ref" / f"ws{w}")
            cfg = dict(base_cfg, reshard_from=prev_ref, keep_ref=ref if len(worlds) > 1 else None)
            print(f"[save_throughput] world size {w} ...", flush=True)
            raw[w] = run_ranks(_bench_rank, w, scratch / "harness", cfg, timeout=900, pg_timeout=600)
            prev_ref = ref
        if len(worlds) > 1 and (not only or "reshard" in only):
            # The first world size loads the checkpoint of the last one.
            w = worlds[0]
            cfg = dict(base_cfg, reshard_from=prev_ref, only_reshard=True, s3=None, train=False)
            print(f"[save_throughput] world size {w}: resharded load from world size {worlds[-1]} ...", flush=True)
            extra = run_ranks(_bench_rank, w, scratch / "harness", cfg, timeout=900, pg_timeout=600)
            for pr, ex in zip(raw[w], extra):
                # Its own raw_read baseline in that run, under another name.
                for r in ex["records"]:
                    if r["method"] == "raw_read":
                        r["method"] = "raw_read_reshard_run"
                pr["records"] += ex["records"]
        for w in worlds:
            summary = _summarize(w, raw[w], raw[w][0].get("s3_bytes"))
            summary["s3_bytes"] = raw[w][0].get("s3_bytes")
            m = summary["methods"]
            if "raw_read_reshard_run" in m:
                rr = m["raw_read_reshard_run"]["time_s"]
                for name in ("distckpt_load_resharded", "distckpt_load_resharded_nocheck"):
                    if name in m:
                        m[name]["ratio_to_raw"] = rr / m[name]["time_s"]
            summary["targets"] = _targets(summary)
            results.append(summary)
    finally:
        if server is not None:
            server.stop()
        remove_scratch(scratch, own_dir)
    result = {
        "benchmark": "save_throughput",
        "machine": machine_info(),
        "config": {
            "size_gib": args.size_gib,
            "world_sizes": worlds,
            "repeats": args.repeats,
            "dir": str(Path(args.dir).resolve()) if args.dir else "benchmarks/.scratch (repo disk)",
            "s3": bool(args.s3),
            "s3_size_gib": args.s3_size_gib if s3cfg else None,
            "thread_count": THREADS,
            "device": args.device,
            "small_mib": base_cfg["small_mib"],
            "layout": "replicated (DDP-like: every rank holds every tensor; DCP dedups the writes)",
        },
        "wall_s": time.perf_counter() - t_start,
        "world_sizes": results,
    }
    table = _table(result)
    publish(result, table, args.json)
    if args.png:
        _plot(result, Path(args.png))
    return result


if __name__ == "__main__":
    main()
