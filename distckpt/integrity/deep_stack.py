"""Unpickling a checkpoint's pickles on a thread stack deep enough for what they can nest.

Hashing a tuple hashes its items in C, recursively, with no recursion limit: a tuple nested a
million levels deep crashes the interpreter (SIGSEGV) when it is hashed, on CPython 3.11 after
~130,000 levels on an 8 MiB stack (64 bytes per level, measured). A pickle builds such a tuple
with one byte per level (``TUPLE1``), and the unpickler hashes it as soon as it is a dictionary
key, a set member, or part of a ``MetadataIndex`` key of ``storage_data``: a 1 MB ``.metadata``,
or a 1 MB value record read by ``torch.load(weights_only=True)``, crashed every rank that read it.

No allow-list can refuse it (it is made of tuples only), and no check can run between the
unpickler's opcodes. What bounds it is the data: every level of nesting is a distinct tuple,
built by one of the opcodes ``TUPLE``, ``TUPLE1``, ``TUPLE2``, ``TUPLE3`` (the only ones that
make a tuple holding another object; no class the allow-lists admit makes tuples of objects)
but the innermost, and a pickle has no loops, so a tuple's nesting is at most one more than the
number of bytes of the pickle that could be one of those opcodes (:func:`tuple_nesting_bound`,
a count at C speed; a seeded fuzz test checks it against real nesting). The
unpickling then runs on a thread whose stack holds that many levels (:func:`call_with_stack`);
the stack is address space, reserved, not memory: only the pages a deep structure touches are
used. A legitimate 18 MB ``.metadata`` (2,000 tensors x 64 shards) bounds its nesting at ~1.04
million and gets ~200 MB of reserved stack; it nests 3 levels.

A ``torch.save`` record is a zip whose ``data.pkl`` ``torch.load`` unpickles: its bound is
counted over that entry as torch's own zip reader finds it (:func:`record_nesting_bound`), so a
record holding megabytes of tensor bytes does not ask for a stack in proportion.

What is unpickled must then be checked for depth before the calling thread hashes it: the
``.metadata`` by :func:`distckpt.integrity.metadata_check.validate_metadata` (strict types for
every field DCP writes, a nesting bound on the rest), values by the decoder's depth bound.
"""

from __future__ import annotations

import sys
import threading
import zipfile
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from distckpt._compat import PyTorchFileReader
from distckpt.errors import IntegrityError, UnsafeCheckpointError
from distckpt.integrity.call_scan import refuse_argument_bombs
from distckpt.integrity.work_scan import refuse_work_bombs

T = TypeVar("T")

#: The pickle opcodes that make a tuple holding objects: ``TUPLE`` ('t'), ``TUPLE1-3``.
TUPLE_OPCODES = (b"t", b"\x85", b"\x86", b"\x87")
#: Stack per level of nesting: 64 bytes measured (CPython 3.11, x86-64), three times that for
#: other builds and platforms.
BYTES_PER_LEVEL = 192
#: Stack for what runs besides the nesting (the unpickler, torch.load, the validation).
BASE_STACK = 8 << 20
#: Nesting that any thread's stack holds as it is (64 KiB of the smallest default stacks):
#: below it the call runs where it is, without a thread.
SHALLOW = 1000

_size_lock = threading.Lock()


def tuple_nesting_bound(data: bytes | bytearray | memoryview) -> int:
    """An upper bound on how deep the tuples of the pickle ``data`` nest (tuples in a chain, each
    holding the next): the number of its bytes equal to a tuple-making opcode, plus one for the
    innermost, which may be an empty tuple (``EMPTY_TUPLE``, holding nothing) (pure; any thread)."""
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    return 1 + sum(raw.count(op) for op in TUPLE_OPCODES)


#: Records up to this size whose zip entries are all stored (as torch.save writes them) are
#: counted whole: faster than opening them as a zip, and their pickle's bytes are among them.
_COUNT_WHOLE = 1 << 20
#: What ``torch.load`` tells a zip by: a local file header at the start (else its legacy format).
_ZIP_MAGIC = b"PK\x03\x04"
_CENTRAL_ENTRY = b"PK\x01\x02"


