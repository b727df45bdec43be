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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from distckpt._compat import CHECKPOINTABLE_TENSOR_FIELDS, flatten_state_dict
from distckpt.save.shared_arena import SharedArena, plan_slots, view
from distckpt.state import fingerprint, fpkernels
from distckpt.state.containers import unflatten_for_dcp

from torch.distributed.tensor import DTensor


def check_saveable(state_dict: dict[str, Any]) -> None:
    """Refuse tensors DCP cannot write, naming the key (sync and async saves alike).

    Raises:
        TypeError: two values with the same checkpoint key (DCP's dotted path), a sparse tensor (any non-strided layout), a meta tensor (it has no data), a
            tensor of a raw bit dtype (``torch.bits8``...), a tensor subclass with its own
            ``__torch_dispatch__`` (a wrapper of other tensors), a nested tensor, or a tensor with DCP's
            ``CheckpointableTensor`` fields (torch 2.15+), which distckpt cannot save as DCP would.
    """
    try:
        flat, _ = flatten_state_dict(state_dict)
    except ValueError as exc:
        if "duplicated flatten key" not in str(exc):
            raise
        key = str(exc).rsplit("duplicated flatten key", 1)[1].strip()
        # DCP names every value by its path joined with '.', and an int key by its digits.
        raise TypeError(
            f"cannot save: two values of the state have the same checkpoint key {key!r} (keys are paths joined with "
            "'.', and an int key is written as its digits: {'a.b': x} and {'a': {'b': y}}, {1: x} and {'1': y}, or "
            "{'l': [x], 'l.0': y} collide); rename one of them"
        ) from None
    fields = CHECKPOINTABLE_TENSOR_FIELDS
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        if fields and all(hasattr(value, f) for f in fields):
            # DCP would write it as shards of its global_shape; distckpt's scopes, replica
            # detection, staging and fingerprints take a tensor's own shape (it failed later as
            # "inconsistent save plans" under a per-rank key).
            raise TypeError(
                f"cannot save {key!r}: it carries DCP's CheckpointableTensor fields ({', '.join(fields)}), "
                "which distckpt does not support; make it a DTensor (DTensor.from_local) or save it with "
                "torch.distributed.checkpoint itself"
            )
        local = value.to_local() if isinstance(value, DTensor) else value
        if type(local).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
            # A wrapper subclass (TwoTensor, torchao's float8 or NF4 tensors) computes its values
            # from the tensors it holds and has no memory of its own for DCP's record (it failed
            # in the writer, ".numpy() is not supported for tensor subclasses", no key named).
            raise TypeError(
                f"cannot save {key!r}: it is a {type(local).__qualname__}, a tensor subclass with its own "
                "__torch_dispatch__ that holds other tensors instead of its values; save the tensors it is "
                "built from (t.__tensor_flatten__() names them) or a plain tensor of its values"
            )
        if local.is_nested:
            # torch's strided nested tensors have no sizes ("NestedTensorImpl doesn't support
            # sizes", in DCP's planning, no key named); jagged ones are wrappers, refused above.
            raise TypeError(f"cannot save {key!r}: nested tensors are not supported; save its tensors (t.unbind()) or t.to_padded_tensor(0)")
        if local.layout != torch.strided:
            raise TypeError(f"cannot save {key!r}: {local.layout} tensors are not supported; save t.to_dense() instead")
        if local.device.type == "meta":
            raise TypeError(f"cannot save {key!r}: it is a meta tensor (no data); materialize it first (to_empty + init)")
        if local.dtype in _BITS:
            # DCP sizes items by element size (torch._utils._element_size), which refuses these:
            # "torch.iinfo() requires an integer input", from a writer thread, with no key named.
            raise TypeError(f"cannot save {key!r}: torch.distributed.checkpoint cannot write {local.dtype} tensors; save t.view(torch.uint8)")


# The raw bit dtypes (no arithmetic, no element size DCP can take).
_BITS = frozenset(getattr(torch, n) for n in ("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16") if hasattr(torch, n))


@dataclass
class Staged:
    """What :meth:`Stager.stage` returns.

    Attributes:
        state_dict: the staged copy (the caller's nesting; tensors in host buffers).
        digests: flattened key -> staging digest of the *live* tensor at the call
            (:func:`staging_digest`), for the keys the caller asked to verify.
    """

    state_dict: dict[str, Any]
    digests: dict[str, int] = field(default_factory=dict)


