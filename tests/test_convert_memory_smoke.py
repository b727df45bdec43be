"""benchmarks/convert_memory.py still runs (``--quick``) and publishes its JSON and table like the
other benchmarks (benchmarks/_common.publish)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_convert_memory_quick(tmp_path: Path) -> None:
    out = tmp_path / "convert_memory.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "convert_memory.py"), "--quick", "--json", str(out), "--dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert res["benchmark"] == "convert_memory" and res["machine"]["cores"] >= 1
    cases = {r["case"]: r for r in res["results"]}
    for case in ("distckpt convert --to safetensors", "distckpt convert --to torch --model-only"):
        assert cases[case]["output_bytes"] > 0 and cases[case]["peak_rss_mb"] > 0
    assert res["all_streaming_under_target"]
    assert out.with_suffix(".md").read_text().startswith("Converting a")
