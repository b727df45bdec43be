"""Values from a checkpoint shown in messages, bounded.

A value read from a checkpoint may be a crafted structure whose full ``repr`` never ends (a list
holding one list twice, forty levels deep, has 2**40 items to show) or runs to gigabytes;
``f"{x!r:.40}"`` builds all of it before it cuts. :func:`shown` never looks deeper than three
levels nor at more than a few items per container, and shows objects of other classes by their
class name (their ``__repr__`` may walk anything).
"""

from __future__ import annotations

import reprlib

import torch

_PLAIN = (int, float, complex, bool, type(None))
#: torch's own classes whose repr is short and computed from a bounded value (a Size holds ints).
_TORCH = (torch.Size, torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Bounded(reprlib.Repr):
    def repr_instance(self, obj: object, level: int) -> str:
        if type(obj) in _TORCH or (
            isinstance(obj, _PLAIN) and type(obj).__repr__ in (int.__repr__, float.__repr__, complex.__repr__, bool.__repr__, object.__repr__)
        ):
            try:  # (reprlib would name a failing repr by the object's address)
                text = repr(obj)
            except Exception:  # noqa: BLE001 - a Size of integers beyond 64 bits
                return f"<{type(obj).__name__}>"
            return text if len(text) <= self.maxother else text[: self.maxother - 3] + "..."
        return f"<{type(obj).__name__}>"


_REPR = _Bounded()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxtuple, _REPR.maxlist = 3, 60, 60, 6, 6
_REPR.maxdict, _REPR.maxset, _REPR.maxfrozenset, _REPR.maxlong = 4, 6, 6, 40


def shown(value: object, width: int = 120) -> str:
    """(pure) ``repr(value)`` for a message: bounded in depth, items and ``width`` characters."""
    try:
        return _REPR.repr(value)[:width]
    except Exception:  # noqa: BLE001 - a raising __repr__ or __len__
        return f"<{type(value).__name__}>"
