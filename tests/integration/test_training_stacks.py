"""distckpt driven by the libraries users train with: a ``transformers`` Llama (from a config, random
init, no downloads) under FSDP2 and DDP with AdamW (two param groups) and a warm-up scheduler, and
torchdata's ``StatefulDataLoader`` over a ``DistributedSampler`` (per rank, shuffled) at
``num_workers`` 0 and 2, all in the checkpointed state.

One job (FSDP2, 2 ranks) trains, evaluates under ``no_grad``, saves asynchronously while training
goes on, and records what follows; resumes from that checkpoint must continue it:

* FSDP2 at 2 ranks: losses bit-identical, each rank's next batches identical;
* DDP at 3 ranks (other world size and parallelism): strict refuses the per-rank loaders naming
  them; ``strict=False`` skips them and the losses continue within float tolerance.

The checkpoint is also exported with ``distckpt convert --to safetensors --key model`` and
loaded by ``transformers``' own ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

import distckpt  # noqa: E402
from dist_harness import run_ranks  # noqa: E402

pytestmark = [pytest.mark.xdist_group("training_stacks"), pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")]
REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 6  # divides by 1, 2 and 3
SAVE_AT, STEPS = 3, 5


def _config():
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip


def _model(parallel: str, world: int):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    return model


def _optim_sched(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 3))
    return optim, sched


def _loaders(rank: int, world: int) -> dict:
    from torch.utils.data import DistributedSampler

    out = {}
    for workers in (0, 2):
        sampler = DistributedSampler(range(96), num_replicas=world, rank=rank, shuffle=True, seed=7)
        out[f"loader{workers}"] = stateful_dataloader.StatefulDataLoader(list(range(96)), batch_size=4, sampler=sampler, num_workers=workers)
    return out


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    tokens = torch.randint(0, 96, (GLOBAL_BATCH, 10), generator=torch.Generator().manual_seed(step))
    per = GLOBAL_BATCH // world
    return tokens[rank * per : (rank + 1) * per]


def _train_step(model, optim, sched, step: int, rank: int, world: int) -> float:
    import torch.distributed as dist

    x = _batch(step, rank, world)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / world


def _job(rank: int, world: int, root: str, parallel: str, mode: str) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    model = _model(parallel, world)
    optim, sched = _optim_sched(model)
    loaders = _loaders(rank, world)
    iters = {}
    state = {"model": model, "optim": optim, "sched": sched, "step": 0, **loaders}
    ckpt = distckpt.Checkpointer(root)
    out: dict = {"losses": {}, "batches": {}}
    start = 1
    if mode == "train":
        for name, loader in loaders.items():
            iters[name] = iter(loader)
            for _ in range(2):
                next(iters[name])
        for step in range(1, SAVE_AT + 1):
            out["losses"][step] = _train_step(model, optim, sched, step, rank, world)
        model.eval()
        with torch.no_grad():  # evaluate, then save: FSDP2's root is left unsharded
            model(input_ids=_batch(0, rank, world))
        model.train()
        state["step"] = SAVE_AT
        ckpt.save(SAVE_AT, state, blocking=False)  # training goes on while it writes
        start = SAVE_AT + 1
    else:
        strict_error = None
        try:
            ckpt.load(state)
        except distckpt.StateMismatchError as exc:
            strict_error = (str(exc), sorted(exc.per_rank))
            state = {"model": model, "optim": optim, "sched": sched, "step": 0, **loaders}
            with pytest.warns(UserWarning, match="per-rank state"):
                ckpt.load(state, strict=False)
        out["strict_error"] = strict_error
        out["skipped"] = sorted(ckpt.last_load_report.skipped)
        start = state["step"] + 1
        iters = {name: iter(loader) for name, loader in loaders.items()}
    for name, it in iters.items():
        out["batches"][name] = [next(it).tolist() for _ in range(2)]
    for step in range(start, STEPS + 1):
        out["losses"][step] = _train_step(model, optim, sched, step, rank, world)
    ckpt.close()
    return out


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stacks")
    root = str(tmp / "ck")
    return tmp, root, run_ranks(_job, 2, tmp, root, "fsdp", "train")


def test_resume_same_world_size_and_parallelism_is_bit_identical(trained):
    tmp, root, reference = trained
    resumed = run_ranks(_job, 2, tmp, root, "fsdp", "resume")
    for r in range(2):
        assert resumed[r]["strict_error"] is None and resumed[r]["skipped"] == []
        for step in range(SAVE_AT + 1, STEPS + 1):
            assert resumed[r]["losses"][step] == reference[r]["losses"][step], (r, step)
        # each rank's next batches after the resume are the ones the uninterrupted job drew
        assert resumed[r]["batches"] == reference[r]["batches"], r
    assert reference[0]["batches"]["loader0"] != reference[1]["batches"]["loader0"], "ranks draw different data"


def test_resume_at_another_world_size_and_parallelism(trained):
    tmp, root, reference = trained
    resumed = run_ranks(_job, 3, tmp, root, "ddp", "resume")
    for r in range(3):
        message, per_rank = resumed[r]["strict_error"]
        assert per_rank == ["loader0", "loader2"] and "saved by 2 ranks, loading at 3" in message
        assert resumed[r]["skipped"] == ["loader0", "loader2"]
        for step in range(SAVE_AT + 1, STEPS + 1):
            assert resumed[r]["losses"][step] == pytest.approx(reference[0]["losses"][step], rel=1e-4), step


def test_exported_safetensors_load_with_from_pretrained(trained, tmp_path):
    _, root, _ = trained
    out = tmp_path / "hf"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "distckpt", "convert", root, "--to", "safetensors", str(out / "model.safetensors"), "--key", "model", "-q"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    _config().save_pretrained(str(out))
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # The same weights through distckpt's own load into a plain model: equal logits.
    torch.manual_seed(1)
    plain = transformers.LlamaForCausalLM(_config())
    distckpt.Checkpointer(root).load({"model": plain}, strict=False)
    x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(x).logits, plain(x).logits)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
