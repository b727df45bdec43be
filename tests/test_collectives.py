"""distckpt's object collectives (``Group.all_gather`` and ``Group.broadcast``): the same results as
torch's object collectives, in one round where every pickled object fits a slot and two where
one does not (torch's take two always: each costs milliseconds on a busy node, and every save and
load makes several). Real gloo ranks; sizes on both sides of the slot's edge, ``None``,
exceptions, the default group and a subgroup whose coordinator is not global rank 0.
"""

from __future__ import annotations

import pytest

from dist_harness import run_ranks

WORLD = 4


def _body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from distckpt import _dist
    from distckpt._dist import Group, _slot

    group = Group()
    slot = _slot(world)
    rounds = []
    real_gather, real_broadcast = dist.all_gather, dist.broadcast

    def counted_gather(*args: object, **kwargs: object) -> object:
        rounds.append("g")
        return real_gather(*args, **kwargs)

    def counted_broadcast(*args: object, **kwargs: object) -> object:
        rounds.append("b")
        return real_broadcast(*args, **kwargs)

    _dist.dist.all_gather = counted_gather  # the module torch.distributed, as _dist calls it
    _dist.dist.broadcast = counted_broadcast
    out: dict[str, object] = {}
    try:
        cases = {
            "small": {"rank": rank, "files": ["a", "b"]},
            "none": None,
            "one_large": ("x" * (3 * slot), rank) if rank == 2 else rank,
            "all_large": list(range(rank, rank + slot)),
        }
        for name, obj in cases.items():
            rounds.clear()
            got = group.all_gather(obj)
            out[f"{name}_rounds"] = len(rounds)
            ref: list[object] = [None] * world
            real_gather_object(ref, obj)
            out[name] = got == ref
        # An exception travels as itself (raise_if_any re-raises it on every rank).
        got = group.all_gather(ValueError(f"rank {rank}"))
        out["exceptions"] = [type(e).__name__ + str(e) for e in got] == [f"ValueErrorrank {r}" for r in range(world)]
        # Both sides of the edge: ranks' pickles of different lengths around slot - header.
        edge = []
        for n in range(slot - 48, slot + 8):
            mine = bytes([rank]) * (n if rank % 2 else n - 20)
            edge.append(group.all_gather(mine) == [bytes([r]) * (n if r % 2 else n - 20) for r in range(world)])
        out["edge"] = all(edge)
        for name, obj in (("b_small", ("small", 1)), ("b_large", "y" * (5 * slot)), ("b_none", None)):
            rounds.clear()
            out[name] = group.broadcast(obj if rank == 0 else "not this") == obj
            out[f"{name}_rounds"] = len(rounds)
        marker = ["the coordinator keeps its own object", "x" * slot]
        got = group.broadcast(marker if rank == 0 else None)  # every rank calls it
        out["b_identity"] = got is marker if rank == 0 else got == marker
        for n in (4, 4 * slot):  # and so at both sizes
            kept = ["k" * n]
            got = group.broadcast(kept if rank == 0 else None)
            out["b_identity"] = out["b_identity"] and (got is kept if rank == 0 else got == kept)
        from distckpt._compat import object_collective_device

        out["device"] = object_collective_device(None) == "cpu"  # gloo: objects travel in host memory
        out["b_edge"] = all(
            group.broadcast(b"z" * n if rank == 0 else None) == b"z" * n for n in range(slot - 48, slot + 8)
        )
        # A subgroup of global ranks 1 and 3: its coordinator is global rank 1.
        sub = dist.new_group([1, 3])
        if rank in (1, 3):
            sg = Group(sub)
            out["sub_gather"] = sg.all_gather(("r", rank)) == [("r", 1), ("r", 3)]
            out["sub_gather_large"] = sg.all_gather("w" * (2 * slot) + str(rank)) == ["w" * (2 * slot) + "1", "w" * (2 * slot) + "3"]
            out["sub_broadcast"] = sg.broadcast(("big" * slot, rank) if rank == 1 else None) == ("big" * slot, 1)
            out["sub_broadcast_small"] = sg.broadcast(rank) == 1
    finally:
        _dist.dist.all_gather, _dist.dist.broadcast = real_gather, real_broadcast
    return out


def real_gather_object(out: list, obj: object) -> None:
    import torch.distributed as dist

    dist.all_gather_object(out, obj)


@pytest.mark.timeout(120)
def test_object_collectives_match_torch_and_take_one_round_when_small(tmp_path):
    results = run_ranks(_body, WORLD, tmp_path, timeout=100)
    for rank, out in enumerate(results):
        for name in ("small", "none", "one_large", "all_large", "exceptions", "edge", "b_small", "b_large", "b_none", "b_edge", "b_identity", "device"):
            assert out[name] is True, (rank, name, out)
        assert (out["small_rounds"], out["none_rounds"], out["b_small_rounds"], out["b_none_rounds"]) == (1, 1, 1, 1), out
        assert (out["one_large_rounds"], out["all_large_rounds"], out["b_large_rounds"]) == (2, 2, 2), out
        if rank in (1, 3):
            assert all(out[k] is True for k in ("sub_gather", "sub_gather_large", "sub_broadcast", "sub_broadcast_small")), out


def test_slot_size_shrinks_with_the_world():
    """A rank receives ``world`` slots in the first round: small at large world sizes."""
    from distckpt._dist import _slot

    assert _slot(1) == _slot(4) == 4096
    assert _slot(256) == 1024
    assert _slot(1024) == _slot(100_000) == 256
    assert all(_slot(w) * w <= max(262144, 256 * w) for w in range(1, 5000, 7))
