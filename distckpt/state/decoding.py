"""Rebuilding non-tensor values from the encoded form (:mod:`distckpt.state.encoded`) at load.

A load reads each non-tensor item with ``torch.load(weights_only=True)``; :func:`decode_loaded`
then turns every encoded value in it back into the type and value that was saved. It validates
each encoded value field by field and never imports a module or calls a class by a name the
checkpoint gives: Enum, dataclass and NamedTuple classes come from the loading process's
allow-list (:mod:`distckpt.state.safetypes`).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import re
import fractions
import pathlib
import uuid
import zoneinfo
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from distckpt._shown import shown
from distckpt.errors import CheckpointError, IntegrityError, UnsafeCheckpointError
from distckpt.state.containers import LOAD_DEPTH
from distckpt.state.encoded import BIT_GENERATORS, FACTORIES, MARKER, MAX_DECIMAL_CHARS, MAX_INT_HEX, NATIVE, PATHS, TopLevel, holds_objects, torch_dtype
from distckpt.state.safetypes import SafeTypes, SafeTypesLike, is_dataclass, is_enum, is_namedtuple
from distckpt.state.shape import numel


class _Malformed(Exception):
    """An encoded value whose fields are not what :mod:`distckpt.state.encoded` writes (raised as
    IntegrityError)."""


def decode_loaded(value: Any, key: str, safe_types: SafeTypesLike = None) -> Any:
    """(any rank, pure) One non-tensor item as read (``weights_only``), with every encoded value in
    it rebuilt (:func:`~distckpt.state.encoded.encode_for_save`); values without encoded parts
    come back as they are.

    Raises:
        UnsafeCheckpointError: naming ``key``, an encoded value names a class that is not in
            ``safe_types`` (nothing is imported or called by a name from the checkpoint).
        IntegrityError: naming ``key``, an encoded value is malformed (damaged or forged), or
            nested more than :data:`~distckpt.state.containers.LOAD_DEPTH` levels deep.
    """
    try:
        return _Decoder(SafeTypes.of(safe_types), key).walk(value, 0)
    except _Malformed as exc:
        raise IntegrityError(f"checkpoint value {key!r}: its stored encoded value is malformed ({exc})") from None
    except RecursionError:
        raise IntegrityError(f"checkpoint value {key!r} is nested too deeply to be read") from None


_UNSEEN = object()
#: What the tuples and frozensets a decode hashes may hold, unfolded, plus the comparisons of its
#: keys and set members whose hashes are equal, in all (see :meth:`_Decoder.hashed`): ~2 s of
#: this walk; a set of a million pairs holds two million.
HASHING_BUDGET = 4_000_000


class _Decoder:
    def __init__(self, allow: SafeTypes, key: str) -> None:
        self.allow = allow
        self.key = key
        # Each object read is decoded once (by id; all of them live while this runs): a pickle
        # refers to one object from many places, and a list holding one list twice, forty
        # levels deep (300 bytes), was walked 2**40 times. Shared parts stay shared.
        self.done: dict[int, Any] = {}
        self.hashing = HASHING_BUDGET
        self.payloads: set[int] = set()  # (ids of payloads decoded: all live while this runs)

    def hashed(self, items: Any) -> Any:
        """``items`` (keys or members about to be hashed into a dict or set), once the tuples and
        frozensets among them, unfolded, and the comparisons of those whose hashes are equal fit
        what is left of :data:`HASHING_BUDGET`: hashing a
        tuple hashes all it holds, again at each reference (a set of one tuple holding one tuple
        twice, forty levels deep, never returned), and comparing equal-hash frozensets compares
        all they hold (frozensets of pairs of the previous one, ~40 levels: never returned)."""
        todo = [x for x in items if isinstance(x, (tuple, frozenset))]
        left = self.hashing
        while todo:
            x = todo.pop()
            left -= len(x)
            if left < 0:
                raise _Malformed(f"its keys or set members unfold into more than {HASHING_BUDGET:,} objects to hash")
            todo.extend(v for v in x if isinstance(v, (tuple, frozenset)))
        # Distinct keys of one hash are compared with each other as they are inserted: n of
        # them cost n**2 / 2 (numbers that differ by multiples of 2**61 - 1, NumPy scalars,
        # tuples of them crafted to collide). Counted from their hashes, now bounded to compute.
        counts: dict[int, int] = {}
        for x in items:
            try:
                h = hash(x)
            except TypeError:  # (a key holding an encoded set: hashable as stored, not decoded)
                raise _Malformed(f"a key or set member {shown(x, 60)} cannot be hashed") from None
            seen = counts.get(h, 0)
            counts[h] = seen + 1
            left -= seen
        if left < 0:
            raise _Malformed(f"its keys or set members hash alike (crafted to collide): inserting them compares more than {HASHING_BUDGET:,} pairs")
        self.hashing = left
        return items

    def walk(self, value: Any, depth: int) -> Any:
        t = type(value)
        if t in NATIVE or isinstance(value, torch.Tensor):
            return value
        done = self.done.get(id(value), _UNSEEN)
        if done is not _UNSEEN:
            return done
        out = self._walk(value, t, depth)
        self.done[id(value)] = out
        return out

    def _walk(self, value: Any, t: type, depth: int) -> Any:
        if depth > LOAD_DEPTH:
            raise _Malformed(f"nested more than {LOAD_DEPTH} levels deep")
        if t is tuple:
            if value and type(value[0]) is str and value[0] == MARKER:
                return self.marker(value, depth)
            return self._seq(value, depth, tuple)
        if t is list:
            return self._seq(value, depth, list)
        if isinstance(value, dict):  # dict, OrderedDict, Counter: what weights_only builds
            pairs = [(self.walk(k, depth + 1), self.walk(v, depth + 1)) for k, v in value.items()]
            if all(a is k and b is v for (a, b), (k, v) in zip(pairs, value.items())):
                return value
            self.hashed([k for k, _ in pairs])  # (rebuilt: its keys are hashed again)
            return collections.Counter(dict(pairs)) if t is collections.Counter else t(pairs)
        if t is set:  # a set written before sets were encoded
            return set(self.hashed([self.walk(v, depth + 1) for v in value]))
        return value

    def items(self, payload: Any, depth: int, what: str) -> tuple[Any, ...]:
        """A payload tuple's items, each decoded (the tuple itself is no encoded value, even if
        its first item is the marker string: a set of strings, say)."""
        return tuple(self.walk(v, depth) for v in _typed(payload, tuple, what))

    def _seq(self, value: list[Any] | tuple[Any, ...], depth: int, kind: type) -> Any:
        if all(type(v) in NATIVE for v in value):  # the common case: numbers, strings
            return value
        items = [self.walk(v, depth + 1) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else kind(items)

    def marker(self, value: tuple[Any, ...], depth: int) -> Any:
        if len(value) != 3 or type(value[1]) is not str:
            raise _Malformed(f"an encoded value must be ({MARKER!r}, kind, payload), got {len(value)} fields")
        kind, payload = value[1], value[2]
        if kind == "value":
            if depth != 0:
                raise _Malformed("a top-level value encoded inside another value")
            return TopLevel(self.walk(payload, depth + 1))
        fn = _DECODERS.get(kind)
        if fn is None:
            raise _Malformed(f"unknown kind {shown(kind, 60)} (written by a newer distckpt, or altered)")
        # Each encoded value has a payload of its own, but a crafted one may give one payload to
        # thousands of encoded values (memo): each is decoded into a copy of its own (2,000
        # sets of one 5,000-member payload: 45 KB, 4.6 s and 0.9 GB). Copies after the first
        # are charged to the budget (an empty payload, (), is shared by every empty value).
        if id(payload) in self.payloads:
            self.hashing -= _copied(payload)
            if self.hashing < 0:
                raise _Malformed(f"its encoded values share one payload, copied more than {HASHING_BUDGET:,} objects' worth")
        else:
            self.payloads.add(id(payload))
        try:
            return fn(self, payload, depth + 1)
        except (_Malformed, CheckpointError):  # CheckpointError: a class missing from the allow-list
            raise
        except (TypeError, ValueError, KeyError, IndexError, OverflowError, AttributeError, RuntimeError) as exc:
            raise _Malformed(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}") from None

    # helpers for the decoders: fields of the right type, or _Malformed
    def fields(self, payload: Any, n: int, kind: str) -> tuple[Any, ...]:
        if type(payload) is not tuple or len(payload) != n:
            got = f"{len(payload)} fields" if type(payload) is tuple else f"a {type(payload).__name__}"
            raise _Malformed(f"{kind}: expected a tuple of {n} fields, got {got}")
        return payload

    def registered(self, name: Any, base: Callable[[type], bool], what: str) -> type:
        if type(name) is not str:
            raise _Malformed(f"{what}: class name {shown(name, 60)} is not a string")
        cls = self.allow.find(name)
        if cls is None:
            short = name.rpartition(":")[2] or name
            others = self.allow.named(short)
            if others:  # registered under another module (moved, or a script's class imported elsewhere)
                listed = ", ".join(f"{t.__module__}:{t.__qualname__}" for t in others)[:300]
                raise UnsafeCheckpointError(
                    f"refusing to load checkpoint value {self.key!r}: it holds {what} of class {name[:200]}, which is not "
                    f"registered; the classes of that name registered here are {listed}, of another module (a load "
                    f"rebuilds classes only from an allow-list, by module and name). Register the class of module "
                    f"{name.partition(':')[0][:100]} (import it from there), or save with the class where it is now"
                )
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint value {self.key!r}: it holds {what} of class {name[:200]}, which is not "
                f"registered (a load rebuilds classes only from an allow-list, never by a name the checkpoint gives).\n"
                f"If you trust this checkpoint, register the class on every rank: Checkpointer(..., safe_types=[{short[:80]}])"
            )
        if not base(cls):
            raise _Malformed(f"{name} is registered but is not {what}")
        return cls


#: How one kind's payload is decoded: ``(decoder, payload, depth) -> value``.
_KindDecoder = Callable[[_Decoder, Any, int], Any]


def _copied(payload: Any) -> int:
    """What decoding ``payload`` again copies, about: its items and its containers' (a tensor's
    elements count a sixteenth)."""
    total = 1
    for v in payload if type(payload) in (tuple, list) else (payload,):
        if isinstance(v, torch.Tensor):
            total += v.numel() // 16
        elif isinstance(v, (tuple, list, dict, set, frozenset, str, bytes)):
            total += len(v)
        else:
            total += 1
    return total


def _typed(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if type(value) not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _Malformed(f"{what} is a {type(value).__name__}")
    return value


def _np_dtype(text: Any) -> np.dtype:
    if type(text) is not str or len(text) > 32:
        raise _Malformed(f"NumPy dtype {shown(text, 40)} is not a dtype string")
    dt = np.dtype(text)
    if holds_objects(dt):
        raise _Malformed(f"NumPy dtype {text!r} holds Python objects or fields")
    return dt


def _bit_generator(name: Any) -> type:
    """NumPy's bit generator class named ``name`` (one of :data:`~distckpt.state.encoded.BIT_GENERATORS`)."""
    if type(name) is not str or name not in BIT_GENERATORS:
        raise _Malformed(f"bit generator {shown(name, 40)} is not one of NumPy's")
    return getattr(np.random, name)


