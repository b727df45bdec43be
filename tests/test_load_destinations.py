"""Load destinations no load can fill are refused by name, on every rank, before anything is read."""
from __future__ import annotations

import warnings

import pytest
import torch

import distckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _expanded_on_rank_1(rank: int, world: int, root: str) -> str:
    with distckpt.Checkpointer(root) as ck:
        ck.save(1, {"a": torch.ones(4, 3), "b": torch.arange(3.0)})
        b = torch.zeros(3)
        a = torch.zeros(3).expand(4, 3) if rank == 1 else torch.zeros(4, 3)
        try:
            ck.load({"a": a, "b": b})
        except ValueError as e:
            assert torch.equal(b, torch.zeros(3)), "refused before anything was read"
            return str(e)
        return "loaded"


def test_an_expanded_destination_is_refused_on_every_rank_naming_the_key(tmp_path):
    """Loading into ``t.expand(...)`` failed inside the read with torch's "more than one element
    of the written-to tensor refers to a single memory location" (no key named), after other
    entries had been overwritten. Plain dcp.load fails the same way."""
    from dist_harness import run_ranks

    got = run_ranks(_expanded_on_rank_1, 2, tmp_path, str(tmp_path / "root"), timeout=120)
    for msg in got:
        assert "cannot load 'a'" in msg and "share memory" in msg and "stride (0, 1)" in msg, msg


def test_one_tensor_under_two_keys_saved_with_different_values_is_refused(tmp_path):
    """Two entries saved with different values, loaded into one shared tensor: both were read
    into it and the later one kept, with a clean report (plain dcp.load does the same). Found by
    a helper (2026-11-29)."""
    with distckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": {"a": torch.full((2,), 1.0), "b": torch.full((2,), 2.0), "c": torch.full((2,), 1.0)}})
        shared = torch.zeros(2)
        with pytest.raises(ValueError, match=r"one tensor under keys .* different values: 'w\.a' and 'w\.b'"):
            ck.load({"w": {"a": shared, "b": shared, "c": torch.zeros(2)}})
        assert torch.equal(shared, torch.zeros(2)), "refused before reading"
        ck.load({"w": {"a": shared, "b": shared, "c": torch.zeros(2)}}, exclude="w.b")  # one of them: loads
        assert torch.equal(shared, torch.full((2,), 1.0))
        same = torch.zeros(2)
        ck.load({"w": {"a": same, "c": same, "b": torch.zeros(2)}})  # equal values under both keys: fine
        assert torch.equal(same, torch.full((2,), 1.0))


def test_a_cast_that_loses_values_warns_naming_the_tensor(tmp_path):
    """A float64 checkpoint loaded into float32 (or int64 into float64) was cast silently, the
    report clean. Exact casts (bf16 into fp32) say nothing."""
    import warnings

    with distckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"f64": torch.tensor([0.1, 1 / 3], dtype=torch.float64), "i64": torch.tensor([2**53 + 1]), "bf": torch.ones(2, dtype=torch.bfloat16)})
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ck.load({"f64": torch.zeros(2), "i64": torch.zeros(1, dtype=torch.float64), "bf": torch.zeros(2)})
    lines = [str(w.message) for w in seen if "cannot hold" in str(w.message)]
    assert len(lines) == 1 and "casts 2 tensor(s)" in lines[0], lines
    assert "f64 (float64 into float32)" in lines[0] and "i64 (int64 into float64)" in lines[0] and "bf" not in lines[0].split(":")[-1]
    assert [w.filename for w in seen if "cannot hold" in str(w.message)] == [__file__]  # points at the caller


def test_overlapping_windows_are_refused_and_slices_load(tmp_path):
    """torch answers "too hard" for an as_strided window whose rows overlap (stride (1, 1)): it
    loaded silently wrong ([[1, 3], [3, 4]] for [[1, 2], [3, 4]]). Found by a helper reviewing
    the expand() refusal (2026-11-29). Column and stepped slices (also "too hard") load."""
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    with distckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": w, "col": torch.arange(3.0), "step": torch.arange(2.0)})
        window = torch.zeros(3).as_strided((2, 2), (1, 1))
        with pytest.raises(ValueError, match=r"cannot load 'w' .* share memory .* stride \(1, 1\)"):
            ck.load({"w": window, "col": torch.zeros(3), "step": torch.zeros(2)})
        base = torch.zeros(3, 4)
        ck.load({"w": torch.zeros(20).as_strided((2, 2), (5, 1)), "col": base[:, 1], "step": base[0, ::2]})
        assert torch.equal(base[:, 1], torch.arange(3.0)) and torch.equal(base[0, ::2], torch.arange(2.0))


