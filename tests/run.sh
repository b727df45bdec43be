#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole suite in parallel.
# Extra arguments go to pytest (e.g. tests/run.sh -k reshard).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh" test
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# loadgroup keeps tests that share an expensive module fixture on one worker.
exec "$PY" -m pytest -n auto --dist loadgroup -q "$@"
