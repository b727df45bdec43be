"""The data position of a ``GlobalBatchSampler`` fed to a ``DataLoader`` with workers: the loader
fetches batches ahead of training, and only the batches training got may count as consumed, or
a resume skips the ones fetched ahead (at any world size: the sampler's state is global)."""

from __future__ import annotations

import warnings

import pytest
from torch.utils.data import DataLoader

import distckpt

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
]

N, GLOBAL = 96, 8


def _sampler(rank: int = 0, world: int = 1) -> distckpt.GlobalBatchSampler:
    return distckpt.GlobalBatchSampler(num_samples=N, global_batch_size=GLOBAL, rank=rank, world_size=world, seed=5)


def _loader(kind: str, sampler, workers: int):
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(list(range(N)), batch_sampler=sampler, num_workers=workers)
    return DataLoader(list(range(N)), batch_sampler=sampler, num_workers=workers)


def test_a_loader_with_workers_iterating_the_sampler_itself_warns():
    sampler = _sampler()
    with pytest.warns(UserWarning, match="fetches batches ahead of training"):
        batches = iter(DataLoader(list(range(N)), batch_sampler=sampler, num_workers=2))
        next(batches)
    del batches
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no workers: each batch fetched is the one training gets
        batches = iter(DataLoader(list(range(N)), batch_sampler=_sampler(), num_workers=0))
        next(batches)


@pytest.mark.parametrize("kind", ["torch", "stateful"])
@pytest.mark.parametrize("workers", [0, 2])
def test_consume_resumes_exactly_at_any_world_size(tmp_path, kind, workers):
    sampler = _sampler()
    batches = sampler.consume(_loader(kind, sampler, workers))
    got = [next(batches).tolist() for _ in range(3)]
    assert got == [sampler.global_batch(i) for i in range(3)]
    assert sampler.batches_consumed == 3  # not 3 + what the workers fetched ahead
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, {"sampler": sampler})
    del batches
    for world in (1, 2, 4):
        seen = []
        for rank in range(world):
            resumed = _sampler(rank, world)
            with distckpt.Checkpointer(tmp_path) as ckpt:
                ckpt.load({"sampler": resumed})
            it = resumed.consume(_loader(kind, resumed, workers))
            seen.append([next(it).tolist() for _ in range(2)])
            del it
        for b in range(2):  # the ranks' parts of each next global batch, in rank order
            assert [i for part in seen for i in part[b]] == sampler.global_batch(3 + b), (world, b)


def test_consume_with_the_loaders_own_state_saved_too(tmp_path):
    # torchdata's StatefulDataLoader records its batch sampler's state as it fetches batches and
    # restores from that record: both states loaded, the position is still exact.
    sampler = _sampler()
    loader = _loader("stateful", sampler, 2)
    batches = sampler.consume(loader)
    for _ in range(3):
        next(batches)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, {"sampler": sampler, "loader": loader})
    del batches
    resumed = _sampler()
    loader = _loader("stateful", resumed, 2)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load({"sampler": resumed, "loader": loader})
    it = resumed.consume(loader)
    assert [next(it).tolist() for _ in range(2)] == [sampler.global_batch(3), sampler.global_batch(4)]
    assert resumed.batches_consumed == 5


def test_consume_refuses_a_loader_of_another_sampler():
    with pytest.raises(ValueError, match="not this GlobalBatchSampler"):
        _sampler().consume(DataLoader(list(range(N)), batch_size=4))