def test_a_model_still_on_the_meta_device_is_refused_naming_its_keys(tmp_path):
    """Built under torch.device("meta") and loaded before to_empty: DCP's planner put fresh
    tensors in their place, the load returned normally and the model held no values (with a
    process group; without one, an error about the default process group, naming no key).
    Found by a helper (2026-12-06)."""
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(3, 2), "extra": {"x": torch.ones(2)}})
        with torch.device("meta"):
            model = torch.nn.Linear(3, 2)
        with pytest.raises(ValueError, match=r"meta device: 'model.weight', 'model.bias'.*to_empty"):
            ckpt.load({"model": model, "extra": {"x": torch.ones(2)}})
        with pytest.raises(ValueError, match=r"meta device: 'extra.x'"):
            ckpt.load({"model": torch.nn.Linear(3, 2), "extra": {"x": torch.empty(2, device="meta")}})
        model.to_empty(device="cpu")
        assert ckpt.load({"model": model, "extra": {"x": torch.zeros(2)}}) == 1


def _views(base: torch.Tensor) -> dict[str, torch.Tensor]:
    # The same element offset, shape and stride in one storage, other dtypes: other bytes.
    return {"a": base.view(torch.float32)[2:4], "b": base.view(torch.float64)[2:4]}


def test_views_of_one_storage_in_two_dtypes_are_not_taken_for_tied_weights(tmp_path):
    """Two tensors viewing one storage as float32 and float64 at the same element offset were
    taken for one tensor under two keys: a load of their own checkpoint was refused as "one
    tensor ... different values", a strict load of a checkpoint without the second key left it
    unloaded, unreported, and save_pretrained left it out. Found by a helper (2026-12-06,
    /tmp/attack52)."""
    from safetensors.torch import load_file

    from distckpt.tools import hf

    saved = _views(torch.arange(16, dtype=torch.float32))
    with distckpt.Checkpointer(tmp_path / "both") as ck:
        ck.save(1, {"x": saved})
        fresh = _views(torch.zeros(16, dtype=torch.float32))
        ck.load({"x": fresh})
    assert torch.equal(fresh["a"], saved["a"]) and torch.equal(fresh["b"], saved["b"])
    with distckpt.Checkpointer(tmp_path / "one") as ck:
        ck.save(1, {"x": {"a": torch.tensor([7.0, 8.0])}})
        with pytest.raises(distckpt.StateMismatchError, match=r"missing keys \(1\): x\.b"):
            ck.load({"x": _views(torch.zeros(16, dtype=torch.float32))})

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for k, v in _views(torch.arange(16, dtype=torch.float32)).items():
                self.register_buffer(k, v)

    hf.save_pretrained(M(), str(tmp_path / "hf"))
    assert sorted(load_file(str(tmp_path / "hf" / "model.safetensors"))) == ["a", "b"]


