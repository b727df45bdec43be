#!/usr/bin/env bash
# The README's main command: set up .venv if needed, then train on 2 ranks with async saves,
# preempt, resume on 3 ranks, and print the loss curve and save throughput (launch/demo.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh" test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" "$ROOT/launch/demo.py" "$@"  # (env.sh: the venv, DISTCKPT_VENV or .venv)
