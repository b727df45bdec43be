"""Seeded fuzzing of manifest.json, .metadata and .distcp (see tests/fuzz_checkpoints.py).

Every mutated checkpoint must load exactly or fail with a documented error, never another
exception, a hang, a signal or planted code running. The cases run in a child process so that a
signal or a hang is observed, not suffered. More cases: ``DISTCKPT_FUZZ_CASES=5000``; another
seed: ``DISTCKPT_FUZZ_SEED=7`` (or run the script directly).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CASES = int(os.environ.get("DISTCKPT_FUZZ_CASES", "200"))
SEED = int(os.environ.get("DISTCKPT_FUZZ_SEED", "0"))


@pytest.mark.timeout(900)
def test_mutated_checkpoints_load_exactly_or_fail_with_a_documented_error(tmp_path):
    progress = tmp_path / "progress"
    cmd = [sys.executable, str(REPO / "tests" / "fuzz_checkpoints.py"), "--cases", str(CASES), "--seed", str(SEED),
           "--work", str(tmp_path / "work"), "--progress", str(progress)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(240, CASES * 2), cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fuzzing hung at case {progress.read_text() if progress.exists() else '?'} (case seed)")
    where = progress.read_text() if progress.exists() else "?"
    assert done.returncode >= 0, f"killed by signal {-done.returncode} at case {where} (case seed)\n{done.stderr[-3000:]}"
    assert not (tmp_path / "work" / "PLANTED_CODE_RAN").exists(), "a planted pickle ran code"
    problems = [line for line in done.stdout.splitlines() if line.startswith(("case ", "PLANTED"))]
    assert done.returncode == 0 and f"{CASES} cases, 0 with problems" in done.stdout, "\n".join(problems) or done.stderr[-3000:]