def _dec_np_scalar(d: _Decoder, payload: Any, depth: int) -> np.generic:
    text, v = d.fields(payload, 2, "numpy.scalar")
    dt = _np_dtype(text)
    if dt.kind == "b":
        return dt.type(_typed(v, bool, "a bool scalar"))
    if dt.kind in "iu":
        return dt.type(_typed(v, int, "an integer scalar"))
    if dt.kind == "f" and dt.itemsize <= 8 and type(v) is not bytes:  # (a NaN is stored as its bytes)
        return dt.type(_typed(v, float, "a float scalar"))
    if dt.kind == "c" and dt.itemsize <= 16 and type(v) is not bytes:
        return dt.type(_typed(v, complex, "a complex scalar"))
    if dt.itemsize == 0 and type(v) is bytes and len(v) <= 4 and not any(v):
        return dt.type()  # np.str_("") / np.bytes_(b""): their tobytes() is a NUL
    if type(v) is not bytes or len(v) != dt.itemsize:
        raise _Malformed(f"numpy.scalar {text}: {type(v).__name__} of the wrong size")
    if dt.kind == "S":
        return dt.type(v)  # (an array's item would drop trailing NULs: b"ab\x00" came back b"ab")
    if dt.kind == "U":
        try:
            return dt.type(v.decode("utf-32-be" if dt.str.startswith(">") else "utf-32-le", "surrogatepass"))
        except UnicodeDecodeError:
            raise _Malformed(f"numpy.scalar {text}: not UTF-32 text") from None
    return np.frombuffer(v, dtype=dt)[0]


