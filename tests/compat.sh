#!/usr/bin/env bash
# Run distckpt's suite under one torch release: tests/compat.sh VERSION [--core] [pytest args...]
#
#   bash tests/compat.sh 2.11.0                 # the whole suite under torch 2.11.0
#   bash tests/compat.sh 2.11.0 --core          # the core subset (below)
#   bash tests/compat.sh 2.12.1 tests/test_compat.py -x    # any pytest arguments
#
# Creates (or reuses) the venv .compat/torch-VERSION/ (git ignores .compat/), installs torch
# VERSION there (the CPU build where one can be had: the local CPU wheel for 2.13.0, PyTorch's CPU
# index when it is reachable; otherwise PyPI's default build, CUDA, with its nvidia-* wheels:
# several GB; exit 3 if that install fails), then distckpt with its test extras under a constraints file that pins torch, so
# pip cannot replace it; it checks that torch is still VERSION afterwards. Then it runs pytest
# (-n 2, or COMPAT_WORKERS) and prints the summary line with the torch build and the date: the
# rows of the README's table "torch version -> suite result". Reruns reuse the venv (distckpt is
# reinstalled only when pyproject.toml changed).
#
# --core: the suite without the tests that time whole runs of scripts beside the library, which
# are slow and test torch's API no further than the rest does: the benchmarks' smoke runs, the
# converter's memory smoke run and the torchrun launch scenarios (tests/test_launch.py; the
# README's torchrun job still runs, so torchrun itself is covered). It is what CI can afford on a
# second torch version.
set -euo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
VERSION="$1"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.compat/torch-$VERSION"
PY="$VENV/bin/python"
pipq() {  # pip install, quiet, without the notices about this machine's empty local indexes
    "$PY" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2)
}
CORE=(
    --ignore tests/test_benchmarks_smoke.py
    --ignore tests/test_convert_memory_smoke.py
    --ignore tests/test_launch.py
)

installed_torch() {  # "2.13.0+cpu", or nothing when torch is absent
    "$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}

mkdir -p "$ROOT/.compat"
[ -x "$PY" ] || python3 -m venv "$VENV"
CONSTRAINTS="$VENV/constraints.txt"
echo "torch==$VERSION" >"$CONSTRAINTS"

have="$(installed_torch)"
if [ "${have%%+*}" != "$VERSION" ]; then
    start=$(date +%s)
    if [ "$VERSION" != "2.13.0" ] && curl -sfI --max-time 10 https://download.pytorch.org/whl/cpu/torch/ >/dev/null 2>&1; then
        echo "compat: torch==$VERSION from PyTorch's CPU index" >&2
        args=(--index-url https://download.pytorch.org/whl/cpu "torch==$VERSION")
    else
        echo "compat: torch==$VERSION from the configured indexes (2.13.0: the local CPU wheel; else PyPI)" >&2
        args=("torch==$VERSION")
    fi
    # Exit 3 (not 1) when torch cannot be installed: no test ran, which .ci/run reports apart
    # from a failing suite (a registry out of reach is not a fault of distckpt's).
    pipq "${args[@]}" || { echo "compat: could not install torch==$VERSION" >&2; exit 3; }
    echo "compat: torch installed in $(( $(date +%s) - start )) s, venv now $(du -sh "$VENV" | cut -f1)" >&2
    rm -f "$VENV/.distckpt-installed"
fi
before="$(installed_torch)"

stamp="$VENV/.distckpt-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    pipq -c "$CONSTRAINTS" -e "$ROOT[test]"
    touch "$stamp"
fi
after="$(installed_torch)"
if [ "$before" != "$after" ] || [ "${after%%+*}" != "$VERSION" ]; then
    echo "compat: torch changed from '$before' to '$after' while installing distckpt" >&2
    exit 1
fi
build="$("$PY" -c 'import torch; print("cuda " + torch.version.cuda if torch.version.cuda else "cpu")')"

what="full suite"
if [ $# -gt 0 ] && [ "$1" == "--core" ]; then
    shift
    set -- "${CORE[@]}" "$@"
    what="core subset"
elif [ $# -gt 0 ]; then
    what="pytest $*"
fi
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PATH="$VENV/bin:$PATH"
log="$VENV/pytest.log"
# -v into the log (each test's outcome by name, even if a run is cut short); a longer per-test
# timeout than pyproject's 240 s (COMPAT_TEST_TIMEOUT): these runs are about torch's behaviour, and
# a test that runs slowly on a loaded machine would otherwise kill its xdist worker; and a bound on
# the whole run (COMPAT_RUN_TIMEOUT), as xdist can wait forever after a worker died.
set +e
timeout "${COMPAT_RUN_TIMEOUT:-5400}" "$PY" -m pytest -n "${COMPAT_WORKERS:-2}" --dist loadgroup -v -p no:cacheprovider \
    --timeout "${COMPAT_TEST_TIMEOUT:-600}" "$@" >"$log" 2>&1
rc=$?
set -e
sed -n '/= short test summary info =/,$p' "$log"
summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran' "$log" | tail -1 | sed 's/^=* *//; s/ *=*$//')"
echo "(full log: $log)"
echo "torch $after ($build), $what, $(date +%Y-%m-%d): ${summary:-no pytest summary (exit $rc)}"
exit "$rc"
