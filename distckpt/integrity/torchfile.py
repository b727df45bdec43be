"""Where a tensor's raw bytes sit inside one ``torch.save`` record of a DCP data file.

DCP writes every tensor item with ``torch.save`` (an uncompressed zip: a small pickle describing
the tensor, then its bytes). Knowing the byte range lets readers copy straight into the
destination tensor, or stream a shard in blocks, instead of ``torch.load``-ing a copy first.
Anything unusual returns ``None`` and callers fall back to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from distckpt.integrity.deep_stack import SHALLOW, tuple_nesting_bound
from distckpt.integrity.work_scan import refuse_work_bombs
from distckpt.state import shape as _shape
from distckpt._compat import PyTorchFileReader, dtype_from_storage_name


class RecordStream(Protocol):
    """One ``torch.save`` record to read: a seekable binary stream (a :class:`ByteRange` over a
    data file, a file, ``io.BytesIO``)."""

    def read(self, size: int = -1, /) -> bytes | None: ...

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int: ...

    def tell(self) -> int: ...


class ByteRange(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of something, as a seekable read-only stream: the
    position bookkeeping; subclasses say where the bytes come from (``readinto``)."""

    def __init__(self, offset: int, length: int) -> None:
        self._start = offset
        self._len = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        self._moved()
        return self._pos

    def _moved(self) -> None:
        """The position changed (a stream over a file handle follows it there)."""


