"""The state check of verified resume with loads that cast (a bf16 checkpoint into an fp32 model),
and with empty DTensors: correct loads pass, wrong values are still caught, and what a cast could
not keep is never called proven."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import distckpt
from distckpt._dist import Group
from distckpt.load.verify import diverged_keys
from distckpt.state import fingerprint
from distckpt.state.casts import exact_cast

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def test_exact_casts():
    assert exact_cast(torch.bfloat16, torch.float32) and exact_cast(torch.float16, torch.float64)
    assert exact_cast(torch.float8_e4m3fn, torch.bfloat16) and exact_cast(torch.int32, torch.int64)
    assert exact_cast(torch.int16, torch.float32) and exact_cast(torch.bool, torch.int8)
    assert not exact_cast(torch.float32, torch.bfloat16) and not exact_cast(torch.bfloat16, torch.float16)
    assert not exact_cast(torch.int64, torch.float64) and not exact_cast(torch.uint8, torch.int8)
    assert not exact_cast(torch.float32, torch.bool) and not exact_cast(torch.complex64, torch.float32)


def _saved(flat: dict) -> dict[str, str]:
    return {k: fingerprint.digest(t, g, d) for k, _, _, g, d, t in fingerprint.local_parts(flat)}


def test_a_cast_load_is_judged_by_casting_back():
    """A bf16 checkpoint loaded into fp32 tensors was judged by the fp32 values' fingerprint
    (another dtype in the digest): every resharded load of it failed with StateDivergedError,
    values intact. Found by a helper (2026-11-29)."""
    torch.manual_seed(0)
    saved_bf16 = {"w": torch.randn(5, 7).to(torch.bfloat16), "n": torch.arange(6, dtype=torch.int32)}
    saved = _saved(saved_bf16)
    dtypes = {"w": torch.bfloat16, "n": torch.int32}
    loaded = {"w": saved_bf16["w"].float(), "n": saved_bf16["n"].long()}
    group = Group(None)
    assert diverged_keys(group, lambda: loaded, saved, ["n", "w"], "check", saved_dtypes=dtypes) == []
    assert diverged_keys(group, lambda: loaded, saved, ["n", "w"], "check") == ["n", "w"]  # without: the old false alarm
    for change in (1e-6, 1.0):  # one not representable in bf16, one that is
        wrong = {"w": loaded["w"].clone(), "n": loaded["n"]}
        wrong["w"][2, 3] += change
        assert diverged_keys(group, lambda: wrong, saved, ["n", "w"], "check", saved_dtypes=dtypes) == ["w"], change
    # fp32 saved, loaded into bf16: the cast lost values; never judged, always reported unproven
    fp32 = {"w": torch.randn(4)}
    unproven: list[str] = []
    narrowed = {"w": fp32["w"].to(torch.bfloat16)}
    assert diverged_keys(group, lambda: narrowed, _saved(fp32), ["w"], "check", saved_dtypes={"w": torch.float32}, unproven=unproven) == []
    assert unproven == ["w"]
    # A NaN's bits do not survive casts (fp32 NaN -> bf16 0xFFFF, whatever the saved one was):
    # a tensor holding one is unproven, never called diverged.
    with_nan = {"w": saved_bf16["w"].clone()}
    with_nan["w"][0, 0] = float("nan")
    unproven = []
    loaded_nan = {"w": with_nan["w"].float()}
    assert diverged_keys(group, lambda: loaded_nan, _saved(with_nan), ["w"], "check", saved_dtypes=dtypes, unproven=unproven) == []
    assert unproven == ["w"]


class _Net(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 4).to(dtype)
        self.empty = nn.Parameter(torch.empty(4, 0, dtype=dtype), requires_grad=False)


def _fsdp(world: int, dtype: torch.dtype) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _Net(dtype)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def _save(rank: int, world: int, root: str) -> bool:
    with distckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": _fsdp(world, torch.bfloat16)})
    return True


def _load(rank: int, world: int, root: str, dtype: torch.dtype, verify_state) -> str:
    model = _fsdp(world, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with warnings.catch_warnings(record=True) as seen, distckpt.Checkpointer(root) as ck:
        warnings.simplefilter("always")
        try:
            ck.load({"model": model}, verify_state=verify_state)
        except distckpt.CheckpointError as exc:
            return f"refused: {exc}"
    want = _Net(torch.bfloat16).lin.weight.to(dtype)
    assert torch.equal(model.lin.weight.full_tensor(), want)
    return "; ".join(str(w.message) for w in seen if "cannot hold" in str(w.message) or "could not verify" in str(w.message)) or "loaded"


def test_resharded_loads_with_casts_and_empty_parameters(tmp_path):
    """Saved at 1 rank in bf16 (with an empty (4, 0) parameter), loaded at 2 ranks: the default
    check (due: the world size changed) failed on both the fp32 cast and the empty parameter
    (FSDP2 gives an empty block no chunk: no rank counted a copy). Found by helpers (2026-11-29)."""
    from dist_harness import run_ranks

    root = str(tmp_path / "root")
    assert run_ranks(_save, 1, tmp_path, root) == [True]
    assert run_ranks(_load, 2, tmp_path, root, torch.float32, None) == ["loaded", "loaded"]
    assert run_ranks(_load, 2, tmp_path, root, torch.float32, True) == ["loaded", "loaded"]
    # bf16 into fp16 loses values (fp16's range is smaller): not provable (the empty one is).
    got = run_ranks(_load, 2, tmp_path, root, torch.float16, None)
    assert all(g.count("distckpt:") == 1 and "casts 2 tensor(s)" in g and "model.lin.weight" in g for g in got), got  # one warning
    got = run_ranks(_load, 2, tmp_path, root, torch.float16, True)
    assert all(g.startswith("refused: load(verify_state=True)") and "bfloat16 into float16" in g for g in got), got
