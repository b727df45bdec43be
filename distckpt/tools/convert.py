"""Streaming export of a distckpt checkpoint into one file: safetensors or ``torch.save`` format.

* :func:`export_safetensors` / :func:`export_torch`: consolidate a sharded checkpoint (any world
  size, no process group) into one ``.safetensors`` file or one ``torch.save``-format file.
* the other conversions: importing a ``torch.save`` file (:mod:`distckpt.tools.importer`), and
  Hugging Face directories both ways (:mod:`distckpt.tools.hf_convert`). What is exported is
  chosen by :mod:`distckpt.tools.selection`; where an output may go and how it appears, by
  :mod:`distckpt.tools.outputs`; the checkpoint is read by
  :class:`~distckpt.integrity.shards.CheckpointSource`.

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
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch

from distckpt._compat import (
    PyTorchFileWriter,
    rebuild_tensor_v2,
    rebuild_tensor_v3,
    storage_alignment,
    storage_name_of_dtype,
    untyped_storage_dtypes,
)
from distckpt.errors import UnsafeCheckpointError
from distckpt.load.reader import CheckpointReader
from distckpt.integrity.checksums import Buffer
from distckpt.integrity.shards import CheckpointSource, TensorInfo
from distckpt.integrity.stepfiles import StepFiles
from distckpt.state import values
from distckpt.state.decoding import decode_loaded
from distckpt.state.encoded import PICKLED_INT_BITS, TopLevel
from distckpt.state.containers import SAVE_DEPTH
from distckpt.state.shape import contiguous_strides, numel
from distckpt.storage.base import named_os_error
from distckpt.tools.outputs import check_output, open_output
from distckpt.tools.safetensors_io import NAMES, check_tensor_name, header_bytes
from distckpt.tools.selection import INTERNAL, cast_dtype, lightning_step, select_tensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the CLI's --dtype names

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def _out_dtype(info: TensorInfo, dtype: torch.dtype | None) -> torch.dtype:
    return cast_dtype(info.key, info.dtype, dtype, info.shape)


def write_tensor(
    f: IO[bytes], source: CheckpointSource, key: str, dtype: torch.dtype, nbytes: int, beyond: list[str] | None = None
) -> None:
    """Stream tensor ``key`` of ``source`` (cast to ``dtype``) into ``f`` as row-major bytes.
    ``beyond``: gets ``key`` where some of its values lie beyond ``dtype``'s range (the source
    judges them before the cast: :attr:`~distckpt.integrity.shards.CheckpointSource.beyond_range`).

    Raises:
        RuntimeError: the bytes written are not the ``nbytes`` the output's header announced.
    """
    written = 0
    for block in source.iter_bytes(key, dtype):
        f.write(block)
        written += len(block)
    if beyond is not None and key in source.beyond_range and key not in beyond:
        beyond.append(key)
    if written != nbytes:
        raise RuntimeError(f"tensor {key}: wrote {written} bytes, expected {nbytes}")


def warn_beyond_range(what: str, keys: list[str], dtype: torch.dtype | None, stacklevel: int = 3) -> None:
    """One warning naming the tensors an export's cast to ``dtype`` changed beyond its range
    (float32 1e6 into float16: ``inf``, exit 0 and "wrote ..." otherwise)."""
    if keys and dtype is not None:
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        warnings.warn(
            f"distckpt: {what}: {len(keys)} tensor(s) hold values beyond the range of {dtype}, changed by the cast "
            f"(into inf; a float8 type saturates to its largest value or gives NaN): {shown}",
            stacklevel=stacklevel,
        )


def open_source(found: StepFiles, out: str, storage_options: Mapping[str, object] | None) -> CheckpointSource:
    """The checkpoint an export reads, once its output ``out`` is checked (before anything is
    read: :func:`~distckpt.tools.outputs.check_output`)."""
    check_output(out, storage_options)
    return CheckpointSource(found, CheckpointReader)


def export_safetensors(
    found: StepFiles,
    out: str,
    *,
    model_only: bool = True,
    key: str | None = None,
    dtype: torch.dtype | None = None,
    storage_options: Mapping[str, object] | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the selected tensors of ``found`` to one safetensors file, streaming. An existing
    file at ``out`` is replaced only with ``overwrite``.

    Returns:
        A summary: output, tensors, bytes.
    """
    source = open_source(found, out, storage_options)
    picked = select_tensors(found, source, model_only=model_only, key=key)
    dtypes: dict[str, torch.dtype] = {}
    for name, k in picked:
        check_tensor_name(name, f"export of checkpoint key {k!r}")
        dtypes[k] = _out_dtype(source.tensors[k], dtype)
        if dtypes[k] not in NAMES:
            raise ValueError(f"tensor {k} has dtype {dtypes[k]}, which safetensors cannot store")
    # The header lists the tensors in checkpoint order; their bytes follow in the order they lie
    # in the checkpoint's files, so that each data file is read once, front to back.
    plan = sorted(picked, key=lambda p: source.position(p[1]))
    head = header_bytes(
        [(name, dtypes[k], source.tensors[k].shape) for name, k in plan],
        {"format": "pt", "source": found.display()},
        listed=[name for name, _ in picked],
    )
    total = sum(source.tensors[k].nbytes(dtypes[k]) for _, k in plan)
    done = 0
    with open_output(out, storage_options, overwrite=overwrite) as f:
        f.write(head)
        for _, k in plan:
            n = source.tensors[k].nbytes(dtypes[k])
            write_tensor(f, source, k, dtypes[k], n)
            done += n
            if progress:
                progress(done, total)
        source.finish()  # every file read checked whole before the output appears
    beyond = list(source.beyond_range)  # (every cast read is a tensor written)
    warn_beyond_range(f"export of {found.display()} to {out}", beyond, dtype)
    return {
        "output": out, "format": "safetensors", "tensors": len(plan), "bytes": total, "unverified": found.unverified,
        "beyond_range": beyond,
    }  # fmt: skip


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

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, _Stub):
            args = (_StorageRef(obj), 0, tuple(obj.shape), contiguous_strides(obj.shape), False, OrderedDict())
            if obj.dtype in _UNTYPED:  # (uint16, float8...: no <X>Storage class names the dtype)
                return (rebuild_tensor_v3, (*args, obj.dtype))
            return (rebuild_tensor_v2, args)
        return NotImplemented

    def persistent_id(self, obj: object) -> tuple[str, type, str, str, int] | None:
        if isinstance(obj, _StorageRef):
            stub = obj.stub
            if stub.dtype in _UNTYPED:  # a storage of bytes, sized in bytes
                return ("storage", torch.UntypedStorage, str(stub.index), "cpu", numel(stub.shape) * stub.dtype.itemsize)
            storage_type = getattr(torch, storage_name_of_dtype(stub.dtype))
            return ("storage", storage_type, str(stub.index), "cpu", numel(stub.shape))
        return None


