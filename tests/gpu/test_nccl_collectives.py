"""distckpt's object collectives (``Group.all_gather``, ``Group.broadcast``) on a group served by
NCCL alone, as ``init_process_group("nccl")`` in a GPU job makes it: the objects travel in CUDA
buffers (``_compat.object_collective_device`` says ``"cuda"``), in one round when they fit a slot
and two when not, and a save and a load of GPU state work on that group. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.xdist_group("cuda"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),
]


def _body(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import distckpt
    from distckpt._compat import object_collective_device
    from distckpt._dist import Group, _slot

    group = Group()
    slot = _slot(world)
    out = {"device": object_collective_device(None)}
    small, large = {"rank": rank}, ("x" * (3 * slot), rank)
    out["gather_small"] = group.all_gather(small) == [{"rank": r} for r in range(world)]
    out["gather_large"] = group.all_gather(large) == [("x" * (3 * slot), r) for r in range(world)]
    kept = ["y" * (2 * slot)]
    got = group.broadcast(kept if rank == 0 else None)
    out["broadcast"] = got is kept if rank == 0 else got == kept
    out["broadcast_small"] = group.broadcast(7 if rank == 0 else None) == 7
    # A whole save and load on the NCCL-only default group (distckpt's own group is gloo).
    model = torch.nn.Linear(64, 64).cuda()
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model})
        fresh = torch.nn.Linear(64, 64).cuda()
        ckpt.load({"model": fresh})
    out["roundtrip"] = torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    out["backend"] = dist.get_backend()
    return out


def test_object_collectives_on_an_nccl_group(tmp_path):
    out = run_ranks(_body, 1, tmp_path, str(tmp_path / "ck"), backend="nccl", timeout=240)[0]
    assert out["backend"] == "nccl" and out["device"] == "cuda", out
    assert all(out[k] for k in ("gather_small", "gather_large", "broadcast", "broadcast_small", "roundtrip")), out
