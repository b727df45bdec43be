"""``python -m distckpt``: the ``distckpt`` command (see :mod:`distckpt.tools.cli`)."""

import sys

from distckpt.tools.cli import main

sys.exit(main())
