"""Streaming conversion between distckpt checkpoints and single files.

* :func:`export_safetensors` / :func:`export_torch`: consolidate a sharded checkpoint (any world
  size, no process group) into one ``.safetensors`` file or one ``torch.save``-format file.
* importing a ``torch.save`` file lives in :mod:`distckpt.tools.importer`
  (:func:`~distckpt.tools.importer.import_torch_save`).

Exports stream tensor by tensor: a tensor's shards are read straight from the ``.distcp`` files
(DCP's metadata says where each one lies) and written out before the next tensor is read. Peak
memory is about the largest tensor (for safetensors: the largest *shard*) plus one shard, never
the whole checkpoint. The file headers are computed up front from DCP's metadata, so neither
format needs the data in memory: safetensors is written by hand (8-byte header length, JSON
header, raw bytes) and the torch file with ``torch._C.PyTorchFileWriter``, one storage record
per tensor, exactly the zip layout ``torch.save`` writes (``torch.load(weights_only=True)`` reads
it).

Not collective: call from one process.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from distckpt.state import fingerprint, values
from distckpt._compat import PyTorchFileWriter, rebuild_tensor_v2, storage_alignment, storage_name_of_dtype
from distckpt.load.reader import _load_record
from distckpt.state.shape import contiguous_strides, numel
from distckpt.integrity.stepfiles import StepFiles, VerifiedFile
from distckpt.integrity.torchfile import raw_layout
from distckpt.errors import IntegrityError
from distckpt.integrity.manifest import MANIFEST_NAME, parse_step_dir
from distckpt.tools.safetensors_io import check_tensor_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    getattr(torch, "float8_e4m3fn", None): "F8_E4M3",
    getattr(torch, "float8_e5m2", None): "F8_E5M2",
    getattr(torch, "uint16", None): "U16",
    getattr(torch, "uint32", None): "U32",
    getattr(torch, "uint64", None): "U64",
}
_INTERNAL = ("_rng",)  # distckpt's own namespaces: never exported

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class SelectionError(ValueError):
    """The requested part of the checkpoint (``key``/model-only) does not exist or is ambiguous."""


# -------------------------------------------------------------------------------------------------
# reading
BLOCK = 16 * 1024 * 1024  # bytes read at a time when streaming a shard


@dataclass
class TensorInfo:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return numel(self.shape)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return self.numel * (dtype or self.dtype).itemsize


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
    """

    def __init__(self, found: StepFiles) -> None:
        self.found = found
        self.metadata = found.metadata()
        self._fingerprints = dict(found.manifest.fingerprints) if found.verifying and found.manifest else {}
        # Non-tensor items' stored bytes against their save-time sha256 (None: not recorded).
        self._value_digests = found.manifest.value_digests if found.verifying and found.manifest else None
        self._files: dict[str, VerifiedFile] = {}
        self._todo: dict[str, set[MetadataIndex]] | None = None
        self.tensors: dict[str, TensorInfo] = {}
        self.values: list[str] = []
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
        from distckpt.errors import CheckpointError

        try:
            return _load_record(io.BytesIO(data), key, self.found.display())
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
                    cast = torch.frombuffer(view, dtype=info.dtype).to(out_dtype)
                    yield memoryview(cast.view(torch.uint8).numpy())
            if done != total:
                raise IntegrityError(f"{f.where} ends inside tensor {key}")

        return blocks()

    def read_value(self, key: str) -> Any:
        """A non-tensor entry, unpickled with ``weights_only=True`` (JSON plain values decoded)."""
        with self._reading(key):
            data = self._record_bytes(MetadataIndex(key))
            values.check_item(data, key, self._value_digests, self._item(MetadataIndex(key))[0].where)
            value = self._record(data, key)
            entry = self.found.manifest.entries.get(key) if self.found.verifying and self.found.manifest else None
            if isinstance(entry, dict) and entry.get("kind") == "value":
                values.check_digest(value, entry, key)
            if isinstance(value, str) and value.startswith(values.PREFIX):
                value = values.decode(value, key)
            self._done(key)
        return value

    def iter_shards(self, key: str) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
        """``(offsets, shard)`` of every stored shard of tensor ``key`` (one in memory at a time)."""
        with self._reading(key):
            yield from self._iter_shards(key)

    def _iter_shards(self, key: str) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
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

    def _row_chunks(self, key: str) -> list[Any] | None:
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
                view.copy_(shard)
                del shard
            tally.check(self.found.display())
            self._done(key)
            return out
        except NotImplementedError:
            return self._read_with_dcp(key, dtype)

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
        reader as a load (:meth:`StepFiles.reader`)."""
        import torch.distributed.checkpoint as dcp

        from distckpt.load.planner import SafeLoadPlanner

        info = self.tensors[key]
        out = torch.empty(info.shape, dtype=info.dtype)
        dcp.load({key: out}, storage_reader=self.found.reader(), planner=SafeLoadPlanner(), no_dist=True)
        tally = self._tally(key)
        tally.shard(out, (0,) * out.dim())
        tally.check(self.found.display())
        self._done(key)
        return out.to(dtype)


# -------------------------------------------------------------------------------------------------
# choosing what to export
def _model_names(found: StepFiles, source: CheckpointSource) -> list[str]:
    entries = found.manifest.entries if found.manifest is not None else {}
    modules = sorted(n for n, e in entries.items() if e.get("kind") == "module")
    if modules:
        return modules
    # Imported checkpoints hold the model as a dict of tensors ("tree" entry).
    return sorted(n for n, e in entries.items() if e.get("kind") == "tree")


def select_tensors(
    found: StepFiles, source: CheckpointSource, *, model_only: bool, key: str | None
) -> list[tuple[str, str]]:
    """``(output name, checkpoint key)`` of the tensors to export, in checkpoint order.

    ``key`` picks the tensors under one prefix (names relative to it); ``model_only`` picks the
    single model (module entry) of the checkpoint. Otherwise every tensor under its full key.

    The selection is announced to ``source`` (:meth:`CheckpointSource.expect`): each data file
    is then checked whole as soon as the last selected tensor it holds has been read.

    Raises:
        SelectionError: no tensor under ``key``, or no / several models for ``model_only``.
    """
    picked = _select(found, source, model_only=model_only, key=key)
    source.expect([k for _, k in picked])  # each file is checked once the last of these it holds is read
    return picked


def _select(found: StepFiles, source: CheckpointSource, *, model_only: bool, key: str | None) -> list[tuple[str, str]]:
    keys = [k for k in source.tensors if k.split(".", 1)[0] not in _INTERNAL]
    prefix = key
    if prefix is None and model_only:
        names = _model_names(found, source)
        if len(names) != 1:
            tops = sorted({k.split(".", 1)[0] for k in keys})
            if not names:
                raise SelectionError(f"{found.display()} records no model; pick tensors with --key PREFIX (top-level names: {', '.join(tops)})")
            raise SelectionError(f"{found.display()} holds several models ({', '.join(names)}); pick one with --key NAME")
        prefix = names[0]
    if prefix is None:
        return [(k, k) for k in keys]
    prefix = prefix.rstrip(".")
    picked = [(k[len(prefix) + 1:], k) for k in keys if k.startswith(prefix + ".")]
    if prefix in source.tensors:  # --key naming a single tensor
        picked = [(prefix.rsplit(".", 1)[-1], prefix)]
    if not picked:
        tops = sorted({k.split(".", 1)[0] for k in keys})
        raise SelectionError(f"no tensor under key prefix {prefix!r} in {found.display()} (top-level names: {', '.join(tops)})")
    return picked


def cast_dtype(key: str, stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype tensor ``key`` (stored as ``stored``) is written in when exports cast to
    ``dtype``: floating-point tensors take ``dtype``, others keep theirs.

    Raises:
        TypeError: ``dtype`` is not a torch dtype, or a floating-point tensor would be cast to a
            non-floating dtype (``torch.int8``, ``torch.bool``: its values truncated), naming
            the key and both dtypes.
    """
    if dtype is None:
        return stored
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if not stored.is_floating_point:
        return stored
    if not dtype.is_floating_point:
        raise TypeError(
            f"tensor {key!r} is {stored}; casting it to {dtype} would truncate its values "
            "(dtype= casts floating-point tensors and takes a floating-point dtype, e.g. torch.bfloat16)"
        )
    return dtype


