"""The encoded form of non-tensor values: what a save writes so that a ``weights_only`` load reads it.

DCP pickles non-tensor values and unpickles them with ``torch.load(weights_only=False)``; a
crafted checkpoint could run code that way. distckpt reads them with ``weights_only=True``, so
it must also *write* only what that reader accepts, or a run saves for days into checkpoints
none of which loads. Every non-tensor value that is not a plain top-level entry (those are JSON,
:mod:`distckpt.state.values`) goes through :func:`encode_for_save` once per save: optimizer
hyper-parameters, objects' ``state_dict()`` contents, top-level values that are not plain.
Values ``weights_only`` reads as they are stay as they are; NumPy scalars, arrays and
generators, ``datetime`` values, ``pathlib`` paths, ``deque``, ``slice``, ``set`` and the other
standard types below become an explicit encoded form, which :func:`distckpt.state.decoding.decode_loaded`
turns back into the same type and value at load. Enum, dataclass and NamedTuple classes are
encoded by name and rebuilt only if the loading process registered them
(:mod:`distckpt.state.safetypes`): nothing in a checkpoint can name code to run. Anything else
fails the save, naming its key and type.

An encoded value is the tuple ``(MARKER, kind, payload)``. A tuple, because DCP's flattening
treats tuples as leaves: the value stays one item under its own key (a dict would be flattened
into other keys, which a fresh object's state at load would not have). The payload is made of
what ``weights_only`` reads (numbers, str, bytes, tuples, lists, dicts, tensors, and encoded
values nested inside), so plain ``dcp.load`` reads these checkpoints too, and sees the tuples.
Payloads of hashable values are tuples of hashables, so encoded values can be dict keys and set
members as the originals were. A user's own tuple that starts with MARKER is itself encoded
(kind ``tuple``), so every MARKER tuple in a checkpoint is one this module wrote (or a forgery,
which decoding validates field by field: it never imports a module or calls a class by name
from the checkpoint; registered classes come from the loading process's allow-list)::

    kind                       payload                                   back as
    numpy.scalar               (dtype.str, int/float/bool/complex|bytes)  the NumPy scalar
    bytes                      () (an empty bytes; others are stored as they are)
    int                        hex text (an int of more than PICKLED_INT_BITS bits)
    numpy.ndarray              (dtype.str, shape, tensor)                 the array (own memory)
    numpy.random.Generator     (bit generator name, its state)            a Generator
    numpy.random.RandomState   its get_state(legacy=False) dict           a RandomState
    datetime / time            (naive isoformat, tzinfo or None, fold)    datetime.datetime / time
    date / timedelta           isoformat / (days, seconds, microseconds)
    timezone / zoneinfo        (offset, name or None) / key
    path                       (PosixPath|WindowsPath|Pure..., str)
    deque / defaultdict        (items, maxlen) / (factory name, dict)
    slice / range              (start, stop, step)
    set / frozenset            items, sorted (bytes independent of hash seeds)
    decimal / fraction / uuid  str / (numerator, denominator) / str
    tuple                      items (a tuple that starts with MARKER)
    enum                       (module:qualname, member name | Flag value)  registered classes only
    dataclass                  (module:qualname, ((field, value), ...)[, ((attribute, value), ...)])  registered classes only
    namedtuple                 (module:qualname, items)                   registered classes only
    value                      a top-level entry of ``state`` that is not plain (TopLevel)
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import pathlib
import re
import uuid
import warnings
import zoneinfo
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch

from distckpt._caller import outside
from distckpt.state.containers import SAVE_DEPTH, dcp_leaf
from distckpt.state.safetypes import REGISTRABLE, SUPPORTED, SafeTypes, SafeTypesLike, type_name
from distckpt.state.values import TEXT_INT_BITS

MARKER = "__distckpt_value__"

#: Leaves ``weights_only`` reads as they are (exact types: a subclass pickles its class).
NATIVE: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.device, torch.dtype, torch.layout}
)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types torch.save pickles readably
#: An empty ``bytes`` as stored: pickle (protocol 2, torch.save's) writes ``b""`` as a call of
#: ``bytes()``, which ``weights_only`` refuses (other bytes are ``_codecs.encode`` of a str).
EMPTY_BYTES = (MARKER, "bytes", ())


#: Ints longer than this are stored encoded: pickle writes an int of more than 255 bytes with
#: the LONG4 opcode, which ``weights_only`` does not read (LONG1 it does).
PICKLED_INT_BITS = 2000


def _passes(value: object) -> bool:
    """Whether leaf ``value`` is stored as it is (a native value, other than ``b""`` and ints
    too long for ``weights_only``)."""
    t = type(value)
    if t is int:
        return value.bit_length() <= PICKLED_INT_BITS  # type: ignore[attr-defined]
    return t in NATIVE and (t is not bytes or bool(value))


#: The ``path`` kind's classes, by name.
PATHS: dict[str, type[pathlib.PurePath]] = {
    c.__name__: c for c in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)
}
#: The ``defaultdict`` kind's default factories, by name.
FACTORIES: dict[str, type] = {c.__name__: c for c in (int, float, complex, str, bytes, bool, list, dict, set, tuple)}


def factory_name(value: collections.defaultdict[Any, Any]) -> str | None:
    """The name of a defaultdict's default factory in :data:`FACTORIES`; ``None``: it has none;
    ``""``: it is not one of them (a load does not run code from the checkpoint to rebuild it)."""
    factory = value.default_factory
    return None if factory is None else next((n for n, c in FACTORIES.items() if c is factory), "")


#: The longest int stored (and read), in hex digits: 16 Ki bits (~4900 decimal digits), beyond
#: any counter or seed. Small, because a load hashes a decoded int again wherever a record uses
#: it as a set member or dict key (memoized: once decoded, referenced many times).
MAX_INT_HEX = 1 << 12
#: The longest Decimal text stored (and read).
MAX_DECIMAL_CHARS = 4096
#: NumPy's bit generators, by name (the only ones the NumPy kinds hold).
BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")

# Not uint16/32/64: torch 2.13 cannot unpickle such tensors from plain pickle (the async writer
# process receives its non-tensor items that way); they are stored as bytes.
_TORCH_OF_NUMPY = {
    "b1": torch.bool, "u1": torch.uint8, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64,
    "f2": torch.float16, "f4": torch.float32, "f8": torch.float64, "c8": torch.complex64, "c16": torch.complex128,
}  # fmt: skip


def torch_dtype(dt: np.dtype) -> torch.dtype | None:
    """The torch dtype holding NumPy dtype ``dt``'s values exactly (native byte order), or None."""
    return _TORCH_OF_NUMPY.get(f"{dt.kind}{dt.itemsize}")


