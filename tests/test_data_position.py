"""The data position of a ``GlobalBatchSampler`` fed to a ``DataLoader`` with workers: the loader
fetches batches ahead of training, and only the batches training got may count as consumed, or
a resume skips the ones fetched ahead (at any world size: the sampler's state is global)."""

from __future__ import annotations

import itertools
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



def test_any_non_negative_seed_is_taken_and_orders_stay_as_they_were():
    """``seed=time.time_ns()`` (or any seed past ~1.8e13) was accepted, then the first batch
    failed in torch's Generator with "Overflow when unpacking long long", naming nothing. Found
    by a helper (2026-12-06). Seeds that worked give the same order as before."""
    import torch

    for seed in (1_800_000_000_000_000, 2**64, 2**70 + 3):
        first = distckpt.GlobalBatchSampler(40, 4, rank=0, world_size=1, seed=seed)
        again = distckpt.GlobalBatchSampler(40, 4, rank=0, world_size=1, seed=seed)
        batches = [first.next_batch() for _ in range(12)]
        assert batches == [again.next_batch() for _ in range(12)] and sorted(i for b in batches[:10] for i in b) == list(range(40))
    # The order of a seed that always worked: torch's permutation of that seed, as before.
    old = torch.randperm(40, generator=torch.Generator().manual_seed(9 * 1_000_003 + 0)).tolist()
    assert distckpt.GlobalBatchSampler(40, 4, rank=0, world_size=1, seed=9).global_batch(0) == old[:4]


def _epoch_loader(workers: int, epoch: int | None = None):
    """A StatefulDataLoader over a shuffling DistributedSampler (one replica), at ``epoch``."""
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = DistributedSampler(list(range(N)), num_replicas=1, rank=0, shuffle=True, seed=3)
    if epoch is not None:
        sampler.set_epoch(epoch)
    return StatefulDataLoader(list(range(N)), batch_size=8, sampler=sampler, num_workers=workers), sampler


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_the_load_reads_nothing_of_is_left_as_it_was(tmp_path, workers):
    """``strict=False`` with a StatefulDataLoader the checkpoint does not hold: the load planned
    it by calling its ``state_dict()``, which starts an iterator (its epoch's order, workers
    prefetching) that its next ``iter()`` returned. ``set_epoch(3)`` after the load was ignored:
    epoch 0's order came out again. Found by a helper (2026-12-06)."""
    import torch

    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"epoch": 3, "w": torch.ones(2)})
    loader, sampler = _epoch_loader(workers)
    state = {"epoch": 0, "w": torch.zeros(2), "loader": loader}
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load(state, strict=False)
        assert ckpt.last_load_report.missing and all(k.startswith("loader.") for k in ckpt.last_load_report.missing)
    sampler.set_epoch(state["epoch"])
    expected, _ = _epoch_loader(0, epoch=3)
    assert [b.tolist() for b in loader] == [b.tolist() for b in expected]


def test_a_failed_load_leaves_a_loader_without_the_iterator_its_planning_started(tmp_path):
    """A load that fails (``strict=True``, a key missing) after planning a fresh loader: the
    iterator the planning started is dropped, as it was never asked for."""
    import torch

    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
    loader, sampler = _epoch_loader(0)
    with distckpt.Checkpointer(tmp_path) as ckpt, pytest.raises(distckpt.StateMismatchError):
        ckpt.load({"w": torch.zeros(2), "loader": loader})
    sampler.set_epoch(2)
    expected, _ = _epoch_loader(0, epoch=2)
    assert [b.tolist() for b in loader] == [b.tolist() for b in expected]


def _save_per_rank_loader(rank: int, world: int, root: str) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = _sampler(rank, world)
    loader = StatefulDataLoader(list(range(N)), batch_sampler=sampler, num_workers=0)
    batches = iter(loader)
    for _ in range(4):
        next(batches)
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.save(4, {"sampler": sampler, "loader": loader})


