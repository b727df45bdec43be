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


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_consume_resumes_exactly_at_any_world_size(tmp_path, workers, persistent):
    def loader(sampler):
        return DataLoader(list(range(N)), batch_sampler=sampler, num_workers=workers, persistent_workers=persistent and workers > 0)

    sampler = _sampler()
    made = loader(sampler)
    batches = sampler.consume(made)
    got = [next(batches).tolist() for _ in range(2)]
    del batches
    batches = sampler.consume(made)  # out of the loop and back in: goes on where it was
    got += [next(batches).tolist()]
    assert got == [sampler.global_batch(i) for i in range(3)]
    assert sampler.batches_consumed == 3  # not 3 + what the workers fetched ahead
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, {"sampler": sampler})
    del batches, made
    for world in (1, 2, 4):
        seen = []
        for rank in range(world):
            resumed = _sampler(rank, world)
            with distckpt.Checkpointer(tmp_path) as ckpt:
                ckpt.load({"sampler": resumed})
            it = resumed.consume(loader(resumed))
            seen.append([next(it).tolist() for _ in range(2)])
            del it
        for b in range(2):  # the ranks' parts of each next global batch, in rank order
            assert [i for part in seen for i in part[b]] == sampler.global_batch(3 + b), (world, b)


def test_consume_refuses_loaders_it_cannot_count_for():
    from torchdata.stateful_dataloader import StatefulDataLoader

    with pytest.raises(ValueError, match="not this GlobalBatchSampler"):
        _sampler().consume(DataLoader(list(range(N)), batch_size=4))
    sampler = _sampler()
    # Its own snapshots restore the batch sampler behind its back (a position counted twice).
    with pytest.raises(ValueError, match="StatefulDataLoader keeps its own position"):
        sampler.consume(StatefulDataLoader(list(range(N)), batch_sampler=sampler, num_workers=0))
    if "in_order" in DataLoader.__init__.__code__.co_varnames:  # (torch >= 2.6)
        with pytest.raises(ValueError, match="out of order"):
            sampler.consume(DataLoader(list(range(N)), batch_sampler=sampler, num_workers=2, in_order=False))
    assert sampler.batches_consumed == 0


def test_numpy_arguments_are_taken_and_others_refused_naming_them():
    """num_samples, global_batch_size and seed read from a config array (NumPy ints): accepted,
    but the first batch failed in torch's Generator with "an integer is required", naming
    nothing. Found by a helper (2026-12-06)."""
    import numpy as np

    import distckpt

    plain = distckpt.GlobalBatchSampler(40, 4, rank=1, world_size=2, seed=9)
    numpy = distckpt.GlobalBatchSampler(np.int64(40), np.int64(4), rank=np.int32(1), world_size=np.int64(2), seed=np.int64(9),
                                        shuffle=np.bool_(True))  # fmt: skip
    assert [numpy.next_batch() for _ in range(12)] == [plain.next_batch() for _ in range(12)]
    assert type(numpy.epoch) is int and type(numpy.state_dict()["seed"]) is int
    for kwargs, named in [({"seed": 1.5}, "seed"), ({"num_samples": "40"}, "num_samples"), ({"global_batch_size": True}, "global_batch_size"),
                          ({"shuffle": "False"}, "shuffle")]:  # fmt: skip
        args = {"num_samples": 40, "global_batch_size": 4, "rank": 0, "world_size": 1, **kwargs}
        with pytest.raises(TypeError, match=f"GlobalBatchSampler: {named} must be"):
            distckpt.GlobalBatchSampler(**args)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        distckpt.GlobalBatchSampler(40, 4, rank=0, world_size=0)
    # The incomplete last global batch of each epoch is dropped (README).
    seq = distckpt.GlobalBatchSampler(10, 4, rank=0, world_size=1, shuffle=False)
    assert [seq.next_batch() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]] and seq.epoch == 1
    other = distckpt.GlobalBatchSampler(12, 4, rank=0, world_size=1, shuffle=False)
    with pytest.raises(ValueError, match="num_samples=10 but this sampler has 12"):
        other.load_state_dict(seq.state_dict())
