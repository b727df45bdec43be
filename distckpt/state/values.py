"""Non-tensor values in a checkpoint, stored in forms that reading runs no code for.

DCP pickles non-tensor values and unpickles them with ``torch.load(weights_only=False)``; a
crafted checkpoint could run code that way. distckpt reads them with ``weights_only=True``, so
it must also *write* only what that reader accepts, or a run saves for days into checkpoints
none of which loads. Two forms:

* A plain top-level entry of ``state`` (int, float, str, bool, None, and lists, tuples and dicts
  of them, exactly those types) is one JSON string, tuples and non-string dict keys tagged so
  that it comes back exactly as saved (:func:`encode`, :func:`decode`).
* Every other non-tensor value (optimizer hyper-parameters, objects' ``state_dict()`` contents,
  top-level values that are not plain) goes through :func:`encode_for_save` once per save:
  values ``weights_only`` reads as they are stay as they are, and NumPy scalars, arrays and
  generators, ``datetime`` values, ``pathlib`` paths, ``deque``, ``slice``, ``set`` and the other
  standard types below become an explicit *encoded form* (see "The encoded form" below) that
  :func:`decode_loaded` turns back into the same type and value at load. Enum, dataclass and
  NamedTuple classes are encoded by name and rebuilt only if the loading process registered them
  (``Checkpointer(safe_types=[...])``): nothing in a checkpoint can name code to run. Anything
  else fails the save, naming its key and type.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import json
import math
import pathlib
import sys
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn, Union

import torch

PREFIX = "distckpt-json:"
_TUPLE = "__distckpt_tuple__"
_DICT = "__distckpt_dict__"
_FLOAT = "__distckpt_float__"


def is_plain(value: Any) -> bool:
    """True if ``value`` is a plain value :func:`encode` can store as JSON text (subclasses of
    the plain types included: they come back as their base type)."""
    try:
        _check(value, "", 0, exact=False)
    except (TypeError, RecursionError):
        return False
    return True


def stores_as_json(value: Any) -> bool:
    """True if the JSON form gives ``value`` back exactly: plain types only, no subclasses
    (``np.float64`` is a float, an ``IntEnum`` an int, a NamedTuple a tuple; JSON would return
    their base types, so they are stored in the encoded form instead)."""
    try:
        _check(value, "", 0, exact=True)
    except (TypeError, RecursionError):
        return False
    return True


_JSON_SCALARS = (type(None), bool, int, float, str)


def _check(value: Any, where: str, depth: int, exact: bool = False) -> None:
    if type(value) in _JSON_SCALARS or (not exact and isinstance(value, _JSON_SCALARS)):
        return
    if depth > SAVE_DEPTH:
        raise TypeError(f"value at {where or 'top'} is nested more than {SAVE_DEPTH} levels deep (or contains itself)")
    if type(value) in (list, tuple) or (not exact and isinstance(value, (list, tuple))):
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]", depth + 1, exact)
        return
    if type(value) is dict or (not exact and isinstance(value, dict)):
        for k, v in value.items():
            if not (type(k) in _JSON_SCALARS or (not exact and isinstance(k, _JSON_SCALARS))):
                raise TypeError(f"dict key {k!r} at {where or 'top'} is of type {type(k).__name__}")
            _check(v, f"{where}[{k!r}]", depth + 1, exact)
        return
    raise TypeError(f"value at {where or 'top'} is of type {type(value).__name__}")


def _tag(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(value)}
    if isinstance(value, tuple):
        return {_TUPLE: [_tag(v) for v in value]}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TUPLE not in value and _DICT not in value and _FLOAT not in value:
            return {k: _tag(v) for k, v in value.items()}
        return {_DICT: [[_tag(k), _tag(v)] for k, v in value.items()]}
    return value


def _untag(value: Any) -> Any:
    if isinstance(value, list):
        return [_untag(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TUPLE in value:
            return tuple(_untag(v) for v in value[_TUPLE])
        if len(value) == 1 and _FLOAT in value:
            return float(value[_FLOAT])
        if len(value) == 1 and _DICT in value:
            return {_untag(k): _untag(v) for k, v in value[_DICT]}
        return {k: _untag(v) for k, v in value.items()}
    return value


def encode(value: Any, name: str = "value") -> str:
    """JSON text for a plain value; ``TypeError`` naming ``name`` if it is not plain."""
    try:
        _check(value, "", 0)
    except TypeError as exc:
        raise TypeError(
            f"state[{name!r}] cannot be saved: {exc}. Plain values may be int, float, str, bool, "
            "None and lists/tuples/dicts of them; give other objects state_dict()/load_state_dict()"
        ) from None
    return PREFIX + json.dumps(_tag(value), allow_nan=False, separators=(",", ":"))


def decode(text: Any, name: str = "value") -> Any:
    """The value :func:`encode` stored.

    Raises:
        IntegrityError: naming ``name``, if ``text`` is not one (the manifest says this entry
            is a plain value, so the checkpoint was damaged or altered).
    """
    from distckpt.errors import IntegrityError

    if not isinstance(text, str) or not text.startswith(PREFIX):
        raise IntegrityError(f"checkpoint entry {name!r} is not a distckpt plain value ({type(text).__name__} stored)")
    try:
        return _untag(json.loads(text[len(PREFIX):]))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise IntegrityError(f"checkpoint entry {name!r}: its stored plain value is malformed ({exc})") from None


def digest(text: str) -> str:
    """What the manifest records of a plain value's stored text (``entries[name]["sha256"]``)."""
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def check_digest(text: Any, entry: Mapping[str, Any], name: str) -> None:
    """Raise :class:`IntegrityError` if ``text`` (as read) is not the value the manifest recorded.

    Plain values carry no tensor fingerprint; without this a ``.metadata`` pointed at another
    record (re-sealed by an attacker) would load another value silently. Entries saved per rank
    hold one value per rank, and the manifest records rank 0's: those are not checked.
    """
    from distckpt.errors import IntegrityError

    expected = entry.get("sha256")
    if not isinstance(expected, str) or entry.get("scope") == "per_rank":
        return
    if not isinstance(text, str) or digest(text) != expected:
        raise IntegrityError(f"checkpoint entry {name!r}: the stored value is not the one saved (its sha256 does not match the manifest)")