def test_destinations_that_share_memory_are_checked(tmp_path):
    """A flat buffer and a view of it in the state, loaded from a checkpoint whose values for them
    disagree: the key read last kept the shared elements, silently, at the same world size with
    the default verify_state (ties of the very same tensor were refused; partial overlaps not)."""
    import pytest

    import distckpt
    from distckpt.load.phases import sharing_memory
    from distckpt.state.statecheck import StateDivergedError

    g = torch.Generator().manual_seed(5)
    distckpt.Checkpointer(tmp_path / "apart").save(1, {"base": torch.randn(4, 3, generator=g), "v": torch.randn(2, 3, generator=g)})
    flat = torch.zeros(4, 3)
    with pytest.raises(StateDivergedError, match=r"read last kept the shared values.*: (v|base)$"):
        distckpt.Checkpointer(tmp_path / "apart").load({"base": flat, "v": flat[1:3]})
    # Saved from the same sharing: the values agree, so the load is exact and quiet.
    buf = torch.randn(4, 3, generator=g)
    distckpt.Checkpointer(tmp_path / "shared").save(1, {"base": buf, "v": buf[1:3]})
    flat = torch.zeros(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distckpt.Checkpointer(tmp_path / "shared").load({"base": flat, "v": flat[1:3]})
    assert torch.equal(flat, buf)
    # Without fingerprints nothing proves them: said.
    distckpt.Checkpointer(tmp_path / "bare", fingerprint=False).save(1, {"base": torch.ones(4, 3), "v": torch.ones(2, 3)})
    flat = torch.zeros(4, 3)
    with pytest.warns(UserWarning, match=r"memory another loaded tensor shares \(or may.*no recorded fingerprint.*base, v"):
        distckpt.Checkpointer(tmp_path / "bare").load({"base": flat, "v": flat[1:3]})
    # What is told apart: interleaved columns share no element; the very same tensor is a tie;
    # numpy views of one array are other storages over the same bytes.
    import numpy as np

    m = torch.zeros(4, 6)
    arr = np.zeros(10, dtype=np.float32)
    assert sharing_memory({"a": m[:, :3], "b": m[:, 3:], "c": m, "d": m}) == ["a", "b", "c", "d"]
    assert sharing_memory({"a": m[:, :3], "b": m[:, 3:], "c": m[:, ::2], "d": m[:, 1::2], "x": m[0], "y": m[0]}) == [
        "a", "b", "c", "d", "x", "y"
    ] and sharing_memory({"a": m[:, :3], "b": m[:, 3:]}) == sharing_memory({"c": m[:, ::2], "d": m[:, 1::2]}) == []
    assert sharing_memory({"t": m.t()[0], "u": m[1]}) == ["t", "u"] and sharing_memory({"t": m.t()[0], "u": m[1, 1:]}) == []
    assert sharing_memory({"x": m[0], "y": m[0], "z": m[0].view(torch.int32)}) == ["x", "y", "z"]
    assert sharing_memory({"x": m[0], "y": m[0]}) == []  # one tensor under two keys: a tie
    assert sharing_memory({"p": torch.from_numpy(arr[:6]), "q": torch.from_numpy(arr[5:])}) == ["p", "q"]
    assert sharing_memory({"p": torch.from_numpy(arr[:5]), "q": torch.from_numpy(arr[5:])}) == []
    # Decided from strides, not by enumerating elements (a review found 0.2-0.5 s per view of a
    # 2M-4M element buffer, on every load): a flat buffer and 200 views of it; the column halves
    # of a fused QKV-sized weight (apart, not taken to share for their size).
    big = torch.zeros(1024, 8192)
    flat = torch.zeros(4 << 20)

    def no_enumeration(*args, **kwargs):
        raise AssertionError("elements enumerated")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "isin", no_enumeration)
        views = {f"v{i}": flat[i * 10 : i * 10 + 5] for i in range(200)}
        assert sharing_memory({"flat": flat, **views}) == sorted(["flat", *views])
        assert sharing_memory({"l": big[:, :4096], "r": big[:, 4096:], "c": big[:, 4095:4097]}) == ["c", "l", "r"]
        assert sharing_memory({"l": big[:, :4096], "r": big[:, 4096:], "t": big[:, ::2], "u": big[1:, 1::2]}) == ["l", "r", "t", "u"]
        assert sharing_memory({"l": big[:, :4096], "r": big[:, 4096:]}) == sharing_memory({"t": big[:, ::2], "u": big[:, 1::2]}) == []


def test_two_storages_over_the_same_bytes_are_one_tensor(tmp_path):
    """from_numpy() of one array twice gives two storages over the same bytes: a tie neither
    check saw (not the same storage, and "the very same tensor" to the overlap check), so a
    checkpoint holding other values for the two keys loaded one of them wrong, silently."""
    import numpy as np

    import distckpt

    distckpt.Checkpointer(tmp_path).save(1, {"p": torch.ones(5), "q": torch.full((5,), 2.0)})
    arr = np.zeros(10, dtype=np.float32)
    with pytest.raises(ValueError, match=r"one tensor under keys the checkpoint holds with different values: 'p' and 'q'"):
        distckpt.Checkpointer(tmp_path).load({"p": torch.from_numpy(arr)[5:], "q": torch.from_numpy(arr[5:])})
    assert not arr.any()  # refused before reading
