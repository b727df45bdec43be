"""DCP's file reader over one step directory (:class:`~distckpt.integrity.stepfiles.StepFiles`): safe,
verifying, and with fewer copies.

* ``.metadata`` is the step's, read once and verified (:meth:`StepFiles.metadata`): checked
  against the manifest, unpickled by an allow-list unpickler, validated.
* Every data file this rank opens is read once, front to back, through
  :class:`~distckpt.integrity.stepfiles.VerifiedFile`, and its size and checksum are compared with the
  manifest; a mismatch raises :class:`~distckpt.errors.IntegrityError` naming the file. (Resharded
  loads thus read whole files even where they need only part of one.)
* A stored tensor that this rank needs whole, into a contiguous host destination of the same
  dtype, is read straight into the destination's memory (``readinto``) and hashed there: one
  copy instead of DCP's three (bytes, ``torch.load``, ``copy_``). Its layout comes from the
  record's first bytes (:func:`~distckpt.integrity.torchfile.head_layout`), read by the same
  front-to-back pass, so the file is still read once, in order, on local disks and object
  stores alike (no random reads, no second handle). Everything else takes DCP's path.
* Files are read side by side by up to ``thread_count`` threads, as many as the bytes pay for
  (:attr:`~distckpt.storage.base.Storage.read_bytes_per_thread`): on a local disk a small load
  runs faster in one thread than in two whose per-tensor Python work contends for the GIL
  (measured: benchmarks/README.md).

Call order is DCP's (all ranks: ``read_metadata``, ``set_up_storage_reader``, ``read_data``).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from distckpt._compat import byte_viewable
from distckpt.errors import IntegrityError
from distckpt.integrity.manifest import FileRecord
from distckpt.integrity.shards import load_record
from distckpt.integrity.stepfiles import StepFiles, VerifiedFile
from distckpt.integrity.torchfile import HEAD, RawLayout, head_layout
from distckpt.save.d2h import caller_streams, follow
from distckpt.storage.base import Storage
from distckpt.storage.stream import StreamedFile, Streams

#: The largest piece of a stored tensor copied to a device through one pinned host buffer. Each
#: reader thread holds two: pinned memory stays bounded (and cached by torch after the load) by
#: this, not by the largest tensor; 64 MiB pieces still keep the copies at the link's speed.
DEVICE_PIECE = 64 * 2**20


def checkpoint_reader(
    storage: Storage,
    *parts: str,
    files: Mapping[str, FileRecord] | None = None,
    checksum: str | None = None,
    thread_count: int = 2,
    metadata: Metadata | None = None,
    streams: Streams | None = None,
) -> CheckpointReader:
    """(each rank) A DCP ``StorageReader`` for the step directory ``parts`` under ``storage``,
    verifying ``files`` (the manifest's records) if given and serving ``metadata`` if it was read
    and verified already. ``streams``: files this rank receives from peers instead of reading
    them, and sends to them (the local tier's recovery, :mod:`distckpt.storage.stream`)."""
    step = StepFiles(storage, "/".join(p.strip("/") for p in parts if p), files=files, algorithm=checksum, metadata=metadata)
    return CheckpointReader(step, thread_count=thread_count, streams=streams)


class CheckpointReader(FileSystemReader):
    """A DCP ``StorageReader`` for one step directory (made by :func:`checkpoint_reader`)."""

    def __init__(self, step: StepFiles, thread_count: int = 2, streams: Streams | None = None) -> None:
        super().__init__(step.storage.join(step.dirname))
        self.streams = streams
        self.step = step
        self.storage = step.storage
        self.fs = step.storage.dcp_filesystem()
        self.path = step.storage.dcp_path(step.dirname)
        self.thread_count = max(1, thread_count)
        self._lock = threading.Lock()
        self._local = threading.local()  # per reader thread: its _DeviceSink
        self._sinks: list[_DeviceSink] = []

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self.load_id = os.urandom(8).hex()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        metadata = self.step.metadata()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        try:
            if self.streams is not None:
                self.streams.start()  # this rank's sends run beside its own reads
            # Opened up front: a file the manifest does not list fails before anything is read.
            jobs = [(self._open(name), reqs) for name, reqs in sorted(per_file.items())]
            workers = min(self.thread_count, len(jobs), self._threads_worth(plan.items))
            if self.streams is not None and self.streams.incoming:
                workers = 1  # streamed files arrive one piece at a time, in order
            if workers <= 1:
                for job in jobs:
                    self._read_file(*job, planner)
            else:
                # Files are independent and readinto/crc32c release the GIL: read them side by side.
                # The planner's per-item callbacks touch disjoint destinations. Each thread takes
                # the caller's device and streams (a new thread's are device 0's defaults): its
                # copies to a device then follow what the caller queued for the destinations,
                # and no thread makes a CUDA context on a device the rank does not use.
                callers = caller_streams(getattr(planner, "state_dict", {}).values())
                with ThreadPoolExecutor(workers, thread_name_prefix="distckpt-read", initializer=follow, initargs=(callers,)) as pool:
                    for future in [pool.submit(self._read_file, *job, planner) for job in jobs]:
                        future.result()
        finally:
            try:
                self.finish_streams()
            finally:
                # Every host-to-device copy done, so the caller's streams see the loaded values
                # when the load returns (and the pinned buffers are free again); after a failed
                # read too: a retry, or the root after a failed local-tier load, writes the same
                # destinations, and must not race copies still in flight.
                for sink in self._sinks:
                    sink.finish()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _open(self, name: str) -> VerifiedFile | StreamedFile:
        if self.streams is not None and name in self.streams.incoming:
            return self.streams.open(name, self.step.display(name))
        return self.step.file(name)

    def finish_streams(self) -> None:
        """(each rank, after its read, failed or not) Receive every stream to its end and send
        every outgoing one, so that no peer waits for this rank (see
        :meth:`~distckpt.storage.stream.Streams.finish`). Nothing without streams."""
        if self.streams is not None:
            self.streams.finish()

    def _threads_worth(self, items: list[ReadItem]) -> int:
        """How many reader threads the bytes of ``items`` pay for on this storage."""
        per_thread = self.storage.read_bytes_per_thread
        if not per_thread:
            return self.thread_count
        stored = {item.storage_index for item in items}
        return max(1, sum(self.storage_data[i].length for i in stored) // per_thread)

    def _read_file(self, f: VerifiedFile | StreamedFile, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        """Read one file in one pass: serve every request from it, then check it whole."""
        by_item: dict[tuple[int, int], list[ReadItem]] = {}
        for req in reqs:
            info = self.storage_data[req.storage_index]
            by_item.setdefault((info.offset, info.length), []).append(req)
        failure: BaseException | None = None
        direct: dict[tuple[int, int], list[tuple[ReadItem, torch.Tensor]] | None] = {}
        try:
            if isinstance(f, StreamedFile):
                try:
                    direct = {key: self._direct_targets(item_reqs, planner) for key, item_reqs in by_item.items()}
                    f.begin()
                    f.place(self._placements(f, direct))
                except Exception as exc:  # noqa: BLE001 - finish() below drains the stream
                    failure = exc
            for (offset, length), item_reqs in sorted(by_item.items()) if failure is None else ():
                try:
                    head = b""
                    key = (offset, length)
                    targets = direct[key] if key in direct else self._direct_targets(item_reqs, planner)
                    if targets is not None:
                        head = f.read_range(offset, min(HEAD, length))
                        if self._read_direct(f, offset, length, head, targets, planner):
                            continue
                    # The head already went by the pass: read on from its end (no read backwards).
                    data = head + f.read_range(offset + len(head), length - len(head)) if head else f.read_range(offset, length)
                    if len(data) != length:
                        raise IntegrityError(f"{f.where}: truncated (ends before byte {offset + length})")
                    self._serve(data, item_reqs, planner, f.where)
                except Exception as exc:  # noqa: BLE001
                    # Corrupt bytes often fail to deserialize, or fail an item's digest, before
                    # the checksum is known: read on, and blame the file if its checksum is wrong.
                    failure = exc
                    break
            try:
                f.finish()
            except IntegrityError as exc:
                if failure is not None:
                    raise exc from failure
                raise
        finally:
            f.close()
        if failure is not None:
            raise failure

    def _placements(
        self, f: StreamedFile, direct: dict[tuple[int, int], list[tuple[ReadItem, torch.Tensor]] | None]
    ) -> dict[int, torch.Tensor]:
        """Where a streamed file's data ranges can be received in place: each stored tensor this
        rank reads whole into one contiguous host destination (the destination
        :meth:`_read_direct` fills, by the same :func:`_direct_plan`), as ``{range start: its
        bytes}``. ``direct``: each record's :meth:`_direct_targets`."""
        out: dict[int, torch.Tensor] = {}
        for (offset, length), targets in direct.items():
            span = f.data_range(offset)
            if span is None or targets is None or len(targets) != 1:
                continue
            layout = head_layout(f.rest_bytes(offset, span[0]))
            plan = _direct_plan(layout, length, targets)
            if layout is None or plan is None or offset + layout.data_offset != span[0] or layout.nbytes != span[1] - span[0]:
                continue
            (_, target, start), = plan
            if target.device.type != "cpu" or start != layout.data_offset or target.numel() * target.element_size() != layout.nbytes:
                continue
            out[span[0]] = target.view(-1).view(torch.uint8)
        return out

    def _direct_targets(self, reqs: list[ReadItem], planner: LoadPlanner) -> list[tuple[ReadItem, torch.Tensor]] | None:
        """The requests of one stored tensor that can be read straight into their destinations,
        with those destinations (sorted by their first row), or ``None``.

        Each request must take whole rows (offsets and lengths cover every dimension but the
        first: the tensor whole, or the rows an FSDP shard at another world size takes), into a
        contiguous destination of the requested shape on the host or on a CUDA device, and the
        requests must not overlap: their bytes are then disjoint runs of the record, read in order.
        """
        if any(r.type == LoadItemType.BYTE_IO for r in reqs):
            return None
        if self.storage_data[reqs[0].storage_index].transform_descriptors:
            return None
        out = []
        for req in reqs:
            if any(int(o) for o in list(req.storage_offsets)[1:]):
                return None
            target = planner.resolve_tensor(req).detach()
            if target.device.type not in ("cpu", "cuda") or not byte_viewable(target) or target.is_conj() or target.is_neg():
                return None  # (a lazy view's memory is not its values: DCP's copy_ fills it)
            if tuple(req.lengths) != tuple(target.shape):
                return None
            out.append((req, target))
        out.sort(key=lambda rt: int(rt[0].storage_offsets[0]) if len(rt[0].storage_offsets) else 0)
        for (a, _), (b, _) in zip(out, out[1:]):
            if int(a.storage_offsets[0]) + int(a.lengths[0]) > int(b.storage_offsets[0]):
                return None  # overlapping rows: DCP's path serves them from one deserialized copy
        return out

    def _read_direct(
        self,
        f: VerifiedFile | StreamedFile,
        offset: int,
        length: int,
        head: bytes,
        targets: list[tuple[ReadItem, torch.Tensor]],
        planner: LoadPlanner,
    ) -> bool:
        """Read a stored tensor's rows straight into their destinations if its record's ``head``
        shows plain bytes of their dtype and row shape: the part of them inside the head is
        copied, the rest read into place (CUDA destinations through a pinned host buffer, copied
        on a side stream, see :class:`_DeviceSink`). ``False`` (nothing written) if the layout
        is not that plain."""
        plan = _direct_plan(head_layout(head), length, targets)
        if plan is None:
            return False
        for req, target, start in plan:
            nbytes = target.numel() * target.element_size()
            if nbytes:
                if _on_host(target):
                    self._fill(f, offset, head, start, memoryview(target.view(-1).view(torch.uint8).numpy()), req)
                else:
                    self._to_device(f, offset, head, start, target, req)
            planner.commit_tensor(req, target)
        return True

    def _to_device(self, f: VerifiedFile | StreamedFile, offset: int, head: bytes, start: int, target: torch.Tensor, req: ReadItem) -> None:
        """:meth:`_fill` for a device destination: through this thread's :class:`_DeviceSink`, in
        pieces of at most :data:`DEVICE_PIECE` (a thread pins two such buffers, not two of the
        largest tensor: a 4 GiB one pinned 8 GiB per thread)."""
        sink = self._sink()
        dest = target.view(-1).view(torch.uint8)
        nbytes = dest.numel()
        for at in range(0, nbytes, DEVICE_PIECE):
            n = min(DEVICE_PIECE, nbytes - at)
            self._fill(f, offset, head, start + at, sink.buffer(n), req)
            sink.copy_to(dest[at : at + n])

    @staticmethod
    def _fill(f: VerifiedFile | StreamedFile, offset: int, head: bytes, start: int, view: memoryview, req: ReadItem) -> None:
        """Bytes ``[start, start + len(view))`` of the record at ``offset`` into ``view``: what the
        head holds is copied, the rest read by the pass."""
        in_head = max(0, min(len(head) - start, len(view)))
        if in_head:
            view[:in_head] = head[start : start + in_head]
        rest = len(view) - in_head
        if rest and f.readinto(offset + start + in_head, view[in_head:]) != rest:
            raise IntegrityError(f"{f.where}: truncated inside {req.storage_index.fqn}")

    def _sink(self) -> _DeviceSink:
        """This reader thread's :class:`_DeviceSink` (made on first use)."""
        sink = getattr(self._local, "sink", None)
        if sink is None:
            sink = self._local.sink = _DeviceSink()
            with self._lock:
                self._sinks.append(sink)
        return sink

    def _serve(self, data: bytes, item_reqs: list[ReadItem], planner: LoadPlanner, where: str) -> None:
        """Deserialize one stored item and hand it to every request that reads from it."""
        for req in item_reqs:
            info = self.storage_data[req.storage_index]
            raw = self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(data))
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw.read()))
                continue
            tensor = load_record(raw if raw.seekable() else io.BytesIO(raw.read()), req.storage_index.fqn, where)
            tensor = _narrow(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise IntegrityError(
                    f"{where}: item {req.storage_index.fqn} has shape {list(tensor.shape)}, expected {list(target.shape)}"
                )
            if target.is_quantized or tensor.is_quantized:
                _refuse_other_quantizer(target, tensor, req.storage_index.fqn, where)
            target.copy_(tensor)
            planner.commit_tensor(req, target)


def _quantizer(t: torch.Tensor) -> tuple | None:
    """What turns ``t``'s integers into values (``None``: not quantized)."""
    if not t.is_quantized:
        return None
    if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return (str(t.qscheme()), t.dtype, t.q_scale(), t.q_zero_point())
    return (str(t.qscheme()), t.dtype, t.q_per_channel_axis(), t.q_per_channel_scales().tolist(), t.q_per_channel_zero_points().tolist())


def _refuse_other_quantizer(target: torch.Tensor, stored: torch.Tensor, key: str, where: str) -> None:
    """A load copies a stored tensor's values into the live one in place, which cannot take
    another scale or zero point: a quantized tensor loaded into one quantized otherwise got the
    stored integers under its own scale (other values), silently. Refused, naming both."""
    want, have = _quantizer(stored), _quantizer(target)
    if want != have:
        saved = f"quantized as {want}" if want is not None else f"unquantized ({stored.dtype})"
        into = f"quantized as {have}" if have is not None else f"unquantized ({target.dtype})"
        raise ValueError(
            f"{where}: {key!r} was saved {saved} but the tensor loaded into is {into}: a load copies values into "
            "your tensor in place and cannot change its quantization; load into a tensor quantized as saved (e.g. "
            "torch.quantize_per_tensor(torch.zeros(shape), scale, zero_point, dtype)), or save it dequantized (a "
            "torch.ao statically quantized module: save and load the float model, quantize after the load)"
        )


def _on_host(target: torch.Tensor) -> bool:
    """Whether bytes are read straight into ``target`` (host memory) or through a pinned buffer
    and a copy (a device)."""
    return target.device.type == "cpu"


def _direct_plan(
    layout: RawLayout | None, length: int, targets: list[tuple[ReadItem, torch.Tensor]]
) -> list[tuple[ReadItem, torch.Tensor, int]] | None:
    """Where in a record of ``length`` bytes each destination's bytes start, if the record holds
    plain bytes (``layout``) of every destination's dtype and row shape, inside the record, and
    each request's rows lie within the stored tensor's; else ``None``. ``targets``: from
    :meth:`CheckpointReader._direct_targets` (whole rows, contiguous, sorted, disjoint)."""
    if layout is None or layout.data_offset + layout.nbytes > length:
        return None
    rows = layout.shape[0] if layout.shape else 1
    row_bytes = layout.nbytes // rows if rows else 0
    plan = []
    for req, target in targets:
        first = int(req.storage_offsets[0]) if layout.shape else 0
        count = int(req.lengths[0]) if layout.shape else 1
        if target.dtype != layout.dtype or tuple(req.lengths)[1:] != tuple(layout.shape)[1:] or first + count > rows:
            return None
        if not layout.shape and tuple(target.shape) != ():
            return None
        plan.append((req, target, layout.data_offset + first * row_bytes))
    return plan


def _narrow(tensor: Any, offsets: Sequence[int], lengths: Sequence[int]) -> Any:
    """The part of a stored shard a request reads: ``lengths`` elements from ``offsets`` per dim
    (``tensor``, what the record held, is returned as it is if it is no tensor)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor  # the shape check below reports it
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, int(start), int(length))
    return tensor


class _DeviceSink:
    """Host-to-device copies of a reader thread: the bytes of a record (a piece of at most
    :data:`DEVICE_PIECE`) are read into one of two pinned host buffers, then copied to their CUDA
    destination on a side stream of the destination's device without blocking, so the next
    piece's read overlaps this copy. A buffer is reused only once its previous copy finished
    (its event, recorded on the stream that ran the copy: one side stream per device, as a
    process may load into tensors on several); :meth:`finish` waits for all (the load returns
    after it, so the caller's streams see every loaded value). Not thread-safe: one per reader
    thread, whose current streams are the caller's (:func:`~distckpt.save.d2h.follow`)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._streams: dict[int | None, torch.cuda.Stream] = {}
        self._pending: torch.Tensor | None = None  # the buffer handed out by buffer(), awaiting copy_to()

    def buffer(self, nbytes: int) -> memoryview:
        """A pinned host buffer of ``nbytes`` to read into (free of earlier copies)."""
        i = self._turn
        if self._events[i] is not None:
            self._events[i].synchronize()  # its previous copy to the device is done
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[i] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._pending = buf[:nbytes]
        return memoryview(self._pending.numpy())

    def copy_to(self, target: torch.Tensor) -> None:
        """Copy the bytes read into the last :meth:`buffer` to ``target`` (CUDA, contiguous,
        ``uint8``, as many bytes)."""
        assert self._pending is not None
        device = target.device
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device=device)
        # Ordered after whatever the caller's stream on that device has queued for the destination.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            target.copy_(self._pending, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._events[self._turn] = event
        self._turn = 1 - self._turn

    def finish(self) -> None:
        """(the thread that called the load) The caller's stream on each device waits for this
        sink's copies there, and the host for all (the pinned buffers are then free)."""
        for stream in self._streams.values():
            torch.cuda.current_stream(stream.device).wait_stream(stream)
            stream.synchronize()
        self._streams = {}
        self._buffers = [None, None]
        self._events = [None, None]
