"""Reading Hugging Face safetensors checkpoints by byte range, on any storage, without pickle
(and the header that writers put before the bytes: :func:`header_bytes`).

A safetensors file is ``u64 header length | JSON header | raw tensor bytes``; a sharded checkpoint
adds ``model.safetensors.index.json`` (``weight_map``: tensor name -> file), without which
several files are refused (an unfinished publish). This module parses and validates the headers
(offsets inside the file, sizes matching dtype x shape, tensors tiling the data bytes without
overlaps or holes) and exposes the files to DCP as a ``StorageReader``, so that ``dcp.load``
reshards them like any distckpt checkpoint: each rank reads exactly the byte ranges of the
blocks it owns (one range per row block for FSDP2 dim-0 shards), straight into its destination
tensor when the dtype matches. Nothing is unpickled and no rank reads the whole model.

Not collective by itself: DCP's ``load`` drives it on every rank.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from distckpt._compat import byte_viewable
from distckpt.errors import IntegrityError, UnsafeCheckpointError
from distckpt.integrity.manifest import json_object
from distckpt.integrity.stepfiles import _readinto
from distckpt.state.casts import beyond_range  # re-exported: it was defined here first
from distckpt.state.shape import numel
from distckpt.storage.base import NotARegularFile, Storage, open_regular_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DIFFUSERS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
#: The weights files transformers writes (and distckpt's publish), and diffusers' single file:
#: such a file beside diffusers' index that does not name it is another checkpoint (or a publish
#: cut short); beside transformers' index only the single file is (stray shards of either
#: library beside their own index are ignored, as transformers and diffusers ignore them).
_WEIGHTS_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors|diffusion_pytorch_model\.safetensors")
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
MAX_DIMS = 64  # more than any real tensor has; bounds the size arithmetic on hostile headers

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie: ``file`` (name inside the directory), absolute ``start``."""

    file: str
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_tensor_name(name: str, where: str) -> None:
    """Refuse a tensor name a safetensors header cannot hold: ``__metadata__`` is the header's
    own metadata entry (a tensor of that name replaces it, and readers skip it, so the file
    cannot be read back), and an empty name.

    Raises:
        ValueError: naming the tensor and ``where`` it was to be written.
    """
    if name == "__metadata__":
        raise ValueError(
            f"{where}: tensor name '__metadata__' is reserved by the safetensors format (the header's metadata "
            "entry): the file could not be read back; rename the tensor (or strip another prefix)"
        )
    if not name:
        raise ValueError(f"{where}: a tensor would be stored under an empty name (a prefix equal to its whole key?)")


