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
    # Complex types are pairs of their component type (found by a helper, 2026-12-06: every
    # cast involving complex was called lossy, and verify_state=True refused complex64 into
    # complex128).
    assert exact_cast(torch.complex64, torch.complex128) and exact_cast(torch.float32, torch.complex64)
    assert exact_cast(torch.bool, torch.complex64) and exact_cast(torch.int16, torch.complex64)
    assert not exact_cast(torch.complex128, torch.complex64) and not exact_cast(torch.float64, torch.complex64)
    assert not exact_cast(torch.int64, torch.complex128) and not exact_cast(torch.complex64, torch.float64)


def test_widening_complex_loads_are_proven(tmp_path):
    """complex64 into complex128, float32 into complex64: proven (a changed value still caught),
    with no warning (torch's complex-to-real cast warns: the real parts are taken)."""
    with distckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"x": {"c": torch.tensor([1 + 2j, -3j], dtype=torch.complex64), "f": torch.tensor([0.5, -2.0])}})
        dst = {"c": torch.zeros(2, dtype=torch.complex128), "f": torch.zeros(2, dtype=torch.complex64)}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.load({"x": dst}, verify_state=True)
    assert dst["c"].tolist() == [1 + 2j, -3j] and dst["f"].tolist() == [0.5 + 0j, -2 + 0j]
    group = Group(None)
    saved = _saved({"f": torch.tensor([0.5, -2.0])})
    for loaded, want in ((torch.tensor([0.5, -2.0 + 0j]), []), (torch.tensor([0.5 + 1j, -2.0]), ["f"])):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = diverged_keys(group, lambda: {"f": loaded}, saved, ["f"], "check", saved_dtypes={"f": torch.float32})
        assert got == want, loaded


class _Ema(torch.optim.SGD):
    """An optimizer keeping float32 state for a bfloat16 parameter (torch's load_state_dict casts
    it to the parameter's dtype)."""


def _ema_state(values: list[float]) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = _Ema([p], lr=0.1)
    opt.state[p]["ema"] = torch.tensor(values)
    return p, opt


@pytest.mark.parametrize("values", [[1.0001, 2.0002, 3.0, 1e-3], [1.0, 2.0, 0.5, -4.0]])
def test_a_cast_an_optimizer_makes_is_not_called_nan_nor_proven(tmp_path, values):
    """torch's Optimizer.load_state_dict casts a floating-point parameter's state to its dtype:
    float32 moments of a bfloat16 parameter came back bfloat16. verify_state=True accepted it,
    with a warning calling them tensors "holding NaN". Now named as the object's own cast: with
    verify_state=True a CheckpointError (the state is not the saved one), by default (a
    resharded load) a warning; values a bfloat16 holds exactly are proven by casting back. Found by a helper
    (2026-12-06, /tmp/attack52)."""
    p, opt = _ema_state(values)
    with distckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"optim": opt, "model": nn.ParameterList([p])})
        p2, opt2 = _ema_state([0.0] * 4)
        exact = torch.equal(torch.tensor(values).bfloat16().float(), torch.tensor(values))
        if exact:
            ck.load({"optim": opt2, "model": nn.ParameterList([p2])}, verify_state=True)
        else:
            with pytest.raises(distckpt.CheckpointError, match=r"were cast by their object's own load_state_dict into a dtype that did not keep.*optim\.state\.0\.ema"):
                ck.load({"optim": opt2, "model": nn.ParameterList([p2])}, verify_state=True)
        assert opt2.state[p2]["ema"].dtype == torch.bfloat16


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


def _load_ema(rank: int, world: int, root: str) -> str:
    p, opt = _ema_state([0.0] * 4)
    with warnings.catch_warnings(record=True) as seen, distckpt.Checkpointer(root) as ck:
        warnings.simplefilter("always")
        ck.load({"optim": opt, "model": nn.ParameterList([p])})
    assert opt.state[p]["ema"].dtype == torch.bfloat16
    return "; ".join(str(w.message) for w in seen if "distckpt" in str(w.message))


def test_the_default_check_of_a_resharded_load_names_an_optimizers_lossy_cast(tmp_path):
    """The default check (due here: saved by one process, loaded by two) names the tensors an
    optimizer's own cast changed, instead of calling them NaN-holding."""
    from dist_harness import run_ranks

    p, opt = _ema_state([1.0001, 2.0, 3.0, 4.0])
    with distckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"optim": opt, "model": nn.ParameterList([p])})
    for msg in run_ranks(_load_ema, 2, tmp_path, str(tmp_path), timeout=120):
        assert "were cast by their object's own load_state_dict into a dtype that did not keep" in msg and "optim.state.0.ema" in msg, msg
        assert "could not verify" not in msg, msg


class _Casting:
    """An object whose load_state_dict casts its tensor into another dtype."""

    def __init__(self, t: torch.Tensor, into: torch.dtype | None = None) -> None:
        self.t, self.into = t, into

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t = sd["t"].to(self.into)


@pytest.mark.parametrize(
    "saved, into",
    [
        (torch.tensor([1.0001, 2.0, float("nan")]), torch.bfloat16),  # NaN: a lossy cast cannot be shown harmless
        (torch.tensor([-1, 5], dtype=torch.int64), torch.uint64),  # -1 loads as 2**64 - 1, casts back to -1
        (torch.tensor([-1, 5], dtype=torch.int8), torch.uint8),
    ],
)
def test_object_casts_a_cast_back_cannot_prove_are_refused(tmp_path, saved, into):
    """Review of bb55558: an object's own lossy cast of a tensor holding NaN was accepted by
    verify_state=True, with the old "holding NaN" warning; a signed-to-unsigned cast of the same
    width was called proven (cast back, the bits match, the value changed)."""
    with distckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"o": _Casting(saved)})
        with pytest.raises(distckpt.CheckpointError, match=r"were cast by their object's own load_state_dict.*o\.t"):
            ck.load({"o": _Casting(torch.zeros_like(saved), into)}, verify_state=True)


def test_a_planned_lossy_cast_holding_nan_is_named_once(tmp_path):
    """Review of bb55558: a float32 checkpoint into a bfloat16 model, a tensor holding NaN, with
    the check due (saved with checksum=None): besides the planned cast's warning, a second one
    called it unverified for its NaN."""
    with distckpt.Checkpointer(tmp_path, checksum=None) as ck:
        ck.save(1, {"x": {"a": torch.tensor([1.0001, float("nan")]), "b": torch.tensor([1.5, 2.0])}})
        dst = {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.bfloat16)}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ck.load({"x": dst})
    said = [str(w.message) for w in seen if "distckpt" in str(w.message)]
    assert len(said) == 1 and "casts 2 tensor(s) into a dtype that cannot hold" in said[0], said