def record_nesting_bound(record: Any, raw: bytes | bytearray | memoryview | None = None) -> int:
    """:func:`tuple_nesting_bound` of what ``torch.load`` unpickles from the ``torch.save`` record
    ``record`` (a seekable binary stream, left at its start; ``raw``: its bytes, where the caller
    has them), following ``torch.load``'s own dispatch:

    * a record that does not start with a zip's local header is read by torch's legacy loader,
      one raw pickle after another: every byte is counted;
    * a zip: the ``.pkl`` entries as torch's zip reader gives them (inflated, if compressed: the
      bytes of a compressed entry are not its opcodes); a small one whose entries are all
      stored is counted whole instead (the same bytes, and cheaper).

    (An attacker's review found both: a 1.2 KB record with a deflated ``data.pkl`` counted 19
    levels for 400,000; a legacy pickle followed by a small zip counted the zip's.)"""
    if raw is not None and len(raw) <= _COUNT_WHOLE and not isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw)  # once, for both scans of a small record below (each would copy it)

    def whole() -> int:
        record.seek(0)
        return tuple_nesting_bound(raw if raw is not None else record.read())

    try:
        if raw is None:
            record.seek(0)
            head = record.read(len(_ZIP_MAGIC))
        else:
            head = bytes(raw[: len(_ZIP_MAGIC)])
        if head != _ZIP_MAGIC:
            return whole()
        if raw is not None and len(raw) <= _COUNT_WHOLE and not _compressed(raw):
            return whole()
        try:
            record.seek(0)
            reader = PyTorchFileReader(record)
            return sum(tuple_nesting_bound(reader.get_record(n)) for n in reader.get_all_records() if n.endswith(".pkl"))
        except Exception:  # noqa: BLE001 - a zip torch cannot read (torch.load fails too): count all of it
            return whole()
    finally:
        record.seek(0)


def _held(reader: Any, names: list[str], record: Any) -> int:
    """The bytes the zip entries ``names`` of ``record`` hold once read (uncompressed), as its
    central directory says."""
    if hasattr(reader, "get_record_size"):
        return sum(reader.get_record_size(n) for n in names)
    record.seek(0)  # (torch 2.11's reader has no get_record_size: Python's reads the same directory)
    with zipfile.ZipFile(record) as z:
        return sum(info.file_size for info in z.infolist())


def _compressed(raw: bytes | bytearray | memoryview) -> bool:
    """Whether any central directory entry of the zip ``raw`` may name a compressed entry: every
    place that could be one (its signature) is looked at, so the real ones are among them."""
    data = raw if isinstance(raw, (bytes, bytearray)) else bytes(raw)
    at = data.find(_CENTRAL_ENTRY)
    while at >= 0:
        if data[at + 10 : at + 12] != b"\x00\x00":  # compression method: 0 is stored
            return True
        at = data.find(_CENTRAL_ENTRY, at + 1)
    return False


def torch_load(record: Any, raw: bytes | bytearray | memoryview | None = None, where: str = "a record") -> Any:
    """``torch.load(record, map_location="cpu", weights_only=True)`` on a stack deep enough for
    the record's nesting (its pickle's dict keys are hashed as they are built), once its pickles
    are known to ask no more work than their size allows (:func:`refuse_record_work_bombs`).
    ``record``: a seekable binary stream; ``raw``: its bytes, where the caller has them;
    ``where``: what errors name.

    Raises:
        pickle.UnpicklingError: what ``torch.load`` raises for a pickle that needs code.
        UnsafeCheckpointError: the record asks for more work than its size allows.
        IntegrityError: naming ``where``, anything else ``torch.load`` raised (an admitted call
            given arguments it refuses, ``set(5)``, ``torch.device("nope")``; a damaged archive).
    """
    bound = refuse_record_work_bombs(record, raw, where)
    if bound is None:
        bound = record_nesting_bound(record, raw)
    try:
        return call_with_stack(bound, lambda: torch.load(record, map_location="cpu", weights_only=True))
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError, RuntimeError, EOFError) as exc:
        # (pickle.UnpicklingError is none of these: it reaches the callers, who name the refusal)
        raise IntegrityError(f"{where} is not a record torch.load reads: {type(exc).__name__}: {str(exc)[:300]}") from None


