"""Plain Python values in a checkpoint, stored as JSON text so that reading them runs no code.

DCP pickles non-tensor values and unpickles them with ``torch.load(weights_only=False)``; a
crafted checkpoint could run code that way. distckpt stores a plain value (int, float, str, bool,
None, and lists, tuples and dicts of them) as one JSON string, with tuples and non-string dict
keys tagged so that the value comes back exactly as it was saved.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

PREFIX = "distckpt-json:"
_TUPLE = "__distckpt_tuple__"
_DICT = "__distckpt_dict__"
_FLOAT = "__distckpt_float__"


def is_plain(value: Any) -> bool:
    """True if ``value`` is a plain value this module can store."""
    try:
        _check(value, "")
    except TypeError:
        return False
    return True


def _check(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"dict key {k!r} at {where or 'top'} is of type {type(k).__name__}")
            _check(v, f"{where}[{k!r}]")
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
        _check(value, "")
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
    from .errors import IntegrityError

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
    from .errors import IntegrityError

    expected = entry.get("sha256")
    if not isinstance(expected, str) or entry.get("scope") == "per_rank":
        return
    if not isinstance(text, str) or digest(text) != expected:
        raise IntegrityError(f"checkpoint entry {name!r}: the stored value is not the one saved (its sha256 does not match the manifest)")