def _out_dtype(info: TensorInfo, dtype: torch.dtype | None) -> torch.dtype:
    return cast_dtype(info.key, info.dtype, dtype)


# -------------------------------------------------------------------------------------------------
# output files
_CHECKPOINT_MARKERS = (MANIFEST_NAME, ".metadata")


def _is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def check_output(out: str, storage_options: Mapping[str, Any] | None = None, *, inputs: tuple[str, ...] = ()) -> None:
    """Refuse an output that would write into a checkpoint or over an input. Not collective.

    Refused (local paths are checked as given and with symbolic links resolved, so a link into a
    step is no way in): ``out`` itself or any folder above it that

    * holds ``manifest.json`` or ``.metadata``: a committed step (under any name) or a plain DCP
      checkpoint; writing there would change or shadow its files;
    * is named like a step directory (``step_<N>``) and holds ``.distcp`` files or lies in a
      checkpoint root (a folder holding a committed step): an incomplete step, or a new folder
      that ``ls`` would list as one and the next save would remove.

    ``out`` naming one of ``inputs`` is refused too.

    Raises:
        ValueError: naming ``out`` and the checkpoint (or the input) it would write into.
    """
    import posixpath

    from fsspec.core import url_to_fs

    from distckpt.storage.base import _redact

    where = _redact(out)  # messages never show credentials a URL may carry
    if _is_url(out):
        fs, path = url_to_fs(out, **dict(storage_options or {}))
        scheme = out.split("://", 1)[0]
        paths = [path.rstrip("/")]

        def show(p: str) -> str:
            return _redact(f"{scheme}://{p.lstrip('/')}")
    else:
        fs, _ = url_to_fs("file:///")
        path = os.path.abspath(os.path.expanduser(out.split("://", 1)[-1]))
        paths = list(dict.fromkeys([path, os.path.realpath(path)]))

        def show(p: str) -> str:
            return p

    for src in inputs:
        same = (
            os.path.realpath(os.path.expanduser(src.split("://", 1)[-1])) == paths[-1]
            if not _is_url(src)
            else src.rstrip("/") == out.rstrip("/")
        )
        if same:
            raise ValueError(f"output {where} is the input {_redact(src)}: distckpt never writes over what it reads; choose another output")
    for p in paths:
        d = p
        while d:
            for marker in _CHECKPOINT_MARKERS:
                if fs.isfile(posixpath.join(d, marker)):  # files: an IDE's .metadata folder is no checkpoint
                    raise ValueError(
                        f"output {where} is inside the checkpoint {show(d)} (it holds {marker}): distckpt never writes "
                        "into a checkpoint; choose an output outside every checkpoint step"
                    )
            if parse_step_dir(posixpath.basename(d)) is not None and _in_checkpoint_root(fs, d):
                raise ValueError(
                    f"output {where} is inside {show(d)}, a step directory of the checkpoint root {show(posixpath.dirname(d))}: "
                    "a save would take it for an incomplete step (and remove it); choose an output outside the root's steps"
                )
            parent = posixpath.dirname(d)
            d = parent if parent != d else ""


