"""A process that used distckpt exits cleanly (issue: 1 in 10 died with SIGABRT at exit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JOBS = 15  # two ranks each: 30 processes
AT_ONCE = 3


def _mode(job: int) -> str:
    # Every third job writes its async save in writer processes (which must be stopped cleanly
    # at exit too); the others in a thread. Writers double a job's process start-ups, so not all.
    return "process" if job % 3 == 0 else "thread"


def _start(job: int, tmp_path: Path) -> list[subprocess.Popen]:
    root = tmp_path / "root"  # shared by all jobs, one step each
    return [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "exit_job.py"), str(rank), "2", str(root), str(tmp_path / f"store{job}"), str(job), _mode(job)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for rank in range(2)
    ]


@pytest.mark.timeout(600)
def test_thirty_processes_that_used_distckpt_all_exit_zero(tmp_path):
    # The first job saves step 0 so that every later job loads (and keeps a caught error).
    results = []
    first = _start(0, tmp_path)
    results += [(0, p.returncode, *p.communicate(timeout=120)) for p in first for _ in [p.wait(timeout=120)]]
    pending = list(range(1, JOBS))
    while pending:
        batch, pending = pending[:AT_ONCE], pending[AT_ONCE:]
        procs = [(job, p) for job in batch for p in _start(job, tmp_path)]
        for job, p in procs:
            out, err = p.communicate(timeout=180)
            results.append((job, p.returncode, out, err))
    bad = [(job, rc, err[-2000:]) for job, rc, out, err in results if rc != 0 or "done" not in out]
    assert len(results) == 2 * JOBS
    assert not bad, f"{len(bad)} of {len(results)} processes did not exit cleanly: {bad[:3]}"
