"""Non-tensor items (optimizer hyper-parameters, scheduler fields, per-rank values, RNG states'
Python parts) at 2 ranks: every item written is recorded once in the manifest's
``value_digests`` (replicated items have one writer), by sync and async (writer process) saves
and by ZeRO partitions alike; clean loads pass, and a re-sealed ``.metadata`` that swaps two of
them fails the load with the same IntegrityError on every rank. One group's lr is an ``np.float64``
(as a NumPy schedule writes it): stored in distckpt's encoded form, recorded and checked like any
item, and loaded back as an ``np.float64`` by DDP and ZeRO partitions alike. The single-process
attack on load, ``verify --state`` and ``convert`` is in tests/test_hostile.py."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import distckpt
from dist_harness import run_ranks
from distckpt.integrity.manifest import MANIFEST_NAME, digest_of, step_dir
from models import make_model, make_optimizer, train_steps, wrap


def _non_tensor_keys(d: Path) -> set[str]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = pickle.loads((d / ".metadata").read_bytes())  # our own, untampered file
    return {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}


def _state(parallel: str, world: int, rank: int) -> dict:
    model = wrap(make_model(0), parallel, world)
    optim = make_optimizer(model, parallel)
    optim.param_groups[1]["lr"] = np.float64(optim.param_groups[1]["lr"])  # ZeRO: its wrapper's groups
    sched = torch.optim.lr_scheduler.StepLR(optim.optim if parallel == "zero" else optim, 4)
    return {"model": model, "optim": optim, "sched": sched, "mine": distckpt.PerRank(f"rank {rank}")}


def _body(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    for parallel in ("ddp", "zero"):
        where = f"{root}-{parallel}"
        state = _state(parallel, world, rank)
        train_steps(state["model"], state["optim"], range(1), rank, world)
        state["sched"].step()
        with distckpt.Checkpointer(where) as ckpt:
            ckpt.save(1, state)
            if parallel == "ddp":
                ckpt.save(2, state, blocking=False)  # written by the writer process
                ckpt.wait()
        for step in (1, 2) if parallel == "ddp" else (1,):
            d = Path(where) / step_dir(step)
            recorded = json.loads((d / MANIFEST_NAME).read_text())["value_digests"]
            out[f"{parallel}{step}"] = (sorted(recorded), sorted(_non_tensor_keys(d)))
        fresh = _state(parallel, world, rank)
        with distckpt.Checkpointer(where) as ckpt:
            ckpt.load(fresh, step=1)
        groups = (fresh["optim"].optim if parallel == "zero" else fresh["optim"]).param_groups
        out[f"{parallel}_loaded"] = ([g["lr"] for g in groups], fresh["sched"].last_epoch, fresh["mine"].obj)
        out[f"{parallel}_lr_types"] = [type(g["lr"]).__name__ for g in groups]

    # Swap the two groups' lr records (ranks write them: DDP replicas, one writer each) and re-seal.
    d = Path(f"{root}-ddp") / step_dir(2)
    if rank == 0:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = pickle.loads((d / ".metadata").read_bytes())
        a, b = MetadataIndex("optim.param_groups.0.weight.lr"), MetadataIndex("optim.param_groups.2.weight.lr")
        md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]
        data = pickle.dumps(md)
        (d / ".metadata").write_bytes(data)
        raw = json.loads((d / MANIFEST_NAME).read_text())
        raw["files"][".metadata"] = {"size": len(data), "checksum": digest_of(data, raw["checksum_algorithm"])}
        (d / MANIFEST_NAME).write_text(json.dumps(raw))
    dist.barrier()
    try:
        with distckpt.Checkpointer(f"{root}-ddp") as ckpt:
            ckpt.load(_state("ddp", world, rank), step=2)
        out["tampered"] = None
    except distckpt.IntegrityError as exc:
        out["tampered"] = str(exc)
    return out


def test_non_tensor_items_are_recorded_once_and_checked_at_two_ranks(tmp_path):
    results = run_ranks(_body, 2, tmp_path, str(tmp_path / "ck"))
    for r, res in enumerate(results):
        for case in ("ddp1", "ddp2", "zero1"):
            recorded, written = res[case]
            assert recorded == written, f"rank {r}: {case}: recorded {set(recorded) ^ set(written)} differently"
            assert "optim.param_groups.0.weight.lr" in recorded and "mine.rank_0" in recorded and "mine.rank_1" in recorded
        for parallel in ("ddp", "zero"):
            assert res[f"{parallel}_loaded"] == ([1e-2, 5e-3], 1, f"rank {r}"), (r, parallel, res[f"{parallel}_loaded"])
            assert res[f"{parallel}_lr_types"] == ["float", "float64"], (r, parallel, res[f"{parallel}_lr_types"])
        message = res["tampered"]
        assert message is not None and "non-tensor item 'optim.param_groups." in message and ".distcp" in message, message
    assert results[0]["tampered"] == results[1]["tampered"], "the same error on every rank"
