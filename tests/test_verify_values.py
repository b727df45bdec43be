"""``distckpt verify --state`` reads every non-tensor value as a load does, decoding included.

Values JSON cannot hold (``np.float64`` hyper-parameters, Enum members, paths) are stored in
distckpt's encoded form (:mod:`distckpt.state.encoded`). ``verify --state`` used to check their
stored bytes only: an encoded value that a load refuses as malformed (a buggy or forged writer,
its digest recorded to match) passed ``verify --state`` and then failed the load. Now verify
decodes each value too; a value of a class of the training code (which only a process holding
the class rebuilds, ``Checkpointer(safe_types=...)``) is not an error.
"""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

from cli_runner import run_cli
from distckpt import Checkpointer
from distckpt.errors import IntegrityError
from distckpt.state import encoded
from distckpt.state.encoded import MARKER


class Phase(enum.Enum):
    WARMUP = 1
    MAIN = 2


def _state() -> dict:
    return {"w": torch.arange(6.0), "extra": {"best": np.float64(0.25), "phase": Phase.MAIN, "n": 3}}


def test_verify_state_decodes_values_as_a_load_does(tmp_path, monkeypatch):
    good = tmp_path / "good"
    Checkpointer(good, safe_types=[Phase]).save(1, _state())
    res = run_cli("verify", str(good), "--state")
    assert res.returncode == 0, res.stderr  # an Enum of the training code is no error

    # A writer that stores a NumPy scalar's encoded form without its value (fields a load refuses);
    # the manifest's digests are of those bytes, so every checksum matches.
    def malformed(self, value, key):
        return (MARKER, "numpy.scalar", (value.dtype.str,))

    monkeypatch.setattr(encoded._Encoder, "_np_scalar", malformed)
    bad = tmp_path / "bad"
    Checkpointer(bad, safe_types=[Phase]).save(1, _state())
    monkeypatch.undo()
    with pytest.raises(IntegrityError, match="malformed"):
        Checkpointer(bad, safe_types=[Phase]).load({"w": torch.zeros(6), "extra": {}})
    res = run_cli("verify", str(bad), "--state")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "extra" in res.stderr and "malformed" in res.stderr, res.stderr
    assert run_cli("verify", str(bad)).returncode == 0  # sizes and checksums alone cannot see it