def header_bytes(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str],
    listed: Iterable[str] = (),
) -> bytes:
    """The start of a safetensors file: the 8-byte header length and the JSON header (padded
    with spaces to a multiple of 8 bytes), for ``tensors`` (name, dtype, shape) whose bytes
    follow the header in this order. ``listed``: names the header lists first, in this order
    (its offsets still follow ``tensors``); ``metadata``: the ``__metadata__`` entry.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    header.update({name: {} for name in listed})
    offset = 0
    for name, dtype, shape in tensors:
        n = numel(shape) * _itemsize(dtype)
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def parse_header(
    raw_len: bytes, read_header: Callable[[int], bytes], file_size: int, name: str, where: str
) -> dict[str, TensorSpan]:
    """Validate a safetensors header and return tensor name -> :class:`TensorSpan`.

    Args:
        raw_len: the file's first 8 bytes.
        read_header: ``read_header(n)`` returns the next ``n`` bytes (the JSON header).
        file_size: the file's size, to check that every tensor lies inside it.
        name: the file's name inside its directory (recorded in the spans).
        where: the file's location, for error messages.

    Raises:
        IntegrityError: anything malformed, naming the file and tensor.
    """
    if len(raw_len) != 8:
        raise IntegrityError(f"{where}: too short to be a safetensors file ({file_size} bytes)")
    n = int.from_bytes(raw_len, "little")
    if n > MAX_HEADER or 8 + n > file_size:
        raise IntegrityError(f"{where}: header length {n} is larger than the file or the 100 MB limit")
    raw = read_header(n)
    # As the safetensors format (and its own reader) has it: UTF-8 without a byte-order mark,
    # plain JSON (no NaN/Infinity), a __metadata__ of strings. Python's json accepts the others,
    # so a file only distckpt could read would pass for a checkpoint.
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise IntegrityError(f"{where}: the header is not UTF-8 text") from None
    if text.startswith("\ufeff"):
        raise IntegrityError(f"{where}: the header starts with a byte-order mark, which safetensors does not allow")
    header = json_object(text, f"{where}: header", IntegrityError, strict=True)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise IntegrityError(f"{where}: __metadata__ must map names to strings (safetensors' format)")
    data_start = 8 + n
    data_len = file_size - data_start
    spans: dict[str, TensorSpan] = {}
    ranges: list[tuple[int, int, str]] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise IntegrityError(f"{where}: tensor {key!r:.100}: entry is not an object")
        dtype = DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if dtype is None:
            raise IntegrityError(f"{where}: tensor {key!r:.100}: unknown dtype {info.get('dtype')!r:.40}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
            raise IntegrityError(f"{where}: tensor {key!r:.100}: shape {shape!r:.80} is not a list of at most {MAX_DIMS} non-negative int64s")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise IntegrityError(f"{where}: tensor {key!r:.100}: data_offsets {offsets!r:.80} are not two ints")
        begin, end = offsets
        span = TensorSpan(name, data_start + begin, dtype, tuple(shape))
        if not 0 <= begin <= end <= data_len or end - begin != span.nbytes:
            raise IntegrityError(
                f"{where}: tensor {key!r:.100}: bytes [{begin}, {end}) do not hold {dtype} {list(shape)!s:.80} "
                f"({span.nbytes} bytes) inside the {data_len} data bytes"
            )
        spans[key] = span
        ranges.append((begin, end, key))
    # As the safetensors format requires: the tensors tile the data bytes exactly, without
    # overlaps or holes. (A header whose length prefix was shortened into its padding would
    # otherwise shift every tensor onto its neighbours' bytes and still pass the checks above.)
    ranges.sort()
    covered, last = 0, None
    for begin, end, key in ranges:
        if begin < covered:
            raise IntegrityError(f"{where}: tensors {last!r:.100} and {key!r:.100} overlap")
        if begin > covered:
            raise IntegrityError(f"{where}: data bytes [{covered}, {begin}) belong to no tensor")
        covered, last = end, key
    if covered != data_len:
        raise IntegrityError(f"{where}: data bytes [{covered}, {data_len}) belong to no tensor (header and data disagree)")
    return spans


@dataclass(frozen=True)
class _FileIdentity:
    """A file as its header was parsed: the data are read later, by reopening it, with the
    header's offsets, so a file replaced in between (a concurrent publish renaming in a shard of
    another layout) would give each tensor another tensor's bytes."""

    size: int
    head: bytes  # SHA-256 of the length prefix and the JSON header
    local: tuple[int, int, int] | None  # (device, inode, mtime in ns) of a local file

    def check(self, f: IO[bytes], where: str) -> None:
        """Raise :class:`IntegrityError` (naming ``where``) if open file ``f`` is not this one."""
        local = _local_identity(f)
        if local is not None and self.local is not None:
            same = local == self.local and os.fstat(f.fileno()).st_size == self.size
        else:
            f.seek(0)
            raw_len = f.read(8)
            n = int.from_bytes(raw_len, "little") if len(raw_len) == 8 else -1
            same = n >= 0 and hashlib.sha256(raw_len + (f.read(n) if n <= MAX_HEADER else b"")).digest() == self.head
            f.seek(0, os.SEEK_END)
            same = same and f.tell() == self.size
        if not same:
            raise IntegrityError(
                f"{where}: the file changed while it was loaded (replaced or rewritten after its header was read); "
                "nothing of it was used: load again once the folder is complete"
            )


