"""distckpt.state.module_keys gives and takes exactly what torch's get/set_model_state_dict do."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from dist_harness import run_ranks
from distckpt.state import module_keys

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Extra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.counter = 0

    def get_extra_state(self) -> dict:
        return {"counter": self.counter}

    def set_extra_state(self, state: dict) -> None:
        self.counter = state["counter"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.extra = _Extra()
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def _same(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)
    for k in theirs:
        a, b = ours[k], theirs[k]
        if isinstance(b, torch.Tensor):
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and torch.equal(a, b), k
        else:
            assert a == b, k


@pytest.mark.parametrize("wrap", ["plain", "compiled"])
def test_state_dict_and_load_equal_torchs(wrap):
    torch.manual_seed(0)
    model = _Net()
    if wrap == "compiled":
        model = torch.compile(model)  # an OptimizedModule: keys carry _orig_mod. until cleaned
    ours, raw_of = module_keys.state_dict(model)
    _same(ours, get_model_state_dict(model))
    assert raw_of is not None and all("_orig_mod" not in k for k in ours)
    # Repeated calls use the cached mapping and still agree.
    _same(module_keys.state_dict(model)[0], get_model_state_dict(model))

    saved = {k: (v.clone() + 1 if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in ours.items()}
    saved["extra._extra_state"] = {"counter": 7}
    a, b = _Net(), _Net()
    if wrap == "compiled":
        a, b = torch.compile(a), torch.compile(b)
    _, raw_of_a = module_keys.state_dict(a)
    module_keys.load(a, dict(saved), raw_of_a)
    set_model_state_dict(b, dict(saved), options=StateDictOptions(strict=False))
    _same(module_keys.state_dict(a)[0], get_model_state_dict(a))
    for (ka, va), (kb, vb) in zip(get_model_state_dict(a).items(), get_model_state_dict(b).items()):
        assert ka == kb and (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb), ka
    inner_a = a._orig_mod if wrap == "compiled" else a
    assert inner_a.extra.counter == 7 and inner_a.head.weight is inner_a.emb.weight


def test_a_changed_structure_recomputes_the_mapping():
    outer = nn.Sequential(nn.Linear(2, 2))
    assert list(module_keys.state_dict(outer)[0]) == ["0.weight", "0.bias"]
    outer[0] = torch.compile(nn.Linear(2, 2))  # same key path, now through an OptimizedModule
    ours, _ = module_keys.state_dict(outer)
    _same(ours, get_model_state_dict(outer))
    assert list(ours) == ["0.weight", "0.bias"]


def test_a_module_without_state_fails_as_torchs_does():
    with pytest.raises(Exception) as theirs:
        get_model_state_dict(nn.ReLU())
    with pytest.raises(Exception) as ours:
        module_keys.state_dict(nn.ReLU())
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def _wrapped_body(rank: int, world: int) -> list[str]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    problems: list[str] = []
    for kind in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        model = _Net()
        if kind == "ddp":
            model = DDP(model)
        else:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        ours, raw_of = module_keys.state_dict(model)
        theirs = get_model_state_dict(model)
        if list(ours) != list(theirs):
            problems.append(f"{kind}: keys {list(ours)} != {list(theirs)}")
            continue
        for k, v in theirs.items():
            a = ours[k]
            if isinstance(v, DTensor):
                if not isinstance(a, DTensor) or a.placements != v.placements or a.to_local().data_ptr() != v.to_local().data_ptr():
                    problems.append(f"{kind}: {k} is not the same DTensor shard")
            elif isinstance(v, torch.Tensor) and a.data_ptr() != v.data_ptr():
                problems.append(f"{kind}: {k} is another tensor")
        # Load new values through the mapping: the live parameters hold them afterwards.
        new = {}
        for k, v in ours.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                new[k] = v.detach().clone() if not isinstance(v, DTensor) else v.detach().clone()
                new[k].fill_(rank + 3.0) if not isinstance(v, DTensor) else new[k].to_local().fill_(3.0)
            else:
                new[k] = v
        module_keys.load(model, new, raw_of)
        after = get_model_state_dict(model)
        for k, v in after.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                local = v.to_local() if isinstance(v, DTensor) else v
                want = 3.0 if isinstance(v, DTensor) else rank + 3.0
                if local.numel() and not bool((local == want).all()):
                    problems.append(f"{kind}: {k} not loaded")
    return problems


def test_ddp_and_fsdp2_equal_torchs(tmp_path):
    for problems in run_ranks(_wrapped_body, 2, tmp_path):
        assert not problems, problems


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*quantize:UserWarning")
def test_a_dynamically_quantized_model_loads_into_a_fresh_one(tmp_path):
    """torch.ao's quantize_dynamic: the save went through, every load raised a bare
    KeyError '0.weight' (the modules' versions were dropped from the dict loaded, so each read
    it in its oldest format). Found by a helper (2026-12-06)."""
    import distckpt

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        return torch.ao.quantization.quantize_dynamic(net, {torch.nn.Linear}, dtype=torch.qint8)

    saved, fresh = model(0), model(1)
    x = torch.randn(5, 8)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": saved})
        assert not torch.equal(fresh(x), saved(x))
        ckpt.load({"model": fresh})
    assert torch.equal(fresh(x), saved(x))


class _ExtraKeys(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.extra = {0: "seed-0", 7: 1.5, "cache": {}, "n": 3}
        self.got = None

    def get_extra_state(self) -> dict:
        return self.extra

    def set_extra_state(self, state: dict) -> None:
        self.got = state


def test_a_modules_extra_state_keeps_its_keys_and_empty_containers(tmp_path):
    """``get_extra_state()`` returning ``{0: seed, "cache": {}}`` was handed back to
    ``set_extra_state`` as ``{"0": seed}`` (int keys as text, the empty dict gone), silently;
    an object's own state_dict() kept them (found by a helper, 2026-12-07)."""
    import distckpt

    saved = torch.nn.Sequential(_ExtraKeys())
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": saved})
        fresh = torch.nn.Sequential(_ExtraKeys())
        fresh[0].extra = {0: "", 7: 0.0, "cache": {}, "n": 0}
        ckpt.load({"model": fresh})
    assert fresh[0].got == {0: "seed-0", 7: 1.5, "cache": {}, "n": 3}
