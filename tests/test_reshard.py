"""Save at world size N, load at M, for every N, M in 1..4 and DDP / ZeRO / FSDP2 in any combination.

Weights and every optimizer state entry (exp_avg, exp_avg_sq, step, param-group hyper-parameters)
must equal what was saved, exactly; at the same world size and parallelism, one more training
step after the load must equal the step the uninterrupted job took. Every load runs the state
check (``verify_state=True``): no layout change may raise a false alarm.
"""

from __future__ import annotations

import pytest

import distckpt
from dist_harness import run_ranks
from models import assert_same, full_model_state, full_optim_state, make_model, make_optimizer, train_steps, wrap

KINDS = ("ddp", "zero", "fsdp")
SAVE_WORLDS = (1, 2, 3, 4)
pytestmark = [pytest.mark.xdist_group("reshard"), pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")]


def _save_body(rank: int, world: int, root: str) -> dict:
    out = {}
    for kind in KINDS:
        model = wrap(make_model(seed=0), kind, world)
        optim = make_optimizer(model, kind)
        train_steps(model, optim, range(3), rank, world)
        ckpt = distckpt.Checkpointer(f"{root}/{kind}-{world}")
        ckpt.save(3, {"model": model, "optim": optim, "step": 3})
        ref_model, ref_optim = full_model_state(model), full_optim_state(model, optim)
        train_steps(model, optim, range(3, 4), rank, world)
        out[kind] = (ref_model, ref_optim, full_model_state(model))
    return out


def _load_body(rank: int, world: int, root: str) -> dict:
    out = {}
    for saved_kind in KINDS:
        for saved_world in SAVE_WORLDS:
            for kind in KINDS:
                model = wrap(make_model(seed=1), kind, world)
                optim = make_optimizer(model, kind)
                state = {"model": model, "optim": optim, "step": 0}
                # Verified: every N -> M, kind -> kind load proves it holds what was saved (no false alarm).
                step = distckpt.Checkpointer(f"{root}/{saved_kind}-{saved_world}").load(state, verify_state=True)
                assert step == 3 and state["step"] == 3
                model_sd, optim_sd, after = full_model_state(model), full_optim_state(model, optim), None
                if kind == saved_kind and world == saved_world:
                    train_steps(model, optim, range(3, 4), rank, world)
                    after = full_model_state(model)
                out[(saved_kind, saved_world, kind)] = (model_sd, optim_sd, after)
    return out


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    refs = {}
    for world in SAVE_WORLDS:
        results = run_ranks(_save_body, world, root, str(root))
        refs[world] = results[0]
    return root, refs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reshard_matrix(saved, world):
    root, refs = saved
    results = run_ranks(_load_body, world, root, str(root), timeout=200)
    checked = 0
    for (saved_kind, saved_world, kind), (model_sd, optim_sd, after) in results[0].items():
        ref_model, ref_optim, ref_after = refs[saved_world][saved_kind]
        what = f"{saved_kind}@{saved_world} -> {kind}@{world}"
        assert_same(ref_model, model_sd, what + " model")
        assert_same(ref_optim, optim_sd, what + " optimizer")
        if after is not None:
            assert_same(ref_after, after, what + " (one more step)")
        checked += 1
    assert checked == len(KINDS) * len(SAVE_WORLDS) * len(KINDS)


def test_replicated_tensors_are_written_once_spread_over_ranks(saved):
    root, _ = saved
    manifest = distckpt.Checkpointer(f"{root}/ddp-4").manifest()
    per_rank = {r: sum(f.size for n, f in manifest.files.items() if n.startswith(f"__{r}_")) for r in range(4)}
    total = sum(per_rank.values())
    # DDP state is replicated on all 4 ranks, yet each byte is written once (the checkpoint is no
    # bigger than at world size 1) and every rank writes a share.
    single = distckpt.Checkpointer(f"{root}/ddp-1").manifest()
    single_total = sum(f.size for n, f in single.files.items() if n.endswith(".distcp"))
    assert total < 1.5 * single_total, (total, single_total)
    assert all(size > 0 for size in per_rank.values()), per_rank
