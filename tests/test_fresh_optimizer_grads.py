"""A fresh optimizer loaded while its parameters hold gradients (a forward/backward ran before
the resume: a warm-up, gradient accumulation). DCP makes the load target of an optimizer without
state by a step with zero gradients, and skips that step where any gradient exists: the target
then held no state. A strict load named every saved moment "unexpected"; ``strict=False``
resumed with fresh moments; and at several ranks, one with gradients loaded no state while the
others did, reported clean. Found by a helper (2026-12-06)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distckpt
from dist_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randn(8, 4)).square().sum().backward()
        optim.step()
        optim.zero_grad()


def _moments(optim: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    return [[s["step"], s["exp_avg"], s["exp_avg_sq"]] for s in (optim.state[p] for g in optim.param_groups for p in g["params"])]


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.mark.parametrize("strict", [True, False])
def test_a_fresh_optimizer_with_gradients_loads_its_state_and_keeps_them(tmp_path, strict):
    model = _net(0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optim, 3)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
    fresh = _net(1)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh(torch.randn(8, 4)).sum().backward()
    grads = [p.grad.clone() for p in fresh.parameters()]
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load({"model": fresh, "optim": fresh_optim}, strict=strict)
        assert ckpt.last_load_report.clean, ckpt.last_load_report
    assert _same(_moments(fresh_optim), _moments(optim))
    assert all(torch.equal(p.grad, g) for p, g in zip(fresh.parameters(), grads))  # given back, untouched


def _ddp_body(rank: int, world: int, root: str) -> list[list[torch.Tensor]]:
    model = nn.parallel.DistributedDataParallel(_net(0))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optim, 3)
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
    fresh = nn.parallel.DistributedDataParallel(_net(1))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    if rank == 1:  # only this rank ran a backward before resuming
        for p in fresh.parameters():
            p.grad = torch.ones_like(p)
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.load({"model": fresh, "optim": fresh_optim})
    assert _same(_moments(fresh_optim), _moments(optim)), rank
    return _moments(fresh_optim)


@pytest.mark.timeout(120)
def test_replicas_load_the_same_optimizer_state_whichever_holds_gradients(tmp_path):
    got = run_ranks(_ddp_body, 2, tmp_path, str(tmp_path / "root"), timeout=100)
    assert _same(got[0], got[1])


def _zero_body(rank: int, world: int, root: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def made(seed: int):
        model = nn.parallel.DistributedDataParallel(_net(seed))
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)

    model, optim = made(0)
    _train(model, optim, 3)
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
    fresh, fresh_optim = made(1)
    if rank == 1:
        for p in fresh.parameters():
            p.grad = torch.ones_like(p)
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.load({"model": fresh, "optim": fresh_optim})
    assert len(fresh_optim.optim.state) == len(optim.optim.state) > 0, (rank, len(fresh_optim.optim.state))
    for p_old, p_new in zip(optim.optim.param_groups[0]["params"], fresh_optim.optim.param_groups[0]["params"]):
        assert torch.equal(optim.optim.state[p_old]["exp_avg"], fresh_optim.optim.state[p_new]["exp_avg"]), rank


@pytest.mark.timeout(120)
def test_a_zero_optimizer_with_gradients_on_one_rank_loads_its_state(tmp_path):
    run_ranks(_zero_body, 2, tmp_path, str(tmp_path / "root"), timeout=100)


def _held(optim: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """:func:`_moments` of the parameters holding state (without adding empty entries)."""
    return [[s["step"], s["exp_avg"], s["exp_avg_sq"]] for s in (optim.state[p] for g in optim.param_groups for p in g["params"] if optim.state.get(p))]


def _stepped_without_one(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and Adam that stepped while its last bias was frozen: no state for that bias."""
    model = _net(seed)
    model[2].bias.requires_grad_(False)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, optim, 1)
    model[2].bias.requires_grad_(True)
    assert model[2].bias not in optim.state
    return model, optim


