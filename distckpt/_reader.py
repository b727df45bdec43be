"""DCP's file reader on a :class:`~distckpt.storage.Storage`: safe, verifying, and with fewer copies.

* ``.metadata`` is unpickled by an allow-list unpickler (:mod:`distckpt.safe_pickle`).
* With the manifest's ``files`` (name -> size and checksum), every file this rank opens is read
  once, front to back, and its size and checksum are compared with the manifest; a mismatch
  raises :class:`~distckpt.errors.IntegrityError` naming the file. (Resharded loads thus read
  whole files even where they need only part of one.)
* A stored tensor that this rank needs whole, into a contiguous destination of the same dtype,
  is read straight into the destination's memory (``readinto``) and hashed there: one copy
  instead of DCP's three (bytes, ``torch.load``, ``copy_``). Everything else takes DCP's path.

Call order is DCP's (all ranks: ``read_metadata``, ``set_up_storage_reader``, ``read_data``).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ._torchfile import FileSlice, raw_layout
from .errors import IntegrityError
from .integrity import CHUNK, new_hasher


class CheckpointReader(FileSystemReader):
    """A DCP ``StorageReader`` for one step directory of a :class:`~distckpt.storage.Storage`."""

    def __init__(
        self,
        storage: Any,
        path: str,
        files: Mapping[str, Any] | None = None,
        checksum: str | None = None,
        thread_count: int = 2,
        metadata: Any = None,
    ) -> None:
        super().__init__(path if storage.is_local else "unused")
        self.metadata = metadata
        self.thread_count = max(1, thread_count)
        self.storage = storage
        self.fs = storage.dcp_filesystem()
        self.path = Path(path) if storage.is_local else path
        self.files = dict(files) if files is not None else None
        self.checksum = checksum
        self.fast_reads = 0  # tensors read straight into their destination (for tests/benchmarks)
        self._count_lock = threading.Lock()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self.load_id = os.urandom(8).hex()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def _rel(self, name: str) -> str:
        """``name`` relative to the storage root (what :meth:`Storage.open` takes)."""
        path = os.fspath(self.path)
        root = self.storage.path
        base = os.path.relpath(path, root) if self.storage.is_local else path[len(root) :].strip("/")
        return name if base in ("", ".") else f"{base}/{name}"

    def _where(self, name: str) -> str:
        return self.storage.display(self._rel(name))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        from .safe_pickle import load_metadata

        if self.metadata is not None:
            # Read and verified once already (by the coordinator, against the manifest).
            metadata = self.metadata
        else:
            with self.storage.open(self._rel(".metadata"), "rb") as f:
                data = f.read()
            metadata = load_metadata(data, self._where(".metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        jobs = []
        for name, reqs in per_file.items():
            record = None
            if self.files is not None:
                record = self.files.get(name)
                if record is None:
                    raise IntegrityError(f"{self._where(name)}: not listed in the manifest")
            jobs.append((name, record, reqs))
        workers = min(self.thread_count, len(jobs))
        if workers <= 1:
            for job in jobs:
                self._read_file(*job, planner)
        else:
            # Files are independent and readinto/crc32 release the GIL: read them side by side.
            # The planner's per-item callbacks touch disjoint destinations.
            with ThreadPoolExecutor(workers, thread_name_prefix="distckpt-read") as pool:
                for future in [pool.submit(self._read_file, *job, planner) for job in jobs]:
                    future.result()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, name: str, record: Any, reqs: list[Any], planner: Any) -> None:
        """Stream ``name`` once: serve every request from it; check size and checksum if known."""
        where = self._where(name)
        by_item: dict[tuple[int, int], list[Any]] = {}
        for req in reqs:
            info = self.storage_data[req.storage_index]
            by_item.setdefault((info.offset, info.length), []).append(req)
        verify = record is not None
        hasher = new_hasher(self.checksum) if verify and self.checksum and record.checksum else None
        try:
            cm = self.storage.open(self._rel(name), "rb")
            stream = cm.__enter__()
        except FileNotFoundError:
            raise IntegrityError(f"{where}: missing") from None
        reader = _HashingReader(stream, hasher)
        failure: BaseException | None = None
        try:
            for (offset, length), item_reqs in sorted(by_item.items()):
                if not verify:
                    stream.seek(offset)
                    reader.pos = offset
                elif offset > reader.pos:
                    reader.skip(offset - reader.pos)
                elif offset < reader.pos:  # overlapping items: not produced by DCP's writer
                    raise IntegrityError(f"{where}: overlapping items at offset {offset}")
                try:
                    if self.storage.is_local and self._read_direct(reader, stream, offset, length, item_reqs, planner):
                        continue
                    data = reader.read(length)
                    if len(data) != length:
                        raise IntegrityError(f"{where}: truncated ({reader.pos} bytes, manifest says {length + offset}+)")
                    self._serve(data, item_reqs, planner, where)
                except IntegrityError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    # Corrupt bytes often fail to deserialize before the checksum is known:
                    # read on, and blame the file if its checksum is wrong.
                    failure = exc
                    break
            if verify:
                reader.skip(None)
        finally:
            cm.__exit__(None, None, None)
        if verify:
            if reader.pos != record.size:
                raise IntegrityError(f"{where}: {reader.pos} bytes, manifest says {record.size} (truncated or overwritten)")
            if hasher is not None and hasher.hexdigest() != record.checksum:
                raise IntegrityError(
                    f"{where}: {self.checksum} {hasher.hexdigest()} does not match the manifest's "
                    f"{record.checksum} (corrupted)"
                ) from failure
        if failure is not None:
            raise failure

    def _read_direct(self, reader: _HashingReader, stream: Any, offset: int, length: int, reqs: list[Any], planner: Any) -> bool:
        """Read one stored tensor straight into its destination, if it is needed whole."""
        if len(reqs) != 1 or reqs[0].type == LoadItemType.BYTE_IO:
            return False
        req = reqs[0]
        info = self.storage_data[req.storage_index]
        if info.transform_descriptors or any(int(o) for o in req.storage_offsets):
            return False
        target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or not target.is_contiguous() or tuple(req.lengths) != tuple(target.shape):
            return False
        layout = raw_layout(FileSlice(stream, offset, length))
        stream.seek(reader.pos)  # raw_layout moved around inside the record
        if (
            layout is None
            or layout.dtype != target.dtype
            or layout.shape != tuple(target.shape)
            or layout.data_offset + layout.nbytes > length
        ):
            return False
        reader.skip(layout.data_offset)
        if layout.nbytes:
            view = memoryview(target.view(-1).view(torch.uint8).numpy())
            if reader.readinto(view) != layout.nbytes:
                raise IntegrityError(f"{self._where(info.relative_path)}: truncated inside {req.storage_index.fqn}")
        reader.skip(length - layout.data_offset - layout.nbytes)
        planner.commit_tensor(req, target)
        with self._count_lock:
            self.fast_reads += 1
        return True

    def _serve(self, data: bytes, item_reqs: list[Any], planner: Any, where: str) -> None:
        """Deserialize one stored item and hand it to every request that reads from it."""
        for req in item_reqs:
            info = self.storage_data[req.storage_index]
            raw = self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(data))
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw.read()))
                continue
            tensor = _load_record(raw if raw.seekable() else io.BytesIO(raw.read()), req.storage_index.fqn, where)
            tensor = _narrow(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise IntegrityError(
                    f"{where}: item {req.storage_index.fqn} has shape {list(tensor.shape)}, expected {list(target.shape)}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)


def _narrow(tensor: Any, offsets: Any, lengths: Any) -> Any:
    """The part of a stored shard a request reads: ``lengths`` elements from ``offsets`` per dim."""
    if not isinstance(tensor, torch.Tensor):
        return tensor  # the shape check below reports it
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, int(start), int(length))
    return tensor


def _load_record(stream: Any, key: str, where: str) -> Any:
    """``torch.load(weights_only=True)`` of one stored item; a refusal names the key."""
    import pickle

    from .errors import UnsafeCheckpointError

    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where}: item {key!r} needs code to be unpickled ({str(exc).strip().splitlines()[0][:200]}); refusing to load it"
        ) from None


class _HashingReader:
    """Sequential reads from a file that feed a hasher (when verifying) and track the position."""

    def __init__(self, stream: Any, hasher: Any) -> None:
        self.stream = stream
        self.hasher = hasher
        self.pos = 0

    def read(self, n: int) -> bytes:
        data = self.stream.read(n)
        if self.hasher is not None:
            self.hasher.update(data)
        self.pos += len(data)
        return data

    def readinto(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            n = self.stream.readinto(view[got:])
            if not n:
                break
            got += n
        if self.hasher is not None:
            self.hasher.update(view[:got])
        self.pos += got
        return got

    def skip(self, n: int | None) -> None:
        """Read (and hash) ``n`` bytes, or to the end with ``None``, in bounded chunks."""
        while n is None or n > 0:
            data = self.read(CHUNK if n is None else min(CHUNK, n))
            if not data:
                return
            if n is not None:
                n -= len(data)
