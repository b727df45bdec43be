"""Where a tensor's raw bytes sit inside one ``torch.save`` record of a DCP data file.

DCP writes every tensor item with ``torch.save`` (an uncompressed zip: a small pickle describing
the tensor, then its bytes). Knowing the byte range lets readers copy straight into the
destination tensor, or stream a shard in blocks, instead of ``torch.load``-ing a copy first.
Anything unusual returns ``None`` and callers fall back to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from distckpt.state import shape as _shape
from distckpt._compat import PyTorchFileReader, dtype_from_storage_name


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


class FileSlice(ByteRange):
    """Bytes ``[offset, offset + length)`` of a binary file, as a seekable read-only stream."""

    def __init__(self, raw: Any, offset: int, length: int) -> None:
        super().__init__(offset, length)
        self._raw = raw
        raw.seek(offset)

    def _moved(self) -> None:
        self._raw.seek(self._start + self._pos)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self._len - self._pos)
        if n <= 0:
            return 0
        got = self._raw.readinto(view[:n]) if hasattr(self._raw, "readinto") else None
        if got is None:
            data = self._raw.read(n)
            got = len(data)
            view[:got] = data
        self._pos += got
        return got


class _LayoutUnpickler(pickle.Unpickler):
    """Reads the layout of the one tensor in a ``torch.save`` record without loading its data.

    Admits only what ``torch.save`` writes for a plain tensor; anything else raises, and the
    caller falls back to ``torch.load(weights_only=True)``.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, int(offset), tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            # The dtype, not the (deprecated) TypedStorage class torch.save names.
            return dtype_from_storage_name(name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        typename, dtype, key, _location, numel = pid
        if typename != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(str(typename))
        return (dtype, str(key), int(numel))


@dataclass
class RawLayout:
    """A tensor stored as plain row-major bytes at ``data_offset`` inside its record."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data_offset: int  # from the start of the record
    nbytes: int


def raw_layout(record: Any) -> RawLayout | None:
    """Layout of the single tensor saved in ``record`` (a seekable file-like of one record)."""
    try:
        reader = PyTorchFileReader(record)
        records = reader.get_all_records()
        pkl = next(r for r in records if r == "data.pkl" or r.endswith("/data.pkl"))
        (sdtype, skey, snumel), offset, size, stride = _LayoutUnpickler(io.BytesIO(reader.get_record(pkl))).load()
        rec = next(r for r in records if r == f"data/{skey}" or r.endswith(f"/data/{skey}"))
        start = int(reader.get_record_offset(rec))
    except Exception:  # noqa: BLE001 - unusual layout: the caller loads the record instead
        return None
    numel = _shape.numel(size)
    if offset + numel > snumel or (numel > 1 and stride != _shape.contiguous_strides(size)):
        return None
    itemsize = torch.empty((), dtype=sdtype).element_size()
    return RawLayout(sdtype, tuple(size), start + offset * itemsize, numel * itemsize)
