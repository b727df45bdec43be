"""A data position that does not depend on the world size.

Per-rank sampler state does not reshard: after a restart at another world size, rank ``r`` no
longer means the same slice of data. :class:`GlobalBatchSampler` defines the order of samples
globally (one seeded permutation per epoch) and cuts it into global batches; rank ``r`` of ``W``
takes the ``r``-th of ``W`` equal parts of each global batch. Its state is just "global batches
consumed", so a job resumed at any world size (same global batch) sees exactly the samples the
uninterrupted job would have seen, none repeated or skipped.

A batch counts as consumed when it is handed to training: by :meth:`GlobalBatchSampler.next_batch`,
by iterating the sampler, or, where a ``DataLoader`` with workers (which fetches batches ahead)
takes it as its ``batch_sampler``, by iterating :meth:`GlobalBatchSampler.consume` of that loader.
Iterated by such a loader directly, the sampler would count the batches fetched ahead too (its
position up to ``num_workers x prefetch_factor`` batches past what training saw): that warns.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from distckpt._ints import plain_int

T = TypeVar("T")


class GlobalBatchSampler:
    """This rank's sample indices, one global batch at a time, in a world-size independent order.

    Not collective. Put it in the checkpointed ``state`` (it has ``state_dict``/``load_state_dict``).

    Args:
        num_samples: size of the dataset.
        global_batch_size: samples per step over all ranks; must divide by ``world_size``.
        rank, world_size: this process's place (default: from ``torch.distributed``, else 0/1).
        seed: seed of the per-epoch permutations.
        shuffle: permute each epoch (else sequential order).
    """

    #: its position is world-size independent: stored once, loads at any world size
    distckpt_scope = "global"

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        import torch.distributed as dist

        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        # Plain ints (NumPy's taken: a config read into an array): an np.int64 seed failed at the
        # first batch in torch's Generator with "an integer is required", naming nothing.
        num_samples, global_batch_size, rank, world_size, seed = (
            _count(v, n) for v, n in (
                (num_samples, "num_samples"), (global_batch_size, "global_batch_size"), (rank, "rank"),
                (world_size, "world_size"), (seed, "seed"),
            )
        )  # fmt: skip
        if not (isinstance(shuffle, bool) or (type(shuffle).__module__ == "numpy" and type(shuffle).__name__ in ("bool", "bool_"))):
            raise TypeError(f"GlobalBatchSampler: shuffle must be True or False, got {shuffle!r}")
        shuffle = bool(shuffle)
        if world_size < 1:
            raise ValueError(f"GlobalBatchSampler: world_size must be >= 1, got {world_size}")
        if global_batch_size < 1 or num_samples < global_batch_size:
            raise ValueError(
                f"need 1 <= global_batch_size <= num_samples, got global_batch_size={global_batch_size}, "
                f"num_samples={num_samples}"
            )
        if global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} does not divide evenly across world_size {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.batches_consumed = 0  # global batches handed out since the start of training
        self._consuming = False  # (consume(): the loader's iterator is being made)
        self._warned = False
        self._order_epoch = -1
        self._order: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size  # the incomplete tail is dropped

    @property
    def epoch(self) -> int:
        return self.batches_consumed // self.batches_per_epoch

    @property
    def samples_consumed(self) -> int:
        """Samples consumed globally (all ranks), the world-size independent position."""
        return self.batches_consumed * self.global_batch_size

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            if self.shuffle:
                # Within the Generator's 64 bits (the same seed as before wherever it fitted):
                # seed=time.time_ns() failed at the first batch with "Overflow when unpacking
                # long long", naming nothing.
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**64)
                self._order = torch.randperm(self.num_samples, generator=g)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def global_batch(self, index: int) -> list[int]:
        """All ranks' indices of global batch ``index`` (counted from the start of training)."""
        epoch, b = divmod(index, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        start = b * self.global_batch_size
        return order[start : start + self.global_batch_size].tolist()

    def _part(self, index: int) -> list[int]:
        """This rank's indices of global batch ``index``."""
        batch = self.global_batch(index)
        per_rank = self.global_batch_size // self.world_size
        return batch[self.rank * per_rank : (self.rank + 1) * per_rank]

    def next_batch(self) -> list[int]:
        """This rank's indices of the next global batch; advances the position."""
        part = self._part(self.batches_consumed)
        self.batches_consumed += 1
        return part

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches from the current position, each advancing it (as :meth:`next_batch`),
        except for the iterator of a loader made by :meth:`consume` (which counts them itself)."""
        if self._consuming:
            return self._ahead(self.batches_consumed)
        workers = _loader_workers(sys._getframe(1))
        if workers and not self._warned:
            self._warned = True  # (a DataLoader's iterator takes two: once is enough)
            warnings.warn(
                f"distckpt: a GlobalBatchSampler is the batch_sampler of a DataLoader with num_workers={workers}, which "
                "fetches batches ahead of training: the sampler's saved position would count those batches too (they "
                "would be skipped at a resume from it; a StatefulDataLoader's own state makes up for it at the same world "
                "size only). Make it a torch.utils.data.DataLoader and iterate `sampler.consume(loader)`: it counts a "
                "batch when the loader hands it to training",
                stacklevel=3,
            )
        return self._handed_out()

    def _handed_out(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def _ahead(self, start: int) -> Iterator[list[int]]:
        index = start
        while True:
            yield self._part(index)
            index += 1

    def consume(self, loader: Iterable[T]) -> Iterator[T]:
        """(each rank, not collective) Iterate ``loader``, a ``torch.utils.data.DataLoader``
        whose ``batch_sampler`` is this sampler, counting a global batch consumed when the loader
        hands it to the caller: its workers fetch batches ahead, which therefore never count.
        Resumes from the current position (after a ``load``, the saved one): make the iterator
        after loading. The sampler is the data position: save it, not the loader.

        Raises:
            ValueError: the loader's ``batch_sampler`` is not this sampler; the loader returns
                batches out of order (``in_order=False``); or it is torchdata's
                ``StatefulDataLoader``, which keeps its own position (per rank) and restores its
                batch sampler itself (use a ``DataLoader``: this sampler's position is global).
        """
        if getattr(loader, "batch_sampler", None) is not self:
            raise ValueError(
                f"consume(loader): the loader's batch_sampler is {type(getattr(loader, 'batch_sampler', None)).__name__}, "
                "not this GlobalBatchSampler (make it with DataLoader(dataset, batch_sampler=sampler, ...))"
            )
        if getattr(loader, "in_order", True) is False:
            raise ValueError(
                "consume(loader): the loader returns batches out of order (in_order=False): the position would count "
                "batches training has not had yet; make it with in_order=True (the default)"
            )
        if any(c.__name__ == "StatefulDataLoader" for c in type(loader).__mro__):
            raise ValueError(
                "consume(loader): a StatefulDataLoader keeps its own position (per rank) and restores its batch sampler "
                "itself, behind this sampler's back; use torch.utils.data.DataLoader (this sampler is the position, "
                "at any world size)"
            )
        self._consuming = True
        try:
            batches = iter(loader)  # the loader's iterator takes this sampler's iterator here
        finally:
            self._consuming = False
        return self._counted(batches)

    def _counted(self, batches: Iterator[T]) -> Iterator[T]:
        for batch in batches:
            self.batches_consumed += 1  # handed to training: the save after its step counts it
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "batches_consumed": self.batches_consumed,
            "samples_consumed": self.samples_consumed,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("global_batch_size", "num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}: "
                    "resuming would not continue the same data order"
                )
        self.batches_consumed = int(state["batches_consumed"])


def _count(value: object, name: str) -> int:
    """``value`` as a plain int (NumPy's integers too); ``TypeError`` naming ``name`` otherwise
    (a float, a string, a bool)."""
    count = plain_int(value)
    if type(count) is int:
        return count
    raise TypeError(f"GlobalBatchSampler: {name} must be an int, got {type(value).__name__} {value!r}")


def _loader_workers(frame: Any) -> int:
    """``num_workers`` of the ``DataLoader`` iterator that called ``iter()`` on the sampler (its
    ``__init__`` or ``_reset`` takes the batch sampler's iterator), 0 where the caller is none."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    caller = frame.f_locals.get("self") if frame is not None else None
    if isinstance(caller, _BaseDataLoaderIter):
        return int(getattr(caller, "_num_workers", 0) or 0)
    return 0