# Non-tensor items inside entries ---------------------------------------------------------------
# Optimizer hyper-parameters (``optim.param_groups.<fqn>.lr``), scheduler and GradScaler fields,
# RNG states' Python parts...: everything DCP writes as a BYTE_IO record (``torch.save`` of the
# object). They carry no tensor fingerprint, so the manifest records, per flattened key, the
# sha256 of the exact bytes stored for the item (``Manifest.value_digests``). A load or export
# hashes the bytes it is about to unpickle and compares them first: a ``.metadata`` re-pointed at
# another record is refused before anything is unpickled. The bytes are hashed as written (the
# writer threads' BytesIO), never re-serialized: ``torch.save`` output depends on process-wide
# switches (its per-record CRC) and pickle memoization, not only on the value.


def item_digest(data: Any) -> str:
    """sha256 (hex) of the bytes stored for one non-tensor item (any buffer)."""
    import hashlib

    return hashlib.sha256(data).hexdigest()


def record_item_digests(planner: Any) -> dict[str, str]:
    """Have ``planner`` (a DCP ``SavePlanner``) record the digest of every non-tensor item it hands
    DCP's writer, as it hands it over (in the writer threads); returns the dict it fills,
    ``flattened key -> sha256``, complete once the write returned. Tensors are not touched.

    Only items this rank writes are recorded, so over all ranks each written item is recorded
    exactly once (replicated items have one writer, see :mod:`distckpt.save.plan`).
    """
    import io

    digests: dict[str, str] = {}
    inner = planner.resolve_data

    def resolve_data(write_item: Any) -> Any:
        data = inner(write_item)
        if isinstance(data, io.BytesIO):  # BYTE_IO: exactly what DCP writes (no storage transforms)
            digests[write_item.index.fqn] = item_digest(data.getbuffer())  # one dict store: thread-safe
        return data

    planner.resolve_data = resolve_data
    return digests


def check_item(data: Any, key: str, digests: Mapping[str, str] | None, where: str) -> None:
    """Raise :class:`IntegrityError` naming ``key`` and ``where`` (its file) unless ``data``, the
    bytes read for non-tensor item ``key``, are the bytes saved for it.

    ``digests``: the manifest's ``value_digests``; ``None`` (a manifest written before they were
    recorded): not checked. Call before unpickling ``data``.
    """
    from distckpt.errors import IntegrityError

    if digests is None:
        return
    expected = digests.get(key)
    if expected is None:
        raise IntegrityError(
            f"{where}: non-tensor item {key!r} was not written when the step was saved (the manifest records "
            "no digest for it; its .metadata was altered)"
        )
    if item_digest(data) != expected:
        raise IntegrityError(
            f"{where}: non-tensor item {key!r}: the stored bytes are not the ones saved for it (their sha256 does "
            "not match the manifest's value_digests; its .metadata or data were altered)"
        )


