"""Non-tensor values as stored, and the digests that prove a load reads the ones saved.

* A plain top-level entry of ``state`` (int, float, str, bool, None, and lists, tuples and dicts
  of them, exactly those types) is one JSON string, tuples and non-string dict keys tagged so
  that it comes back exactly as saved (:func:`encode`, :func:`decode`); the manifest records its
  sha256 (:func:`digest`, :func:`check_digest`). Other top-level values are stored in the
  encoded form (:mod:`distckpt.state.encoded`).
* Every non-tensor item DCP writes (optimizer hyper-parameters, objects' ``state_dict()``
  contents, top-level values) has the sha256 of its stored bytes recorded in the manifest
  (:func:`record_item_digests`) and checked before it is unpickled (:func:`check_item`,
  :func:`check_items_listed`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from distckpt.errors import IntegrityError
from distckpt.integrity.checksums import Buffer
from distckpt.state.containers import SAVE_DEPTH

PREFIX = "distckpt-json:"
_TUPLE = "__distckpt_tuple__"
_DICT = "__distckpt_dict__"
_FLOAT = "__distckpt_float__"
_JSON_SCALARS = (type(None), bool, int, float, str)
#: Ints beyond this many bits may have more than 4300 decimal digits, which Python refuses to
#: write (sys.set_int_max_str_digits): a plain value stores them in the encoded (pickled) form
#: instead, as NaNs; DCP cannot write them as keys.
TEXT_INT_BITS = 14_000


# Plain top-level values ------------------------------------------------------------------------
def is_plain(value: object) -> bool:
    """True if ``value`` is a plain value :func:`encode` can store as JSON text (subclasses of
    the plain types included: they come back as their base type)."""
    return _fits(value, exact=False)


def stores_as_json(value: object) -> bool:
    """True if the JSON form gives ``value`` back exactly: plain types only, no subclasses
    (``np.float64`` is a float, an ``IntEnum`` an int, a NamedTuple a tuple; JSON would return
    their base types, so they are stored in the encoded form instead)."""
    return _fits(value, exact=True)


def _fits(value: object, exact: bool) -> bool:
    try:
        _check(value, "", 0, exact)
    except (TypeError, RecursionError):
        return False
    return True


def _check(value: Any, where: str, depth: int, exact: bool = False) -> None:
    if type(value) in _JSON_SCALARS or (not exact and isinstance(value, _JSON_SCALARS)):
        if exact and type(value) is int and value.bit_length() > TEXT_INT_BITS:
            raise TypeError(f"int at {where or 'top'} has more digits than Python writes as text")
        if exact and type(value) is float and value != value:
            raise TypeError(f"NaN at {where or 'top'}: JSON text would not keep its sign and payload bits")
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
                raise TypeError(f"dict key {_shown_key(k)} at {where or 'top'} is of type {type(k).__name__}")
            _check(v, f"{where}[{_shown_key(k)}]", depth + 1, exact)
        return
    raise TypeError(f"value at {where or 'top'} is of type {type(value).__name__}")


def _shown_key(key: object) -> str:
    """``repr(key)``, clipped; an int of more digits than Python writes as text by its size."""
    if isinstance(key, int) and not isinstance(key, bool) and key.bit_length() > TEXT_INT_BITS:
        return f"<an int of {key.bit_length():,} bits>"
    return f"{key!r:.100}"


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


def decode(text: object, name: str = "value") -> Any:
    """The value :func:`encode` stored.

    Raises:
        IntegrityError: naming ``name``, if ``text`` is not one (the manifest says this entry
            is a plain value, so the checkpoint was damaged or altered).
    """
    if not isinstance(text, str) or not text.startswith(PREFIX):
        raise IntegrityError(f"checkpoint entry {name!r} is not a distckpt plain value ({type(text).__name__} stored)")
    try:
        return _untag(json.loads(text[len(PREFIX):]))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise IntegrityError(f"checkpoint entry {name!r}: its stored plain value is malformed ({exc})") from None


def digest(text: str) -> str:
    """What the manifest records of a plain value's stored text (``entries[name]["sha256"]``)."""
    return item_digest(text.encode())


def check_digest(text: object, entry: Mapping[str, object], name: str) -> None:
    """Raise :class:`IntegrityError` if ``text`` (as read) is not the value the manifest recorded.

    Plain values carry no tensor fingerprint; without this a ``.metadata`` pointed at another
    record (re-sealed by an attacker) would load another value silently. Entries saved per rank
    hold one value per rank, and the manifest records rank 0's: those are not checked.
    """
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


def item_digest(data: Buffer) -> str:
    """sha256 (hex) of the bytes stored for one non-tensor item."""
    return hashlib.sha256(data).hexdigest()


def record_item_digests(planner: SavePlanner) -> dict[str, str]:
    """Have ``planner`` (a DCP ``SavePlanner``) record the digest of every non-tensor item it hands
    DCP's writer, as it hands it over (in the writer threads); returns the dict it fills,
    ``flattened key -> sha256``, complete once the write returned. Tensors are not touched.

    Only items this rank writes are recorded, so over all ranks each written item is recorded
    exactly once (replicated items have one writer, see :mod:`distckpt.save.plan`).
    """
    digests: dict[str, str] = {}
    # The wrapper lives on the planner: it must not hold the planner (a bound method would),
    # or the planner and the state dict it holds (an async save's staged copy: the whole
    # state) would live in a reference cycle until the garbage collector ran, which a writer
    # process creating few objects rarely does (one staging arena kept per layout change).
    own = planner.__dict__.get("resolve_data")  # (an instance's own, e.g. an earlier wrapper)
    method = type(planner).resolve_data
    ref = weakref.ref(planner)

    def resolve_data(write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if own is not None:
            data = own(write_item)
        else:
            live = ref()
            if live is None:
                raise RuntimeError("distckpt: the save planner is gone")
            data = method(live, write_item)
        if isinstance(data, io.BytesIO):  # BYTE_IO: exactly what DCP writes (no storage transforms)
            digests[write_item.index.fqn] = item_digest(data.getbuffer())  # one dict store: thread-safe
        return data

    planner.resolve_data = resolve_data  # type: ignore[method-assign]
    return digests


def check_item(data: Buffer, key: str, digests: Mapping[str, str] | None, where: str) -> None:
    """Raise :class:`IntegrityError` naming ``key`` and ``where`` (its file) unless ``data``, the
    bytes read for non-tensor item ``key``, are the bytes saved for it.

    ``digests``: the manifest's ``value_digests``; ``None`` (a manifest written before they were
    recorded): not checked. Call before unpickling ``data``.
    """
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


def check_items_listed(digests: Mapping[str, str] | None, index: Mapping[str, Sequence[int] | None], where: str) -> None:
    """Raise :class:`IntegrityError` if a non-tensor item the manifest recorded is missing from the
    step's ``.metadata`` or described there as a tensor. ``index``: key -> global shape, ``None``
    for non-tensor items (:func:`distckpt.load.phases.metadata_index`)."""
    if not digests:
        return
    lost = sorted(k for k in digests if k not in index or index[k] is not None)
    if lost:
        shown = ", ".join(lost[:10]) + (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
        raise IntegrityError(f"{where}: non-tensor items saved in this step are missing from it or altered: {shown}")