def _in_checkpoint_root(fs: Any, d: str) -> bool:
    """Whether folder ``d`` (named like a step) holds DCP data files or lies beside a committed step."""
    import posixpath

    def entries(where: str) -> list[dict[str, Any]]:
        try:
            return list(fs.ls(where, detail=True))
        except (FileNotFoundError, NotADirectoryError):
            return []

    if any(e.get("type") == "file" and str(e["name"]).endswith(".distcp") for e in entries(d)):
        return True
    root = posixpath.dirname(d)
    for e in entries(root):
        name = str(e["name"]).rstrip("/")
        if e.get("type") == "directory" and parse_step_dir(posixpath.basename(name)) is not None:
            if fs.isfile(posixpath.join(name, MANIFEST_NAME)):
                return True
    return False


@contextmanager
def open_output(out: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A binary file at ``out`` (path or URL) that appears only if the block succeeds.

    Local: written to a temporary name beside ``out`` and renamed. Object stores: one upload,
    removed again if the block fails.
    """
    if "://" not in out or out.startswith("file://"):
        path = os.path.abspath(os.path.expanduser(out.split("://", 1)[-1]))
        if os.path.isdir(path):
            raise IsADirectoryError(f"output {path} is a directory")
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            f = open(tmp, "wb")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot write {path}: {exc.strerror}") from None
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, path)
        except BaseException as exc:
            try:
                f.close()  # flushes what is buffered: on a full disk this fails again
            except OSError:
                pass
            try:
                os.remove(tmp)
            except OSError:
                pass
            if isinstance(exc, OSError):
                from distckpt.storage.base import named_os_error

                raise named_os_error(exc, path) from exc
            raise
        return
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(out, **dict(storage_options or {}))
    f = fs.open(path, "wb")
    try:
        yield f
        f.close()
    except BaseException:
        # Object stores publish a file only when its upload completes (close). Discarding the
        # upload leaves any earlier object at ``out`` untouched and publishes nothing partial.
        discard = getattr(f, "discard", None)
        try:
            if discard is not None:
                discard()
            else:  # a filesystem without uploads: remove what was written
                f.close()
                fs.rm_file(path)
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass
        raise


def export_safetensors(
    found: StepFiles,
    out: str,
    *,
    model_only: bool = True,
    key: str | None = None,
    dtype: torch.dtype | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the selected tensors of ``found`` to one safetensors file, streaming.

    Returns:
        A summary: output, tensors, bytes.
    """
    check_output(out, storage_options)
    source = CheckpointSource(found)
    picked = select_tensors(found, source, model_only=model_only, key=key)
    for name, k in picked:
        check_tensor_name(name, f"export of checkpoint key {k!r}")
        odt = _out_dtype(source.tensors[k], dtype)
        if odt not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {k} has dtype {odt}, which safetensors cannot store")
    # The header lists the tensors in checkpoint order; their bytes follow in the order they lie
    # in the checkpoint's files, so that each data file is read once, front to back.
    plan = sorted(picked, key=lambda p: source.position(p[1]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": found.display()}}
    header.update({name: {} for name, _ in picked})
    offset = 0
    for name, k in plan:
        info = source.tensors[k]
        odt = _out_dtype(info, dtype)
        n = info.nbytes(odt)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[odt], "shape": list(info.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    done = 0
    with open_output(out, storage_options) as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name, k in plan:
            odt = _out_dtype(source.tensors[k], dtype)
            n = source.tensors[k].nbytes(odt)
            written = 0
            for block in source.iter_bytes(k, odt):
                f.write(block)
                written += len(block)
            if written != n:
                raise RuntimeError(f"tensor {k}: wrote {written} bytes, expected {n}")
            done += n
            if progress:
                progress(done, offset)
        source.finish()  # every file read checked whole before the output appears
    return {"output": out, "format": "safetensors", "tensors": len(plan), "bytes": offset, "unverified": found.unverified}


# torch.save format ---------------------------------------------------------------------------------
@dataclass
class _Stub:
    """A tensor not read yet: pickled as a reference to storage record ``index``."""

    index: int
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class _StorageRef:
    def __init__(self, stub: _Stub) -> None:
        self.stub = stub


class _StubPickler(pickle.Pickler):
    """Pickles :class:`_Stub` exactly as ``torch.save`` pickles a contiguous CPU tensor."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _Stub):
            return (
                rebuild_tensor_v2,
                (_StorageRef(obj), 0, tuple(obj.shape), contiguous_strides(obj.shape), False, OrderedDict()),
            )
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            stub = obj.stub
            storage_type = getattr(torch, storage_name_of_dtype(stub.dtype))
            return ("storage", storage_type, str(stub.index), "cpu", numel(stub.shape))
        return None


def export_torch(
    found: StepFiles,
    out: str,
    *,
    model_only: bool = False,
    key: str | None = None,
    dtype: torch.dtype | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``found`` as one ``torch.save``-format file, streaming one tensor at a time.

    With ``model_only`` or ``key``: a flat state dict for ``model.load_state_dict``. Otherwise
    ``{top-level name: {rest of key: tensor or value}}`` with plain values (epoch, optimizer
    hyper-parameters) included; distckpt's RNG states are left out.

    Returns:
        A summary: output, tensors, bytes, skipped values.
    """
    check_output(out, storage_options)
    source = CheckpointSource(found)
    stubs: list[_Stub] = []
    skipped: list[str] = []

    def stub(k: str) -> _Stub:
        info = source.tensors[k]
        s = _Stub(len(stubs), k, _out_dtype(info, dtype), info.shape)
        stubs.append(s)
        return s

    obj: dict[str, Any]
    if model_only or key is not None:
        obj = {name: stub(k) for name, k in select_tensors(found, source, model_only=model_only, key=key)}
    else:
        obj = {}
        entries = found.manifest.entries if found.manifest is not None else {}
        all_keys = [k for k in source.metadata.state_dict_metadata if k.partition(".")[0] not in _INTERNAL]
        source.expect(all_keys)
        for k in all_keys:
            top, _, rest = k.partition(".")
            if k in source.tensors:
                item: Any = stub(k)
            else:
                # A value that cannot be read (damaged, altered, or needing code to unpickle)
                # fails the export like a tensor would; only a readable value that is not plain
                # data (a torch.save file holds no custom classes) is left out and reported.
                item = source.read_value(k)
                if not values.is_plain(item):
                    skipped.append(f"{k} (not a plain value)")
                    continue
            if not rest or entries.get(top, {}).get("kind") == "value":
                obj[top] = item
            else:
                obj.setdefault(top, {})[rest] = item

    buf = io.BytesIO()
    _StubPickler(buf, protocol=2).dump(obj)
    total = sum(source.tensors[s.key].nbytes(s.dtype) for s in stubs)
    crc = getattr(torch.serialization, "get_crc32_options", lambda: True)()
    alignment = storage_alignment()
    with open_output(out, storage_options) as f:
        sink = _Sink(f, out)
        writer = PyTorchFileWriter(sink, crc, alignment) if alignment is not None else PyTorchFileWriter(sink)
        try:
            _write_torch_records(writer, buf.getvalue(), stubs, source, alignment, total, progress, sink)
            sink.raise_error()
            source.finish()  # every file read checked whole before the output appears
        except BaseException:
            # The C++ writer finishes its zip in its destructor, writing to ``sink``; if that write
            # failed (closed file, failed upload) inside a destructor, the process would abort
            # with "terminate called". Disarm the sink and drop the writer while Python runs.
            sink.disarm()
            del writer
            raise
    return {"output": out, "format": "torch", "tensors": len(stubs), "bytes": total, "skipped": skipped, "unverified": found.unverified}


class _Sink:
    """The file ``PyTorchFileWriter`` writes to.

    A write error (a full disk) is recorded in :attr:`error`, not raised into the C++ writer:
    a Python exception there leaves the writer's byte count wrong, and its destructor then
    aborts the process ("terminate called ... unexpected pos"). After an error or
    :meth:`disarm`, writes are counted and dropped, so the writer can always finish.
    """

    def __init__(self, f: Any, where: str) -> None:
        self._f: Any = f
        self._where = where
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self._f is not None:
            try:
                self._f.write(data)
            except OSError as exc:
                from distckpt.storage.base import named_os_error

                self.error = named_os_error(exc, self._where)
                self._f = None
        return n

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def disarm(self) -> None:
        self._f = None


def _write_torch_records(
    writer: Any,
    data: bytes,
    stubs: list[_Stub],
    source: CheckpointSource,
    alignment: int | None,
    total: int,
    progress: Progress | None,
    sink: _Sink,
) -> int:
    """The records of a ``torch.save`` zip, one storage per tensor; returns the bytes written."""
    done = 0
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
    if alignment is not None:
        text = str(alignment)
        writer.write_record(".storage_alignment", text, len(text))
    writer.write_record("byteorder", "little", len("little"))
    # Records in the order the tensors lie in the checkpoint's files (each file read once, front
    # to back); the pickled object refers to them by index, so its order is the checkpoint's.
    for s in sorted(stubs, key=lambda s: source.position(s.key)):
        t = source.read_tensor(s.key, s.dtype)
        n = t.untyped_storage().nbytes()
        writer.write_record(f"data/{s.index}", t.untyped_storage(), n)
        del t
        sink.raise_error()  # stop at the first failed write instead of reading on
        done += n
        if progress:
            progress(done, total)
    writer.write_end_of_file()
    return done


# -------------------------------------------------------------------------------------------------
# import
