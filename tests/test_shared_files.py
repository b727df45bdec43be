"""A rank's load reads its own files and the small shared ones, not every file of the step.

distckpt verifies whole files, so a load reads every byte of each file it takes anything from.
DCP's file split dealt the replicated values a rank writes (an optimizer's hyper-parameters and
step counters, the LR scheduler, plain values) round robin into every file: with FSDP2 and AdamW
every file held something every rank reads, and each rank read the whole checkpoint (4x its
share at 4 ranks; a node recovering from a peer was sent every file). distckpt now writes those
values into files of their own (:func:`distckpt.save.records.buckets`).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

import distckpt
from dist_harness import run_ranks
from distckpt.integrity.manifest import step_dir
from distckpt.integrity.stepfiles import StepFiles
from distckpt.save import records
from models import assert_same, full_model_state, full_optim_state, make_optimizer, make_wide_model, train_steps, wrap
from step_layout import keys_by_file


# -- the split ----------------------------------------------------------------------------------
def _item(key: str, nbytes: int | None) -> WriteItem:
    if nbytes is None:
        return WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO)
    size = torch.Size([nbytes // 4])
    return WriteItem(
        MetadataIndex(key, (0,)),
        WriteItemType.TENSOR,
        tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([0]), size), TensorProperties(dtype=torch.float32), size),
    )


def _keys(files: list[list[WriteItem]]) -> list[set[str]]:
    return [{i.index.fqn for i in f} for f in files]


def test_shared_items_get_files_of_their_own_only_beside_own_items():
    own = [_item(f"model.w{i}", 1 << 20) for i in range(4)]
    hyper = [_item(f"optim.param_groups.w{i}.lr", None) for i in range(4)] + [_item("optim.state.w0.step", 4)]
    shared = {i.index.fqn for i in hyper}
    files = records.buckets(own + hyper, 2, shared)
    # Two files of shards (DCP's rule over them alone), then one small file of the shared values.
    assert len(files) == 3 and _keys(files)[2] == shared
    assert _keys(files)[0] | _keys(files)[1] == {i.index.fqn for i in own}
    # DCP's rule would have dealt the byte items into both files of shards.
    dcp = records.split_by_size_and_type(2, own + hyper)
    assert all(k & shared for k in _keys(dcp))
    # Only one kind: DCP's own split, as before.
    assert _keys(records.buckets(hyper, 2, shared)) == _keys(records.split_by_size_and_type(2, hyper))
    assert _keys(records.buckets(own, 2, shared)) == _keys(records.split_by_size_and_type(2, own))
    # Without the planner's writers, non-tensor values still leave the files of shards; a
    # replicated tensor (the step counter) is then not known as such.
    assert _keys(records.buckets(own + hyper, 2, None))[2] == shared - {"optim.state.w0.step"}
    # No empty file where the own items are fewer than the threads.
    files = records.buckets(own[:1] + hyper, 4, shared)
    assert [len(f) for f in files] == [1, len(hyper)]
    # Own items below OWN_FILE_MIN_BYTES (a DDP rank's RNG state): DCP's split, no file more.
    rng = [_item("_rng.rank_0.torch", 5000)]
    assert _keys(records.buckets(rng + hyper, 2, shared)) == _keys(records.split_by_size_and_type(2, rng + hyper))


def test_large_shared_items_are_spread_over_up_to_thread_count_files(monkeypatch):
    monkeypatch.setattr(records, "SHARED_FILE_BYTES", 1000)
    monkeypatch.setattr(records, "OWN_FILE_MIN_BYTES", 1000)
    own = [_item(f"zero.w{i}", 4000) for i in range(4)]
    big = [_item(f"model.p{i}", 800) for i in range(10)]  # 8000 bytes: 8 files' worth, capped at 4
    files = records.buckets(own + big, 4, {i.index.fqn for i in big})
    assert len(files) == 8 and all(files)
    assert set().union(*_keys(files[4:])) == {i.index.fqn for i in big}
    files = records.buckets(own + big[:2], 4, {i.index.fqn for i in big})  # 2 items: 2 files at most
    assert len(files) == 6 and all(files)


# -- what a load reads ----------------------------------------------------------------------------
def _body(rank: int, world: int, root: str, parallel: str, mode: str) -> dict:
    model = wrap(make_wide_model(0), parallel, world)
    optim = make_optimizer(model, parallel)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3)
    train_steps(model, optim, range(2), rank, world)
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim, "sched": sched, "step": 2}, blocking=mode == "sync")
        ckpt.wait()
    want_model, want_optim = full_model_state(model), full_optim_state(model, optim)

    fresh = wrap(make_wide_model(1), parallel, world)
    fresh_optim = make_optimizer(fresh, parallel)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_optim, step_size=3)
    opened: list[str] = []
    real = StepFiles.file

    def file(self: StepFiles, name: str):  # every data file this rank's load opens
        opened.append(name)
        return real(self, name)

    StepFiles.file = file
    try:
        state = {"model": fresh, "optim": fresh_optim, "sched": fresh_sched, "step": 0}
        with distckpt.Checkpointer(root) as ckpt:
            assert ckpt.load(state) == 1
    finally:
        StepFiles.file = real
    assert state["step"] == 2 and fresh_sched.state_dict() == sched.state_dict()
    assert_same(want_model, full_model_state(fresh), f"rank {rank} model")
    assert_same(want_optim, full_optim_state(fresh, fresh_optim), f"rank {rank} optim")
    return {"opened": sorted(set(opened))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel,mode", [("fsdp", "sync"), ("fsdp", "async"), ("zero", "sync")])
def test_each_rank_reads_its_own_files_and_the_shared_ones_only(tmp_path, parallel, mode):
    world = 4
    results = run_ranks(_body, world, tmp_path, str(tmp_path / "root"), parallel, mode, timeout=240)
    step = tmp_path / "root" / step_dir(1)
    data = sorted(p.name for p in step.iterdir() if p.name.endswith(".distcp"))
    assert all(re.fullmatch(r"__\d+_\d+\.distcp", n) for n in data)
    keys, shards = keys_by_file(step)
    for rank, res in enumerate(results):
        others = [n for n in res["opened"] if n.endswith(".distcp") and not n.startswith(f"__{rank}_")]
        assert others, rank  # the values other ranks wrote (hyper-parameters, the scheduler, ...)
        if parallel == "fsdp":
            # Another rank's files that this rank opened hold none of that rank's shards.
            assert not any(shards.get(n) for n in others), (rank, others, data)
        else:
            # ZeRO: nor another rank's optimizer partition (only its owner reads it back at this
            # world size); the model, replicated and written once, is read by every rank.
            assert not any(k.startswith("optim.state.") for n in others for k in keys[n]), (rank, others, data)