def _local_identity(f: IO[bytes]) -> tuple[int, int, int] | None:
    try:
        st = os.fstat(f.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None  # not a local file (an fsspec buffered file)
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


def hf_cache_blob(storage: Storage, name: str) -> tuple[str, str] | None:
    """``(blobs, blob)``: the blob that file ``name`` of ``storage`` links to, where ``storage``
    is (a folder in) a snapshot of a Hugging Face hub cache (``<repo>/snapshots/<revision>/...``,
    whose files are symbolic links into ``<repo>/blobs/``: what ``snapshot_download`` and
    ``hf_hub_download`` return); else None. ``<repo>`` is where the folder really lies (the path
    the caller gave, resolved), and ``blobs`` is opened without following any link
    (:func:`_open_blob`): a tree that only looks like a cache (a ``blobs`` that is a link
    elsewhere) reads nothing outside it. Reads never follow other links."""
    if not storage.is_local:
        return None
    path = os.path.join(storage.path, name)
    if not os.path.islink(path):
        return None
    folder = os.path.realpath(storage.path)
    rev = folder
    while os.path.basename(os.path.dirname(rev)) != "snapshots":
        parent = os.path.dirname(rev)
        if parent == rev:
            return None
        rev = parent
    blobs = os.path.join(os.path.dirname(os.path.dirname(rev)), "blobs")
    # The link's own text, taken lexically: it must name a file directly in <repo>/blobs.
    resolved = os.path.normpath(os.path.join(folder, os.readlink(path)))
    if os.path.dirname(resolved) != blobs or os.path.realpath(path) != resolved:
        return None  # (also where the text and the kernel disagree: blobs/sub/../x, sub a link)
    return blobs, os.path.basename(resolved)


def _open_blob(blobs: str, blob: str) -> int:
    """A descriptor of regular file ``blob`` in directory ``blobs`` (absolute, resolved), every
    component of the path opened without following a link: one swapped in since (``blobs`` or a
    folder above it made a link elsewhere) is refused, not followed.

    Raises:
        UnsafeCheckpointError: a link on the way, or ``blob`` is no regular file.
    """
    # O_PATH: a folder one may pass through but not list (mode 0711) is walked as open() does.
    walk = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY
    fd = os.open(os.sep, walk)
    try:
        for part in [p for p in blobs.split(os.sep) if p]:
            try:
                child = os.open(part, walk | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeCheckpointError(f"{blobs}: {part!r} is no directory (a symbolic link?); refusing to read {blob} through it") from None
                raise
            os.close(fd)
            fd = child
        try:
            blob_fd, _ = open_regular_file(blob, dir_fd=fd)
        except NotARegularFile:
            raise UnsafeCheckpointError(f"{os.path.join(blobs, blob)} is not a regular file") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeCheckpointError(f"{os.path.join(blobs, blob)} is a symbolic link; refusing to read it") from None
            raise
        return blob_fd
    finally:
        os.close(fd)


def index_name(files: Mapping[str, int]) -> str | None:
    """The index of the safetensors checkpoint in a folder whose files are ``files``:
    ``model.safetensors.index.json`` (transformers), else diffusers'
    ``diffusion_pytorch_model.safetensors.index.json``; ``None`` where there is none. (Other
    ``*.index.json`` files, an adapter's or an editor's copy, are not a model's index.)"""
    return next((name for name in (INDEX_NAME, DIFFUSERS_INDEX_NAME) if name in files), None)


class SafetensorsIndex:
    """The tensors of a Hugging Face checkpoint directory (single file or sharded with an index).

    Not collective; reads the index and every file's header (a few KB each).

    Args:
        storage: a :class:`~distckpt.storage.base.Storage` whose root is the directory.
        only: read this one file of the directory (named by the caller), not its index.

    Raises:
        IntegrityError: a malformed header or index, several files without an index, or a
            directory holding both ``model.safetensors`` and an index naming other files
            (transformers would load the single file: which one is meant is not guessed).
        UnsafeCheckpointError: the index names a file outside the directory.
        FileNotFoundError: no safetensors files.
    """

    def __init__(self, storage: Storage, only: str | None = None) -> None:
        self.storage = storage
        self.index_file: str | None = None  # the index read; None: none was
        files = storage.list_files()
        if only is not None:  # one file, named by the caller (an index beside it is not read)
            weight_map = None
            names = [only]
        elif (index := index_name(files)) is not None:
            self.index_file = index
            where = storage.display(index)
            if files[index] > MAX_HEADER:
                raise IntegrityError(f"{where}: {files[index]} bytes, larger than the 100 MB limit for an index")
            with self.open(index) as f:
                raw = f.read(MAX_HEADER + 1)  # (the listed size may be another file's: bounded here too)
            if len(raw) > MAX_HEADER:
                raise IntegrityError(f"{where}: larger than the 100 MB limit for an index")
            weight_map = json_object(raw, where, IntegrityError).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise IntegrityError(f"{where}: no 'weight_map' of tensor name -> file name")
            names = sorted(set(weight_map.values()))
            for name in names:
                self._check_name(name, files)
            others = sorted(f for f in files if f not in names and _WEIGHTS_FILE.fullmatch(f))
            if index == INDEX_NAME:
                others = [f for f in others if f == SINGLE_NAME]  # (stray shards: as before)
            if others:
                # Two checkpoints in one folder: transformers (diffusers) loads the single file
                # (it looks for it first), an index reader the shards; diffusers' index beside
                # transformers-named shards is a publish cut short after it removed its own
                # index. Neither is chosen silently.
                shown = ", ".join(f"{n!r:.100}" for n in names[:3]) + (", ..." if len(names) > 3 else "")
                extra = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
                raise IntegrityError(
                    f"{storage.display()}: holds both {extra} and {index} (naming {shown}): two checkpoints, or "
                    "an unfinished publish (transformers would load a single model.safetensors first); remove the "
                    "files that are not the checkpoint (or move them to another folder)"
                )
        else:
            # Without an index only a single file is a checkpoint: shards without their index
            # are an unfinished publish (possibly new shards beside old ones), never guessed at.
            weight_map = None
            names = sorted(f for f in files if f.endswith(".safetensors"))
            if not names:
                if not files and not storage.root_exists():  # (a typo in the path, a missing bucket)
                    raise FileNotFoundError(f"{storage.display()}: no such folder (or bucket)")
                raise FileNotFoundError(f"{storage.display()}: no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors files")
            if len(names) > 1:
                shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                raise IntegrityError(
                    f"{storage.display()}: {len(names)} safetensors files ({shown}) but no {INDEX_NAME}: a sharded "
                    "checkpoint is complete only with its index (an unfinished or failed publish leaves shards without it)"
                )
        self.spans: dict[str, TensorSpan] = {}
        self.files: dict[str, _FileIdentity] = {}  # file name -> what it was when its header was parsed
        for name in names:
            self._check_name(name, files)
            where = storage.display(name)
            with self.open(name) as f:
                head = hashlib.sha256()

                def read_header(n: int, f: IO[bytes] = f, head: hashlib._Hash = head) -> bytes:
                    raw = f.read(n)
                    head.update(raw)
                    return raw

                spans = parse_header(read_header(8), read_header, files[name], name, where)
                self.files[name] = _FileIdentity(files[name], head.digest(), _local_identity(f))
            for key, span in spans.items():
                if key in self.spans:
                    raise IntegrityError(f"{where}: tensor {key!r:.100} is also in {self.spans[key].file}")
                if weight_map is not None and weight_map.get(key) != name:
                    raise IntegrityError(f"{where}: holds {key!r:.100}, which the index puts in {weight_map.get(key)!r:.100}")
                self.spans[key] = span
        if weight_map is not None:
            lost = sorted(set(weight_map) - set(self.spans))
            if lost:
                raise IntegrityError(f"{storage.display(self.index_name)}: tensors missing from their files: {lost[:10]}")

    @property
    def index_name(self) -> str:
        """The index named in errors: the one read, else transformers' (a caller's file)."""
        return self.index_file or INDEX_NAME

    def _check_name(self, name: str, files: Mapping[str, int]) -> None:
        """Refuse file ``name`` of the index (or the caller's) unless it is a ``.safetensors``
        file directly in the folder."""
        if "/" in name or "\\" in name or name in (".", ".."):
            raise UnsafeCheckpointError(f"{self.storage.display(self.index_name)} names file {name!r:.100} outside the directory")
        if not name.endswith(".safetensors"):
            raise IntegrityError(f"{self.storage.display(self.index_name)} names {name!r:.100}, which is not a .safetensors file")
        if name not in files:
            raise IntegrityError(f"{self.storage.display(self.index_name)} names {name!r:.100}, which does not exist")

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """Open file ``name`` of the folder for reading: as the storage opens files (never
        through a link), except the links of a Hugging Face cache snapshot into its blobs
        (:func:`hf_cache_blob`), opened at their target (itself no link, a regular file)."""
        blob = hf_cache_blob(self.storage, name)
        if blob is None:
            with self.storage.open(name, "rb") as f:
                yield f
            return
        with os.fdopen(_open_blob(*blob), "rb") as f:
            yield f

    def metadata(self) -> Metadata:
        """DCP metadata: one chunk per tensor (each is stored whole)."""
        state: dict[str, TensorStorageMetadata] = {}
        data: dict[MetadataIndex, TensorSpan] = {}
        for key, span in self.spans.items():
            zeros = torch.Size([0] * len(span.shape))
            state[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=span.dtype),
                size=torch.Size(span.shape),
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(span.shape))],
            )
            data[MetadataIndex(key, zeros)] = span
        return Metadata(state_dict_metadata=state, storage_data=data)  # type: ignore[arg-type]


