"""A committed step's stored tensors and values, read verified, shard by shard, without a process
group: the one reader that exports (:mod:`distckpt.tools.convert`, :mod:`distckpt.tools.hf_convert`),
``distckpt verify --state`` and the fingerprint check of stored files
(:func:`distckpt.state.statecheck.from_files`) share.

* :class:`ShardSource`: the typed seam, what a consumer of stored shards needs (the tensors'
  keys, dtypes and global shapes, and each tensor's stored shards).
* :class:`CheckpointSource`: the implementation over a step opened with
  :class:`~distckpt.integrity.stepfiles.StepFiles`. Every byte is read through the step's
  verified files, one front-to-back pass per data file, hashed as it goes; every tensor read
  whole is checked against the fingerprint the manifest recorded at save, and non-tensor items
  against their recorded digests. Records are unpickled with ``weights_only=True`` only
  (:func:`load_record`): nothing in a checkpoint runs code.

Not collective: call from one process.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from distckpt.errors import CheckpointError, IntegrityError, UnsafeCheckpointError
from distckpt.integrity import deep_stack
from distckpt.integrity.stepfiles import StepFiles, VerifiedFile
from distckpt.integrity.torchfile import RecordStream, raw_layout
from distckpt.state import fingerprint, values
from distckpt.state.casts import beyond_range
from distckpt.state.shape import numel

__all__ = ["BLOCK", "CheckpointSource", "ShardSource", "TensorInfo", "load_record"]

BLOCK = 16 * 1024 * 1024  # bytes read at a time when streaming a shard

Shard = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the global tensor, the stored shard)


@dataclass
class TensorInfo:
    """A stored tensor as ``.metadata`` declares it: key, dtype and global shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return numel(self.shape)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return self.numel * (dtype or self.dtype).itemsize


class ShardSource(Protocol):
    """A checkpoint's stored tensors, read shard by shard (:class:`CheckpointSource`).

    ``tensors`` lists every stored tensor (key -> :class:`TensorInfo`); ``iter_shards(key)``
    yields ``(offsets, shard)`` for every stored shard of tensor ``key``, one in memory at a
    time, as the ranks that saved it wrote them.
    """

    @property
    def tensors(self) -> Mapping[str, TensorInfo]: ...

    def iter_shards(self, key: str) -> Iterator[Shard]: ...


def load_record(stream: RecordStream, key: str, where: str) -> Any:
    """``torch.load(weights_only=True)`` of one stored item (a tensor or whatever value was
    saved); a refusal names the key.

    Raises:
        UnsafeCheckpointError: the item needs code (globals outside torch's allow-list) to be
            unpickled.
    """
    try:
        return deep_stack.torch_load(stream, where=f"{where}: item {key!r}")  # weights_only, on a stack its nesting fits
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where}: item {key!r} needs code to be unpickled ({str(exc).strip().splitlines()[0][:200]}); refusing to load it"
        ) from None