def holds_objects(dt: np.dtype) -> bool:
    """Whether NumPy dtype ``dt`` holds Python objects, fields or sub-arrays (never stored)."""
    return dt.hasobject or dt.fields is not None or dt.subdtype is not None


def _exact_number(dt: np.dtype) -> bool:
    """Whether a scalar of NumPy dtype ``dt`` is stored as a Python number (exactly), not bytes."""
    return dt.kind in "biu" or (dt.kind == "f" and dt.itemsize <= 8) or (dt.kind == "c" and dt.itemsize <= 16)


@dataclasses.dataclass(frozen=True)
class TopLevel:
    """A top-level entry of ``state`` that is not a plain value (``state["best"] = np.float64(..)``),
    as :class:`~distckpt.state.entries.ValueEntry` hands it to a save (stored as one item, encoded
    by :func:`encode_for_save`) and gets it back from a load (decoded by
    :func:`~distckpt.state.decoding.decode_loaded`)."""

    value: Any


def encode_for_save(state_dict: Mapping[str, Any], safe_types: SafeTypesLike = None) -> dict[str, Any]:
    """(each rank, pure) ``state_dict`` with every non-tensor value in a form that load reads.

    Tensors, and values ``weights_only`` reads as they are, are left alone; containers are copied
    only where something inside them changed (a module's state dict comes back as it went in).
    Everything made here owns its data (arrays are copied into tensors), so the result can be
    written after the caller's objects changed.

    Raises:
        TypeError: naming the flattened key and the type of a value load could not read (or a
            class missing from ``safe_types``), and how to store or register it.
    """
    encoder = _Encoder(SafeTypes.of(safe_types))
    out: dict[str, Any] = {}
    for name, value in state_dict.items():
        try:
            if isinstance(value, TopLevel):
                out[name] = (MARKER, "value", encoder.pickled(value.value, name, 1))
            else:
                out[name] = encoder.traversed(value, name, 0)
        except RecursionError:
            raise TypeError(f"cannot save state value {name!r}: it is nested too deeply (or contains itself)") from None
    return out