def _dec_np_array(d: _Decoder, payload: Any, depth: int) -> np.ndarray:
    text, shape, data = d.fields(payload, 3, "numpy.ndarray")
    dt = _np_dtype(text)
    if type(shape) is not tuple or len(shape) > 64 or any(type(s) is not int or s < 0 for s in shape):
        raise _Malformed(f"numpy.ndarray: shape {shown(shape, 80)} is not a tuple of sizes")
    if type(data) is not torch.Tensor or data.layout != torch.strided or data.device.type != "cpu":
        raise _Malformed(f"numpy.ndarray: data is a {type(data).__name__}, not a CPU tensor")
    count = numel(shape)
    if _repeats_storage(data):
        # A view repeating its storage (stride 0): a 1.6 KB record asked for 800 MB here.
        raise _Malformed(f"numpy.ndarray: {data.dtype} data of shape {list(data.shape)[:8]} repeats a storage of {data.untyped_storage().nbytes():,} bytes")
    if data.dtype == torch_dtype(dt) and tuple(data.shape) == shape:
        return data.resolve_conj().resolve_neg().numpy().astype(dt, copy=True)
    if data.dtype == torch.uint8 and data.dim() == 1 and data.numel() == count * dt.itemsize:
        return np.frombuffer(data.numpy().tobytes(), dtype=dt, count=count).reshape(shape).copy()
    raise _Malformed(f"numpy.ndarray: {data.dtype} data of shape {list(data.shape)} does not hold {text} of shape {list(shape)}")


