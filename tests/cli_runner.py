"""Run the ``distckpt`` command inside the test process.

A fresh interpreter costs ~3 s of CPU (torch's import) per call, which across the suite's
command-line checks was a minute on 2 cores. In-process runs see the same arguments, exit code,
stdout and stderr (warnings included, printed as a fresh interpreter prints them). Tests about
the interpreter itself (``python -m distckpt``, a process that must not abort, resource limits)
keep a real subprocess.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import warnings


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``distckpt ARGS...`` in this process, as ``subprocess.run(..., capture_output=True, text=True)`` reports it."""
    from distckpt.tools.cli import main

    out, err = io.StringIO(), io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("default")  # what a fresh interpreter shows
        warnings.showwarning = show  # to this call's stderr, not pytest's recorder
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["distckpt", *args], code, out.getvalue(), err.getvalue())
