"""Every parallel layout of a torchtitan-style job saves and reshards into every other one.

A toy transformer (tests/models.py: ``ToyJob``) is trained two AdamW steps in each source layout,
saved with ``distckpt.Checkpointer`` and loaded, with ``verify_state=True``, into target layouts
at other world sizes; the loaded weights and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``,
hyper-parameters), gathered to whole tensors by FQN with ``full_tensor()``, must equal the saved
ones bit for bit.

Sources at 4 ranks: FSDP2 x TP (torchtitan's 2-D layout: ``_StridedShard`` on ``dp``), the same
with norms and embeddings left to FSDP alone (every TP rank holds them, on its own ``dp``
sub-mesh), HSDP, TP, TP with sequence parallelism and a loss-parallel output, FSDP2 with
``reshard_after_forward=False`` and a frozen sub-module; the 2-D and HSDP jobs save again
asynchronously (process and thread mode), and that checkpoint is the one loaded. At 2 ranks TP
and FSDP2; in one process a plain model. Targets: every 4-rank layout for the 4-rank checkpoints,
the 2-D ones (FSDP2 x TP, HSDP) for the 1- and 2-rank checkpoints, DDP at 3 ranks and a plain
model in one process for all others. A frozen checkpoint loads into the same layouts built frozen.

Spawns, in order (each costs ~8 s here): one 2-rank, one 4-rank and one 3-rank; the 1-process
work runs in the test process.
"""

from __future__ import annotations

import faulthandler
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from dist_harness import RanksFailed, run_ranks
from models import ToyJob

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning"),
]

#: Source layouts saved at 4 ranks: name -> (layout, frozen sub-module, async saves after the sync one).
SOURCES_4 = {
    "fsdp_tp": ("fsdp_tp", False, "process"),
    "fsdp_tp_plain_norms": ("fsdp_tp_plain_norms", False, None),
    "hsdp": ("hsdp", False, "thread"),
    "tp": ("tp", False, None),
    "tp_sp": ("tp_sp", False, None),
    "fsdp_nrf_frozen": ("fsdp_nrf", True, None),
}
#: Source layouts saved at 2 ranks, and the plain model of one process.
SOURCES_2 = {"tp@2": ("tp", False), "fsdp_nrf@2": ("fsdp_nrf", False)}
#: Target layouts at 4 ranks, for the 4-rank checkpoints (a frozen checkpoint loads into layouts
#: built frozen), and the 2-D ones the 1- and 2-rank checkpoints go back into.
TARGETS_4 = ["fsdp_tp", "fsdp_tp_plain_norms", "hsdp", "tp", "tp_sp", "fsdp_nrf", "ddp"]
TARGETS_4_FROZEN = ["fsdp_tp", "fsdp_nrf"]
BACK_INTO_2D = ["fsdp_tp", "hsdp"]