class SafetensorsReader(StorageReader):
    """A DCP ``StorageReader`` over a :class:`SafetensorsIndex`; reads only requested byte ranges.

    Call order is DCP's (all ranks: ``read_metadata``, ``set_up_storage_reader``,
    ``prepare_local_plan``, ``read_data``; coordinator: ``prepare_global_plan``).

    Args:
        index: the checkpoint's index (key names as the *state dict* will ask for them).
        rename: state-dict key -> name in the files, for keys that differ.
        thread_count: files read at the same time.
    """

    def __init__(self, index: SafetensorsIndex, rename: Mapping[str, str] | None = None, thread_count: int = 2) -> None:
        super().__init__()
        self.index = index
        self.rename = dict(rename or {})
        self.thread_count = max(1, thread_count)
        self.bytes_read = 0
        # Keys some of whose values lie beyond the range of the dtype they were read into
        # (appended by reader threads: list.append is atomic).
        self.beyond_range: list[str] = []

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        metadata = self.index.metadata()
        inverse = {v: k for k, v in self.rename.items()}

        def named(fqn: str) -> str | None:
            # A file's key that is a renamed key's state name (key_map a -> b, b -> skipped) is
            # not read under it: both were 'b' here, and whichever the files listed last filled
            # the model's b (the skipped tensor, reported unused).
            if fqn in inverse:
                return inverse[fqn]
            return None if fqn in self.rename else fqn

        metadata.state_dict_metadata = {
            name: v for k, v in metadata.state_dict_metadata.items() if (name := named(k)) is not None
        }
        metadata.storage_data = {
            MetadataIndex(name, i.offset): s for i, s in metadata.storage_data.items() if (name := named(i.fqn)) is not None
        }
        metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        jobs = list(per_file.items())
        if self.thread_count <= 1 or len(jobs) <= 1:
            counts = [self._read_file(name, items, planner) for name, items in jobs]
        else:
            with ThreadPoolExecutor(min(self.thread_count, len(jobs)), thread_name_prefix="distckpt-hf") as pool:
                counts = [fut.result() for fut in [pool.submit(self._read_file, name, items, planner) for name, items in jobs]]
        self.bytes_read += sum(counts)  # summed here: threads updating one counter lose updates
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: list[ReadItem], planner: LoadPlanner) -> int:
        """Serve ``items`` from file ``name``; returns the bytes read."""
        where = self.index.storage.display(name)
        nbytes = 0
        with self.index.open(name) as f:
            self.index.files[name].check(f, where)
            for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].start):
                span: TensorSpan = self.storage_data[item.storage_index]
                target = planner.resolve_tensor(item).detach()
                block = _read_block(f, span, tuple(item.storage_offsets), tuple(item.lengths), target, where, item.storage_index.fqn)
                if block is not target:
                    if beyond_range(block, target.dtype):
                        self.beyond_range.append(item.storage_index.fqn)
                    target.copy_(block)
                planner.commit_tensor(item, target)
                nbytes += numel(item.lengths) * _itemsize(span.dtype)
        return nbytes


