"""What importing distckpt costs a process: every training process pays it, and so does every
background writer process, at each start (and the test suite at every interpreter it starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_importing_distckpt_does_not_import_torch_distributed_optim():
    # torch.distributed.optim scripts eight functional optimizers at import: ~0.3 s of a ~2.7 s
    # start, for a class (ZeroRedundancyOptimizer) that only states holding one need, whose
    # module is then imported already (distckpt.state.zero.is_zero).
    code = (
        "import sys, distckpt, distckpt.save.background, distckpt.tools.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.optim')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_zero_is_recognised_without_importing_it():
    code = (
        "import sys, torch\n"
        "from distckpt.state import zero\n"
        "sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)\n"
        "assert not zero.is_zero(sgd) and not zero.is_zero(object())\n"
        "assert zero.ZERO_MODULE not in sys.modules\n"
        "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
        "class Mine(ZeroRedundancyOptimizer):\n"
        "    def __init__(self):\n"
        "        pass\n"
        "assert zero.is_zero(Mine()) and not zero.is_zero(sgd)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