class _LayoutUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Reads the layout of the one tensor in a ``torch.save`` record without loading its data.

    Admits only what ``torch.save`` writes for a plain tensor; anything else raises, and the
    caller falls back to ``torch.load(weights_only=True)``.

    Python's pure unpickler, not the C one: the C unpickler keeps its memo in an array sized by
    the largest index a ``PUT`` names, so one damaged byte in a record's head (an index of 2**30)
    made it allocate and zero gigabytes (16 GiB measured) before failing; this one keeps a dict.
    A head is a few dozen opcodes: the pure unpickler costs microseconds more per record.
    """

    def find_class(self, module: str, name: str) -> Callable[..., object]:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _BYTES  # (v3's storage: bytes, sized in bytes)
        if module == "torch" and name.endswith("Storage"):
            # The dtype, not the (deprecated) TypedStorage class torch.save names.
            return dtype_from_storage_name(name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # v3 names the tensor's dtype
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: tuple[str, object, str, str, int]) -> tuple[object, str, int]:
        typename, dtype, key, _location, numel = pid
        if typename != "storage" or not (isinstance(dtype, torch.dtype) or dtype is _BYTES):
            raise pickle.UnpicklingError(str(typename))
        return (dtype, str(key), int(numel))


# The storage of a tensor whose dtype has no ``<X>Storage`` class (uint16/32/64, float8...):
# torch.save pickles an ``UntypedStorage`` (its size in bytes) and ``_rebuild_tensor_v3`` with the dtype.
_BYTES = "UntypedStorage"
_Unpickled = tuple[tuple[torch.dtype, str, int], int, tuple[int, ...], tuple[int, ...]]


def _rebuild_v2(storage: tuple[object, str, int], offset: int, size: object, stride: object, *rest: object) -> _Unpickled:
    dtype, key, numel = storage
    if not isinstance(dtype, torch.dtype):  # (v2 always names a typed storage)
        raise pickle.UnpicklingError("_rebuild_tensor_v2 of an untyped storage")
    return (dtype, key, numel), int(offset), tuple(size), tuple(stride)  # type: ignore[arg-type]


def _rebuild_v3(
    storage: tuple[object, str, int], offset: int, size: object, stride: object, requires_grad: object, hooks: object,
    dtype: object, *rest: object,
) -> _Unpickled:
    """``_rebuild_tensor_v3``'s tensor: ``dtype`` over a storage of bytes, its offset in elements."""
    kind, key, nbytes = storage
    if kind is not _BYTES or not isinstance(dtype, torch.dtype) or nbytes % dtype.itemsize:
        raise pickle.UnpicklingError("_rebuild_tensor_v3 of a typed storage, or of bytes that are no whole elements")
    return (dtype, key, nbytes // dtype.itemsize), int(offset), tuple(size), tuple(stride)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RawLayout:
    """A tensor stored as plain row-major bytes at ``data_offset`` inside its record."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data_offset: int  # from the start of the record
    nbytes: int


# Bytes at a record's head that hold its first entries: the pickle describing the tensor and
# the small entries torch.save writes before the tensor's data (a few hundred bytes in all).
HEAD = 4096


def raw_layout(record: RecordStream) -> RawLayout | None:
    """Layout of the single tensor saved in ``record`` (a seekable file-like of one record).

    Found from the record's head where possible (:func:`head_layout`): that is where a reader
    that goes front to back already is, while torch's zip reader starts from the central
    directory at the record's end, which on a cold disk costs a seek per record ahead of the
    data. Anything else goes through torch's reader.
    """
    try:
        head = record.read(HEAD)
        layout = head_layout(head) if isinstance(head, (bytes, bytearray)) else None
    except Exception:  # noqa: BLE001 - e.g. a short read: torch's reader decides
        layout = None
    if layout is not None:
        return layout
    return _zip_layout(record)


def head_layout(head: bytes) -> RawLayout | None:
    """The layout of the tensor a ``torch.save`` record holds, from the record's first bytes
    alone, or ``None`` if they do not show it plainly.

    torch.save writes ``<prefix>data.pkl`` first (a local zip header, then the pickle), then a
    few small entries, then ``<prefix>data/<key>`` with the tensor's bytes, each entry's size
    after its data (zip data descriptors). The pickle names ``<key>``; the data entry is found
    by its local header (signature, stored uncompressed, exactly that name). Only plain
    row-major tensors qualify, as for torch's reader (:func:`raw_layout`).
    """
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        return None
    for length in tuple(_SEEN_LENGTHS):
        if len(head) >= length:
            hit = _SEEN.get(head[:length])
            if hit is not None:
                return hit
    layout, end = _parse_head(head)
    # (a data entry whose header runs past the window has a key no head of this size can match)
    if layout is not None and end <= len(head) and len(_SEEN) < _SEEN_MAX:
        _SEEN[head[:end]] = layout
        _SEEN_LENGTHS[end] = None
    return layout


# Heads already parsed, up to their data (what their layout is read from, and nothing more:
# the same bytes give the same layout). A data file's records are mostly tensors of a few
# shapes, whose heads are byte for byte alike: one parse each (the pure-Python unpickler costs
# ~40 us a record). Bounded; dict reads and writes are atomic, so reader threads share it.
_SEEN: dict[bytes, RawLayout] = {}
_SEEN_LENGTHS: dict[int, None] = {}
_SEEN_MAX = 64


def _parse_head(head: bytes) -> tuple[RawLayout | None, int]:
    """:func:`head_layout` without the cache of heads already parsed, and where the bytes it
    depends on end (the start of the data entry's bytes: nothing after it is looked at)."""
    nlen, elen = struct.unpack_from("<HH", head, 26)
    name = head[30 : 30 + nlen]
    if not name.endswith(b"data.pkl"):
        return None, 0
    prefix = name[: -len(b"data.pkl")]
    stream = io.BytesIO(head)
    stream.seek(30 + nlen + elen)
    try:
        refuse_work_bombs(head, "a record's head", start=30 + nlen + elen)  # its dict keys are hashed
        (sdtype, skey, snumel), offset, size, stride = _LayoutUnpickler(stream).load()
        target = prefix + b"data/" + skey.encode()
        at = head.find(b"PK\x03\x04", stream.tell())
        while at != -1 and at + 30 <= len(head):
            compression, = struct.unpack_from("<H", head, at + 8)
            tlen, textra = struct.unpack_from("<HH", head, at + 26)
            if tlen == len(target) and head[at + 30 : at + 30 + tlen] == target and compression == 0:
                start = at + 30 + tlen + textra
                return _layout(sdtype, snumel, offset, size, stride, start), start
            at = head.find(b"PK\x03\x04", at + 1)
    except Exception:  # noqa: BLE001 - the pickle does not fit the window, or is unusual, or
        # unpickles into values of other types (a damaged record, or a value that is no tensor
        # but pickles alike): never an error here, the caller's torch.load path decides
        return None, 0
    return None, 0


def _zip_layout(record: RecordStream) -> RawLayout | None:
    """:func:`raw_layout` through torch's zip reader (the central directory)."""
    try:
        record.seek(0)
        reader = PyTorchFileReader(record)
        records = reader.get_all_records()
        pkl = next(r for r in records if r == "data.pkl" or r.endswith("/data.pkl"))
        head = reader.get_record(pkl)
        if tuple_nesting_bound(head) > SHALLOW:  # a tensor's is a few dozen opcodes; deep tuples
            return None  # hashed here would crash: torch.load, on a deep stack, decides
        refuse_work_bombs(head, "a record")  # (refused: torch_load refuses it by name)
        (sdtype, skey, snumel), offset, size, stride = _LayoutUnpickler(io.BytesIO(head)).load()
        rec = next(r for r in records if r == f"data/{skey}" or r.endswith(f"/data/{skey}"))
        start = int(reader.get_record_offset(rec))
    except Exception:  # noqa: BLE001 - unusual layout: the caller loads the record instead
        return None
    return _layout(sdtype, snumel, offset, size, stride, start)


def _layout(
    sdtype: torch.dtype, snumel: int, offset: int, size: tuple[int, ...], stride: tuple[int, ...], start: int
) -> RawLayout | None:
    """A plain row-major tensor of ``size`` at element ``offset`` of a storage of ``snumel``
    elements whose bytes start at ``start``; ``None`` for anything else."""
    numel = _shape.numel(size)
    if offset + numel > snumel or (numel > 1 and stride != _shape.contiguous_strides(size)):
        return None
    itemsize = sdtype.itemsize
    return RawLayout(sdtype, tuple(size), start + offset * itemsize, numel * itemsize)