def _diff(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Keys whose loaded value differs from the saved one (missing and unexpected keys too)."""
    out = [f"missing {k}" for k in expected if k not in got] + [f"unexpected {k}" for k in got if k not in expected]
    for k, a in expected.items():
        if k not in got:
            continue
        b = got[k]
        if isinstance(a, torch.Tensor):
            if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
                out.append(f"differs {k}")
        elif a != b:
            out.append(f"differs {k}: {a!r} != {b!r}")
    return out


def _train_and_save(name: str, layout: str, world: int, frozen: bool, root: str, async_mode: str | None) -> dict:
    """(every rank) Train ``layout`` two steps and save it at step 2 (and, with ``async_mode``, again
    asynchronously at step 3); the checkpoint's record with the full state as saved."""
    job = ToyJob(layout, world, frozen=frozen)
    job.train(range(2))
    full = job.full_state()
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(2, job.state())
    step = 2
    if async_mode is not None:
        with distckpt.Checkpointer(root, async_mode=async_mode) as ckpt:
            ckpt.save(3, job.state(), blocking=False)
            ckpt.wait()
        step = 3
    return {"name": name, "root": root, "step": step, "frozen": frozen, "world": world, "full": full}


def _load_into(
    targets: list[tuple[str, bool]], world: int, checkpoints: list[dict], only: list[str] | None = None
) -> dict[tuple[str, str], list[str]]:
    """(every rank) Load every checkpoint into every target layout (of ``only``, if given) built
    with the checkpoint's ``frozen`` flag, with the state check on; (checkpoint, target) ->
    differing keys (the state gathered with ``full_tensor()``: the layout's own placement
    semantics, not the offsets DCP reads by)."""
    out: dict[tuple[str, str], list[str]] = {}
    for layout, frozen in targets:
        mine = [ck for ck in checkpoints if ck["frozen"] == frozen and (only is None or layout in only or ck["world"] == world)]
        if not mine:
            continue
        job = ToyJob(layout, world, frozen=frozen)
        job.train(range(5, 6))  # a job that already trained: loading replaces all of it
        for ck in mine:
            with distckpt.Checkpointer(ck["root"]) as ckpt:
                step = ckpt.load(job.state(), step=ck["step"], verify_state=True)
            got = job.full_state()
            out[(ck["name"], f"{layout}@{world}")] = ([] if step == ck["step"] else [f"step {step}"]) + _diff(ck["full"], got)
    return out


def _spawn(fn: Any, world: int, tmp_path: Path, *args: Any, timeout: float) -> list[Any]:
    """``run_ranks(fn, world, tmp_path, *args)`` with a watchdog (:func:`_watched`): a rank still
    running 20 s before the deadline dumps every thread's stack, and a failure reports those
    dumps, so that a hang says where each rank waits."""
    stacks = tmp_path / f"stacks-{fn.__name__}"
    stacks.mkdir(exist_ok=True)
    try:
        return run_ranks(_watched, world, tmp_path, fn, str(stacks), timeout - 20, *args, timeout=timeout, pg_timeout=120)
    except RanksFailed as exc:
        dumps = "\n".join(f"--- {p.name} ---\n{p.read_text()}" for p in sorted(stacks.glob("*.txt")) if p.stat().st_size)
        raise RanksFailed(f"{fn.__name__} (run by _watched): {exc}\n{dumps}") from None


def _watched(rank: int, world: int, fn: Any, stacks: str, after_s: float, *args: Any) -> Any:
    """(each rank) ``fn(rank, world, *args)``, dumping every thread's stack into
    ``stacks/rank<r>.txt`` if it still runs after ``after_s`` seconds."""
    with open(f"{stacks}/rank{rank}.txt", "w") as out:
        faulthandler.dump_traceback_later(after_s, file=out)
        try:
            return fn(rank, world, *args)
        finally:
            faulthandler.cancel_dump_traceback_later()


def _two_ranks(rank: int, world: int, base: str) -> list[dict]:
    return [_train_and_save(n, lay, world, fr, f"{base}/{n}", None) for n, (lay, fr) in SOURCES_2.items()]


def _four_ranks(rank: int, world: int, base: str, earlier_bytes: bytes) -> dict:
    earlier = pickle.loads(earlier_bytes)
    t0 = time.perf_counter()
    saved = [_train_and_save(n, lay, world, fr, f"{base}/{n}", am) for n, (lay, fr, am) in SOURCES_4.items()]
    t1 = time.perf_counter()
    targets = [(t, False) for t in TARGETS_4] + [(t, True) for t in TARGETS_4_FROZEN]
    loaded = _load_into(targets, world, saved + earlier, only=BACK_INTO_2D)
    sync_async = {}
    for ck in saved:
        if ck["step"] == 3:  # the async save's .metadata is the sync save's
            metas = [_metadata(ck["root"], s) for s in (2, 3)]
            sync_async[ck["name"]] = metas[0] == metas[1]
    return {
        "saved": [dict(ck, full=ck["full"] if rank == 0 else None) for ck in saved],
        "loaded": loaded,
        "sync_async": sync_async,
        "seconds": (t1 - t0, time.perf_counter() - t1),
    }


def _three_ranks(rank: int, world: int, checkpoints: bytes) -> dict:
    return _load_into([("ddp", False), ("ddp", True)], world, pickle.loads(checkpoints))


def _metadata(root: str, step: int) -> dict:
    """The tensor layout a step's ``.metadata`` records: key -> (size, chunks), RNG entries aside."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from distckpt.integrity.manifest import step_dir

    md = FileSystemReader(str(Path(root) / step_dir(step))).read_metadata()
    return {
        k: (tuple(v.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith("_rng")
    }


@pytest.mark.timeout(900)
def test_every_layout_saves_and_reshards_into_every_other(tmp_path):
    base = str(tmp_path)
    t0 = time.perf_counter()
    # One process: a plain model, saved (no process group: distckpt runs single-process).
    plain = _train_and_save("plain@1", "plain", 1, False, f"{base}/plain@1", None)
    plain_frozen = _train_and_save("plain_frozen@1", "plain", 1, True, f"{base}/plain_frozen@1", None)
    # Deadlines far above the ~5 / 30 / 5 s each spawn takes on an idle machine: the suite shares
    # 2 cores with other jobs, and a dead or stuck rank still fails the test (with every rank's stack).
    two = _spawn(_two_ranks, 2, tmp_path, base, timeout=180)[0]
    earlier = [plain, plain_frozen] + two
    # Expected states travel pickled: as arguments, tensors would be shared through file
    # descriptors, more than the forkserver passes.
    four = _spawn(_four_ranks, 4, tmp_path, base, pickle.dumps(earlier), timeout=420)
    saved = four[0]["saved"]
    every = saved + earlier
    three = _spawn(_three_ranks, 3, tmp_path, pickle.dumps(saved + two), timeout=180)
    one = _load_into([("plain", False), ("plain", True)], 1, saved + two)
    wall = time.perf_counter() - t0

    results: dict[tuple[str, str], list[str]] = {}
    for r, res in enumerate(four):
        for pair, diffs in res["loaded"].items():
            results.setdefault(pair, []).extend(f"rank {r}: {d}" for d in diffs)
        assert all(res["sync_async"].values()), (r, res["sync_async"])
    for r, res in enumerate(three):
        for pair, diffs in res.items():
            results.setdefault(pair, []).extend(f"rank {r}: {d}" for d in diffs)
    for pair, diffs in one.items():
        results.setdefault(pair, []).extend(diffs)
    bad = {pair: diffs[:4] for pair, diffs in results.items() if diffs}
    assert not bad, f"loaded state differs from the saved one: {bad}"
    # The whole matrix ran: every checkpoint into every target of its kind.
    for ck in every:
        at_4 = TARGETS_4_FROZEN if ck["frozen"] else TARGETS_4
        if ck["world"] != 4:
            at_4 = [t for t in at_4 if t in BACK_INTO_2D]
        want = {f"{t}@4" for t in at_4} | ({"ddp@3", "plain@1"} if ck["world"] > 1 else set())
        assert {tgt for src, tgt in results if src == ck["name"]} == want, ck["name"]
    print(f"layout matrix: {len(results)} loads, {wall:.1f} s; 4-rank spawn save/load {four[0]['seconds']}")

