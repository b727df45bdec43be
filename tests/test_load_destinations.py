"""Load destinations no load can fill are refused by name, on every rank, before anything is read."""
from __future__ import annotations

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
