"""The CUDA tier of values that hold device tensors (a tuple's tensors are stored inside it, as one
value): an async save stages them to host memory on the caller's stream (distckpt/save/staging.py,
``frozen``), so the writer never reads device memory that stream is still writing; a load unpickles
them onto the host and copies them into the live tensors. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import distckpt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.xdist_group("cuda"),
    pytest.mark.timeout(600),
]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_async_save_of_a_tuple_written_on_the_callers_stream(tmp_path, mode):
    side = torch.cuda.Stream()
    pair = (torch.zeros(4 << 20, device="cuda"), torch.zeros(3, device="cuda"))
    torch.cuda.synchronize()
    with distckpt.Checkpointer(tmp_path, save_rng=False, async_mode=mode) as ckpt:
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the fill lands ~0.1 s into the stream's queue
            pair[0].fill_(5.0)
            pair[1].fill_(2.0)
            ckpt.save(1, {"pair": pair, "w": torch.ones(8, device="cuda")}, blocking=False)
            pair[0].fill_(-1.0)  # after the save returned: never in the checkpoint
        ckpt.wait()
        torch.cuda.synchronize()
        live = (torch.zeros(4 << 20, device="cuda"), torch.zeros(3, device="cuda"))
        state = {"pair": live, "w": torch.zeros(8, device="cuda")}
        ckpt.load(state)
    torch.cuda.synchronize()
    got = state["pair"]
    assert got[0].device.type == "cuda" and bool((got[0] == 5.0).all()) and bool((got[1] == 2.0).all())


def test_tuples_inside_a_tree_come_back_into_the_live_cuda_tensors(tmp_path):
    """A tuple inside a dict of the state, and a list stored whole holding tuples: their CUDA
    tensors were replaced by the host copies the load unpickles (the tree's tensors then on the
    CPU); they are copied into the live CUDA tensors (2026-12-06; unmeasured on a GPU when added)."""
    state = {"tree": {"pair": (torch.full((3,), 5.0, device="cuda"), 1), "items": [(torch.ones(2, device="cuda"), "a")]}}
    with distckpt.Checkpointer(tmp_path, save_rng=False) as ckpt:
        ckpt.save(1, state)
    pair, item = torch.zeros(3, device="cuda"), torch.zeros(2, device="cuda")
    fresh = {"tree": {"pair": (pair, 0), "items": [(item, "b")]}}
    with distckpt.Checkpointer(tmp_path, save_rng=False) as ckpt:
        ckpt.load(fresh)
    torch.cuda.synchronize()
    assert fresh["tree"]["pair"][0] is pair and bool((pair == 5.0).all()) and fresh["tree"]["pair"][1] == 1
    assert fresh["tree"]["items"][0][0] is item and bool((item == 1.0).all()) and fresh["tree"]["items"][0][1] == "a"