def test_a_loader_skipped_at_another_world_size_resumes_at_the_samplers_position(tmp_path):
    """Per-rank state saved at world size 2, loaded at 1 with ``strict=False``: the loader is
    skipped (reported) and the sampler's global position resumes. The loader's planning had
    started an iterator at the sampler's position before the load (batch 0): the first batches
    after the resume were the start of training."""
    from dist_harness import run_ranks
    from torchdata.stateful_dataloader import StatefulDataLoader

    run_ranks(_save_per_rank_loader, 2, tmp_path, str(tmp_path / "root"), timeout=100)
    sampler = _sampler()
    loader = StatefulDataLoader(list(range(N)), batch_sampler=sampler, num_workers=2)  # they fetch ahead
    with distckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.load({"sampler": sampler, "loader": loader}, strict=False)
        assert "loader" in ckpt.last_load_report.skipped
    position = sampler.batches_consumed
    assert position == 4
    batches = iter(loader)
    assert [next(batches).tolist() for _ in range(2)] == [sampler.global_batch(i) for i in (position, position + 1)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_state_the_user_restored_survives_a_load_that_hands_it_nothing(tmp_path, workers):
    """The loader's position restored (``load_state_dict``, or an earlier load), then a load of a
    checkpoint without it (``strict=False``): the planning's ``state_dict()`` started an iterator
    that used up the restored position; dropping that iterator must give the position back, or
    the next epoch starts at batch 0. Found by a review helper (2026-12-06)."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    source = StatefulDataLoader(list(range(N)), batch_size=8, num_workers=workers)
    batches = iter(source)
    for _ in range(3):
        next(batches)
    position = source.state_dict()
    del batches
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
    loader = StatefulDataLoader(list(range(N)), batch_size=8, num_workers=workers)
    loader.load_state_dict(position)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load({"w": torch.zeros(2), "loader": loader}, strict=False)
    assert next(iter(loader)).tolist() == list(range(24, 32))


def test_the_state_check_takes_no_state_of_a_loader_the_load_left_alone(tmp_path):
    """``verify_state=True`` re-reads every entry's state after the load to compare it with the
    saved fingerprints; for a loader the load read nothing into, that re-read started the stale
    iterator again (the fix above undone). Found by a review helper (2026-12-06)."""
    import torch

    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"epoch": 3, "w": torch.ones(2)})
    loader, sampler = _epoch_loader(0)
    state = {"epoch": 0, "w": torch.zeros(2), "loader": loader}
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load(state, strict=False, verify_state=True)
    sampler.set_epoch(state["epoch"])
    expected, _ = _epoch_loader(0, epoch=3)
    assert [b.tolist() for b in loader] == [b.tolist() for b in expected]


def test_an_unhashable_stateful_object_the_load_left_alone_is_fine(tmp_path):
    """Left alone (missing from the checkpoint, ``strict=False``), an object that cannot be
    hashed (a dataclass with ``eq``) is not looked up among the loaders' iterators."""
    import dataclasses

    import torch

    @dataclasses.dataclass
    class Counter:
        n: int = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
    counter = Counter(7)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load({"w": torch.zeros(2), "counter": counter}, strict=False)
        assert ckpt.last_load_report.missing == ["counter.n"]
    assert counter.n == 7


@pytest.mark.parametrize("after", ["verify_state", "prepare_staging"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_loaded_loader_resumes_its_epoch_after_the_state_check_or_prepare_staging(tmp_path, workers, after):
    """A loader saved one batch into epoch 1, loaded, then ``set_epoch(state["epoch"])`` (the
    usual DistributedSampler pattern): the state check of ``verify_state=True`` (due by default
    after a change of parallelism too) and ``prepare_staging`` after the load took the loader's
    state, which started an iterator with the sampler still at epoch 0; the user's ``iter()``
    got that one, and the resumed epoch ran epoch 0's order. The global generator is left as
    the user's ``iter()`` needs it. Found by a helper (2026-12-06, /tmp/attack51)."""
    import torch

    loader, sampler = _epoch_loader(workers, epoch=1)
    it = iter(loader)
    next(it)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"loader": loader, "epoch": 1})
    want = [b.tolist() for b in it]
    loader, sampler = _epoch_loader(workers)
    state = {"loader": loader, "epoch": 0}
    with distckpt.Checkpointer(tmp_path, async_mode="thread") as ckpt:
        ckpt.load(state, verify_state=after == "verify_state")
        rng = torch.get_rng_state()
        if after == "prepare_staging":
            ckpt.prepare_staging(state)
        assert torch.equal(torch.get_rng_state(), rng)
        sampler.set_epoch(state["epoch"])
        assert [b.tolist() for b in loader] == want


@pytest.mark.parametrize("workers", [0, 2])
def test_prepare_staging_leaves_a_fresh_shuffled_loaders_first_epoch_as_it_was(tmp_path, workers):
    """Review of the fix above: on a fresh loader (never iterated, never loaded) the dropped
    iterator had drawn the shuffle's permutation from the sampler's generator (and workers over
    a GlobalBatchSampler fetched batches ahead): the first epoch came out in another order, or
    skipped. A fresh loader keeps the iterator, as its own state_dict() does."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        return StatefulDataLoader(list(range(N)), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5), num_workers=workers)

    want = [b.tolist() for b in make()]
    loader = make()
    with distckpt.Checkpointer(tmp_path, async_mode="thread") as ckpt:
        ckpt.prepare_staging({"loader": loader, "w": torch.ones(2)})
    assert [b.tolist() for b in loader] == want
    sampler = _sampler()
    gbs = _loader("stateful", sampler, workers)
    with distckpt.Checkpointer(tmp_path, async_mode="thread") as ckpt:
        ckpt.prepare_staging({"loader": gbs, "w": torch.ones(2)})
    first = [b.tolist() for b in itertools.islice(iter(gbs), GLOBAL + 2)]  # (it runs on across epochs)
    assert first == [b.tolist() for b in itertools.islice(iter(_loader("stateful", _sampler(), workers)), GLOBAL + 2)]


def test_the_state_check_leaves_a_loaded_loaders_own_generator_as_it_was(tmp_path):
    """A loaded loader with ``generator=``: the dropped iterator drew its base seed from that
    generator; it is restored, so a resume with the check equals one without."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        return StatefulDataLoader(list(range(N)), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))

    loader = make()
    it = iter(loader)
    next(it)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"loader": loader})
    got = {}
    for check in (False, True):
        fresh = make()
        with distckpt.Checkpointer(tmp_path) as ckpt:
            ckpt.load({"loader": fresh}, verify_state=check)
        got[check] = ([b.tolist() for b in fresh], fresh.generator.get_state())
    assert got[True][0] == got[False][0] == [b.tolist() for b in it]
    assert torch.equal(got[True][1], got[False][1])


