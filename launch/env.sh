#!/usr/bin/env bash
# Create (or reuse) ./.venv with torch and distckpt installed. Sourced by launch/demo.sh and
# tests/run.sh; needs only python3 (>= 3.10) and pip.
#
# torch==2.13.0 is installed first when no torch is present: a bare "torch" requirement would
# pull a multi-GB CUDA build on machines where the CPU wheel is at hand. An existing torch inside
# pyproject's range is kept (GPU machines bring their own).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DISTCKPT_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
EXTRAS="${1:-test}"
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
stamp="$VENV/.distckpt-installed-$EXTRAS"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    "$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[$EXTRAS]"
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
