"""Lazy conjugate and negative views save their values (sync and async, with and without fingerprints)."""
from __future__ import annotations

import pytest
import torch

import distckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


@pytest.mark.parametrize("fingerprint", [True, False])
def test_conjugate_and_negative_views_save_their_values(tmp_path, fingerprint):
    """``t.conj()`` is a lazy view: its memory holds the unconjugated values. A sync save wrote
    those (the conjugate lost silently, checksums and all) where fingerprints were off, and
    failed inside the fingerprint (torch's view_as_real error, no key named) where they were on.
    Found by a helper (2026-11-29); plain DCP saves the values."""
    t = torch.randn(4, 3, dtype=torch.complex64)
    state = {"c": t.conj(), "neg": t.conj().imag, "ct": t.t().conj(), "col": t[:, 1].conj()}
    assert state["c"].is_conj() and state["neg"].is_neg()
    with distckpt.Checkpointer(tmp_path, async_mode="thread", fingerprint=fingerprint, verify_state=fingerprint) as ck:
        ck.save(1, state)
        ck.save(2, state, blocking=False)
        ck.wait()
        for step in (1, 2):
            out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
            ck.load(out, step=step)
            for k, v in state.items():
                assert torch.equal(out[k], v), (step, k)