def _repeats_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` views more bytes than its storage holds (stride 0: one element repeated)."""
    return t.numel() * t.element_size() > t.untyped_storage().nbytes()


def _own_data(state: Any) -> Any:
    """``state`` (a bit generator's), once no tensor in it repeats its storage: NumPy copies
    what it is given (a stride-0 view of one element: 1.7 KB of record, 1.5 GB here)."""
    todo = [state]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided or _repeats_storage(x):
                raise _Malformed(f"a bit generator's state holds a {x.dtype} tensor of {x.numel():,} elements that repeats its storage")
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return state


def _dec_np_generator(d: _Decoder, payload: Any, depth: int) -> np.random.Generator:
    name, state = d.fields(payload, 2, "numpy.random.Generator")
    bg = _bit_generator(name)()
    bg.state = _own_data(d.walk(state, depth))
    return np.random.Generator(bg)


def _dec_np_random_state(d: _Decoder, payload: Any, depth: int) -> np.random.RandomState:
    state = _own_data(d.walk(_typed(payload, dict, "a RandomState's state"), depth))
    rs = np.random.RandomState(_bit_generator(state.get("bit_generator"))())
    rs.set_state(state)
    return rs


def _dec_tz(d: _Decoder, value: Any, depth: int) -> datetime.tzinfo | None:
    tz = d.walk(value, depth)
    if tz is not None and not isinstance(tz, datetime.tzinfo):
        raise _Malformed(f"time zone is a {type(tz).__name__}")
    return tz


def _dec_datetime(cls: type[datetime.datetime] | type[datetime.time]) -> _KindDecoder:
    def dec(d: _Decoder, payload: Any, depth: int) -> datetime.datetime | datetime.time:
        iso, tz, fold = d.fields(payload, 3, cls.__name__)
        if type(iso) is not str or len(iso) > 64 or type(fold) is not int or fold not in (0, 1):
            raise _Malformed(f"{cls.__name__}: fields {shown(iso, 70)}, fold {shown(fold, 20)}")
        return cls.fromisoformat(iso).replace(tzinfo=_dec_tz(d, tz, depth), fold=fold)

    return dec


def _dec_date(d: _Decoder, payload: Any, depth: int) -> datetime.date:
    if type(payload) is not str or len(payload) > 32:
        raise _Malformed(f"date {shown(payload, 40)}")
    return datetime.date.fromisoformat(payload)


def _dec_timedelta(d: _Decoder, payload: Any, depth: int) -> datetime.timedelta:
    days, seconds, micro = (_typed(v, int, "a timedelta field") for v in d.fields(payload, 3, "timedelta"))
    return datetime.timedelta(days=days, seconds=seconds, microseconds=micro)


def _dec_timezone(d: _Decoder, payload: Any, depth: int) -> datetime.timezone:
    offset, name = d.fields(payload, 2, "timezone")
    offset = d.walk(offset, depth)
    if type(offset) is not datetime.timedelta:
        raise _Malformed(f"timezone offset is a {type(offset).__name__}")
    if name is None:
        return datetime.timezone(offset)
    return datetime.timezone(offset, _typed(name, str, "a timezone name"))


def _dec_zoneinfo(d: _Decoder, payload: Any, depth: int) -> zoneinfo.ZoneInfo:
    key = _typed(payload, str, "a time zone key")
    try:
        return zoneinfo.ZoneInfo(key)  # a name in the system's tz database; refuses paths
    except zoneinfo.ZoneInfoNotFoundError as exc:
        raise ValueError(f"time zone {key[:60]!r} is not in this system's time zone database") from exc


def _dec_path(d: _Decoder, payload: Any, depth: int) -> pathlib.PurePath:
    name, text = d.fields(payload, 2, "path")
    cls = PATHS.get(name) if type(name) is str else None
    if cls is None:
        raise _Malformed(f"path class {shown(name, 40)} is not one of pathlib's")
    return cls(_typed(text, str, "a path"))


def _dec_deque(d: _Decoder, payload: Any, depth: int) -> collections.deque[Any]:
    items, maxlen = d.fields(payload, 2, "deque")
    if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
        raise _Malformed(f"deque maxlen {shown(maxlen, 40)}")
    return collections.deque(d.walk(_typed(items, list, "a deque's items"), depth), maxlen)


def _dec_defaultdict(d: _Decoder, payload: Any, depth: int) -> collections.defaultdict[Any, Any]:
    name, items = d.fields(payload, 2, "defaultdict")
    if name is not None and (type(name) is not str or name not in FACTORIES):  # (a str: a tuple would be hashed)
        raise _Malformed(f"defaultdict factory {shown(name, 40)} is not a built-in type")
    factory = None if name is None else FACTORIES[name]
    return collections.defaultdict(factory, d.walk(_typed(items, dict, "a defaultdict's items"), depth))


def _dec_bytes(d: _Decoder, payload: Any, depth: int) -> bytes:
    if payload != ():
        raise _Malformed(f"bytes {shown(payload, 40)} (only an empty bytes is stored encoded)")
    return b""


_HEX_INT = re.compile(r"-?[0-9a-f]+")


def _dec_int(d: _Decoder, payload: Any, depth: int) -> int:
    text = _typed(payload, str, "an int's hex text")
    if len(text) - text.startswith("-") > MAX_INT_HEX or not _HEX_INT.fullmatch(text):
        raise _Malformed(f"int {shown(payload, 40)}")
    return int(text, 16)


def _dec_slice(d: _Decoder, payload: Any, depth: int) -> slice:
    return slice(*d.items(d.fields(payload, 3, "slice"), depth, "a slice's fields"))


def _dec_range(d: _Decoder, payload: Any, depth: int) -> range:
    start, stop, step = (_typed(d.walk(v, depth), int, "a range field") for v in d.fields(payload, 3, "range"))
    return range(start, stop, step)


def _dec_set(cls: type[set[Any]] | type[frozenset[Any]]) -> _KindDecoder:
    def dec(d: _Decoder, payload: Any, depth: int) -> set[Any] | frozenset[Any]:
        return cls(d.hashed(d.items(payload, depth, f"a {cls.__name__}'s items")))

    return dec


def _dec_tuple(d: _Decoder, payload: Any, depth: int) -> tuple[Any, ...]:
    items = d.items(payload, depth, "a tuple's items")
    if not items or type(items[0]) is not str or items[0] != MARKER:
        raise _Malformed("an escaped tuple that does not start with the marker")
    return items


def _dec_decimal(d: _Decoder, payload: Any, depth: int) -> decimal.Decimal:
    if type(payload) is not str or len(payload) > MAX_DECIMAL_CHARS:
        raise _Malformed(f"Decimal {shown(payload, 40)}")
    return decimal.Decimal(payload)


def _dec_fraction(d: _Decoder, payload: Any, depth: int) -> fractions.Fraction:
    num, den = (_typed(d.walk(v, depth), int, "a Fraction field") for v in d.fields(payload, 2, "fraction"))
    if den == 0:
        raise _Malformed("Fraction with denominator 0")
    return fractions.Fraction(num, den)


def _dec_uuid(d: _Decoder, payload: Any, depth: int) -> uuid.UUID:
    return uuid.UUID(_typed(payload, str, "a UUID"))


def _dec_enum(d: _Decoder, payload: Any, depth: int) -> Any:
    name, member = d.fields(payload, 2, "enum")
    cls = d.registered(name, is_enum, "an Enum")
    if type(member) is str:
        found = cls.__members__.get(member)
        if found is None:
            raise _Malformed(f"{name} has no member {member[:60]!r} (renamed since the save?)")
        return found
    if type(member) is int and issubclass(cls, enum.Flag):
        return cls(member)
    raise _Malformed(f"{name}: member {shown(member, 40)}")


def _dec_dataclass(d: _Decoder, payload: Any, depth: int) -> Any:
    name, fields, *rest = d.fields(payload, 3 if type(payload) is tuple and len(payload) == 3 else 2, "dataclass")
    extras = rest[0] if rest else ()  # attributes beyond the fields (__post_init__'s), where it had any
    cls = d.registered(name, is_dataclass, "a dataclass")
    for pairs in (fields, extras):
        if type(pairs) is not tuple or any(type(f) is not tuple or len(f) != 2 or type(f[0]) is not str for f in pairs):
            raise _Malformed(f"{name}: fields are not (name, value) pairs")
    saved = dict(fields)
    expected = [f.name for f in dataclasses.fields(cls)]
    if sorted(saved) != sorted(expected) or len(saved) != len(fields):
        raise _Malformed(
            f"{name}: saved fields {sorted(saved)[:20]} are not the class's {sorted(expected)[:20]} (changed since the save?)"
        )
    more = dict(extras)
    if len(more) != len(extras) or set(more) & set(saved) or any(n.startswith("__") for n in more):
        raise _Malformed(f"{name}: attributes {sorted(more)[:20]} beside its fields")
    obj = cls.__new__(cls)  # like pickle: no __init__/__post_init__, the saved fields exactly
    setstate = getattr(cls, "__setstate__", None)
    if setstate is not None and not getattr(setstate, "__qualname__", "").endswith("_dataclass_setstate"):
        # The registered class's own (as pickle and torch's weights_only call it): it makes
        # what its __getstate__ left out (a lock), from the fields and attributes stored.
        state = {n: d.walk(saved[n], depth) for n in expected} | {a: d.walk(v, depth) for a, v in more.items()}
        obj.__setstate__(state)
        return obj
    for field_name in expected:
        object.__setattr__(obj, field_name, d.walk(saved[field_name], depth))
    if more:
        if not hasattr(obj, "__dict__"):  # (a slots class: it never saves attributes beyond its fields)
            raise _Malformed(f"{name}: attributes {sorted(more)[:20]} for a class without __dict__")
        for attr, value in more.items():
            obj.__dict__[attr] = d.walk(value, depth)
    return obj


def _dec_namedtuple(d: _Decoder, payload: Any, depth: int) -> tuple[Any, ...]:
    name, items = d.fields(payload, 2, "namedtuple")
    cls = d.registered(name, is_namedtuple, "a NamedTuple")
    items = d.items(items, depth, "a NamedTuple's items")
    if len(items) != len(cls._fields):
        raise _Malformed(f"{name}: {len(items)} items saved, the class has {len(cls._fields)} fields (changed since the save?)")
    return tuple.__new__(cls, items)


_DECODERS: dict[str, _KindDecoder] = {
    "numpy.scalar": _dec_np_scalar,
    "numpy.ndarray": _dec_np_array,
    "numpy.random.Generator": _dec_np_generator,
    "numpy.random.RandomState": _dec_np_random_state,
    "datetime": _dec_datetime(datetime.datetime),
    "time": _dec_datetime(datetime.time),
    "date": _dec_date,
    "timedelta": _dec_timedelta,
    "timezone": _dec_timezone,
    "zoneinfo": _dec_zoneinfo,
    "path": _dec_path,
    "deque": _dec_deque,
    "defaultdict": _dec_defaultdict,
    "bytes": _dec_bytes,
    "int": _dec_int,
    "slice": _dec_slice,
    "range": _dec_range,
    "set": _dec_set(set),
    "frozenset": _dec_set(frozenset),
    "tuple": _dec_tuple,
    "decimal": _dec_decimal,
    "fraction": _dec_fraction,
    "uuid": _dec_uuid,
    "enum": _dec_enum,
    "dataclass": _dec_dataclass,
    "namedtuple": _dec_namedtuple,
}