def staging_digest(t: torch.Tensor, chunk: int | None = None) -> int | torch.Tensor:
    """The digest an async save records of a tensor when it stages it, and checks against the
    tensor its writer serializes (``verify_staging``): the version-1 fingerprint sum of the
    tensor's elements in row-major order from index 0 (:mod:`distckpt.state.fpkernels`; any single
    changed element always changes it, a random corruption escapes with probability ~2**-32).
    Version 1 rather than 2: it is one multiply and one sum per element, which on an accelerator
    runs at memory speed beside the staging copy (version 2's extra 64-bit passes would not).

    Host tensors give an int (``chunk``: elements per NumPy call, see
    :func:`distckpt.state.fpkernels.host_run_sum`); accelerator tensors a 0-dim device tensor,
    computed on the current stream without synchronizing (:func:`distckpt.state.fpkernels.settle`
    brings them back)."""
    t = t.detach().resolve_conj().resolve_neg()  # a lazy conj/neg view's values (the staged copy holds them)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    bits = fpkernels.bits(t)
    if t.device.type == "cpu":
        return fpkernels.host_run_sum(bits, 0, 1, chunk)
    return fpkernels.device_run_sum(bits, 0, 1)


class Stager:
    """Copies state dicts into reused host buffers.

    Not collective: each rank stages its own state. One stager serves one checkpointer; it is not
    thread-safe, and the checkpointer never stages while a staged dict is still being written.

    Args:
        shared: put the buffers in one :class:`~distckpt.save.shared_arena.SharedArena` (shared
            memory a background writer process maps) instead of private host memory.

    Buffers of CUDA tensors are pinned (when CUDA is available), and their copies are issued
    non-blocking on a side stream of the tensor's own device that first waits for that device's
    current stream (training's), then synchronized once: the copies overlap each other, and
    training's later kernels cannot change a tensor before it is copied. Tensors on other
    accelerators are copied synchronously.
    """

    def __init__(self, shared: bool = False) -> None:
        self.pin_memory = torch.cuda.is_available()
        self.shared = shared
        self.arena: SharedArena | None = None
        self._layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: dict[tuple[str, int], torch.cuda.Stream] = {}  # (use, CUDA device index) -> side stream
        self._reserving: threading.Thread | None = None  # reserve()'s allocation, until stage() joins it
        self._reserve_error: BaseException | None = None

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = self.pin_memory and like.device.type == "cuda"
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
        pin = self.pin_memory and any(t.device.type == "cuda" for t in tensors.values())
        self.arena = SharedArena(nbytes, pin=pin)
        self._layout = layout
        self._buffers = {k: view(self.arena.tensor, slot) for k, slot in slots.items()}

    def _local_tensors(
        self, state_dict: dict[str, Any], skip: frozenset[str] | set[str]
    ) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]], dict[str, torch.Tensor]]:
        """The flattened state (without ``skip``), its mappings (flat key -> path in the nested
        state), and its tensors as staged (a DTensor by its local shard)."""
        flat, mappings = flatten_state_dict(state_dict)
        flat = {k: v for k, v in flat.items() if k not in skip}
        tensors = {
            k: (v.to_local() if isinstance(v, DTensor) else v).detach()
            for k, v in flat.items()
            if isinstance(v, torch.Tensor)
        }
        return flat, mappings, tensors

    def reserve(self, state_dict: dict[str, Any], skip: frozenset[str] | set[str] = frozenset()) -> None:
        """(each rank) Allocate, pin and touch the buffers :meth:`stage` will copy ``state_dict``
        into, in a background thread, and return at once. The allocation is most of a first
        staging's cost (page faults over the whole state, and registering it as pinned memory for
        CUDA tensors); :meth:`stage` waits for it if it is still running. Only the tensors'
        shapes, dtypes and devices are read here, never their values."""
        self._await_reserve()
        _, _, tensors = self._local_tensors(state_dict, skip)
        # A new thread's current CUDA device is device 0: registering pinned memory there would
        # create a context on device 0 from every rank of a node. It works on the state's device.
        device = next((t.device for t in tensors.values() if t.device.type == "cuda"), None)

        def allocate() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                if self.shared:
                    self._prepare_arena(tensors)
                    arena = self.arena
                    if arena is not None and not arena.pinned and arena.nbytes:
                        arena.tensor.fill_(0)  # fault every page in now, not during the first copy
                    return
                for key, t in tensors.items():
                    if not t.is_quantized and t.numel():
                        self._buffer(key, t).view(-1).view(torch.uint8).fill_(0)
            except BaseException as exc:  # noqa: BLE001 - raised by the next stage()
                self._reserve_error = exc

        self._reserving = threading.Thread(target=allocate, name="distckpt-reserve-staging", daemon=True)
        self._reserving.start()

    def _await_reserve(self) -> None:
        """Wait for :meth:`reserve`'s allocation; raise what it failed with."""
        thread, self._reserving = self._reserving, None
        if thread is not None:
            thread.join()
        error, self._reserve_error = self._reserve_error, None
        if error is not None:
            raise error

    def stage(
        self,
        state_dict: dict[str, Any],
        skip: frozenset[str] | set[str] = frozenset(),
        verify: Callable[[str, torch.Tensor], bool] | None = None,
    ) -> Staged:
        """(each rank) A copy of ``state_dict`` whose tensors live in host buffers.

        The copy has the caller's nesting (not DCP's flattened keys), so that an async save
        records exactly the ``.metadata`` a sync save of the same state does. Keys in ``skip``
        (flattened names of replicated tensors another rank writes) are left out. For the keys
        ``verify(key, value)`` accepts, the :func:`staging_digest` of the live tensor (a
        DTensor's local shard) is taken at the call, before training can change it: accelerator
        tensors on the device, on a side stream of their own beside the copies'; host tensors here.
        """
        self._await_reserve()
        flat, mappings, tensors = self._local_tensors(state_dict, skip)
        if self.shared:
            self._prepare_arena(tensors)
        else:
            for key in list(self._buffers):
                if key not in tensors:
                    del self._buffers[key]  # the state shrank: free what is no longer needed
        checked = {k for k in tensors if verify is not None and fingerprint.supported(tensors[k]) and verify(k, flat[k])}
        copies: dict[str, torch.Tensor] = {}
        pending: dict[str, int | torch.Tensor] = {}
        streams: list[torch.cuda.Stream] = []
        try:
            for device, keys in _by_device(tensors).items():
                stream = self._side_stream(device)
                if stream is not None:
                    streams.append(stream)
                with _on_stream(stream):
                    for k in keys:
                        copies[k] = self._copy(k, tensors[k])
                # The digests on a side stream of their own: their kernels run on the device's
                # cores while the copies above run on its copy engine, instead of each digest
                # waiting for its tensor's copy. Both streams follow the work training queued
                # before the call, only read the tensors, and are synchronized below, before
                # training may go on.
                proofs = [k for k in keys if k in checked]
                digest_stream = self._side_stream(device, "digest") if proofs else None
                if digest_stream is not None:
                    streams.append(digest_stream)
                with _on_stream(digest_stream):
                    for k in proofs:
                        pending[k] = staging_digest(tensors[k])
        finally:
            # Also when a copy or a digest failed (no device memory for a temporary): no copy
            # issued may still be landing in buffers that are about to be reused or unmapped.
            for stream in streams:
                stream.synchronize()
        digests = dict(zip(pending, fpkernels.settle(list(pending.values()))))
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
                staged[key] = frozen(value)
        return Staged(unflatten_for_dcp(staged, mappings), digests)

    def _side_stream(self, device: torch.device, use: str = "copy") -> torch.cuda.Stream | None:
        """The side stream of a CUDA ``device`` for ``use`` (``"copy"``: the staging copies;
        ``"digest"``: the ``verify_staging`` digests), ``None`` for host memory and other
        accelerators; made to wait for that device's current stream first."""
        if device.type != "cuda":
            return None
        stream = self._streams.get((use, device.index))
        if stream is None:
            stream = self._streams[(use, device.index)] = torch.cuda.Stream(device=device)
        # Copies must see every kernel training queued on this device before save() was called.
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def _copy(self, key: str, src: torch.Tensor) -> torch.Tensor:
        if src.is_quantized:
            # A quantized tensor carries its quantizer; an empty buffer cannot hold one, so it
            # is copied afresh (quantized state is small: observers, a few weights).
            self._buffers.pop(key, None)
            return src.to("cpu", copy=True)
        buf = self._buffer(key, src)
        # Non-blocking only from CUDA into pinned memory, on the side stream synchronized before
        # stage() returns; every other copy completes before copy_ returns.
        buf.copy_(src, non_blocking=src.device.type == "cuda" and (buf.is_pinned() or self._arena_pinned))
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
        try:
            self._await_reserve()
        except BaseException:  # noqa: BLE001 - closing: what failed to be reserved is released anyway
            pass
        self._buffers.clear()
        self._layout = []
        if self.arena is not None:
            self.arena.close()
            self.arena = None


