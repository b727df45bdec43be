"""Tensor subclasses and nested tensors: a subclass with its own memory is saved as its values and loads back into
the user's subclass (sync and async alike); a wrapper of other tensors is refused at save, naming
the key."""
from __future__ import annotations

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import distckpt
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


class Tagged(torch.Tensor):
    """A subclass as users make them (``t.as_subclass``): torch.save pickles its class, which a
    weights-only load refuses."""


class TaggedParam(torch.nn.Parameter):
    pass


def _state() -> dict:
    return {
        "w": torch.arange(6.0).as_subclass(Tagged),
        "bf": torch.arange(6.0).to(torch.bfloat16).as_subclass(Tagged),
        "empty": torch.zeros(0, 3).as_subclass(Tagged),
        "col": torch.arange(12.0).as_subclass(Tagged).view(3, 4)[:, 1],
        "p": TaggedParam(torch.arange(3.0)),
    }


@pytest.mark.parametrize("blocking", [True, False])
def test_a_subclass_saves_its_values_and_loads_into_the_subclass(tmp_path, blocking):
    """A sync save wrote ``w`` as a pickled ``Tagged``: every load of the step then failed with
    UnsafeCheckpointError ("item 'w' needs code to be unpickled"), the other entries with it; an
    async save (staged into plain buffers) loaded. Found 2026-11-29."""
    state = _state()
    with distckpt.Checkpointer(tmp_path, async_mode="thread", verify_staging=True) as ck:
        ck.save(1, state, blocking=blocking)
        ck.wait()
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert type(out["w"]) is Tagged
        ck.load(out)
    for k, v in state.items():
        assert torch.equal(out[k].as_subclass(torch.Tensor), v.as_subclass(torch.Tensor)), k
    assert type(out["w"]) is Tagged  # filled in place
    # plain DCP reads the step too (it stays a standard checkpoint)
    plain = {"w": torch.zeros(6)}
    dcp_load(plain, storage_reader=FileSystemReader(str(tmp_path / "step_000000001")))
    assert torch.equal(plain["w"], torch.arange(6.0))


@pytest.mark.parametrize("blocking", [True, False])
def test_a_wrapper_subclass_is_refused_at_save_naming_the_key(tmp_path, blocking):
    """A wrapper of other tensors (TwoTensor; torchao's float8 and NF4 tensors are such) has no
    memory of its own: the save failed in the writer with ".numpy() is not supported for tensor
    subclasses", naming no key."""
    state = {"ok": torch.ones(2), "t": TwoTensor(torch.arange(4.0), torch.arange(4.0) * 2)}
    with distckpt.Checkpointer(tmp_path, async_mode="thread") as ck:
        with pytest.raises(TypeError, match=r"cannot save 't': it is a TwoTensor.*__tensor_flatten__"):
            ck.save(1, state, blocking=blocking)
        assert ck.steps() == []
        ck.save(1, {"ok": torch.ones(2), "a": state["t"].a, "b": state["t"].b})  # its parts save
        assert ck.steps() == [1]


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_are_refused_at_save_naming_the_key(tmp_path, layout):
    """A strided nested tensor failed in DCP's planning with torch's "Internal error:
    NestedTensorImpl doesn't support sizes", naming no key (plain dcp.save fails too)."""
    nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=layout)
    with distckpt.Checkpointer(tmp_path, async_mode="thread") as ck:
        for blocking in (True, False):
            with pytest.raises(TypeError, match=r"cannot save 'nt'"):
                ck.save(1, {"nt": nt}, blocking=blocking)
        assert ck.steps() == []
