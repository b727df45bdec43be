"""DCP load planner that never runs code from the checkpoint.

DCP's default planner unpickles non-tensor values with ``torch.load(weights_only=False)``.
distckpt stores its own plain values as JSON strings, and everything else DCP writes as bytes
(optimizer hyper-parameters, scheduler state) is made of plain containers and numbers, which
``weights_only=True`` admits. A value that would need arbitrary globals is refused with an error
naming its key instead of being executed. Given the manifest's ``value_digests``, the bytes of
every such value are first compared with the digest recorded at save (:func:`distckpt.state.values.check_item`).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from distckpt.state import values
from distckpt.errors import UnsafeCheckpointError


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values are read with ``weights_only=True``.

    Args:
        value_digests: the manifest's ``value_digests`` (key -> sha256 of the stored bytes);
            each value's bytes must match before they are unpickled, else
            :class:`~distckpt.errors.IntegrityError` naming the key and file. ``None``: unchecked.
        where: the step directory, as errors name it.
    """

    def __init__(self, *args: Any, value_digests: Mapping[str, str] | None = None, where: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.value_digests = value_digests
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if self.value_digests is not None:
            values.check_item(value.getbuffer(), read_item.storage_index.fqn, self.value_digests, self._file_of(read_item))
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint value {fqn!r}: it needs code to be unpickled "
                f"({str(exc).splitlines()[0]})"
            ) from None
        if self.flatten_state_dict:
            from distckpt._compat import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def _file_of(self, read_item: ReadItem) -> str:
        """The file the item is read from (its record in the verified ``.metadata``), as errors name it."""
        metadata = getattr(self, "metadata", None)
        info = metadata.storage_data.get(read_item.storage_index) if metadata is not None else None
        name = os.fspath(info.relative_path) if info is not None else "?"
        return f"{self.where}/{name}" if self.where else name
