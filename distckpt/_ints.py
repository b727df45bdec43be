"""Integers as users hold them: ``int``, NumPy's integer scalars, anything with ``__index__``.

A step counted in a NumPy array (``np.int64``), a ``keep_last`` read from a config through
NumPy, or a step kept as a 0-d integer tensor, are integers to the user; the manifest (JSON) and
the step directory's name need a plain ``int``. Bools are not integers here (``keep_last=True``
is a mistake, not 1).
"""

from __future__ import annotations

import operator


def plain_int(value: object) -> object:
    """``value`` as a plain ``int`` where it is an integer other than a bool (``operator.index``
    takes it); anything else unchanged, for the caller's own check to refuse with its message."""
    if type(value) is int or isinstance(value, bool):
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return value