def _read_block(
    f: IO[bytes], span: TensorSpan, offsets: Sequence[int], lengths: Sequence[int], target: torch.Tensor, where: str, key: str
) -> torch.Tensor:
    """The block ``offsets``/``lengths`` of a stored tensor, read with the fewest bytes possible.

    A block of whole rows (all dims but the first complete) is one contiguous byte range, read
    straight into ``target`` when dtype and layout allow; otherwise the enclosing rows are read
    and narrowed.
    """
    shape = span.shape
    item = _itemsize(span.dtype)
    row = numel(shape[1:]) * item if shape else item
    first, count = (int(offsets[0]), int(lengths[0])) if shape else (0, 1)
    whole_rows = all(int(o) == 0 for o in offsets[1:]) and tuple(int(n) for n in lengths[1:]) == tuple(shape[1:])
    f.seek(span.start + first * row)
    nbytes = count * row
    direct = (
        whole_rows
        and target.dtype == span.dtype
        and target.device.type == "cpu"
        and byte_viewable(target)
        and tuple(target.shape) == tuple(int(n) for n in lengths)
    )
    buf = target if direct else torch.empty((count, *shape[1:]) if shape else (), dtype=span.dtype)
    if nbytes:
        view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
        got = _readinto(f, view)
        if got != nbytes:
            raise IntegrityError(f"{where}: ends inside tensor {key!r} ({got} of {nbytes} bytes)")
    if direct:
        return target
    block = buf
    for dim in range(1, len(shape)):
        block = block.narrow(dim, int(offsets[dim]), int(lengths[dim]))
    return block
