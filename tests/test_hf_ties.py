"""Tied weights through ``save_pretrained`` / ``load_pretrained``: FSDP2 ranks holding an empty
shard of the tied tensor, and ``strip_prefix`` leaving out the tie's first key. Found by a
helper (2026-12-06, /tmp/attack37)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_harness import run_ranks
from distckpt.tools import hf

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


class _Tied(nn.Module):
    """A language-model shape: the head shares the embedding (4 rows: at 3 FSDP2 ranks the
    last rank's shard of it is empty)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(4, 6)
        self.body = nn.Linear(6, 5)
        self.head = nn.Linear(6, 4, bias=False)
        self.head.weight = self.embed.weight


def _sharded(seed: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = _Tied(seed)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(m.body, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _full(m: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in m.state_dict().items()}


def _publish_and_load_body(rank: int, world: int, out: str) -> tuple:
    saved = _sharded(0, world)
    hf.save_pretrained(saved, out)
    fresh = _sharded(7, world)
    report = hf.load_pretrained(fresh, out)
    a, b = _full(saved), _full(fresh)
    return report.missing, report.tied, [k for k in a if not torch.equal(a[k], b[k])]


def test_tied_weights_with_an_empty_shard_on_a_rank_publish_and_load(tmp_path):
    """The rank whose shard of the tied tensor was empty never saw the tie (ties were told by
    data pointer, and empty shards were skipped): ``save_pretrained`` failed on every rank with
    "ranks disagree on the model's keys", ``load_pretrained`` with "missing keys: head.weight"."""
    out = run_ranks(_publish_and_load_body, 3, tmp_path, str(tmp_path / "pub"), timeout=120)
    assert out == [([], {"head.weight": "embed.weight"}, [])] * 3, out


class _HeadFirst(nn.Module):
    """A head registered before the backbone it shares its weight with: the tie's first key
    (``head.weight``) lies outside the backbone's prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 10, bias=False)
        self.model = nn.Module()
        self.model.embed = nn.Embedding(10, 4)
        self.model.proj = nn.Linear(4, 4)
        self.head.weight = self.model.embed.weight


def test_strip_prefix_publishes_a_tied_weight_whose_first_key_it_leaves_out(tmp_path):
    """``strip_prefix="model."`` skipped ``model.embed.weight`` as the tie's duplicate and
    ``head.weight`` for lacking the prefix: the embedding was published nowhere, silently."""
    m = _HeadFirst()
    hf.save_pretrained(m, tmp_path / "pub", strip_prefix="model.")
    backbone = nn.Module()
    backbone.embed = nn.Embedding(10, 4)
    backbone.proj = nn.Linear(4, 4)
    report = hf.load_pretrained(backbone, tmp_path / "pub")
    assert report.missing == [] and report.loaded == 3
    assert torch.equal(backbone.embed.weight, m.model.embed.weight)


def test_load_pretrained_names_values_a_narrower_dtype_turned_into_inf(tmp_path):
    """float32 values beyond float16's range, loaded into a float16 model, became inf with no
    word (Checkpointer.load warns about such casts); values within range load without one."""
    import warnings

    from safetensors.torch import save_file

    save_file({"weight": torch.tensor([[1e5, 3.0e38, 1.0]]), "bias": torch.tensor([0.5])}, str(tmp_path / "model.safetensors"))
    m = nn.Linear(3, 1).to(torch.float16)
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) hold values beyond the range of the model's dtype.*weight \(torch.float32 into torch.float16\)"):
        hf.load_pretrained(m, tmp_path)
    save_file({"weight": torch.tensor([[1e3, 3.0, 1.0]]), "bias": torch.tensor([0.5])}, str(tmp_path / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", ".*torch.distributed is disabled")
        hf.load_pretrained(m, tmp_path)
    assert m.weight.tolist() == [[1000.0, 3.0, 1.0]]


def test_load_pretrained_into_a_float8_model_names_saturated_values(tmp_path):
    """A bf16 file into a float8_e4m3fn model failed after the read had written into it
    (``isinf`` has no float8 kernel) naming nothing, and float8_e4m3fn saturates: 500 loads as
    448, which cannot be told from a true 448 afterwards. The values are judged before the
    cast: one warning names the key; values within range (and an inf file value into a type
    that holds inf) load without one. Found by a helper (2026-12-06, /tmp/attack52)."""
    import warnings

    from safetensors.torch import save_file

    class M(nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 2, dtype=dtype), requires_grad=False)

    save_file({"w": torch.tensor([[1.0, 2.0], [500.0, -3.0]], dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    m = M(torch.float8_e4m3fn)
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) hold values beyond.*w \(torch.bfloat16 into torch.float8_e4m3fn\)"):
        hf.load_pretrained(m, tmp_path)
    # (torch 2.13 saturates to 448, 2.11 gives NaN: whatever torch's own cast gives.)
    want = torch.tensor([[1.0, 2.0], [500.0, -3.0]], dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    assert torch.equal(m.w.view(torch.uint8), want.view(torch.uint8))
    for dtype, values in ((torch.float8_e5m2, [[1.0, 2.0], [500.0, -3.0]]), (torch.float16, [[1.0, float("inf")], [500.0, -3.0]])):
        save_file({"w": torch.tensor(values, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
        m = M(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            warnings.filterwarnings("ignore", ".*torch.distributed is disabled")
            hf.load_pretrained(m, tmp_path)
        assert torch.equal(m.w, torch.tensor(values, dtype=torch.bfloat16).to(dtype)), dtype


def test_tied_weights_stored_twice_with_values_beyond_the_range_are_named(tmp_path):
    """Review of bb55558: tied weights stored under both keys (embedding and head), float32
    values beyond float16's into a float16 model: the warning looked up the popped tied key and
    raised KeyError (under FSDP2 on the ranks whose rows held the value only)."""
    from safetensors.torch import save_file

    w = torch.tensor([[1.0, 2.0], [1e5, 3.0], [0.5, 0.25], [4.0, 5.0]])
    save_file({"embed.weight": w, "head.weight": w.clone()}, str(tmp_path / "model.safetensors"))
    m = nn.Module()
    m.embed = nn.Embedding(4, 2).to(torch.float16)
    m.head = nn.Linear(2, 4, bias=False).to(torch.float16)
    m.head.weight = m.embed.weight
    with pytest.warns(UserWarning, match=r"2 tensor\(s\) hold values beyond.*embed\.weight \(torch.float32 into torch.float16\), head\.weight"):
        hf.load_pretrained(m, tmp_path)
    assert m.embed.weight[1, 0].item() == float("inf")


def test_beyond_range_judges_the_values_before_the_cast():
    """The thresholds: float16 rounds to inf from 65520; float8_e4m3fn saturates (from 464);
    an infinity is lost only into a type without infinities, also one of a wider range."""
    from distckpt.tools.safetensors_io import beyond_range

    f16, e4, e5, e5z = torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e5m2fnuz
    inf, nan = float("inf"), float("nan")
    assert not beyond_range(torch.tensor([65519.0, -65519.0, inf, nan]), f16)
    assert beyond_range(torch.tensor([65520.0]), f16) and beyond_range(torch.tensor([-1e9]), f16)
    assert not beyond_range(torch.tensor([463.0]), e4) and beyond_range(torch.tensor([464.0]), e4)
    assert beyond_range(torch.tensor([inf]), e4) and not beyond_range(torch.tensor([inf]), e5)
    assert beyond_range(torch.tensor([inf], dtype=e5), e5z) and not beyond_range(torch.tensor([1.0], dtype=e5), e5z)
    assert not beyond_range(torch.tensor([3e38]), torch.bfloat16) and not beyond_range(torch.tensor([1e6], dtype=e5), f16)
    assert not beyond_range(torch.tensor([], dtype=torch.float64), f16) and not beyond_range(torch.tensor([7]), f16)