def check_items_listed(digests: Mapping[str, str] | None, index: Mapping[str, Any], where: str) -> None:
    """Raise :class:`IntegrityError` if a non-tensor item the manifest recorded is missing from the
    step's ``.metadata`` or described there as a tensor. ``index``: key -> global shape, ``None``
    for non-tensor items (:func:`distckpt.load.phases.metadata_index`)."""
    from distckpt.errors import IntegrityError

    if not digests:
        return
    lost = sorted(k for k in digests if k not in index or index[k] is not None)
    if lost:
        shown = ", ".join(lost[:10]) + (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
        raise IntegrityError(f"{where}: non-tensor items saved in this step are missing from it or altered: {shown}")


# The encoded form ------------------------------------------------------------------------------
# An encoded value is the tuple ``(MARKER, kind, payload)``. A tuple, because DCP's flattening
# treats tuples as leaves: the value stays one item under its own key (a dict would be flattened
# into other keys, which a fresh object's state at load would not have). The payload is made of
# what ``weights_only`` reads (numbers, str, bytes, tuples, lists, dicts, tensors, and encoded
# values nested inside), so plain ``dcp.load`` reads these checkpoints too, and sees the tuples.
# Payloads of hashable values are tuples of hashables, so encoded values can be dict keys and set
# members as the originals were. A user's own tuple that starts with MARKER is itself encoded
# (kind ``tuple``), so every MARKER tuple in a checkpoint is one this module wrote (or a forgery,
# which decoding validates field by field: it never imports a module or calls a class by name
# from the checkpoint; registered classes come from the loading process's allow-list).
#
#   kind                       payload                                   back as
#   numpy.scalar               (dtype.str, int/float/bool/complex|bytes)  the NumPy scalar
#   numpy.ndarray              (dtype.str, shape, tensor)                 the array (own memory)
#   numpy.random.Generator     (bit generator name, its state)            a Generator
#   numpy.random.RandomState   its get_state(legacy=False) dict           a RandomState
#   datetime / time            (naive isoformat, tzinfo or None, fold)    datetime.datetime / time
#   date / timedelta           isoformat / (days, seconds, microseconds)
#   timezone / zoneinfo        (offset, name or None) / key
#   path                       (PosixPath|WindowsPath|Pure..., str)
#   deque / defaultdict        (items, maxlen) / (factory name, dict)
#   slice / range              (start, stop, step)
#   set / frozenset            items, sorted (bytes independent of hash seeds)
#   decimal / fraction / uuid  str / (numerator, denominator) / str
#   tuple                      items (a tuple that starts with MARKER)
#   enum                       (module:qualname, member name | Flag value)  registered classes only
#   dataclass                  (module:qualname, ((field, value), ...))   registered classes only
#   namedtuple                 (module:qualname, items)                   registered classes only
#   value                      a top-level entry of ``state`` that is not plain (TopLevel)

MARKER = "__distckpt_value__"
SAVE_DEPTH = 100  # nesting a save accepts (deeper: refused, naming the key)
LOAD_DEPTH = 200  # nesting a load walks (checkpoints from before SAVE_DEPTH may nest deeper)

# Leaves weights_only reads as they are (exact types: a subclass pickles its class).
_NATIVE: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.device, torch.dtype, torch.layout}
)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types torch.save pickles readably
_PATHS = {c.__name__: c for c in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)}
_FACTORIES = {c.__name__: c for c in (int, float, complex, str, bytes, bool, list, dict, set, tuple)}
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
_REGISTRABLE = "an Enum, a dataclass or a NamedTuple"
_SUPPORTED = (
    "tensors, None/bool/int/float/complex/str/bytes, lists/tuples/dicts/sets of them, NumPy scalars, arrays "
    "and generators, datetime values, pathlib paths, deque, defaultdict, slice, range, Decimal, Fraction, UUID"
)

#: Classes allowed when a caller passes no ``safe_types`` (the Checkpointer passes its option).
DEFAULT_SAFE_TYPES: tuple[type, ...] = ()


def type_name(cls: type) -> str:
    """How the encoded form names a registered class: ``module:qualname``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _registrable(cls: type) -> bool:
    return issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))


@dataclasses.dataclass(frozen=True)
class SafeTypes:
    """The classes beyond the built-in ones whose instances a checkpoint may hold, by
    :func:`type_name`: what ``Checkpointer(safe_types=[...])`` lists. A save refuses instances
    of Enum, dataclass and NamedTuple classes not listed; a load rebuilds only listed ones."""

    by_name: Mapping[str, type] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, types: SafeTypes | Iterable[type] | None) -> SafeTypes:
        """Validate a ``safe_types`` argument (``None``: :data:`DEFAULT_SAFE_TYPES`).

        Raises:
            ValueError: an entry is not a class that can be registered, or two different
                classes share a name.
        """
        if isinstance(types, SafeTypes):
            return types
        if types is None:
            types = DEFAULT_SAFE_TYPES
        if isinstance(types, type):  # safe_types=Mode instead of [Mode]: an Enum class iterates its members
            raise ValueError(f"safe_types takes a list of classes, e.g. safe_types=[{types.__qualname__}]")
        by_name: dict[str, type] = {}
        for t in types:
            if not isinstance(t, type) or not _registrable(t):
                raise ValueError(
                    f"safe_types: {t!r} is not {_REGISTRABLE} class; other values must be stored as {_SUPPORTED}"
                )
            name = type_name(t)
            if by_name.setdefault(name, t) is not t:
                raise ValueError(f"safe_types: two different classes are named {name}; a checkpoint could not tell them apart")
        return cls(by_name)


#: What functions taking ``safe_types`` accept: a :class:`SafeTypes`, classes, or ``None``
#: (:data:`DEFAULT_SAFE_TYPES`).
SafeTypesLike = Union[SafeTypes, Iterable[type], None]


@dataclasses.dataclass(frozen=True)
class TopLevel:
    """A top-level entry of ``state`` that is not a plain value (``state["best"] = np.float64(..)``),
    as :class:`~distckpt.state.entries.ValueEntry` hands it to a save (stored as one item, encoded
    by :func:`encode_for_save`) and gets it back from a load (decoded by :func:`decode_loaded`)."""

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


def _dcp_leaf(value: Any, depth: int = 0) -> bool:
    """Whether DCP's flattening stores ``value`` as one item (mirrors ``traverse_state_dict``:
    mappings are entered, lists only when they hold tensors, mappings or such lists). Lists
    nested beyond :data:`SAVE_DEPTH` count as items, which the save then refuses, naming them."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list) or depth > SAVE_DEPTH:
        return True
    for v in value:
        if isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not _dcp_leaf(v, depth + 1)):
            return False
    return True


def _sorted_items(items: Iterable[Any]) -> tuple[Any, ...]:
    """Set members in an order independent of the process's hash seed (so every rank writes the
    same bytes for the same set, and scope digests agree): by type, then repr, a total order
    where values may not compare (mixed types, NaN)."""
    return tuple(sorted(items, key=lambda v: (type(v).__qualname__, repr(v))))


