"""distckpt's private torch APIs (distckpt/_compat.py) exist in the torch under test, and that torch
is inside the range pyproject.toml declares (the range is what has been tested)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def test_every_private_api_resolves():
    from distckpt import _compat

    assert callable(_compat.flatten_state_dict) and callable(_compat.unflatten_state_dict)
    assert callable(_compat.set_element)
    assert _compat.FsspecDcpFileSystem is not None
    assert _compat.PyTorchFileReader is not None and _compat.PyTorchFileWriter is not None
    assert _compat.storage_name_of_dtype(torch.bfloat16) == "BFloat16Storage"
    assert _compat.dtype_from_storage_name("FloatStorage") == torch.float32
    assert callable(_compat.rebuild_tensor_v2)


def test_torch_under_test_is_inside_the_declared_range():
    text = (REPO / "pyproject.toml").read_text()
    spec = re.search(r'"torch(>=[^"]+)"', text).group(1)
    lower = re.search(r">=\s*([\d.]+)", spec).group(1)
    upper = re.search(r"<\s*([\d.]+)", spec).group(1)
    current = _version(torch.__version__)
    assert _version(lower) <= current < _version(upper), (torch.__version__, spec)
