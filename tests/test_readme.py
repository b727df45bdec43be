"""The README's minimal torchrun job runs as written (with a temporary root and fewer steps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import distckpt

REPO = Path(__file__).resolve().parents[1]


def _job_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Adding distckpt to your own job") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_torchrun_job_runs_and_resumes(tmp_path):
    code = _job_block()
    assert 'Checkpointer("/checkpoints/run1"' in code and "range(state[\"step\"] + 1, 1001)" in code
    code = code.replace("/checkpoints/run1", str(tmp_path / "run1"))
    script = tmp_path / "train.py"
    # The CPU explicitly (the job itself runs on GPUs where it finds one per rank).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    for last in (31, 52):
        script.write_text(code.replace("1001", str(last)).replace("step % 100 == 0", "step % 10 == 0"))
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    ckpt = distckpt.Checkpointer(tmp_path / "run1")
    assert ckpt.steps() == [30, 40, 50]  # the second run resumed at 30 (keep_last=3)
    state = {"sampler": distckpt.GlobalBatchSampler(num_samples=100_000, global_batch_size=64, rank=0, world_size=1), "step": 0}
    ckpt.load(state, only=["sampler", "step"])
    assert state["step"] == 50 and state["sampler"].batches_consumed == 50