class _Encoder:
    def __init__(self, allow: SafeTypes) -> None:
        self.allow = allow

    # where DCP goes on flattening: the structure (keys) must stay as it is
    def traversed(self, value: Any, key: str, depth: int) -> Any:
        if type(value) in _NATIVE or isinstance(value, torch.Tensor):
            return value
        if depth > SAVE_DEPTH:
            _too_deep(key)
        if isinstance(value, Mapping):
            new: dict[Any, Any] | None = None
            for k, v in value.items():
                if type(v) in _NATIVE or isinstance(v, torch.Tensor):  # most leaves: cheap to pass
                    continue
                e = self.traversed(v, f"{key}.{k}", depth + 1)
                if e is not v:
                    if new is None:
                        new = dict(value)
                    new[k] = e
            return value if new is None else new
        if isinstance(value, list) and not _dcp_leaf(value):
            items = [self.traversed(v, f"{key}.{i}", depth + 1) for i, v in enumerate(value)]
            return value if all(a is b for a, b in zip(items, value)) else items
        return self.pickled(value, key, depth)

    # inside one stored item (torch.save'd, read back with weights_only)
    def pickled(self, value: Any, key: str, depth: int) -> Any:
        t = type(value)
        if t in _NATIVE:
            return value
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

    def _items(self, value: Any, key: str, depth: int) -> tuple[Any, ...] | None:
        """The encoded items of a sequence as a tuple, or ``None`` if none changed."""
        out = None
        for i, v in enumerate(value):
            if type(v) in _NATIVE:
                continue
            e = self.pickled(v, f"{key}[{i}]", depth + 1)
            if e is not v:
                if out is None:
                    out = list(value)
                out[i] = e
        return None if out is None else tuple(out)

    def _dict(self, value: Any, key: str, depth: int) -> Any:
        pairs = []
        changed = False
        for k, v in value.items():
            ek = k if type(k) in _NATIVE else self.pickled(k, f"{key}<key {k!r:.40}>", depth + 1)
            ev = v if type(v) in _NATIVE else self.pickled(v, f"{key}[{k!r:.40}]", depth + 1)
            changed = changed or ek is not k or ev is not v
            pairs.append((ek, ev))
        if not changed:
            return value
        try:
            return type(value)(pairs) if type(value) is not collections.Counter else collections.Counter(dict(pairs))
        except TypeError:  # an encoded key that cannot be hashed (its original could)
            self._refuse(key, value, " (a dict key that cannot be stored hashably)")

    def _special(self, value: Any, key: str, depth: int) -> Any:
        t = type(value)
        np = sys.modules.get("numpy")  # no NumPy value can exist unless NumPy was imported
        if np is not None:
            if isinstance(value, np.generic):
                return self._np_scalar(np, value, key)
            if t in (np.ndarray, np.memmap):
                return self._np_array(np, value, key)
            if t is np.random.Generator:
                bg = value.bit_generator
                name = type(bg).__name__
                if name not in _BIT_GENERATORS or type(bg) is not getattr(np.random, name):
                    self._refuse(key, value, f" (its bit generator {type(bg).__qualname__} is not one of NumPy's)")
                return (MARKER, "numpy.random.Generator", (name, self.pickled(bg.state, f"{key}.state", depth + 1)))
            if t is np.random.RandomState:
                state = value.get_state(legacy=False)
                if state.get("bit_generator") not in _BIT_GENERATORS:
                    self._refuse(key, value, " (its bit generator is not one of NumPy's)")
                return (MARKER, "numpy.random.RandomState", self.pickled(state, f"{key}.state", depth + 1))
        sub = depth + 1
        if t is datetime.datetime or t is datetime.time:
            naive = value.replace(tzinfo=None).isoformat()
            return (MARKER, t.__name__, (naive, self._tz(value.tzinfo, key, sub), value.fold))
        if t is datetime.date:
            return (MARKER, "date", value.isoformat())
        if t is datetime.timedelta:
            return (MARKER, "timedelta", (value.days, value.seconds, value.microseconds))
        if t is datetime.timezone:
            return self._tz(value, key, depth)
        if _is_zoneinfo(value):
            return self._tz(value, key, depth)
        if _PATHS.get(t.__name__) is t:
            return (MARKER, "path", (t.__name__, str(value)))
        if t is collections.deque:
            return (MARKER, "deque", (list(self._items(value, key, depth) or value), value.maxlen))
        if t is collections.defaultdict:
            factory = value.default_factory
            name = None if factory is None else next((n for n, c in _FACTORIES.items() if c is factory), "")
            if name == "":
                self._refuse(key, value, f" (its default_factory {factory!r:.60} is not a built-in type)")
            return (MARKER, "defaultdict", (name, self._dict(dict(value), key, depth)))
        if t is slice:
            parts = (value.start, value.stop, value.step)
            return (MARKER, "slice", self._items(parts, key, depth) or parts)
        if t is range:
            return (MARKER, "range", (value.start, value.stop, value.step))
        if t is decimal.Decimal:
            return (MARKER, "decimal", str(value))
        if t is fractions.Fraction:
            return (MARKER, "fraction", (value.numerator, value.denominator))
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
            fields = tuple(
                (f.name, self.pickled(getattr(value, f.name), f"{key}.{f.name}", sub)) for f in dataclasses.fields(value)
            )
            return (MARKER, "dataclass", (type_name(t), fields))
        if isinstance(value, tuple) and hasattr(t, "_fields"):
            self._registered(t, key, "a NamedTuple")
            return (MARKER, "namedtuple", (type_name(t), self._items(value, key, depth) or tuple(value)))
        self._refuse(key, value)

    def _tz(self, tz: Any, key: str, depth: int) -> Any:
        if tz is None:
            return None
        if type(tz) is datetime.timezone:
            args = tz.__getinitargs__()  # (offset,) or (offset, name): the name only if one was given
            offset = self.pickled(args[0], key, depth + 1)
            return (MARKER, "timezone", (offset, args[1] if len(args) > 1 else None))
        if _is_zoneinfo(tz) and isinstance(getattr(tz, "key", None), str):
            return (MARKER, "zoneinfo", tz.key)
        self._refuse(f"{key}.tzinfo", tz, " (only datetime.timezone and zoneinfo.ZoneInfo time zones can be stored)")

    def _np_scalar(self, np: Any, value: Any, key: str) -> Any:
        dt = value.dtype
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
            self._refuse(key, value, f" (NumPy dtype {dt} holds Python objects or fields)")
        if dt.kind in "biu" or (dt.kind == "f" and dt.itemsize <= 8) or (dt.kind == "c" and dt.itemsize <= 16):
            return (MARKER, "numpy.scalar", (dt.str, value.item()))  # exact as a Python number
        return (MARKER, "numpy.scalar", (dt.str, value.tobytes()))

    def _np_array(self, np: Any, value: Any, key: str) -> Any:
        dt = value.dtype
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
            self._refuse(key, value, f" (NumPy dtype {dt} holds Python objects or fields; store numeric arrays, or lists)")
        # Copies either way: the caller's array may change before an async save writes it.
        if _torch_dtype(dt) is not None:  # a tensor of the same values (native byte order)
            native = dt.newbyteorder("=") if dt.byteorder in "<>" else dt
            data = torch.from_numpy(np.array(value, dtype=native, order="C", copy=True))
        else:  # longdouble, datetime64, str_ ...: the bytes, in the array's own byte order
            data = torch.from_numpy(np.frombuffer(value.tobytes(order="C"), dtype=np.uint8).copy())
        return (MARKER, "numpy.ndarray", (dt.str, tuple(int(s) for s in value.shape), data))

    def _registered(self, cls: type, key: str, what: str) -> None:
        if self.allow.by_name.get(type_name(cls)) is not cls:
            raise TypeError(
                f"cannot save state value {_clip(key)!r}: it is {what} of class {_shown(cls)}, which is not registered; "
                f"a load rebuilds classes only from an allow-list (a checkpoint must never name code to run). Register "
                f"it on every rank, in this job and in the jobs that load it: Checkpointer(..., safe_types=[{cls.__qualname__}])"
            )

    def _refuse(self, key: str, value: Any, why: str = "") -> NoReturn:
        raise TypeError(
            f"cannot save state value {_clip(key)!r} of type {_shown(type(value))}{why}: a load reads non-tensor values "
            f"without running code, and could not rebuild this one. Supported: {_SUPPORTED}; and {_REGISTRABLE} "
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


def _is_zoneinfo(value: Any) -> bool:
    zoneinfo = sys.modules.get("zoneinfo")
    return zoneinfo is not None and type(value) is zoneinfo.ZoneInfo


def _torch_dtype(dt: Any) -> torch.dtype | None:
    """The torch dtype holding NumPy dtype ``dt``'s values exactly (native byte order), or None."""
    return _TORCH_OF_NUMPY.get(f"{dt.kind}{dt.itemsize}")


# Not uint16/32/64: torch 2.13 cannot unpickle such tensors from plain pickle (the async writer
# process receives its non-tensor items that way); they are stored as bytes.
_TORCH_OF_NUMPY = {
    "b1": torch.bool, "u1": torch.uint8, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64,
    "f2": torch.float16, "f4": torch.float32, "f8": torch.float64, "c8": torch.complex64, "c16": torch.complex128,
}  # fmt: skip


# Decoding ----------------------------------------------------------------------------------------
def restore_containers(loaded: Any, like: Any, depth: int = 0) -> Any:
    """``loaded``, as a load hands an object's state back, in the containers and keys of ``like``
    (the object's own state, of the same structure: DCP's targets had its keys).

    DCP flattens the dicts of a state into string keys, stores nothing for an empty dict, and
    rebuilds plain dicts: without this a ``{0: seed}`` came back as ``{"0": seed}``, a
    ``defaultdict`` as a ``dict``, and ``{"seen": {}}`` as ``{}``, silently. The values are
    ``loaded``'s; keys ``like`` does not have stay as loaded. Lists are matched item by item;
    everything else (stored items, decoded exactly) is left as it is.
    """
    if depth > LOAD_DEPTH:
        return loaded
    if type(loaded) is dict and isinstance(like, Mapping):
        keys = {str(k): k for k in like}
        got: dict[Any, Any] = {}
        for k, v in loaded.items():
            key = keys.get(k, k) if type(k) is str else k
            got[key] = restore_containers(v, like[key], depth + 1) if key in like else v
        pairs = []
        for k in like:  # like's order: the order the object keeps its state in
            if k in got:
                pairs.append((k, got.pop(k)))
            elif not _stores_items(like[k]):  # an empty container: DCP stored nothing for it
                pairs.append((k, _bare(like[k])))
        pairs.extend(got.items())
        return _mapping_like(like, pairs)
    if type(loaded) is list and isinstance(like, list):
        out = []
        for i in range(max(len(loaded), len(like))):
            here = loaded[i] if i < len(loaded) else None
            if i < len(like) and here is None and not _stores_items(like[i]):
                out.append(_bare(like[i]))  # DCP padded with None (or stopped) where it stored nothing
            elif i < len(loaded):
                out.append(restore_containers(here, like[i], depth + 1) if i < len(like) else here)
            else:
                break
        return out
    return loaded


def _stores_items(value: Any, depth: int = 0) -> bool:
    """Whether DCP's flattening of ``value`` yields any item (an empty dict yields none)."""
    if depth > LOAD_DEPTH:
        return True
    if isinstance(value, Mapping):
        return any(_stores_items(v, depth + 1) for v in value.values())
    if isinstance(value, list) and not _dcp_leaf(value):
        return any(_stores_items(v, depth + 1) for v in value)
    return True


def _bare(like: Any) -> Any:
    """A copy of a container that holds no items (dicts of empty dicts ...), of ``like``'s types."""
    if isinstance(like, Mapping):
        return _mapping_like(like, [(k, _bare(v)) for k, v in like.items()])
    return [_bare(v) for v in like] if isinstance(like, list) else like


def _mapping_like(like: Mapping, pairs: list[tuple[Any, Any]]) -> Any:
    t = type(like)
    if t is collections.defaultdict:
        return collections.defaultdict(like.default_factory, pairs)  # type: ignore[attr-defined]
    if t is collections.Counter:
        return collections.Counter(dict(pairs))
    return t(pairs) if t in (dict, collections.OrderedDict) else dict(pairs)


class _Malformed(Exception):
    """An encoded value whose fields are not what this module writes (raised as IntegrityError)."""


def decode_loaded(value: Any, key: str, safe_types: SafeTypesLike = None) -> Any:
    """(any rank, pure) One non-tensor item as read (``weights_only``), with every encoded value in
    it rebuilt (:func:`encode_for_save`); values without encoded parts come back as they are.

    Raises:
        UnsafeCheckpointError: naming ``key``, an encoded value names a class that is not in
            ``safe_types`` (nothing is imported or called by a name from the checkpoint).
        IntegrityError: naming ``key``, an encoded value is malformed (damaged or forged), or
            nested more than :data:`LOAD_DEPTH` levels deep.
    """
    from distckpt.errors import IntegrityError

    try:
        return _Decoder(SafeTypes.of(safe_types), key).walk(value, 0)
    except _Malformed as exc:
        raise IntegrityError(f"checkpoint value {key!r}: its stored encoded value is malformed ({exc})") from None
    except RecursionError:
        raise IntegrityError(f"checkpoint value {key!r} is nested too deeply to be read") from None


class _Decoder:
    def __init__(self, allow: SafeTypes, key: str) -> None:
        self.allow = allow
        self.key = key

    def walk(self, value: Any, depth: int) -> Any:
        t = type(value)
        if t in _NATIVE or isinstance(value, torch.Tensor):
            return value
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
            return collections.Counter(dict(pairs)) if t is collections.Counter else t(pairs)
        if t is set:  # a set written before sets were encoded
            return {self.walk(v, depth + 1) for v in value}
        return value

    def items(self, payload: Any, depth: int, what: str) -> tuple:
        """A payload tuple's items, each decoded (the tuple itself is no encoded value, even if
        its first item is the marker string: a set of strings, say)."""
        return tuple(self.walk(v, depth) for v in _typed(payload, tuple, what))

    def _seq(self, value: Any, depth: int, kind: type) -> Any:
        if all(type(v) in _NATIVE for v in value):  # the common case: numbers, strings
            return value
        items = [self.walk(v, depth + 1) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else kind(items)

    def marker(self, value: tuple, depth: int) -> Any:
        if len(value) != 3 or type(value[1]) is not str:
            raise _Malformed(f"an encoded value must be ({MARKER!r}, kind, payload), got {len(value)} fields")
        kind, payload = value[1], value[2]
        if kind == "value":
            if depth != 0:
                raise _Malformed("a top-level value encoded inside another value")
            return TopLevel(self.walk(payload, depth + 1))
        fn = _DECODERS.get(kind)
        if fn is None:
            raise _Malformed(f"unknown kind {kind!r:.60} (written by a newer distckpt, or altered)")
        from distckpt.errors import CheckpointError

        try:
            return fn(self, payload, depth + 1)
        except (_Malformed, CheckpointError):  # CheckpointError: a class missing from the allow-list
            raise
        except (TypeError, ValueError, KeyError, IndexError, OverflowError, AttributeError, RuntimeError) as exc:
            raise _Malformed(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}") from None

    # helpers for the decoders: fields of the right type, or _Malformed
    def fields(self, payload: Any, n: int, kind: str) -> tuple:
        if type(payload) is not tuple or len(payload) != n:
            got = f"{len(payload)} fields" if type(payload) is tuple else f"a {type(payload).__name__}"
            raise _Malformed(f"{kind}: expected a tuple of {n} fields, got {got}")
        return payload

    def registered(self, name: Any, base: Any, what: str) -> type:
        from distckpt.errors import UnsafeCheckpointError

        if type(name) is not str:
            raise _Malformed(f"{what}: class name {name!r:.60} is not a string")
        cls = self.allow.by_name.get(name)
        if cls is None:
            short = name.rpartition(":")[2] or name
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint value {self.key!r}: it holds {what} of class {name[:200]}, which is not "
                f"registered (a load rebuilds classes only from an allow-list, never by a name the checkpoint gives).\n"
                f"If you trust this checkpoint, register the class on every rank: Checkpointer(..., safe_types=[{short[:80]}])"
            )
        if not base(cls):
            raise _Malformed(f"{name} is registered but is not {what}")
        return cls


def _typed(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if type(value) not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _Malformed(f"{what} is a {type(value).__name__}")
    return value


def _np_dtype(text: Any) -> Any:
    import numpy as np

    if type(text) is not str or len(text) > 32:
        raise _Malformed(f"NumPy dtype {text!r:.40} is not a dtype string")
    dt = np.dtype(text)
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise _Malformed(f"NumPy dtype {text!r} holds Python objects or fields")
    return dt


def _dec_np_scalar(d: _Decoder, payload: Any, depth: int) -> Any:
    import numpy as np

    text, v = d.fields(payload, 2, "numpy.scalar")
    dt = _np_dtype(text)
    if dt.kind == "b":
        return dt.type(_typed(v, bool, "a bool scalar"))
    if dt.kind in "iu":
        return dt.type(_typed(v, int, "an integer scalar"))
    if dt.kind == "f" and dt.itemsize <= 8:
        return dt.type(_typed(v, float, "a float scalar"))
    if dt.kind == "c" and dt.itemsize <= 16:
        return dt.type(_typed(v, complex, "a complex scalar"))
    if type(v) is not bytes or len(v) != dt.itemsize:
        raise _Malformed(f"numpy.scalar {text}: {type(v).__name__} of the wrong size")
    return np.frombuffer(v, dtype=dt)[0]


def _dec_np_array(d: _Decoder, payload: Any, depth: int) -> Any:
    import numpy as np

    text, shape, data = d.fields(payload, 3, "numpy.ndarray")
    dt = _np_dtype(text)
    if type(shape) is not tuple or len(shape) > 64 or any(type(s) is not int or s < 0 for s in shape):
        raise _Malformed(f"numpy.ndarray: shape {shape!r:.80} is not a tuple of sizes")
    if type(data) is not torch.Tensor or data.layout != torch.strided or data.device.type != "cpu":
        raise _Malformed(f"numpy.ndarray: data is a {type(data).__name__}, not a CPU tensor")
    count = math.prod(shape)
    if data.dtype == _torch_dtype(dt) and tuple(data.shape) == shape:
        return data.resolve_conj().resolve_neg().numpy().astype(dt, copy=True)
    if data.dtype == torch.uint8 and data.dim() == 1 and data.numel() == count * dt.itemsize:
        return np.frombuffer(data.numpy().tobytes(), dtype=dt, count=count).reshape(shape).copy()
    raise _Malformed(f"numpy.ndarray: {data.dtype} data of shape {list(data.shape)} does not hold {text} of shape {list(shape)}")


def _dec_np_generator(d: _Decoder, payload: Any, depth: int) -> Any:
    import numpy as np

    name, state = d.fields(payload, 2, "numpy.random.Generator")
    if name not in _BIT_GENERATORS:
        raise _Malformed(f"bit generator {name!r:.40} is not one of NumPy's")
    bg = getattr(np.random, name)()
    bg.state = d.walk(state, depth)
    return np.random.Generator(bg)


def _dec_np_random_state(d: _Decoder, payload: Any, depth: int) -> Any:
    import numpy as np

    state = d.walk(_typed(payload, dict, "a RandomState's state"), depth)
    name = state.get("bit_generator")
    if name not in _BIT_GENERATORS:
        raise _Malformed(f"bit generator {name!r:.40} is not one of NumPy's")
    rs = np.random.RandomState(getattr(np.random, name)())
    rs.set_state(state)
    return rs


def _dec_tz(d: _Decoder, value: Any, depth: int) -> Any:
    tz = d.walk(value, depth)
    if tz is not None and not isinstance(tz, datetime.tzinfo):
        raise _Malformed(f"time zone is a {type(tz).__name__}")
    return tz


def _dec_datetime(cls: type) -> Any:
    def dec(d: _Decoder, payload: Any, depth: int) -> Any:
        iso, tz, fold = d.fields(payload, 3, cls.__name__)
        if type(iso) is not str or len(iso) > 64 or type(fold) is not int or fold not in (0, 1):
            raise _Malformed(f"{cls.__name__}: fields {iso!r:.70}, fold {fold!r:.20}")
        return cls.fromisoformat(iso).replace(tzinfo=_dec_tz(d, tz, depth), fold=fold)

    return dec


def _dec_date(d: _Decoder, payload: Any, depth: int) -> Any:
    if type(payload) is not str or len(payload) > 32:
        raise _Malformed(f"date {payload!r:.40}")
    return datetime.date.fromisoformat(payload)


def _dec_timedelta(d: _Decoder, payload: Any, depth: int) -> Any:
    days, seconds, micro = (_typed(v, int, "a timedelta field") for v in d.fields(payload, 3, "timedelta"))
    return datetime.timedelta(days=days, seconds=seconds, microseconds=micro)


def _dec_timezone(d: _Decoder, payload: Any, depth: int) -> Any:
    offset, name = d.fields(payload, 2, "timezone")
    offset = d.walk(offset, depth)
    if type(offset) is not datetime.timedelta:
        raise _Malformed(f"timezone offset is a {type(offset).__name__}")
    if name is None:
        return datetime.timezone(offset)
    return datetime.timezone(offset, _typed(name, str, "a timezone name"))


def _dec_zoneinfo(d: _Decoder, payload: Any, depth: int) -> Any:
    import zoneinfo

    key = _typed(payload, str, "a time zone key")
    try:
        return zoneinfo.ZoneInfo(key)  # a name in the system's tz database; refuses paths
    except zoneinfo.ZoneInfoNotFoundError as exc:
        raise ValueError(f"time zone {key[:60]!r} is not in this system's time zone database") from exc


def _dec_path(d: _Decoder, payload: Any, depth: int) -> Any:
    name, text = d.fields(payload, 2, "path")
    cls = _PATHS.get(name) if type(name) is str else None
    if cls is None:
        raise _Malformed(f"path class {name!r:.40} is not one of pathlib's")
    return cls(_typed(text, str, "a path"))


def _dec_deque(d: _Decoder, payload: Any, depth: int) -> Any:
    items, maxlen = d.fields(payload, 2, "deque")
    if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
        raise _Malformed(f"deque maxlen {maxlen!r:.40}")
    return collections.deque(d.walk(_typed(items, list, "a deque's items"), depth), maxlen)


def _dec_defaultdict(d: _Decoder, payload: Any, depth: int) -> Any:
    name, items = d.fields(payload, 2, "defaultdict")
    if name is not None and name not in _FACTORIES:
        raise _Malformed(f"defaultdict factory {name!r:.40} is not a built-in type")
    factory = None if name is None else _FACTORIES[name]
    return collections.defaultdict(factory, d.walk(_typed(items, dict, "a defaultdict's items"), depth))


def _dec_slice(d: _Decoder, payload: Any, depth: int) -> Any:
    return slice(*d.items(d.fields(payload, 3, "slice"), depth, "a slice's fields"))


def _dec_range(d: _Decoder, payload: Any, depth: int) -> Any:
    start, stop, step = (_typed(v, int, "a range field") for v in d.fields(payload, 3, "range"))
    return range(start, stop, step)


def _dec_set(cls: type) -> Any:
    def dec(d: _Decoder, payload: Any, depth: int) -> Any:
        return cls(d.items(payload, depth, f"a {cls.__name__}'s items"))

    return dec


def _dec_tuple(d: _Decoder, payload: Any, depth: int) -> Any:
    items = d.items(payload, depth, "a tuple's items")
    if not items or type(items[0]) is not str or items[0] != MARKER:
        raise _Malformed("an escaped tuple that does not start with the marker")
    return items


def _dec_decimal(d: _Decoder, payload: Any, depth: int) -> Any:
    if type(payload) is not str or len(payload) > 4096:
        raise _Malformed(f"Decimal {payload!r:.40}")
    return decimal.Decimal(payload)


def _dec_fraction(d: _Decoder, payload: Any, depth: int) -> Any:
    num, den = (_typed(v, int, "a Fraction field") for v in d.fields(payload, 2, "fraction"))
    if den == 0:
        raise _Malformed("Fraction with denominator 0")
    return fractions.Fraction(num, den)


def _dec_uuid(d: _Decoder, payload: Any, depth: int) -> Any:
    return uuid.UUID(_typed(payload, str, "a UUID"))


def _dec_enum(d: _Decoder, payload: Any, depth: int) -> Any:
    name, member = d.fields(payload, 2, "enum")
    cls = d.registered(name, lambda c: issubclass(c, enum.Enum), "an Enum")
    if type(member) is str:
        found = cls.__members__.get(member)
        if found is None:
            raise _Malformed(f"{name} has no member {member[:60]!r} (renamed since the save?)")
        return found
    if type(member) is int and issubclass(cls, enum.Flag):
        return cls(member)
    raise _Malformed(f"{name}: member {member!r:.40}")


def _dec_dataclass(d: _Decoder, payload: Any, depth: int) -> Any:
    name, fields = d.fields(payload, 2, "dataclass")
    cls = d.registered(name, lambda c: dataclasses.is_dataclass(c), "a dataclass")
    if type(fields) is not tuple or any(type(f) is not tuple or len(f) != 2 or type(f[0]) is not str for f in fields):
        raise _Malformed(f"{name}: fields are not (name, value) pairs")
    saved = dict(fields)
    expected = [f.name for f in dataclasses.fields(cls)]
    if sorted(saved) != sorted(expected) or len(saved) != len(fields):
        raise _Malformed(
            f"{name}: saved fields {sorted(saved)[:20]} are not the class's {sorted(expected)[:20]} (changed since the save?)"
        )
    obj = cls.__new__(cls)  # like pickle: no __init__/__post_init__, the saved fields exactly
    for field_name in expected:
        object.__setattr__(obj, field_name, d.walk(saved[field_name], depth))
    return obj


def _dec_namedtuple(d: _Decoder, payload: Any, depth: int) -> Any:
    name, items = d.fields(payload, 2, "namedtuple")
    cls = d.registered(name, lambda c: issubclass(c, tuple) and hasattr(c, "_fields"), "a NamedTuple")
    items = d.items(items, depth, "a NamedTuple's items")
    if len(items) != len(cls._fields):
        raise _Malformed(f"{name}: {len(items)} items saved, the class has {len(cls._fields)} fields (changed since the save?)")
    return tuple.__new__(cls, items)


_DECODERS: dict[str, Any] = {
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
