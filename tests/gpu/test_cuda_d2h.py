"""The CUDA tier of a sync save's device-to-host pipeline (distckpt/save/d2h.py): the copies go
through the pinned ring on a side stream, follow the caller's stream, and every copy is proven.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt.save import d2h

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.xdist_group("cuda"),
    pytest.mark.timeout(600),
]


def test_a_sync_save_copies_through_the_pinned_ring_and_proves_each_copy(tmp_path, monkeypatch):
    issued, proven = [], []
    real_issue, real_prove = d2h._Copier.issue, d2h._prove
    monkeypatch.setattr(d2h._Copier, "issue", lambda self, p, prove: issued.append(self.memory.is_pinned()) or real_issue(self, p, prove))
    monkeypatch.setattr(d2h, "_prove", lambda p, host, where: proven.append(p.item.index.fqn) or real_prove(p, host, where))
    monkeypatch.setattr(d2h, "RING_BYTES", 8 << 20)  # smaller than the state: the ring wraps
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(1 << 20, device="cuda") for i in range(24)}  # 4 MiB each, 96 MiB
    with distckpt.Checkpointer(tmp_path, save_rng=False, thread_count=2) as ckpt:
        ckpt.save(1, {"w": state})
        assert len(issued) == 24 and all(issued)
        assert sorted(proven) == sorted(f"w.t{i}" for i in range(24))
        dest = {"w": {k: torch.zeros_like(v) for k, v in state.items()}}
        # verify_state: the fingerprints the writer threads left on the device and settled after
        # the write (fingerprint.settled) are the ones the loaded values give.
        ckpt.load(dest, verify_state=True)
    assert all(torch.equal(dest["w"][k], v) for k, v in state.items())


def test_a_sync_save_copies_what_the_callers_stream_computed(tmp_path):
    # The tensors are written on a stream of the caller's, behind a long kernel: the copies must
    # wait for it (they follow the caller's current stream, not the writer threads' defaults).
    side = torch.cuda.Stream()
    x = torch.zeros(64 << 20, device="cuda")  # 256 MiB
    torch.cuda.synchronize()
    with torch.cuda.stream(side), distckpt.Checkpointer(tmp_path, save_rng=False) as ckpt:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the stream's time before the fill
        x.fill_(3.0)
        ckpt.save(1, {"x": x})
    torch.cuda.synchronize()
    dest = {"x": torch.zeros_like(x)}
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load(dest)
    assert bool((dest["x"] == 3.0).all())
