"""A data position that does not depend on the world size.

Per-rank sampler state does not reshard: after a restart at another world size, rank ``r`` no
longer means the same slice of data. :class:`GlobalBatchSampler` defines the order of samples
globally (one seeded permutation per epoch) and cuts it into global batches; rank ``r`` of ``W``
takes the ``r``-th of ``W`` equal parts of each global batch. Its state is just "global batches
consumed", so a job resumed at any world size (same global batch) sees exactly the samples the
uninterrupted job would have seen, none repeated or skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


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
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
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

    def next_batch(self) -> list[int]:
        """This rank's indices of the next global batch; advances the position."""
        batch = self.global_batch(self.batches_consumed)
        per_rank = self.global_batch_size // self.world_size
        self.batches_consumed += 1
        return batch[self.rank * per_rank : (self.rank + 1) * per_rank]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

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
