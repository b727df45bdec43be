"""Copies of accelerator tensors to host memory ahead of a writer thread (sync saves).

A writer thread serializes its tensors one after another, and each must be in host memory when
its turn comes. For a CUDA tensor, ``.cpu()`` would copy it into freshly allocated pageable
memory, synchronously, one tensor at a time, with the writes waiting meanwhile (most of a sync
save of GPU state: ``../shared/gpu/RESULTS.md`` §2). Instead :func:`host_tensors` gives each
writer thread a ring of pinned host memory of bounded size (:data:`RING_BYTES`, not a copy of
the whole state), copies the tensors the thread writes next into it on a side stream as far
ahead as the ring has room, and hands each tensor out of the ring when its copy is done: the
copies of the next tensors run while the current one is serialized and written, and no tensor
waits for an allocation. A tensor is handed out as a host tensor whose storage is exactly its
bytes in the ring (``torch.save`` writes a tensor's whole storage), and its room is reused once
the thread comes back for the next one.

The copies are ordered after the work already queued on the caller's current stream of each
device (the training step that produced the tensors), exactly like the copies of an async
save's staging. With ``prove`` (``verify_staging``), every copy is proven as an async save's
staging is: a digest of the device tensor, taken on the side stream just before its copy, must
equal the digest of the bytes handed out (:func:`distckpt.save.staging.staging_digest`, taken by
a helper thread while the writer writes them), or the save fails with
:class:`~distckpt.errors.StagingMismatchError` and nothing is committed.

Tensors larger than the ring, and tensors of other devices, are copied by ``.cpu()`` when their
turn comes, in order. Not collective; one call per writer thread.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.checkpoint.planner import WriteItem

from distckpt.errors import StagingMismatchError
from distckpt.save.staging import staging_digest
from distckpt.state import fpkernels
from distckpt.state.shape import numel

#: Pinned host memory per writer thread for the copies ahead of it. Large enough that copies of
#: the next tensors overlap the write of the current one at disk speeds; torch's caching host
#: allocator keeps it for the next save instead of pinning memory anew.
RING_BYTES = 256 << 20
#: Every tensor starts on a cache line of the ring (any dtype's alignment).
ALIGN = 64
#: Device types whose tensors go through the ring (pinned memory and streams are CUDA's).
PIPELINED = frozenset({"cuda"})
#: Elements per NumPy call of a proof's host digest. Each call gives up the GIL and must take it
#: back from the writer threads; beside 7 threads writing pieces (crc32c between Python steps),
#: on the 2-core VM a 64 MiB digest took 0.105-0.115 s in 64 Ki-element calls against
#: 0.058-0.071 s in 1 Mi-element ones (alone, 1 Mi is ~9% slower; measured 2026-11-26).
PROOF_CHUNK = 1 << 20


class Timings(Protocol):
    """Where :func:`host_tensors` adds the seconds its thread spent on copies and proofs
    (:class:`distckpt.save.writer.WriteTimings`)."""

    def add(self, part: str, dt: float) -> None: ...


#: The parts :func:`host_tensors` times (thread-seconds, summed over writer threads):
#: issuing copies (and the device digests before them), waiting for a copy to land, waiting for
#: the host digest of a written tensor (the proof).
PARTS = ("d2h_issue", "d2h_wait", "proof_wait")


class Ring:
    """A first-in, first-out allocator over ``capacity`` bytes: :meth:`take` gives room at the
    front (wrapping around to the start when the end has too little), :meth:`give_back` frees the
    oldest room taken. Pure bookkeeping; the memory is the caller's."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._live: deque[tuple[int, int]] = deque()  # (offset, end) in the order taken
        self._head = 0  # where the next room starts if it fits there

    @staticmethod
    def room(nbytes: int) -> int:
        """The bytes a room for ``nbytes`` takes (whole cache lines)."""
        return -(-max(nbytes, 1) // ALIGN) * ALIGN

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit in the ring at all (once it is empty)."""
        return self.room(nbytes) <= self.capacity

    def take(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` of room, or ``None`` while the live rooms leave too little
        (always ``None`` if it does not :meth:`fits`)."""
        size = self.room(nbytes)
        if size > self.capacity:
            return None
        if not self._live:
            offset = 0
        else:
            tail = self._live[0][0]  # the oldest live room: nothing may reach into it
            if self._head > tail:  # live rooms lie in [tail, head): room at the end, or from 0
                if self._head + size <= self.capacity:
                    offset = self._head
                elif size <= tail:
                    offset = 0
                else:
                    return None
            elif self._head + size <= tail:  # wrapped: room only between head and tail
                offset = self._head
            else:
                return None
        self._live.append((offset, offset + size))
        self._head = offset + size
        return offset

    def give_back(self, offset: int) -> None:
        """Free the oldest room taken, which must be the one at ``offset``."""
        oldest = self._live.popleft()
        if oldest[0] != offset:
            raise RuntimeError(f"ring rooms freed out of order: {offset} before {oldest[0]}")
        if not self._live:
            self._head = 0

    @property
    def live(self) -> list[tuple[int, int]]:
        """The rooms taken and not yet given back, ``(offset, end)``, oldest first."""
        return list(self._live)


@dataclass
class _Pending:
    """A tensor on its way out: copied into the ring (``offset``) or waiting for ``.cpu()``."""

    item: WriteItem
    data: torch.Tensor
    offset: int | None = None
    done: torch.cuda.Event | None = None
    digest: torch.Tensor | int | None = None


class _Copier:
    """The ring's memory and, per device, the side stream its copies run on."""

    def __init__(self, capacity: int, callers: Mapping[int, torch.cuda.Stream], pin: bool) -> None:
        self.memory = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self._bytes = memoryview(self.memory.numpy())
        self._callers = callers
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None  # (tests pipeline host tensors: plain synchronous copies)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
            # Ordered after the work queued so far on the caller's stream of that device (the
            # step that made the tensors), once: the save holds the caller until it returns.
            caller = self._callers.get(device.index)
            stream.wait_stream(caller if caller is not None else torch.cuda.current_stream(device))
        return stream

    def issue(self, pending: _Pending, prove: bool) -> None:
        """Start copying ``pending.data`` into its room (and digesting it first, if ``prove``)."""
        src = pending.data
        nbytes = src.numel() * src.element_size()
        dst = self.memory[pending.offset : pending.offset + nbytes].view(src.dtype).view(src.shape)
        stream = self._stream(src.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if prove:
                pending.digest = staging_digest(src)
            dst.copy_(src, non_blocking=stream is not None)
            if stream is not None:
                pending.done = torch.cuda.Event()
                pending.done.record(stream)

    def host(self, pending: _Pending) -> torch.Tensor:
        """``pending``'s tensor in the ring, once its copy is done: a host tensor whose storage is
        exactly its bytes there."""
        if pending.done is not None:
            pending.done.synchronize()
        src = pending.data
        nbytes = src.numel() * src.element_size()
        raw = torch.frombuffer(self._bytes[pending.offset : pending.offset + nbytes], dtype=torch.uint8)
        return raw.view(src.dtype).view(src.shape)

    def finish(self) -> None:
        """Wait for every copy issued (before the ring's memory may be reused)."""
        for stream in self._streams.values():
            stream.synchronize()


def pipelined(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the ring: a plain dense tensor with bytes, on a pipelined device."""
    return (
        t.device.type in PIPELINED
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.numel() > 0
    )


def caller_streams(values: Iterable[object]) -> dict[int, torch.cuda.Stream]:
    """(the thread that calls the save) Its current stream on each CUDA device ``values`` (the
    tensors to write, DTensors too) lie on: what the copies must follow, captured before the
    writer threads (whose current streams are the defaults) start. Only those devices: asking
    for another's stream would create a CUDA context there (from every rank of a node)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    devices = {d.index for d in (getattr(v, "device", None) for v in values) if isinstance(d, torch.device) and d.type == "cuda"}
    return {d: torch.cuda.current_stream(d) for d in sorted(i for i in devices if i is not None)}


def follow(callers: Mapping[int, torch.cuda.Stream]) -> None:
    """(a writer thread, first) Make the caller's streams this thread's current ones, and their
    device its current device (a new thread's is device 0, whatever the rank's): the device work
    it queues (fingerprints of the tensors it writes) must follow the caller's work. Only devices
    the tensors lie on, whose contexts exist already."""
    for device, stream in callers.items():
        torch.cuda.set_device(device)
        torch.cuda.set_stream(stream)


def host_tensors(
    items: Iterable[WriteItem],
    resolve: Callable[[WriteItem], object],
    as_host: Callable[[torch.Tensor], torch.Tensor],
    *,
    prove: bool = False,
    callers: Mapping[int, torch.cuda.Stream] | None = None,
    capacity: int | None = None,
    where: str = "",
    timings: Timings | None = None,
) -> Iterator[tuple[WriteItem, torch.Tensor, torch.Tensor]]:
    """(one writer thread) ``(item, data, host)`` for each tensor item in order: ``data`` what
    ``resolve`` gave, ``host`` its values in host memory, valid until the next item is asked for.

    Pipelined tensors (:func:`pipelined`) are copied ahead into a pinned ring of at most
    ``capacity`` bytes (default :data:`RING_BYTES`; see the module docstring); the others, and tensors larger than the ring,
    are made host tensors by ``as_host`` when their turn comes. ``timings`` gets the seconds of
    each of :data:`PARTS` (where a sync save's time goes that is neither writing nor checksums).

    Raises:
        StagingMismatchError: ``prove`` and a copy's bytes differ from its device tensor's
            (``where`` names the file).
    """
    items = list(items)
    upcoming = iter(items)
    pending: deque[_Pending] = deque()
    ahead: _Pending | None = None  # resolved, not yet placed (no room in the ring yet)
    ring: Ring | None = None
    copier: _Copier | None = None
    # The digest of a tensor's bytes in the ring is taken by a helper thread while this thread
    # writes them (both only read them): a host digest runs at ~5 GB/s per core, which, taken
    # before each write, added its whole time to the save.
    checker = ThreadPoolExecutor(1, thread_name_prefix="distckpt-d2h-proof") if prove else None
    proof: Future[int | torch.Tensor] | None = None
    spent = dict.fromkeys(PARTS, 0.0)
    clock = time.perf_counter
    try:
        while True:
            # Place as many of the next tensors as the ring has room for, in order.
            while True:
                if ahead is None:
                    item = next(upcoming, None)
                    if item is None:
                        break
                    data = resolve(item)
                    if not isinstance(data, torch.Tensor):
                        raise TypeError(f"item {item.index.fqn}: a tensor item resolved to {type(data).__name__}")
                    ahead = _Pending(item, data)
                data = ahead.data
                if pipelined(data):
                    nbytes = data.numel() * data.element_size()
                    if copier is None:
                        # No more than the thread's tensors take (a small save pins little).
                        size = max(ALIGN, min(capacity or RING_BYTES, _planned_bytes(items)))
                        ring = Ring(size)
                        copier = _Copier(size, callers or {}, pin=data.device.type == "cuda")
                    assert ring is not None
                    offset = ring.take(nbytes) if ring.fits(nbytes) else None
                    if offset is None and ring.fits(nbytes):
                        if not pending:  # an empty ring has room for what fits: a bug if not
                            raise RuntimeError(f"{where}: no room for {ahead.item.index.fqn} in an empty ring")
                        break  # no room until the tensors before it are written
                    ahead.offset = offset
                    if offset is not None:
                        t0 = clock()
                        copier.issue(ahead, prove)
                        spent["d2h_issue"] += clock() - t0
                pending.append(ahead)
                ahead = None
            if not pending:
                return
            head = pending.popleft()
            if head.offset is None:
                yield head.item, head.data, as_host(head.data)
                continue
            assert copier is not None and ring is not None
            t0 = clock()
            host = copier.host(head)
            spent["d2h_wait"] += clock() - t0
            if checker is not None:
                proof = _digest_beside(checker, host)
            yield head.item, head.data, host
            if proof is not None:
                # Before its room is reused, and before the file can be committed.
                t0 = clock()
                got, proof = proof.result(), None
                _prove(head, got, where)
                spent["proof_wait"] += clock() - t0
            ring.give_back(head.offset)  # written: its room is free for the next copies
    finally:
        if checker is not None:
            checker.shutdown(wait=True)  # no digest may still read memory about to be reused
        if copier is not None:
            copier.finish()  # no copy may still land in memory that is about to be reused
        if timings is not None:
            for part, dt in spent.items():
                timings.add(part, dt)


def item_bytes(item: WriteItem) -> int:
    """The bytes of ``item``'s tensor chunk, from the plan, without resolving it (1 for a byte
    item: its size is not known before it is serialized)."""
    td = item.tensor_data
    return 1 if td is None else numel(td.chunk.sizes) * td.properties.dtype.itemsize


def _planned_bytes(items: list[WriteItem]) -> int:
    """The bytes of ``items``' tensors, from the plan (without resolving them), each rounded up
    to the ring's alignment."""
    return sum(Ring.room(item_bytes(item)) for item in items if item.tensor_data is not None)


def _digest_beside(checker: ThreadPoolExecutor, host: torch.Tensor) -> Future[int | torch.Tensor]:
    """:func:`staging_digest` of ``host`` on the helper thread; here, at once, where no thread can
    take it (a save made while the interpreter exits: executors then refuse new work)."""
    try:
        return checker.submit(staging_digest, host, PROOF_CHUNK)
    except RuntimeError:
        done: Future[int | torch.Tensor] = Future()
        done.set_result(staging_digest(host, PROOF_CHUNK))
        return done


def _prove(pending: _Pending, host_digest: int | torch.Tensor, where: str) -> None:
    """Raise unless ``host_digest`` (:func:`staging_digest` of the bytes handed out) equals the
    digest taken of the device tensor before its copy."""
    expected = fpkernels.settle([pending.digest])[0] if pending.digest is not None else None
    got = fpkernels.settle([host_digest])[0]
    if expected != got:
        key = pending.item.index.fqn
        raise StagingMismatchError(
            f"{where}: verify_staging: {key} was copied to host memory with values other than the "
            "device tensor's at the save call; nothing was committed (please report it with the "
            "device and torch version)"
        )
