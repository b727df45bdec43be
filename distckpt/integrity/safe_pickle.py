"""Reading DCP's ``.metadata`` without running code from the checkpoint.

DCP unpickles ``.metadata`` with plain ``pickle.load``: a crafted file (say, in a shared bucket)
runs arbitrary code on load. :func:`load_metadata` uses an unpickler that admits only the classes
DCP's metadata is made of; :func:`check_relative_name` refuses file paths that would leave the
checkpoint directory (applied to every stored item by :mod:`distckpt.integrity.metadata_check`).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from distckpt._process import gc_paused
from distckpt._shown import shown
from distckpt.errors import UnsafeCheckpointError
from distckpt.integrity.deep_stack import call_with_stack, tuple_nesting_bound
from distckpt.integrity.pickle_scan import refuse_memory_bombs
from distckpt.integrity.work_scan import refuse_work_bombs
from distckpt._compat import MEM_FORMAT_ENCODING as _MEM_FORMAT_ENCODING
from distckpt._compat import TENSOR_PROPERTIES_READER

# Besides _BOUNDED below (constructors given only the arguments DCP writes), admitted as they are.
_ALLOWED: set[tuple[str, str]] = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


#: Bounds on what the admitted constructors that take arguments are given: a pickle may hand
#: the same argument to them again and again (memo), so each call is bounded, never the file.
#: Unbounded, ``PosixPath(p, p)`` repeated doubled its parts each time (40 steps, 476 bytes:
#: 2**40 of them) and ``torch.Size`` of one long list, repeated, cost 10,000x the file's size.
MAX_PATH_PARTS, MAX_PATH_CHARS, MAX_DIMS = 64, 4096, 1024

_BOUNDED = frozenset({("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"), ("torch", "Size"),
                      ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")})  # fmt: skip


class _Refused(UnsafeCheckpointError):
    """Raised inside the unpickler, where the file is not known: :func:`load_metadata` names it."""


#: Attributes an object of DCP's metadata classes may be given beyond its fields (a field a newer
#: torch added): a ``BUILD`` with more is refused.
SPARE_ATTRIBUTES = 4
#: ``storage_data`` keys (``MetadataIndex``) of one ``.metadata`` that may share a hash: DCP's
#: are distinct (fqn, offset) pairs, whose hashes never collide unless crafted.
MAX_EQUAL_INDEX_HASHES = 64


def _guard(cls: type, index_hashes: dict[int, int] | None = None) -> type:
    """A stand-in for DCP's dataclass ``cls`` that ``NEWOBJ`` makes and whose first ``BUILD``
    (``__setstate__``) is checked before anything is copied, then turns the object into a ``cls``.

    Without it a pickle memoizes one large attribute dict and applies it by ``BUILD`` to
    thousands of new objects, each getting a copy: 75 KB of ``.metadata`` took 400 MB and 2.7 s
    (4,000 x 4,000 entries), a few hundred KB exhaust any host's memory before the validation
    sees one object. An object no ``BUILD`` reaches stays a stand-in (named so in errors), which
    the validation refuses where DCP writes fields (``BytesStorageMetadata`` has none).

    ``index_hashes`` (``MetadataIndex``, one per load): how many keys of each hash the load met.
    The unpickler inserts each into ``storage_data`` as it is built: ``n`` distinct keys of one
    hash cost ``n**2 / 2`` comparisons there (offsets that differ by multiples of ``2**61 - 1``
    collide: 400 KB of ``.metadata`` took 27 s), which the opcode walk cannot see, as the key's
    fields come by ``BUILD``."""
    fields = frozenset(f.name for f in dataclasses.fields(cls))

    most = len(fields) + SPARE_ATTRIBUTES
    hashed = cls is MetadataIndex
    # Fields without a default (DCP writes every field): missing, the validation met an
    # AttributeError where it reads them (a fuzzed byte made _StorageInfo lose relative_path).
    required = frozenset(
        f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )

    def __setstate__(self: object, state: object, _set: Callable[..., None] = object.__setattr__) -> None:
        # Called for every object of a .metadata (hundreds of thousands): kept lean. The dict is
        # adopted, not copied (a pickle handing one dict to many objects gets it shared, never
        # multiplied); the validation checks its keys and values.
        if type(state) is not dict or len(state) > most:
            size = len(state) if isinstance(state, (dict, tuple, list)) else "?"
            raise _Refused(
                f"it gives a {cls.__name__} the attributes {type(state).__name__} of {size} items, which DCP never "
                f"writes (its fields: {', '.join(sorted(fields)) or 'none'})"
            )
        if not required <= state.keys():
            raise _Refused(f"it gives a {cls.__name__} no {', '.join(sorted(required - state.keys()))}, which DCP always writes")
        if hashed and not (type(state.get("fqn")) is str and type(state.get("offset")) in (torch.Size, type(None))):
            # A key of storage_data: hashing it hashes these two, as the unpickler inserts it
            # (work_scan counts a tuple's weight when it is built, not a key's attributes).
            raise _Refused(
                f"it gives a {cls.__name__} the fqn {type(state.get('fqn')).__name__} and offset "
                f"{type(state.get('offset')).__name__}, where DCP writes a str and a torch.Size"
            )
        if index_hashes is not None:
            h = hash((state["fqn"], state.get("offset")))  # (MetadataIndex's own hash: its index is not hashed)
            seen = index_hashes[h] = index_hashes.get(h, 0) + 1
            if seen > MAX_EQUAL_INDEX_HASHES:
                raise _Refused(
                    f"it holds more than {MAX_EQUAL_INDEX_HASHES} storage keys (MetadataIndex) with one hash, such as "
                    f"{shown(state['fqn'], 60)} at offset {shown(state.get('offset'), 60)} (crafted offsets: inserting n "
                    "keys of one hash compares each with all the others)"
                )
        _set(self, "__dict__", state)
        _set(self, "__class__", cls)  # (a frozen dataclass refuses setattr)

    name = f"{cls.__name__} without its fields"
    return type(name, (cls,), {"__slots__": (), "__setstate__": __setstate__, "__qualname__": name, "__module__": __name__})


#: DCP's dataclasses, as ``.metadata`` names them, and the stand-ins it gets (:func:`_guard`;
#: ``TensorProperties``, whose state is a tuple: the class that reads the state of every torch of
#: the range, see :data:`distckpt._compat.TENSOR_PROPERTIES_READER`).
_GUARDS: dict[tuple[str, str], type] = {
    ("torch.distributed.checkpoint.metadata", c.__name__): _guard(c)
    for c in (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata)
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _guard(_StorageInfo),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"): TENSOR_PROPERTIES_READER,
}
#: The stand-in of the one class DCP writes without fields (never given a BUILD).
BYTES_GUARD = _GUARDS[("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")]


_INDEX = ("torch.distributed.checkpoint.metadata", "MetadataIndex")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: io.BytesIO, where: str) -> None:
        super().__init__(data)
        self.where = where
        self.index_guard = _guard(MetadataIndex, {})  # (its own count of the keys' hashes)

    def find_class(self, module: str, name: str) -> Callable[..., object]:
        if name == "getattr" and module in ("builtins", "__builtin__"):  # protocol 2 says __builtin__
            return self._member_of_mem_format  # CPython 3.11.0-3.11.2's enum pickling
        if (module, name) in _BOUNDED:
            return self._bounded(module, name, super().find_class(module, name))
        if (module, name) == _INDEX:
            return self.index_guard
        guard = _GUARDS.get((module, name))
        if guard is not None:
            return guard
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        # Its own attributes only: torch's module __getattr__ imports lazy submodules (_dynamo:
        # a second of a load, for one crafted name).
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise UnsafeCheckpointError(
            f"refusing to read {self.where}: it references {module}.{name}, which DCP metadata never "
            "contains (a crafted file could run code through it)"
        )

    def _bounded(self, module: str, name: str, real: Callable[..., object]) -> Callable[..., object]:
        """``real`` for the arguments DCP's metadata gives it (as their ``__reduce__`` writes
        them), bounded in size; anything else is refused (a class wanted by NEWOBJ: this is not
        one, and the unpickler refuses it)."""
        where = self.where

        def refuse(args: tuple[object, ...]) -> UnsafeCheckpointError:
            kinds = ", ".join(type(a).__name__ for a in args[:4]) + (", ..." if len(args) > 4 else "")
            return UnsafeCheckpointError(f"refusing to read {where}: it calls {module}.{name}({kinds}), which DCP metadata never does")

        if module == "pathlib":

            def path(*parts: object) -> object:
                if len(parts) > MAX_PATH_PARTS or not all(isinstance(p, str) for p in parts):
                    raise refuse(parts)
                if sum(len(p) for p in parts) > MAX_PATH_CHARS:  # type: ignore[arg-type]
                    raise UnsafeCheckpointError(f"refusing to read {where}: it holds a path of more than {MAX_PATH_CHARS} characters")
                return real(*parts)

            return path
        if name == "Size":

            def size(dims: object = ()) -> object:
                if not isinstance(dims, (tuple, list)) or len(dims) > MAX_DIMS or not all(type(d) is int for d in dims):
                    raise refuse((dims,))
                return real(dims)

            return size
        if name == "_get_layout":

            def layout(text: object) -> object:
                if not isinstance(text, str) or len(text) > 64:
                    raise refuse((text,))
                return real(text)

            return layout

        def ordered_dict(*args: object) -> object:  # its items come by SETITEMS, never as arguments
            if args:
                raise refuse(args)
            # A plain dict (ordered too): an OrderedDict has attributes, which a BUILD of one
            # memoized dict onto many of them would copy again and again; a dict has none.
            return {}

        return ordered_dict

    def _member_of_mem_format(self, owner: object, name: object) -> enum.Enum:
        """``getattr`` as CPython 3.11.0-3.11.2 pickle an enum member (``getattr(cls, name)``),
        admitted only for the memory-format enum of DCP's ``TensorProperties`` and its members."""

        if owner is _MEM_FORMAT_ENCODING and isinstance(name, str) and name in _MEM_FORMAT_ENCODING.__members__:
            return _MEM_FORMAT_ENCODING[name]
        raise UnsafeCheckpointError(
            f"refusing to read {self.where}: it calls getattr({getattr(owner, '__name__', type(owner).__name__)}, {shown(name, 40)}); "
            "DCP metadata only ever names members of its memory-format enum that way"
        )