def test_a_stepped_optimizer_takes_the_state_of_a_parameter_it_held_none_for(tmp_path):
    """An optimizer that had stepped but held no state for one of its parameters (frozen until
    then, unfrozen for the resume) refused that parameter's saved state as "unexpected"
    (``strict=False``: dropped it), where torch's ``load_state_dict`` takes it. Found by a
    helper (2026-12-07)."""
    model, optim = _net(0), None
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, optim, 3)
    with distckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(3, {"model": model, "optim": optim})
        for strict in (True, False):
            other, other_optim = _stepped_without_one(5)
            ckpt.load({"model": other, "optim": other_optim}, strict=strict)
            assert _same(_moments(other_optim), _moments(optim)), strict
            assert strict or ckpt.last_load_report.clean, ckpt.last_load_report
        # Where the load reads nothing for it (excluded), it keeps none, as before the load;
        # the others take the checkpoint's.
        other, other_optim = _stepped_without_one(5)
        ckpt.load({"model": other, "optim": other_optim}, exclude="optim.state.2.bias.*")
        assert not other_optim.state.get(other[2].bias)
        assert _same(_held(other_optim), _moments(optim)[:3])
        # A load that fails leaves it without state, and the others' state as it was.
        other, other_optim = _stepped_without_one(5)
        before = _held(other_optim)
        with pytest.raises(distckpt.StateMismatchError):
            ckpt.load({"model": other, "optim": other_optim, "extra": torch.zeros(2)})
        assert other[2].bias not in other_optim.state and _same(_held(other_optim), before)


def test_a_fresh_sparse_adam_resumes(tmp_path):
    """SparseAdam refuses dense gradients: the load target of a fresh one (made by a step with
    zero gradients) failed with torch's bare "SparseAdam does not support dense gradients",
    naming no entry; a checkpoint of it could be loaded only into one that had stepped. Found
    by a helper (2026-12-07)."""

    def build(seed: int):
        torch.manual_seed(seed)
        emb = nn.Embedding(10, 3, sparse=True)
        return emb, torch.optim.SparseAdam(emb.parameters(), lr=0.1)

    def train(emb, optim, steps):
        for i in range(steps):
            emb(torch.tensor([i % 10, (3 * i) % 10])).sum().backward()
            optim.step()
            optim.zero_grad()

    emb, optim = build(0)
    train(emb, optim, 3)
    with distckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(3, {"model": emb, "optim": optim})
        other, other_optim = build(7)
        ckpt.load({"model": other, "optim": other_optim})
    assert torch.equal(other.weight, emb.weight)
    assert other_optim.state[other.weight]["step"] == optim.state[emb.weight]["step"] == 3
    assert all(torch.equal(other_optim.state[other.weight][k], optim.state[emb.weight][k]) for k in ("exp_avg", "exp_avg_sq"))
    train(emb, optim, 2)
    train(other, other_optim, 2)
    assert torch.equal(other.weight, emb.weight)


def test_a_frozen_parameters_saved_state_is_reported_not_dropped_and_no_hook_sees_the_target_step(tmp_path):
    """Review of the change above (2026-12-07): (1) a frozen parameter (``requires_grad=False``,
    LoRA-style) got the target's state too, DCP's ``set_optimizer_state_dict`` then skipped it,
    and the load reported clean: its saved state was dropped silently (it is "unexpected", as
    before); (2) the zero-gradient step ran the user's step hooks on an optimizer that had
    stepped (an EMA update, a step counter)."""
    model = _net(0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, optim, 2)
    fired: list[str] = []
    with distckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(2, {"model": model, "optim": optim})
        for stepped in (False, True):
            if stepped:  # frozen again: the parameter it holds no state for
                other, other_optim = _stepped_without_one(5)
                frozen, key = other[2].bias, "optim.state.2.bias."
            else:
                other = _net(5)
                other_optim = torch.optim.AdamW(other.parameters(), lr=0.05)
                frozen, key = other[0].weight, "optim.state.0.weight."
            frozen.requires_grad_(False)
            other_optim.register_step_pre_hook(lambda *a: fired.append("pre"))
            other_optim.register_step_post_hook(lambda *a: fired.append("post"))
            with pytest.raises(distckpt.StateMismatchError, match=r"unexpected keys .*" + key.replace(".", r"\.") + "exp_avg"):
                ckpt.load({"model": other, "optim": other_optim})
            ckpt.load({"model": other, "optim": other_optim}, strict=False)
            assert any(k.startswith(key) for k in ckpt.last_load_report.unexpected), (stepped, ckpt.last_load_report)
            assert not other_optim.state.get(frozen), stepped
            assert other_optim.state.get(other[2].weight), "the others take their saved state"
    assert fired == [], fired