def _sorted_items(items: Iterable[Any]) -> tuple[Any, ...]:
    """Set members in an order independent of the process's hash seed (so every rank writes the
    same bytes for the same set, and scope digests agree): by type, then repr, a total order
    where values may not compare (mixed types, NaN)."""
    return tuple(sorted(items, key=lambda v: (type(v).__qualname__, repr(v))))


def _unsteady_text(k: Any, depth: int) -> str | None:
    """Why ``str(k)`` (the text DCP writes a flattened dict key as, which a load matches with the
    live object's key) can differ between processes for the same key, else ``None``: a
    frozenset's order follows the process's hash seed; an object's default text holds its
    memory address."""
    if depth > 20 or isinstance(k, (str, int, float, type(None), enum.Enum)):
        return None
    if isinstance(k, frozenset) and len(k) > 1:
        # Strings hash by the process's seed; even numbers, hashed alike everywhere, are listed
        # in the order they were added where they collide (frozenset([0, 8]) vs ([8, 0])).
        return "lists its members in an order that depends on the process (its hash seed, or the order they were added)"
    if isinstance(k, (tuple, frozenset)):
        return next((why for v in k if (why := _unsteady_text(v, depth + 1)) is not None), None)
    if dataclasses.is_dataclass(k):
        fields = (getattr(k, f.name, None) for f in dataclasses.fields(k))
        why = next((why for v in fields if (why := _unsteady_text(v, depth + 1)) is not None), None)
        if why is not None:
            return why
    t = type(k)
    if t.__str__ is object.__str__ and t.__repr__ is object.__repr__:
        return "holds the object's memory address"
    try:
        text = str(k)
    except Exception:  # noqa: BLE001 - DCP's own str(key) raises it, naming the key
        return None
    if _ADDRESS.search(text):  # a function's, a method's, an object's default text inside
        return "holds a memory address"
    return None


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]{4,}")


K = TypeVar("K", bound=Hashable)


def _changed(pairs: Iterable[tuple[K, Any]], encode: Callable[[K, Any], Any], tensors_pass: bool) -> dict[K, Any]:
    """``key -> encode(key, value)`` for the ``(key, value)`` pairs whose encoded value is a new
    object; empty if none changed. Native values (and, with ``tensors_pass``, tensors) pass
    without a call."""
    out: dict[K, Any] = {}
    for k, v in pairs:
        if _passes(v) or (tensors_pass and isinstance(v, torch.Tensor)):  # most leaves: cheap to pass
            continue
        e = encode(k, v)
        if e is not v:
            out[k] = e
    return out


_WARNED_EXTRAS: set[tuple[type, str]] = set()