class _TensorsOnly(dcp.DefaultLoadPlanner):
    """DCP's planner for a request of tensors only: a non-tensor item (which DCP would unpickle
    with ``weights_only=False``) is refused, never read."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise IntegrityError(f"item {read_item.storage_index.fqn!r} is stored as a value where a tensor was expected")


class _Tally:
    """The fingerprint sum of one tensor, accumulated while its blocks or shards stream past."""

    def __init__(self, info: TensorInfo, expected: str | None, version: int) -> None:
        self.info = info
        self.expected = expected
        self.version = version  # the manifest's fingerprint construction
        self.total = 0

    def run(self, values: torch.Tensor, start: int) -> None:
        if self.expected is not None and values.numel():
            self.total = fingerprint.add(self.total, fingerprint.run_sum(values, start, self.version))

    def shard(self, shard: torch.Tensor, offsets: tuple[int, ...]) -> None:
        if self.expected is not None:
            self.total = fingerprint.add(self.total, fingerprint.partial_sum(shard, self.info.shape, offsets, self.version))

    def check(self, where: str) -> None:
        if self.expected is not None and fingerprint.digest(self.total, self.info.shape, self.info.dtype, self.version) != self.expected:
            raise IntegrityError(
                f"{where}: the stored values of {self.info.key} do not match the fingerprint recorded when "
                "it was saved (its .metadata or data were altered)"
            )


class CheckpointSource:
    """A checkpoint opened for streaming reads, tensor by tensor, without a process group.

    Every byte is read through the step's verified files (:meth:`StepFiles.file`): one pass per
    data file, hashed as it goes (no check first and read again). A file's size and checksum
    are compared with the manifest by :meth:`finish`, which callers call before they publish
    anything, or earlier, as soon as the last of the entries announced with :meth:`expect` that
    it holds was read. Every tensor read whole (``read_tensor``, ``iter_bytes``) is also checked
    against the fingerprint the manifest recorded at save. An altered checkpoint is an
    ``IntegrityError``; a plain DCP directory (no manifest) is read unverified
    (``found.unverified`` says so).

    Args:
        found: the step.
        reader: makes the DCP ``StorageReader`` of a step (:class:`distckpt.load.reader.CheckpointReader`,
            which the tools pass), needed only for stored items with stream transforms (plain
            DCP checkpoints written with extensions); ``None``: such items are refused, naming them.
    """

    def __init__(self, found: StepFiles, reader: Callable[[StepFiles], StorageReader] | None = None) -> None:
        self.found = found
        self._reader = reader
        self.metadata = found.metadata()
        self._fingerprints = dict(found.manifest.fingerprints) if found.verifying and found.manifest else {}
        # Non-tensor items' stored bytes against their save-time sha256 (None: not recorded).
        self._value_digests = found.manifest.value_digests if found.verifying and found.manifest else None
        self._files: dict[str, VerifiedFile] = {}
        self._todo: dict[str, set[MetadataIndex]] | None = None
        self.tensors: dict[str, TensorInfo] = {}
        self.values: list[str] = []
        # Tensors whose reads cast some values beyond the asked dtype's range (float32 1e6 into
        # float16: inf), in the order found: an export names them instead of writing inf quietly.
        self.beyond_range: list[str] = []
        for key, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                self.tensors[key] = TensorInfo(key, md.properties.dtype, tuple(int(d) for d in md.size))
            else:
                self.values.append(key)
        lost = sorted(set(self._fingerprints) - set(self.tensors))
        if lost:
            # The manifest recorded these tensors at save; a .metadata without them was altered.
            shown = ", ".join(lost[:10]) + (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
            raise IntegrityError(f"{found.display('.metadata')}: tensors saved in this step are missing from it: {shown}")
        values.check_items_listed(self._value_digests, {k: None for k in self.values}, found.display(".metadata"))

    # files ---------------------------------------------------------------------------------------
    def _indexes(self, key: str) -> list[MetadataIndex]:
        md = self.metadata.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            return [MetadataIndex(key, torch.Size(c.offsets)) for c in md.chunks]
        return [MetadataIndex(key)]

    def _item(self, index: MetadataIndex) -> tuple[VerifiedFile, int, int]:
        """The verified file holding stored item ``index`` and the item's byte range in it."""
        info = self.metadata.storage_data[index]
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError("storage transforms")
        name = os.fspath(info.relative_path)
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = self.found.file(name)
        return f, int(info.offset), int(info.length)

    def position(self, key: str) -> tuple[str, int]:
        """Where ``key``'s first stored byte lies (file, offset): reading entries in this order
        reads each file front to back."""
        stored = [self.metadata.storage_data[i] for i in self._indexes(key)]
        return min((os.fspath(info.relative_path), int(info.offset)) for info in stored)

    def expect(self, keys: list[str]) -> None:
        """Announce the entries that will be read: each file is then checked whole as soon as the
        last of them it holds has been read (before the read of that entry returns)."""
        todo: dict[str, set[MetadataIndex]] = {}
        for key in keys:
            for index in self._indexes(key):
                todo.setdefault(os.fspath(self.metadata.storage_data[index].relative_path), set()).add(index)
        self._todo = todo

    def _done(self, key: str) -> None:
        """Entry ``key`` was read: release the handles, check files nothing more is expected from."""
        for f in self._files.values():
            f.close()
        if self._todo is None:
            return
        for index in self._indexes(key):
            name = os.fspath(self.metadata.storage_data[index].relative_path)
            left = self._todo.get(name)
            if left is not None:
                left.discard(index)
                if not left:
                    del self._todo[name]
                    self._item(index)[0].finish()

    @contextmanager
    def _reading(self, key: str) -> Iterator[None]:
        """Blame a damaged file for a failed read of ``key`` where its checksum says so: corrupt
        bytes usually fail to parse, or fail a fingerprint, before their file's end is reached."""
        try:
            yield
        except IntegrityError as exc:
            for index in self._indexes(key):
                try:
                    f = self._item(index)[0]
                except NotImplementedError:
                    continue
                try:
                    f.finish()
                except IntegrityError as damaged:
                    if damaged is exc:
                        raise
                    raise damaged from exc
            raise

    def finish(self) -> None:
        """Check every data file read so far whole (size and checksum against the manifest).
        Call it before publishing what was made from the reads.

        Raises:
            IntegrityError: a file differs from the manifest or changed while it was read.
        """
        for f in self._files.values():
            f.finish()

    # records -------------------------------------------------------------------------------------
    def _record_bytes(self, index: MetadataIndex) -> bytes:
        f, offset, length = self._item(index)
        data = f.read_range(offset, length)
        if len(data) != length:
            raise IntegrityError(f"{f.where}: truncated (ends inside the item of {index.fqn})")
        return data

    def _record(self, data: bytes, key: str) -> Any:
        """One stored item, unpickled safely; a record that does not parse is an IntegrityError."""
        try:
            return load_record(io.BytesIO(data), key, self.found.display())
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - .metadata points at something that is no record
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise IntegrityError(f"{self.found.display()}: the record stored for {key} cannot be read ({type(exc).__name__}: {first})") from exc

    def _tally(self, key: str) -> _Tally:
        info = self.tensors[key]
        expected = self._fingerprints.get(key)
        if expected is not None and not fingerprint.supported(torch.empty((), dtype=info.dtype)):
            expected = None
        version = self.found.manifest.fingerprint_version if self.found.manifest else fingerprint.VERSION
        return _Tally(info, expected, version)

    def _raw_span(self, key: str, offsets: tuple[int, ...], dtype: torch.dtype, count: int) -> tuple[VerifiedFile, int] | None:
        """(file, byte offset) of shard ``offsets`` of ``key`` stored as plain row-major bytes, else None."""
        index = MetadataIndex(key, torch.Size(offsets))
        if index not in self.metadata.storage_data:
            return None
        try:
            f, offset, length = self._item(index)
        except NotImplementedError:
            return None
        layout = raw_layout(f.peek(offset, length))
        if (
            layout is None
            or layout.dtype != dtype
            or layout.nbytes != count * dtype.itemsize
            or layout.data_offset + layout.nbytes > length
        ):
            return None
        return f, offset + layout.data_offset

    def iter_shard_blocks(
        self,
        key: str,
        offsets: tuple[int, ...],
        count: int,
        dtype: torch.dtype | None = None,
        tally: _Tally | None = None,
    ) -> Iterator[memoryview] | None:
        """Bytes of one shard of ``count`` elements (cast to ``dtype``) in blocks of about
        :data:`BLOCK`, read straight from the data file; ``None`` if the shard is not stored as
        plain row-major bytes.

        ``tally``: for a row block (offsets ``(r, 0, ...)``), adds its values to the tensor's
        fingerprint sum."""
        info = self.tensors[key]
        span = self._raw_span(key, offsets, info.dtype, count)
        if span is None:
            return None
        f, start = span
        itemsize = info.dtype.itemsize
        total = count * itemsize
        out_dtype = dtype or info.dtype
        flat0 = offsets[0] * numel(info.shape[1:]) if offsets else 0

        def blocks() -> Iterator[memoryview]:
            done = 0
            for view in f.blocks(start, total, max(itemsize, BLOCK // itemsize * itemsize)):
                if tally is not None:
                    tally.run(torch.frombuffer(view, dtype=info.dtype), flat0 + done // itemsize)
                done += len(view)
                if out_dtype == info.dtype:
                    yield view
                else:
                    cast = self._cast(key, torch.frombuffer(view, dtype=info.dtype), out_dtype)
                    yield memoryview(cast.view(torch.uint8).numpy())
            if done != total:
                raise IntegrityError(f"{f.where} ends inside tensor {key}")

        return blocks()

    def read_value(self, key: str) -> Any:
        """A non-tensor entry, unpickled with ``weights_only=True`` (JSON plain values decoded)."""
        return self.read_value_and_form(key)[0]

    def read_value_and_form(self, key: str) -> tuple[Any, bool]:
        """:meth:`read_value`, and whether the entry was stored as JSON text (a plain top-level
        value: then the value is what a load gives back, with nothing in it to decode)."""
        plain = False
        with self._reading(key):
            data = self._record_bytes(MetadataIndex(key))
            values.check_item(data, key, self._value_digests, self._item(MetadataIndex(key))[0].where)
            value = self._record(data, key)
            entry = self.found.manifest.entries.get(key) if self.found.verifying and self.found.manifest else None
            if isinstance(entry, dict) and entry.get("kind") == "value":
                values.check_digest(value, entry, key)
            if isinstance(value, str) and value.startswith(values.PREFIX):
                value, plain = values.decode(value, key), True
            self._done(key)
        return value, plain

    def iter_shards(self, key: str) -> Iterator[Shard]:
        """``(offsets, shard)`` of every stored shard of tensor ``key`` (one in memory at a time)."""
        with self._reading(key):
            yield from self._iter_shards(key)

    def _iter_shards(self, key: str) -> Iterator[Shard]:
        info = self.tensors[key]
        for chunk in self.metadata.state_dict_metadata[key].chunks:  # type: ignore[union-attr]
            offsets = tuple(int(o) for o in chunk.offsets)
            sizes = tuple(int(d) for d in chunk.sizes)
            span = self._raw_span(key, offsets, info.dtype, numel(sizes))
            if span is not None:  # straight into the shard's memory
                f, start = span
                shard = torch.empty(sizes, dtype=info.dtype)
                if shard.numel():
                    view = memoryview(shard.view(-1).view(torch.uint8).numpy())
                    if f.readinto(start, view) != len(view):
                        raise IntegrityError(f"{f.where} ends inside tensor {key}")
            else:
                shard = self._record(self._record_bytes(MetadataIndex(key, torch.Size(offsets))), key)
            if not isinstance(shard, torch.Tensor) or tuple(shard.shape) != sizes or shard.dtype != info.dtype:
                got = f"{shard.dtype} tensor of shape {tuple(shard.shape)}" if isinstance(shard, torch.Tensor) else type(shard).__name__
                raise IntegrityError(
                    f"{self.found.display()}: the record stored for {key} at offsets {offsets} holds a {got}, "
                    f".metadata says a {info.dtype} tensor of shape {sizes}"
                )
            yield offsets, shard
        self._done(key)

    def _row_chunks(self, key: str) -> list[ChunkStorageMetadata] | None:
        """The shards of ``key`` sorted, if they are row blocks (split along dim 0 only) that
        tile the tensor, so that their bytes concatenated are the tensor's; else ``None``."""
        info = self.tensors[key]
        chunks = sorted(self.metadata.state_dict_metadata[key].chunks, key=lambda c: tuple(c.offsets))  # type: ignore[union-attr]
        if not info.shape:
            return chunks if len(chunks) == 1 else None
        row = 0
        for c in chunks:
            offsets, sizes = tuple(int(o) for o in c.offsets), tuple(int(d) for d in c.sizes)
            if offsets[0] != row or any(offsets[1:]) or sizes[1:] != info.shape[1:]:
                return None
            row += sizes[0]
        return chunks if row == info.shape[0] else None

    def read_tensor(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``key`` (cast to ``dtype``), assembled from its shards and checked
        against its recorded fingerprint.

        Row-block shards are copied block by block from the data files into the result, so
        memory is the result plus one block. The result's size was bounded by the stored items'
        lengths when ``.metadata`` was validated, so a declared shape never allocates more than
        the files hold.
        """
        with self._reading(key):
            return self._read_tensor(key, dtype)

    def _read_tensor(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        info = self.tensors[key]
        dtype = dtype or info.dtype
        chunks = self._row_chunks(key)
        if chunks is not None:
            tally = self._tally(key)
            out = torch.empty(info.shape, dtype=dtype)
            flat = out.reshape(-1).view(torch.uint8)
            row_bytes = numel(info.shape[1:]) * out.element_size() if info.shape else 0
            pos = 0
            for c in chunks:
                pos = int(c.offsets[0]) * row_bytes if info.shape else 0
                blocks = self.iter_shard_blocks(key, tuple(int(o) for o in c.offsets), numel(c.sizes), dtype, tally)
                if blocks is None:
                    break
                for block in blocks:
                    n = len(block)
                    if n:
                        flat[pos:pos + n].copy_(torch.frombuffer(block, dtype=torch.uint8))
                    pos += n
            else:
                tally.check(self.found.display())
                self._done(key)
                return out
            del out, flat
        try:
            tally = self._tally(key)
            out = torch.empty(info.shape, dtype=dtype)
            for offsets, shard in self._iter_shards(key):
                tally.shard(shard, offsets)
                view = out
                for dim, (o, n) in enumerate(zip(offsets, shard.shape)):
                    view = view.narrow(dim, o, n)
                view.copy_(self._cast(key, shard, dtype))
                del shard
            tally.check(self.found.display())
            self._done(key)
            return out
        except NotImplementedError:
            return self._read_with_dcp(key, dtype)

    def _cast(self, key: str, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``stored`` (values of ``key``) cast to ``dtype``; ``key`` goes into :attr:`beyond_range`
        where the cast loses some of them to ``dtype``'s range (judged before the cast)."""
        if stored.dtype == dtype:
            return stored
        if key not in self.beyond_range and beyond_range(stored, dtype):
            self.beyond_range.append(key)
        return stored.to(dtype)

    def iter_bytes(self, key: str, dtype: torch.dtype | None = None) -> Iterator[memoryview]:
        """Tensor ``key`` (cast to ``dtype``) as row-major bytes, in blocks.

        Row-block shards (FSDP, or one shard) are streamed from the data files a block at a
        time; other layouts are assembled in memory first.
        """
        with self._reading(key):
            yield from self._iter_bytes(key, dtype)

    def _iter_bytes(self, key: str, dtype: torch.dtype | None) -> Iterator[memoryview]:
        chunks = self._row_chunks(key)
        streams = []
        tally = self._tally(key)
        if chunks is not None:
            for c in chunks:
                blocks = self.iter_shard_blocks(key, tuple(int(o) for o in c.offsets), numel(c.sizes), dtype, tally)
                if blocks is None:
                    streams = []
                    break
                streams.append(blocks)
        if chunks is not None and streams:
            for blocks in streams:
                yield from blocks
            # Raised before the caller finishes its output, so an altered tensor is never published.
            tally.check(self.found.display())
            self._done(key)
            return
        t = self._read_tensor(key, dtype)
        if t.numel():
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())

    def _read_with_dcp(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``key`` read by DCP (stored items with transforms), through the same verified
        reader as a load (the ``reader`` this source was given)."""
        if self._reader is None:
            raise IntegrityError(
                f"{self.found.display()}: {key!r} is stored with stream transforms, which this reader does not "
                "decode (read it with distckpt's CLI or Checkpointer.load)"
            )
        info = self.tensors[key]
        out = torch.empty(info.shape, dtype=info.dtype)
        with warnings.catch_warnings():
            # no_dist is chosen, not a fallback: DCP's warning that it "assumes" it would mislead.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({key: out}, storage_reader=self._reader(self.found), planner=_TensorsOnly(), no_dist=True)
        tally = self._tally(key)
        tally.shard(out, (0,) * out.dim())
        tally.check(self.found.display())
        self._done(key)
        return self._cast(key, out, dtype)