@pytest.mark.parametrize("workers", [0, 2])
def test_prepare_staging_after_a_load_that_left_the_loader_alone(tmp_path, workers):
    """Review of the fixes above: a loader the load left alone (``strict=False``, not in the
    checkpoint) has no position to start from, was taken for a fresh one and kept the iterator
    ``prepare_staging`` started: ``set_epoch(3)`` after it came too late. Every loader now drops
    it, giving back its samplers' state and generators (the fresh loaders' tests above hold)."""
    import torch

    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"epoch": 3, "w": torch.ones(2)})
    loader, sampler = _epoch_loader(workers)
    state = {"epoch": 0, "w": torch.zeros(2), "loader": loader}
    with distckpt.Checkpointer(tmp_path, async_mode="thread") as ckpt:
        ckpt.load(state, strict=False)
        ckpt.prepare_staging(state)
    sampler.set_epoch(state["epoch"])
    expected, _ = _epoch_loader(0, epoch=3)
    assert [b.tolist() for b in loader] == [b.tolist() for b in expected]


def test_prepare_staging_keeps_a_stateful_distributed_samplers_loaded_position(tmp_path):
    """Review of the fix above: the samplers' state was given back through their own
    load_state_dict(state_dict()), which torchdata's StatefulDistributedSampler does not invert
    (its state_dict() reports a stale count until it iterates): a position loaded into it was
    reset to 0, and the loader restarted the data. Their attributes are given back instead."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def make():
        sampler = StatefulDistributedSampler(list(range(64)), num_replicas=1, rank=0, shuffle=False)
        return sampler, StatefulDataLoader(list(range(64)), batch_size=8, sampler=sampler)

    sampler, loader = make()
    it = iter(loader)
    next(it), next(it)
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"sampler": sampler})  # (the loader joins the state in the next run)
    sampler, loader = make()
    state = {"sampler": sampler, "loader": loader, "w": torch.ones(2)}
    with distckpt.Checkpointer(tmp_path, async_mode="thread") as ckpt:
        ckpt.load(state, strict=False)
        ckpt.prepare_staging(state)
    assert next(iter(loader)).tolist() == list(range(16, 24))
