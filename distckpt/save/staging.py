"""Staging: copy the state into reusable host buffers so training can go on while it is written.

An asynchronous save blocks training only for :meth:`Stager.stage`. Every tensor, CPU tensors
included (training mutates them in place right after ``save`` returns), is copied into a host
buffer that is allocated on the first save and reused by every later save of the same shapes, so
memory does not grow from save to save. Buffers for accelerator tensors are pinned, and their
copies are issued non-blocking and synchronized once at the end.

DTensors are staged shard by shard: the local shard is copied and re-wrapped with the same mesh
and placements, so DCP still writes each shard from its owner.

Replicated state (a DDP model: the same plain tensors under the same keys on every rank) is
written once by DCP, each tensor by one rank. Staging all of it on every rank would copy, and
hold in host memory, ``world_size`` times what is written. :func:`replicated_shares` splits the
replicated tensors among the ranks (largest first, to the least-loaded rank, the same on every
rank), and each rank stages only its share: DCP then finds the keys disjoint and writes each
rank's share from that rank.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from typing import Any

import torch
from distckpt._compat import flatten_state_dict, unflatten_state_dict
from distckpt.save.shared_arena import SharedArena, plan_slots, view

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]


def check_saveable(state_dict: dict[str, Any]) -> None:
    """Refuse tensors DCP cannot write, naming the key (sync and async saves alike).

    Raises:
        TypeError: a sparse tensor (any non-strided layout) or a meta tensor (it has no data).
    """
    flat, _ = flatten_state_dict(state_dict)
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.layout != torch.strided:
            raise TypeError(f"cannot save {key!r}: {local.layout} tensors are not supported; save t.to_dense() instead")
        if local.device.type == "meta":
            raise TypeError(f"cannot save {key!r}: it is a meta tensor (no data); materialize it first (to_empty + init)")


class Stager:
    """Copies state dicts into reused host buffers.

    Not collective: each rank stages its own state. One stager serves one checkpointer; it is not
    thread-safe, and the checkpointer never stages while a staged dict is still being written.

    Args:
        shared: put the buffers in one :class:`~distckpt.save.shared_arena.SharedArena` (shared
            memory a background writer process maps) instead of private host memory.

    Buffers of accelerator tensors are pinned (when CUDA is available), and their copies are
    issued non-blocking on a side stream that first waits for the training stream, then
    synchronized once: the copies overlap each other, and training's later kernels cannot change
    a tensor before it is copied.
    """

    def __init__(self, shared: bool = False) -> None:
        self.pin_memory = torch.cuda.is_available()
        self.shared = shared
        self.arena: SharedArena | None = None
        self._layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: Any = None

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = self.pin_memory and like.device.type != "cpu"
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def _prepare_arena(self, tensors: dict[str, torch.Tensor]) -> None:
        """(shared mode) One arena slot per tensor; a new arena only when the layout changed."""
        layout = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items() if not t.is_quantized]
        if self.arena is not None and layout == self._layout:
            return
        slots, nbytes = plan_slots(layout)
        if self.arena is not None:
            self.arena.close()
        pin = self.pin_memory and any(t.device.type != "cpu" for t in tensors.values())
        self.arena = SharedArena(nbytes, pin=pin)
        self._layout = layout
        self._buffers = {k: view(self.arena.tensor, slot) for k, slot in slots.items()}

    def stage(self, state_dict: dict[str, Any], skip: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
        """(each rank) A copy of ``state_dict`` whose tensors live in host buffers.

        The copy has the caller's nesting (not DCP's flattened keys), so that an async save
        records exactly the ``.metadata`` a sync save of the same state does. Keys in ``skip``
        (flattened names of replicated tensors another rank writes) are left out.
        """
        flat, mappings = flatten_state_dict(state_dict)
        flat = {k: v for k, v in flat.items() if k not in skip}
        tensors = {
            k: (v.to_local() if isinstance(v, DTensor) else v).detach()
            for k, v in flat.items()
            if isinstance(v, torch.Tensor)
        }
        if self.shared:
            self._prepare_arena(tensors)
        else:
            for key in list(self._buffers):
                if key not in tensors:
                    del self._buffers[key]  # the state shrank: free what is no longer needed
        stream = self._side_stream(tensors.values())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            copies = {k: self._copy(k, t) for k, t in tensors.items()}
        if stream is not None:
            stream.synchronize()
        staged: dict[str, Any] = {}
        for key, value in flat.items():
            if isinstance(value, DTensor):
                staged[key] = DTensor.from_local(
                    copies[key],
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
            elif isinstance(value, torch.Tensor):
                staged[key] = copies[key]
            else:
                # Non-tensor leaves are small (hyper-parameters, JSON text); a deep copy
                # freezes them against later mutation by the training loop.
                staged[key] = copy.deepcopy(value)
        return unflatten_state_dict(staged, mappings)

    def _side_stream(self, tensors: Any) -> Any:
        """The CUDA stream staging copies run on (None without CUDA tensors)."""
        if not any(t.device.type == "cuda" for t in tensors):
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # Copies must see every kernel training queued before save() was called.
        self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    def _copy(self, key: str, src: torch.Tensor) -> torch.Tensor:
        if src.is_quantized:
            # A quantized tensor carries its quantizer; an empty buffer cannot hold one, so it
            # is copied afresh (quantized state is small: observers, a few weights).
            self._buffers.pop(key, None)
            return src.to("cpu", copy=True)
        buf = self._buffer(key, src)
        buf.copy_(src, non_blocking=src.device.type != "cpu" and (buf.is_pinned() or self._arena_pinned))
        return buf

    @property
    def _arena_pinned(self) -> bool:
        return self.arena is not None and self.arena.pinned

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held in staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def close(self) -> None:
        """Release every buffer (and the shared arena)."""
        self._buffers.clear()
        self._layout = []
        if self.arena is not None:
            self.arena.close()
            self.arena = None


def replicated_layout(state_dict: dict[str, Any]) -> tuple[dict[str, str], list[tuple[str, int]]]:
    """Per top-level entry, a digest of its plain (non-DTensor) tensors' keys, shapes and dtypes;
    and those tensors as ``(key, nbytes)``. Ranks whose digests agree hold the entry replicated."""
    flat, _ = flatten_state_dict(state_dict)
    per_entry: dict[str, list[str]] = {}
    sizes: list[tuple[str, int]] = []
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            per_entry.setdefault(key.split(".", 1)[0], []).append(f"{key}:{tuple(value.shape)}:{value.dtype}")
            sizes.append((key, value.numel() * value.element_size()))
    digests = {name: hashlib.sha256("\n".join(items).encode()).hexdigest() for name, items in per_entry.items()}
    return digests, sizes


def replicated_shares(
    digests_by_rank: list[dict[str, str]], sizes: list[tuple[str, int]], rank: int
) -> frozenset[str]:
    """Keys of replicated tensors that ranks other than ``rank`` stage and write.

    An entry counts as replicated when every rank reported the same digest for it. Its tensors
    go, largest first, to the rank with the fewest bytes so far (ties: the lowest rank): every
    rank computes the same assignment from the same gathered digests.
    """
    world = len(digests_by_rank)
    if world < 2:
        return frozenset()
    names = set(digests_by_rank[0])
    replicated = {n for n in names if all(d.get(n) == digests_by_rank[0][n] for d in digests_by_rank[1:])}
    load = [0] * world
    others: set[str] = set()
    for key, nbytes in sorted((kv for kv in sizes if kv[0].split(".", 1)[0] in replicated), key=lambda kv: (-kv[1], kv[0])):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += nbytes
        if owner != rank:
            others.add(key)
    return frozenset(others)