_UNTYPED = untyped_storage_dtypes()


def export_torch(
    found: StepFiles,
    out: str,
    *,
    model_only: bool = False,
    key: str | None = None,
    dtype: torch.dtype | None = None,
    storage_options: Mapping[str, object] | None = None,
    progress: Progress | None = None,
    encoded_values: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``found`` as one ``torch.save``-format file, streaming one tensor at a time.

    With ``model_only`` or ``key``: a flat state dict for ``model.load_state_dict``. Otherwise
    ``{top-level name: {rest of key: tensor or value}}`` with plain values (epoch, optimizer
    hyper-parameters) included; distckpt's RNG states are left out. Values are decoded as a load
    decodes them and written in plain types (``np.float64`` as a float), so that
    ``torch.load(weights_only=True)`` reads the file; values plain data cannot hold (Enum and
    dataclass members, NumPy arrays, paths...) are left out and listed in ``skipped`` with the
    reason. ``encoded_values``: write values as plain ``dcp.load`` sees them instead (distckpt's
    encoded form, ``("__distckpt_value__", kind, payload)``; those holding tensors skipped).
    An existing file at ``out`` is replaced only with ``overwrite``.

    Returns:
        A summary: output, tensors, bytes, skipped values.
    """
    source = open_source(found, out, storage_options)
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
        if lightning_step(found):
            warnings.warn(
                f"distckpt: {found.display()} is a step of Lightning's DistckptCheckpointIO: the full export holds its "
                "entries by their checkpoint keys ('optimizer_states' as one dict of keys such as '0.state.0.step'), not "
                "Lightning's checkpoint dict, so Trainer.fit(ckpt_path=...) cannot resume from it; resume through the "
                "plugin, or export the weights with --model-only",
                stacklevel=2,
            )
        obj = {}
        entries = found.manifest.entries if found.manifest is not None else {}
        all_keys = [k for k in source.metadata.state_dict_metadata if k.partition(".")[0] not in INTERNAL]
        source.expect(all_keys)
        for k in all_keys:
            top, dot, rest = k.partition(".")
            if k in source.tensors:
                item: Any = stub(k)
            else:
                # A value that cannot be read (damaged, altered, or needing code to unpickle)
                # fails the export like a tensor would; only a readable value that is not plain
                # data (a torch.save file holds no custom classes) is left out and reported.
                raw, stored_as_json = source.read_value_and_form(k)
                item, why = _exported_value(raw, k, encoded_values, stored_as_json)
                if why is not None:
                    skipped.append(f"{k} ({why})")
                    continue
            # A top-level name (no dot) is an item itself; "m." is the key "" inside "m", not "m"
            # (that replaced the dict "m" already held: {"m": {"a": .., "": ..}} lost m.a).
            if not dot or entries.get(top, {}).get("kind") == "value":
                obj[top] = item
            else:
                obj.setdefault(top, {})[rest] = item

    buf = io.BytesIO()
    _StubPickler(buf, protocol=2).dump(obj)
    total = sum(source.tensors[s.key].nbytes(s.dtype) for s in stubs)
    crc = torch.serialization.get_crc32_options()
    alignment = storage_alignment()
    with open_output(out, storage_options, overwrite=overwrite) as f:
        sink = _Sink(f, out)
        writer = PyTorchFileWriter(sink, crc, alignment)
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
    beyond = list(source.beyond_range)  # (every cast read is a tensor written)
    warn_beyond_range(f"export of {found.display()} to {out}", beyond, dtype)
    return {
        "output": out, "format": "torch", "tensors": len(stubs), "bytes": total, "skipped": skipped,
        "unverified": found.unverified, "beyond_range": beyond,
    }  # fmt: skip


def _exported_value(raw: Any, key: str, encoded: bool = False, stored_as_json: bool = False) -> tuple[Any, str | None]:
    """A value as read (``raw``: distckpt's encoded form for what JSON cannot hold) as the output
    holds it: decoded as a load decodes it, in plain types (``np.float64`` a float, a subclass
    of ``int`` an int), so that ``torch.load(weights_only=True)`` reads the file. Or ``(None,
    why)`` for a value the output cannot hold: one of a class of the training code (Enum,
    dataclass, NamedTuple: only a process holding the class can rebuild it), or one that is no
    plain data (NumPy arrays, paths, frozensets, tensors inside values...). ``encoded``: ``raw`` as
    it is, if it is plain data (``encoded_values`` of :func:`export_torch`). ``stored_as_json``:
    ``raw`` is a plain value stored as JSON text, already as a load gives it back (a user's tuple
    that merely looks like the encoded form stays that tuple, as for a load).

    Raises:
        IntegrityError: ``raw`` is a malformed encoded value (damaged or forged), as a load would.
    """
    if encoded:
        return (raw, None) if values.is_plain(raw) else (None, "not a plain value")
    try:
        value = raw if stored_as_json else decode_loaded(raw, key)
    except UnsafeCheckpointError:
        return None, "a value of a class of the training code: load it with Checkpointer(safe_types=...)"
    if isinstance(value, TopLevel):  # a top-level entry that was stored encoded
        value = value.value
    value = _as_plain(value)
    if not _loadable(value):
        return None, f"not plain data: {_type_name(value)}"
    return value, None


# What ``torch.load(weights_only=True)`` reads back as written (checked under torch 2.11-2.15):
# JSON's scalars and containers, and complex numbers, bytes, sets and dicts keyed by any of these
# (a tuple, an int). Not frozensets, ranges or slices: it refuses those.
_LOADABLE_SCALARS = (type(None), bool, int, float, str, complex, bytes, bytearray)


def _loadable(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` (in exact types, as :func:`_as_plain` gives it) is data a
    ``torch.load(weights_only=True)`` reads back."""
    if type(value) in _LOADABLE_SCALARS:
        return _odd_scalar(value) is None
    if depth > SAVE_DEPTH:  # (or a container holding itself)
        return False
    if type(value) in (list, tuple, set):
        return all(_loadable(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(_loadable(k, depth + 1) and _loadable(v, depth + 1) for k, v in value.items())
    return False


def _odd_scalar(value: Any) -> str | None:
    """What ``weights_only`` cannot read of a plain scalar: an int pickled with LONG4 (more than
    255 bytes), an empty ``bytes`` (pickled as a call of ``bytes()``); None for the others."""
    if type(value) is int and value.bit_length() > PICKLED_INT_BITS:
        return f"an int of {value.bit_length():,} bits"
    if type(value) is bytes and not value:
        return "an empty bytes"
    return None


def _type_name(value: Any) -> str:
    """The first type in ``value`` that is no plain data (a container's element's, if that)."""
    if type(value) in _LOADABLE_SCALARS:
        return _odd_scalar(value) or type(value).__name__
    if type(value) in (list, tuple, set):
        return next((_type_name(v) for v in value if not _loadable(v)), type(value).__name__)
    if type(value) is dict:
        for k, v in value.items():
            if not _loadable(k):
                return f"a dict key of type {_type_name(k)}"
            if not _loadable(v):
                return _type_name(v)
    return type(value).__name__


def _as_plain(value: Any, depth: int = 0) -> Any:
    """``value`` in exactly the plain types where it holds plain data: a NumPy bool, integer or
    float scalar (a schedule's ``np.int64`` step) as the Python scalar of the same number, a
    subclass of a plain type (``np.float64``, an ``OrderedDict``) as its base type, containers
    rebuilt. Anything else is left as it is, for :func:`_loadable` to refuse."""
    if isinstance(value, (np.bool_, np.integer, np.floating, np.complexfloating)):
        return value.item()
    for base in (bool, int, float, str, complex, bytes, bytearray):
        if isinstance(value, base):
            return base(value)
    if depth > SAVE_DEPTH:
        return value  # too deep: _loadable() refuses it
    if isinstance(value, tuple):
        return tuple(_as_plain(v, depth + 1) for v in value)
    if isinstance(value, list):
        return [_as_plain(v, depth + 1) for v in value]
    if isinstance(value, set):
        return {_as_plain(v, depth + 1) for v in value}
    if isinstance(value, dict):
        return {_as_plain(k, depth + 1): _as_plain(v, depth + 1) for k, v in value.items()}
    return value


class _Sink:
    """The file ``PyTorchFileWriter`` writes to.

    A write error (a full disk) is recorded in :attr:`error`, not raised into the C++ writer:
    a Python exception there leaves the writer's byte count wrong, and its destructor then
    aborts the process ("terminate called ... unexpected pos"). After an error or
    :meth:`disarm`, writes are counted and dropped, so the writer can always finish.
    """

    def __init__(self, f: IO[bytes], where: str) -> None:
        self._f: IO[bytes] | None = f
        self._where = where
        self.error: OSError | None = None

    def write(self, data: Buffer) -> int:
        n = memoryview(data).nbytes
        if self._f is not None:
            try:
                self._f.write(data)
            except OSError as exc:
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
    writer: PyTorchFileWriter,
    data: bytes,
    stubs: list[_Stub],
    source: CheckpointSource,
    alignment: int,
    total: int,
    progress: Progress | None,
    sink: _Sink,
) -> int:
    """The records of a ``torch.save`` zip, one storage per tensor; returns the bytes written.
    Tensors are read cast to their record's dtype (``source.beyond_range`` names those the cast
    changed beyond its range)."""
    done = 0
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
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