def frozen(value: Any) -> Any:
    """(the thread that calls the save) A non-tensor leaf of the state as an async save stages it:
    a deep copy, frozen against the training loop's later changes. Tensors it holds (a tuple's,
    stored inside it) on an accelerator are copied to host memory first, here, on the caller's
    stream: the writer (a thread on the default stream, or a process that must not touch the
    GPU) then never reads device memory that stream may still be writing. Loads copy them back
    into the live tensors, on their devices."""
    if _holds_device_tensor(value):
        value = _to_host(value)
    return copy.deepcopy(value)


def _holds_device_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not isinstance(value, DTensor) and value.device.type not in ("cpu", "meta")
    if isinstance(value, (tuple, list)):
        return any(_holds_device_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_device_tensor(v) for v in value.values())
    return False


def _to_host(value: Any) -> Any:
    """``value`` with its device tensors copied to the host (containers rebuilt, as they were)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if _holds_device_tensor(value) else value
    if isinstance(value, tuple):
        items = [_to_host(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _to_host(v)
        return out
    return value


def _by_device(tensors: dict[str, torch.Tensor]) -> dict[torch.device, list[str]]:
    """Keys of ``tensors`` grouped by the device they live on (insertion order kept)."""
    out: dict[torch.device, list[str]] = {}
    for key, t in tensors.items():
        out.setdefault(t.device, []).append(key)
    return out


def _on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.stream(stream)`` (which also makes its device current), or nothing."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


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
