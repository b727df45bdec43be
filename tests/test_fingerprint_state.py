"""Fingerprint version 2 where it decides something: the per-rank/global decision of a save, the
state check of a load, ``verify --state``; and checkpoints that recorded version 1 still check.

The value pairs used here are chosen so that version 1 (a linear sum in which two sign flips
cancel half of the time) cannot tell them apart: each test fails with version 1's construction.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import distckpt
from dist_harness import run_ranks
from distckpt.state import fingerprint as fp
from distckpt.state.statecheck import StateDivergedError

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _v1_blind_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``-x`` (2 elements) with equal version-1 fingerprints."""
    g = torch.Generator().manual_seed(5)
    while True:
        x = torch.randn(2, generator=g)
        if fp.of_tensor(x, 1) == fp.of_tensor(-x, 1):
            return x, -x


def _v1_blind_flip(t: torch.Tensor) -> tuple[int, int]:
    """Two positions of ``t`` whose sign flips leave its version-1 fingerprint unchanged."""
    ref = fp.of_tensor(t, 1)
    flat = t.reshape(-1)
    for i in range(flat.numel()):
        for j in range(i + 1, flat.numel()):
            u = flat.clone()
            u[i], u[j] = -u[i], -u[j]
            if fp.of_tensor(u.view(t.shape), 1) == ref:
                return i, j
    raise AssertionError("no such pair")


def _opposite_values(rank: int, world: int, root: str, x: list[float]) -> list[float]:
    value = torch.tensor(x) * (1 if rank == 0 else -1)
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, {"t": value})
    scope = ckpt.manifest(1).entries["t"]["scope"]
    back = {"t": torch.zeros(2)}
    ckpt.load(back)
    ckpt.close()
    return [scope, back["t"].tolist()]


def test_ranks_holding_x_and_minus_x_are_saved_per_rank(tmp_path):
    # A value two ranks hold differently is stored per rank; judged equal, one rank's copy would
    # be stored as global and the other rank would resume with it.
    x, _ = _v1_blind_pair()
    out = run_ranks(_opposite_values, 2, tmp_path, str(tmp_path / "ck"), x.tolist())
    assert [o[0] for o in out] == ["per_rank", "per_rank"]
    assert out[0][1] == x.tolist() and out[1][1] == (-x).tolist()


def _flip_stored_signs(step_dir: Path, t: torch.Tensor, i: int, j: int) -> None:
    """Flip the sign bits of elements ``i`` and ``j`` of ``t`` where its bytes are stored."""
    raw = t.numpy().tobytes()
    for f in step_dir.glob("*.distcp"):
        data = bytearray(f.read_bytes())
        at = data.find(raw)
        if at >= 0:
            for k in (i, j):
                data[at + 4 * k + 3] ^= 0x80  # little-endian float32: the sign is the last byte's top bit
            f.write_bytes(bytes(data))
            return
    raise AssertionError("tensor bytes not found")


def test_two_flipped_sign_bits_fail_the_state_check_and_verify_state(tmp_path):
    t = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    i, j = _v1_blind_flip(t)
    root = tmp_path / "ck"
    # checksum=None: the file checksums would catch the flips first; the fingerprints must too.
    with distckpt.Checkpointer(str(root), checksum=None) as ckpt:
        ckpt.save(1, {"w": t.clone()})
    _flip_stored_signs(root / "step_000000001", t, i, j)
    with distckpt.Checkpointer(str(root), checksum=None) as ckpt:
        with pytest.raises(StateDivergedError, match="'w'|w"):
            ckpt.load({"w": torch.zeros(8, 8)}, verify_state=True)
    from cli_runner import run_cli

    res = run_cli("verify", str(root), "--state")
    assert res.returncode != 0 and "'w'" in res.stdout + res.stderr


