"""Staging: copy the state into reusable host buffers so training can go on while it is written.

An asynchronous save blocks training only for :meth:`Stager.stage`. Every tensor, CPU tensors
included (training mutates them in place right after ``save`` returns), is copied into a host
buffer that is allocated on the first save and reused by every later save of the same shapes, so
memory does not grow from save to save. Buffers for accelerator tensors are pinned, and their
copies are issued non-blocking and synchronized once at the end.

DTensors are staged shard by shard: the local shard is copied and re-wrapped with the same mesh
and placements, so DCP still writes each shard from its owner.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]


class Stager:
    """Copies state dicts into reused host buffers.

    Not collective: each rank stages its own state. One stager serves one checkpointer; it is not
    thread-safe, and the checkpointer never stages while a staged dict is still being written.

    Args:
        pin_memory: pin buffers of accelerator tensors (``None``: when CUDA is available).
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = self.pin_memory and like.device.type != "cpu"
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """(each rank) A flat copy of ``state_dict`` whose tensors live in host buffers."""
        flat, _ = flatten_state_dict(state_dict)
        staged: dict[str, Any] = {}
        needs_sync = False
        seen: set[str] = set()
        for key, value in flat.items():
            seen.add(key)
            if isinstance(value, DTensor):
                local = value.to_local()
                buf = self._copy(key, local)
                needs_sync |= local.device.type != "cpu"
                staged[key] = DTensor.from_local(
                    buf,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
            elif isinstance(value, torch.Tensor):
                buf = self._copy(key, value)
                needs_sync |= value.device.type != "cpu"
                staged[key] = buf
            else:
                # Non-tensor leaves are small (hyper-parameters, JSON text); a deep copy
                # freezes them against later mutation by the training loop.
                staged[key] = copy.deepcopy(value)
        for key in list(self._buffers):
            if key not in seen:
                del self._buffers[key]  # the state shrank: free what is no longer needed
        if needs_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        return staged

    def _copy(self, key: str, src: torch.Tensor) -> torch.Tensor:
        src = src.detach()
        buf = self._buffer(key, src)
        buf.copy_(src, non_blocking=src.device.type != "cpu" and buf.is_pinned())
        return buf

    def close(self) -> None:
        """Release every buffer."""
        self._buffers.clear()
