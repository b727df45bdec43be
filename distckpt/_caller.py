"""The first caller outside distckpt, for warnings: ``warnings.warn(msg, stacklevel=outside())``
names the user's line (their ``save()`` call), however deep inside distckpt the warning is made
(what Python 3.12's ``skip_file_prefixes`` does)."""

from __future__ import annotations

import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def outside() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the function that calls this one: that
    of the first frame above it whose code is not distckpt's."""
    frame, level = sys._getframe(2), 2  # the warning function's caller is stacklevel 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
