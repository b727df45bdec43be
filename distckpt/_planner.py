"""DCP load planner that never runs code from the checkpoint.

DCP's default planner unpickles non-tensor values with ``torch.load(weights_only=False)``.
distckpt stores its own plain values as JSON strings, and everything else DCP writes as bytes
(optimizer hyper-parameters, scheduler state) is made of plain containers and numbers, which
``weights_only=True`` admits. A value that would need arbitrary globals is refused with an error
naming its key instead of being executed.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from .errors import UnsafeCheckpointError


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values are read with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint value {fqn!r}: it needs code to be unpickled "
                f"({str(exc).splitlines()[0]})"
            ) from None
        if self.flatten_state_dict:
            from ._compat import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