def test_no_step_hook_sees_the_target_step_of_a_subclass_calling_super_step(tmp_path):
    """Review (2026-12-07): skipping only the class's own hook wrapper left the hooks to the
    ``super().step()`` of a subclass (once any plain Adam exists, Adam's step is wrapped too),
    and global hooks ran as well."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    class MyAdam(torch.optim.Adam):
        def step(self, closure=None):
            return super().step(closure)

    torch.optim.Adam(_net(0).parameters())  # (hooks Adam.step)
    model = _net(0)
    optim = MyAdam(model.parameters(), lr=0.05)
    _train(model, optim, 2)
    fired: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda *a: fired.append("global pre")),
        register_optimizer_step_post_hook(lambda *a: fired.append("global post")),
    ]
    try:
        with distckpt.Checkpointer(tmp_path / "root") as ckpt:
            ckpt.save(2, {"model": model, "optim": optim})
            for stepped in (False, True):
                other, other_optim = _net(5), None
                other_optim = MyAdam(other.parameters(), lr=0.05)
                if stepped:  # and holds no state for one parameter
                    other[2].bias.requires_grad_(False)
                    _train(other, other_optim, 1)
                    other[2].bias.requires_grad_(True)
                other_optim.register_step_pre_hook(lambda *a: fired.append("pre"))
                other_optim.register_step_post_hook(lambda *a: fired.append("post"))
                fired.clear()
                ckpt.load({"model": other, "optim": other_optim})
                assert fired == [], (stepped, fired)
                assert _same(_moments(other_optim), _moments(optim))
        _train(other, other_optim, 1)  # the hooks are back, in place (torch runs them per wrapper)
        assert fired[:2] == ["global pre", "pre"] and fired[-2:] == ["post", "global post"], fired
    finally:
        for h in handles:
            h.remove()


def test_an_optimizer_whose_step_needs_a_closure_is_named(tmp_path):
    """Review (2026-12-07): an Adam checkpoint loaded into a fresh LBFGS failed with torch's bare
    "step() missing 1 required positional argument: 'closure'"."""
    model = _net(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, optim, 1)
    with distckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        other = _net(5)
        with pytest.raises(TypeError, match="cannot load optimizer state into LBFGS: its load target is made by a step"):
            ckpt.load({"model": other, "optim": torch.optim.LBFGS(other.parameters())})


def _zero_one_cycle(seed: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = DDP(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)))
    optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.0)
    return {"model": model, "optim": optim, "sched": torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=0.05, total_steps=20)}


def _zero_one_cycle_body(rank: int, world: int, root: str) -> bool:
    state = _zero_one_cycle(0)
    for _ in range(3):
        state["optim"].zero_grad()
        state["model"](torch.randn(4, 6)).square().mean().backward()
        state["optim"].step()
        state["sched"].step()
    buffers = {i: s["momentum_buffer"].clone() for i, s in enumerate(state["optim"].optim.state.values())}
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(3, state)
        fresh = _zero_one_cycle(1)
        ckpt.load(fresh)
    got = {i: s["momentum_buffer"] for i, s in enumerate(fresh["optim"].optim.state.values())}
    return bool(buffers) and buffers.keys() == got.keys() and all(torch.equal(buffers[i], got[i]) for i in buffers)


@pytest.mark.timeout(150)
def test_zero_with_a_scheduler_that_sets_momentum_loads_its_momentum(tmp_path):
    """ZeroRedundancyOptimizer(SGD, momentum=0) with OneCycleLR (which sets momentum on the
    wrapper's groups): the load target was made with the local optimizer's momentum 0, so the
    saved momentum buffers were "unexpected keys", at the same world size and layout."""
    assert run_ranks(_zero_one_cycle_body, 2, tmp_path, str(tmp_path / "root"), timeout=120) == [True, True]