def test_checkpoints_that_recorded_version_1_still_check(tmp_path):
    # A manifest written before fingerprint_version existed holds version-1 fingerprints: loads
    # and `verify --state` check them with version 1, and catch a change.
    t = torch.randn(6, 5, generator=torch.Generator().manual_seed(9))
    root = tmp_path / "ck"
    with distckpt.Checkpointer(str(root)) as ckpt:
        ckpt.save(3, {"w": t.clone()})
        assert ckpt.manifest(3).fingerprint_version == fp.VERSION == 2
    path = root / "step_000000003" / "manifest.json"
    raw = json.loads(path.read_text())
    assert raw["fingerprints"]["w"] == fp.of_tensor(t, 2)
    # Every tensor's (the RNG states' too) fingerprint as version 1 computes it from the files.
    from distckpt.state.statecheck import from_files
    from distckpt.tools.catalog import locate
    from distckpt.integrity.shards import CheckpointSource

    raw["fingerprints"] = from_files(CheckpointSource(locate(str(root), {}, 3)), version=1)
    assert raw["fingerprints"]["w"] == fp.of_tensor(t, 1) != fp.of_tensor(t, 2)
    del raw["fingerprint_version"]
    path.write_text(json.dumps(raw))
    from cli_runner import run_cli

    with distckpt.Checkpointer(str(root)) as ckpt:
        assert ckpt.manifest(3).fingerprint_version == 1
        back = {"w": torch.zeros(6, 5)}
        ckpt.load(back, verify_state=True)
        assert torch.equal(back["w"], t)
    assert run_cli("verify", str(root), "--state").returncode == 0
    # Read with the wrong construction, the same manifest fails: the version is what is honoured.
    raw["fingerprint_version"] = 2
    path.write_text(json.dumps(raw))
    with distckpt.Checkpointer(str(root)) as ckpt:
        with pytest.raises(StateDivergedError):
            ckpt.load({"w": torch.zeros(6, 5)}, verify_state=True)
    # A construction this distckpt does not know is named, not mistaken for a divergence.
    raw["fingerprint_version"] = 7
    path.write_text(json.dumps(raw))
    with distckpt.Checkpointer(str(root)) as ckpt:
        with pytest.raises(ValueError, match="fingerprint version 7"):
            ckpt.load({"w": torch.zeros(6, 5)}, verify_state=True)


def test_verify_state_names_a_stored_tensor_without_a_fingerprint(tmp_path):
    # A tensor in .metadata whose fingerprint the manifest lacks (removed by an edit, its data
    # changed and the checksums redone) passed `verify --state` as "OK ... fingerprints of N
    # tensors", silently; a value without its digest was already named.
    from cli_runner import run_cli

    root = tmp_path / "ck"
    with distckpt.Checkpointer(str(root)) as ckpt:
        ckpt.save(3, {"w": torch.ones(4, 4), "v": torch.zeros(3)})
    path = root / "step_000000003" / "manifest.json"
    raw = json.loads(path.read_text())
    del raw["fingerprints"]["w"]
    path.write_text(json.dumps(raw))
    done = run_cli("verify", str(root), "--state")
    assert done.returncode == 1, done
    assert "UNVERIFIED" in done.stderr and "no fingerprint in the manifest" in done.stderr and "'w'" in done.stderr
    assert "'v'" not in done.stderr
    done = run_cli("verify", str(root), "--state", "--json")
    assert done.returncode == 1 and not json.loads(done.stdout)["verified"]
    done = run_cli("verify", str(root), "--state", "--allow-unverified")
    assert done.returncode == 0 and "WARNING" in done.stderr and "'w'" in done.stderr, done
    assert "only sizes were checked" not in done.stderr  # (the checksums were checked)


def test_verify_state_passes_a_quantized_tensor_on_its_checksums(tmp_path):
    # No save records a fingerprint of a quantized tensor (none is made of one): `verify --state`
    # called it UNVERIFIED and blamed an altered manifest (a review finding).
    from cli_runner import run_cli

    q = torch.quantize_per_tensor(torch.randn(8), 0.1, 3, torch.qint8)
    with distckpt.Checkpointer(str(tmp_path / "ck")) as ckpt:
        ckpt.save(1, {"q": q, "w": torch.ones(3)})
    done = run_cli("verify", str(tmp_path / "ck"), "--state")
    assert done.returncode == 0, done
    assert "not fingerprintable (quantized), checksums only: 'q'" in done.stdout, done.stdout