def refuse_record_work_bombs(record: Any, raw: bytes | bytearray | memoryview | None, where: str) -> int | None:
    """:func:`~distckpt.integrity.work_scan.refuse_work_bombs` over every pickle ``torch.load``
    would unpickle from the ``torch.save`` record ``record`` (left at its start): the ``.pkl``
    entries of its zip, as torch's zip reader gives them. A record that is no zip (torch's
    legacy format, which ``torch.save`` has not written since torch 1.6, nor DCP ever) is
    refused: its pickles follow one another with nothing saying where each starts. So is a zip
    whose entries hold more bytes than the record (shared or compressed entries: a memory bomb
    of the storages ``torch.load`` reads from them).

    Returns the :func:`tuple_nesting_bound` of those pickles (read once, for both), or ``None``
    where torch's zip reader cannot read the record (``torch.load`` then fails on it too).

    Raises:
        UnsafeCheckpointError: the record is no zip, its entries hold more than its size, or
            one of its pickles is a work bomb.
    """
    try:
        record.seek(0)
        head = bytes(raw[: len(_ZIP_MAGIC)]) if raw is not None else record.read(len(_ZIP_MAGIC))
        if head != _ZIP_MAGIC:
            raise UnsafeCheckpointError(
                f"refusing to read {where}: it is not a zip archive as torch.save writes (torch's legacy format, "
                "which DCP never writes, or a damaged or crafted record)"
            )
        length = len(raw) if raw is not None else record.seek(0, 2)
        record.seek(0)
        try:
            reader = PyTorchFileReader(record)
            names = reader.get_all_records()
            held = _held(reader, names, record)
            pickles = [reader.get_record(n) for n in names if n.endswith(".pkl")] if held <= length else []
        except Exception:  # noqa: BLE001 - a zip torch cannot read: torch.load fails on it too
            return None
        if held > length:
            # torch.save stores its entries side by side, uncompressed: their bytes fit in the
            # record. More is entries that share bytes (a central directory naming one 4 MB entry
            # 64 times loaded 256 MB from 4.2 MB) or that inflate.
            raise UnsafeCheckpointError(
                f"refusing to read {where}: its {len(names)} zip entries hold {held:,} bytes, more than its {length:,} "
                "(entries that overlap or are compressed, which torch.save never writes: a crafted record, whose load "
                "would allocate in proportion)"
            )
        for data in pickles:
            refuse_work_bombs(data, where)
            refuse_argument_bombs(data, where)
        return sum(tuple_nesting_bound(data) for data in pickles)
    finally:
        record.seek(0)


def call_with_stack(levels: int, fn: Callable[[], T]) -> T:
    """``fn()``, on a thread whose stack holds ``levels`` levels of tuple nesting (here, where
    ``levels`` is shallow, or while the interpreter exits and no thread can start); what it
    raises is raised here. Blocks the caller until it returns.

    Raises:
        MemoryError: the stack could not be reserved (the process' address space or the
            system's overcommit limit), naming the size.
    """
    if levels <= SHALLOW:
        return fn()
    size = BASE_STACK + levels * BYTES_PER_LEVEL
    size += -size % (1 << 16)  # whole pages on every platform
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as it is
            error.append(exc)

    thread = threading.Thread(target=run, name="distckpt-deep-stack", daemon=True)
    # stack_size() is process-wide: set for this one thread's start, then restored (a thread
    # another caller starts meanwhile gets a larger stack than it asked for; nothing in torch
    # or distckpt sets it).
    with _size_lock:
        before = threading.stack_size(size)
        try:
            thread.start()
        except (RuntimeError, MemoryError) as exc:
            if sys.is_finalizing():  # no thread starts while the interpreter exits: here, then
                return fn()
            raise MemoryError(
                f"could not reserve a {size >> 20} MiB thread stack to unpickle data that may nest "
                f"{levels:,} levels deep ({exc})"
            ) from None
        finally:
            threading.stack_size(before)
    thread.join()
    if error:
        raise error[0]
    return result[0]