class _Encoder:
    def __init__(self, allow: SafeTypes) -> None:
        self.allow = allow
        self._open: set[int] = set()  # the dataclasses being encoded (one holding itself is refused at once)

    # where DCP goes on flattening: the structure (keys) must stay as it is
    def traversed(self, value: Any, key: str, depth: int) -> Any:
        if _passes(value) or isinstance(value, torch.Tensor):
            return value
        if depth > SAVE_DEPTH:
            _too_deep(key)
        if isinstance(value, Mapping):
            for k in value:
                if type(k) is int and k.bit_length() > TEXT_INT_BITS:  # (DCP writes each key as its digits)
                    raise TypeError(
                        f"cannot save state key {_clip(key)!r}.<an int of {k.bit_length():,} bits>: keys DCP flattens "
                        "become their decimal text, which Python refuses beyond 4300 digits; use a shorter key"
                    )
                why = _unsteady_text(k, 0)
                if why is not None:
                    raise TypeError(
                        f"cannot save state key {_clip(key)!r}.<{type(k).__name__} {_clip(repr(k))}>: keys DCP flattens "
                        f"become their text, and this key's text {why}, so no later process could load it (its "
                        "object's key would read otherwise); use str or int keys"
                    )
            new = _changed(value.items(), lambda k, v: self.traversed(v, f"{key}.{k}", depth + 1), tensors_pass=True)
            return {**value, **new} if new else value
        if isinstance(value, list) and not dcp_leaf(value):
            items = [self.traversed(v, f"{key}.{i}", depth + 1) for i, v in enumerate(value)]
            return value if all(a is b for a, b in zip(items, value)) else items
        return self.pickled(value, key, depth)

    # inside one stored item (torch.save'd, read back with weights_only)
    def pickled(self, value: Any, key: str, depth: int) -> Any:
        t = type(value)
        if _passes(value):
            return value
        if t is bytes:
            return EMPTY_BYTES
        if t is int:
            text = f"{value:x}"  # (hex: decimal text is refused beyond 4300 digits)
            if len(text) - text.startswith("-") > MAX_INT_HEX:
                self._refuse(key, value, f" (an int of {value.bit_length():,} bits; at most {4 * MAX_INT_HEX:,} are stored)")
            return (MARKER, "int", text)
        if depth > SAVE_DEPTH:
            _too_deep(key)
        if t is tuple:
            if value and type(value[0]) is str and value[0] == MARKER:  # user data that looks like ours
                return (MARKER, "tuple", self._items(value, key, depth) or value)
            items = self._items(value, key, depth)
            return value if items is None else items
        if t is list:
            items = self._items(value, key, depth)
            return value if items is None else list(items)
        if t in (dict, collections.OrderedDict, collections.Counter):
            return self._dict(value, key, depth)
        if t in (set, frozenset):
            return (MARKER, t.__name__, _sorted_items(self.pickled(v, f"{key}{{member}}", depth + 1) for v in value))
        if isinstance(value, torch.Tensor):
            if t in _PLAIN_TENSORS:
                return value
            self._refuse(key, value, " (a tensor subclass inside a non-tensor value)")
        return self._special(value, key, depth)

    def _items(self, value: Iterable[Any], key: str, depth: int) -> tuple[Any, ...] | None:
        """The encoded items of a sequence as a tuple, or ``None`` if none changed."""
        new = _changed(enumerate(value), lambda i, v: self.pickled(v, f"{key}[{i}]", depth + 1), tensors_pass=False)
        if not new:
            return None
        out = list(value)
        for i, e in new.items():
            out[i] = e
        return tuple(out)

    def _dict(self, value: Mapping[Any, Any], key: str, depth: int) -> Mapping[Any, Any]:
        pairs = []
        changed = False
        for k, v in value.items():
            ek = k if _passes(k) else self.pickled(k, f"{key}<key {k!r:.40}>", depth + 1)
            ev = v if _passes(v) else self.pickled(v, f"{key}[{k!r:.40}]", depth + 1)
            changed = changed or ek is not k or ev is not v
            pairs.append((ek, ev))
        if not changed:
            return value
        try:
            return type(value)(pairs) if type(value) is not collections.Counter else collections.Counter(dict(pairs))
        except TypeError:  # an encoded key that cannot be hashed (its original could)
            self._refuse(key, value, " (a dict key that cannot be stored hashably)")

    def _special(self, value: Any, key: str, depth: int) -> tuple[Any, ...] | None:
        t = type(value)
        if isinstance(value, np.generic):
            return self._np_scalar(value, key)
        if t in (np.ndarray, np.memmap):
            return self._np_array(value, key)
        if t is np.random.Generator:
            bg = value.bit_generator
            name = type(bg).__name__
            if name not in BIT_GENERATORS or type(bg) is not getattr(np.random, name):
                self._refuse(key, value, f" (its bit generator {type(bg).__qualname__} is not one of NumPy's)")
            return (MARKER, "numpy.random.Generator", (name, self.pickled(bg.state, f"{key}.state", depth + 1)))
        if t is np.random.RandomState:
            state = value.get_state(legacy=False)
            if state.get("bit_generator") not in BIT_GENERATORS:
                self._refuse(key, value, " (its bit generator is not one of NumPy's)")
            return (MARKER, "numpy.random.RandomState", self.pickled(state, f"{key}.state", depth + 1))
        if t is datetime.datetime or t is datetime.time:
            naive = value.replace(tzinfo=None).isoformat()
            return (MARKER, t.__name__, (naive, self._tz(value.tzinfo, key, depth + 1), value.fold))
        if t is datetime.date:
            return (MARKER, "date", value.isoformat())
        if t is datetime.timedelta:
            return (MARKER, "timedelta", (value.days, value.seconds, value.microseconds))
        if t is datetime.timezone or t is zoneinfo.ZoneInfo:
            return self._tz(value, key, depth)
        if PATHS.get(t.__name__) is t:
            return (MARKER, "path", (t.__name__, str(value)))
        if t is collections.deque:
            return (MARKER, "deque", (list(self._items(value, key, depth) or value), value.maxlen))
        if t is collections.defaultdict:
            name = factory_name(value)
            if name == "":
                self._refuse(key, value, f" (its default_factory {value.default_factory!r:.60} is not a built-in type)")
            return (MARKER, "defaultdict", (name, self._dict(dict(value), key, depth)))
        if t is slice:
            parts = (value.start, value.stop, value.step)
            return (MARKER, "slice", self._items(parts, key, depth) or parts)
        if t is range:
            parts = (value.start, value.stop, value.step)
            return (MARKER, "range", self._items(parts, key, depth) or parts)  # (long ints encoded)
        if t is decimal.Decimal:
            text = str(value)
            if len(text) > MAX_DECIMAL_CHARS:  # (a load refuses longer ones: bounded work on hostile records)
                self._refuse(key, value, f" (a Decimal of {len(text):,} characters; at most {MAX_DECIMAL_CHARS} are stored: store it as a str)")
            return (MARKER, "decimal", text)
        if t is fractions.Fraction:
            parts = (value.numerator, value.denominator)
            return (MARKER, "fraction", self._items(parts, key, depth) or parts)  # (long ints encoded)
        if t is uuid.UUID:
            return (MARKER, "uuid", str(value))
        if isinstance(value, enum.Enum):
            self._registered(t, key, "an Enum")
            member = value.name if value.name is not None and t.__members__.get(value.name) is value else None
            if member is None and isinstance(value, enum.Flag) and type(value.value) is int:
                member = value.value  # a combination of flags: rebuilt by value
            if member is None:
                self._refuse(key, value, " (a member without a name)")
            return (MARKER, "enum", (type_name(t), member))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            self._registered(t, key, "a dataclass")
            if id(value) in self._open:
                self._refuse(key, value, " (it contains itself)")
            self._open.add(id(value))
            try:
                names = [f.name for f in dataclasses.fields(value)]
                fields = tuple((n, self.pickled(getattr(value, n), f"{key}.{n}", depth + 1)) for n in names)
                extras = self._extras(value, names, key, depth)
            finally:
                self._open.discard(id(value))
            return (MARKER, "dataclass", (type_name(t), fields, extras) if extras else (type_name(t), fields))
        if isinstance(value, tuple) and hasattr(t, "_fields"):
            self._registered(t, key, "a NamedTuple")
            return (MARKER, "namedtuple", (type_name(t), self._items(value, key, depth) or tuple(value)))
        self._refuse(key, value)

    def _extras(self, value: Any, names: list[str], key: str, depth: int) -> tuple[tuple[str, Any], ...]:
        """A dataclass's attributes beyond its fields (set by ``__post_init__``, a
        ``cached_property``), encoded: pickle keeps them (the instance's ``__dict__``, or what
        its class's own ``__getstate__`` returns), and a load that set the fields alone gave an
        object without them. Best effort: an attribute a load could not rebuild (a lock, a
        logger, a reference back to the object) is left out, as all were before, with a warning."""
        state = getattr(value, "__dict__", None)
        getstate = getattr(type(value), "__getstate__", None)
        if getstate is not None and getstate is not getattr(object, "__getstate__", None):
            try:
                state = value.__getstate__()
            except Exception:  # noqa: BLE001 - the class's own: its fields are stored all the same
                state = None
        if not isinstance(state, dict):
            return ()
        out, left = [], []
        for n, v in state.items():
            if type(n) is not str or n in names:
                continue
            if n.startswith("__"):
                left.append(n)
                continue
            try:
                out.append((n, self.pickled(v, f"{key}.{n}", depth + 1)))
            except (TypeError, RecursionError):
                left.append(n)
        new = [n for n in left if (type(value), n) not in _WARNED_EXTRAS]
        if new:  # (once per class and attribute: a list of 3000 such objects warns once)
            _WARNED_EXTRAS.update((type(value), n) for n in new)
            warnings.warn(
                f"distckpt: state value {_clip(key)!r} ({_shown(type(value))}): attributes beside its fields that a load "
                f"could not rebuild are not stored: {', '.join(new[:10])} (a load gives an object without them, or "
                "its class's __setstate__ makes them)",
                stacklevel=outside(),
            )
        return tuple(out)

    def _tz(self, tz: datetime.tzinfo | None, key: str, depth: int) -> tuple[Any, ...] | None:
        if tz is None:
            return None
        if type(tz) is datetime.timezone:
            args = tz.__getinitargs__()  # (offset,) or (offset, name): the name only if one was given
            offset = self.pickled(args[0], key, depth + 1)
            return (MARKER, "timezone", (offset, args[1] if len(args) > 1 else None))
        if type(tz) is zoneinfo.ZoneInfo and isinstance(getattr(tz, "key", None), str):
            return (MARKER, "zoneinfo", tz.key)
        self._refuse(f"{key}.tzinfo", tz, " (only datetime.timezone and zoneinfo.ZoneInfo time zones can be stored)")

    def _np_scalar(self, value: np.generic, key: str) -> tuple[Any, ...]:
        dt = value.dtype
        if holds_objects(dt):
            self._refuse(key, value, f" (NumPy dtype {dt} holds Python objects or fields)")
        if _exact_number(dt) and not (dt.kind in "fc" and value != value):
            return (MARKER, "numpy.scalar", (dt.str, value.item()))  # exact as a Python number
        # The bytes: a NaN's payload (a float32 signalling NaN, quieted by a Python float),
        # longdouble, str_/bytes_ (an empty one's dtype has no bytes, its tobytes() a NUL: as
        # the load expects; an empty bytes would be pickled as a call weights_only refuses).
        return (MARKER, "numpy.scalar", (dt.str, value.tobytes()))

    def _np_array(self, value: np.ndarray, key: str) -> tuple[Any, ...]:
        dt = value.dtype
        if holds_objects(dt):
            self._refuse(key, value, f" (NumPy dtype {dt} holds Python objects or fields; store numeric arrays, or lists)")
        # Copies either way: the caller's array may change before an async save writes it.
        if torch_dtype(dt) is not None:  # a tensor of the same values (native byte order)
            native = dt.newbyteorder("=") if dt.byteorder in "<>" else dt
            data = torch.from_numpy(np.array(value, dtype=native, order="C", copy=True))
        else:  # longdouble, datetime64, str_ ...: the bytes, in the array's own byte order
            data = torch.from_numpy(np.frombuffer(value.tobytes(order="C"), dtype=np.uint8).copy())
        return (MARKER, "numpy.ndarray", (dt.str, tuple(int(s) for s in value.shape), data))

    def _registered(self, cls: type, key: str, what: str) -> None:
        if not self.allow.allows(cls):
            raise TypeError(
                f"cannot save state value {_clip(key)!r}: it is {what} of class {_shown(cls)}, which is not registered; "
                f"a load rebuilds classes only from an allow-list (a checkpoint must never name code to run). Register "
                f"it on every rank, in this job and in the jobs that load it: Checkpointer(..., safe_types=[{cls.__qualname__}])"
            )

    def _refuse(self, key: str, value: Any, why: str = "") -> NoReturn:
        raise TypeError(
            f"cannot save state value {_clip(key)!r} of type {_shown(type(value))}{why}: a load reads non-tensor values "
            f"without running code, and could not rebuild this one. Supported: {SUPPORTED}; and {REGISTRABLE} "
            f"class once registered with Checkpointer(..., safe_types=[...]). Convert it to one of these (in the "
            f"object's state_dict())"
        )


def _too_deep(key: str) -> NoReturn:
    raise TypeError(f"cannot save state value {_clip(key)!r}: it is nested more than {SAVE_DEPTH} levels deep (or contains itself)")


def _shown(cls: type) -> str:
    """A class as error messages name it (``numpy.ndarray``, ``mymodule.Mode``)."""
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _clip(key: str) -> str:
    return key if len(key) <= 120 else key[:100] + "..." + key[-15:]