def check_relative_name(name: object, where: str) -> None:
    """Refuse a file name recorded in a checkpoint that is not a plain name inside its directory."""
    text = os.fspath(name) if isinstance(name, (str, os.PathLike)) else None
    if (
        not text
        or text in (".", "..")
        or "/" in text
        or "\\" in text
        or os.path.isabs(text)
        or "\x00" in text
    ):
        raise UnsafeCheckpointError(f"{where} names file {name!r}, which is outside the checkpoint directory")


def load_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle DCP ``Metadata`` safely (only the classes it is made of).

    This only unpickles: the values are validated (types, file names inside the directory,
    byte ranges, chunk coverage) by :func:`distckpt.integrity.metadata_check.validate_metadata`, which
    :meth:`distckpt.integrity.stepfiles.StepFiles.metadata`, the one reader of ``.metadata``, applies
    to every result, with the manifest's file sizes where it has them. The unpickler runs on a
    thread stack deep enough for any tuple nesting ``data`` can hold
    (:mod:`distckpt.integrity.deep_stack`): it hashes dictionary keys as it builds them, and the
    validation must see a deeply nested one before anything else hashes it on an ordinary stack.

    Raises:
        UnsafeCheckpointError: it would run code to unpickle, declares memo slots or lengths
            its size cannot hold (a memory bomb, :mod:`distckpt.integrity.pickle_scan`), or is
            not DCP ``Metadata``.
    """
    refuse_memory_bombs(data, where)
    refuse_work_bombs(data, where, strict=True)  # keys hashed, objects copied: no more than its size allows
    before = _enum_state()
    try:
        with gc_paused():  # (millions of objects, no cycle: collections would find nothing)
            metadata = call_with_stack(tuple_nesting_bound(data), _MetadataUnpickler(io.BytesIO(data), where).load)
    except _Refused as exc:
        raise UnsafeCheckpointError(f"refusing to read {where}: {exc}") from None
    except (UnsafeCheckpointError, MemoryError):
        raise
    except Exception as exc:
        raise UnsafeCheckpointError(f"{where} is not valid DCP metadata: {type(exc).__name__}: {_text(exc)}") from None
    finally:
        changed = _restore_enum(before)
    if changed:
        raise UnsafeCheckpointError(
            f"refusing to read {where}: it sets attributes of torch's {changed}, which DCP metadata never does (they "
            "are restored; unpickled, they would have changed how this process writes every later checkpoint)"
        )
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) is dict:
        for md in entries.values():
            if type(md) is BYTES_GUARD:
                object.__setattr__(md, "__class__", BytesStorageMetadata)  # DCP writes it without a BUILD
    return metadata


def _enum_state() -> list[tuple[object, dict[str, object]]]:
    """The attributes of the one class the allow-list hands out as it is, and of its members:
    shared objects, which a ``BUILD`` aimed at them would modify for the whole process (the
    enum by ``setattr``, a member's ``__dict__``)."""
    return [(_MEM_FORMAT_ENCODING, dict(vars(_MEM_FORMAT_ENCODING)))] + [(m, dict(vars(m))) for m in _MEM_FORMAT_ENCODING]


def _restore_enum(before: list[tuple[object, dict[str, object]]]) -> str:
    """Put back what an unpickling changed of :func:`_enum_state` (compared by identity: no
    ``__eq__`` of an unpickled object runs); the name of what it changed, or ``""``."""
    changed = ""
    for obj, attrs in before:
        now = vars(obj)
        if now.keys() == attrs.keys() and all(now[k] is attrs[k] for k in attrs):
            continue
        # (the name as it was: the unpickling may have made it anything, costly to show)
        changed = changed or (obj.__name__ if isinstance(obj, type) else f"{type(obj).__name__}.{attrs.get('_name_')}")  # type: ignore[attr-defined]
        if isinstance(obj, type):
            for k in [k for k in now if k not in attrs]:
                type.__delattr__(obj, k)
            for k, v in attrs.items():
                if now.get(k, attrs) is not v:
                    type.__setattr__(obj, k, v)
        else:
            now.clear()
            now.update(attrs)
    return changed


def _text(exc: BaseException) -> str:
    """``str(exc)``, short, or nothing where building it fails: a crafted file's error may hold
    an object whose repr recurses without end (a ``KeyError`` of a deeply nested frozenset)."""
    try:
        return str(exc)[:300]
    except Exception:  # noqa: BLE001 - RecursionError, MemoryError, a raising __repr__
        return "(its message could not be shown)"
