"""``python -m distckpt``: the ``distckpt`` command (see :mod:`distckpt.cli`)."""

import sys

from .cli import main

sys.exit(main())
