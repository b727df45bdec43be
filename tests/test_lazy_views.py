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


def _views() -> dict:
    z = torch.randn(5, dtype=torch.complex64)
    return {"c": z.conj(), "neg": torch.randn((), dtype=torch.complex64).conj().imag}


def test_lazy_views_with_the_staging_proof_and_as_load_destinations(tmp_path):
    """With ``verify_staging=True`` an async save of a conjugate view (or of a contiguous
    negative view: a 0-d ``.conj().imag``) failed in the staging digest (view_as_real / view of
    a negative view, no key named); loading into such views failed in the direct read
    (torch refuses ``view(uint8)`` of them; writing the raw bytes there would have stored the
    conjugate). Found by a helper (2026-11-29); plain DCP does both."""
    state = _views()
    assert state["neg"].is_neg() and state["neg"].is_contiguous()
    with distckpt.Checkpointer(tmp_path, async_mode="thread", verify_staging=True) as ck:
        ck.save(1, state, blocking=False)
        ck.wait()
        out = {"c": torch.zeros(5, dtype=torch.complex64).conj(), "neg": torch.zeros((), dtype=torch.complex64).conj().imag}
        assert out["c"].is_conj() and out["neg"].is_neg()
        ck.load(out)
        for k, v in state.items():
            assert torch.equal(out[k], v), k


def _replicated_views(rank: int, world: int, root: str) -> bool:
    torch.manual_seed(0)  # the same values on both ranks: replicated
    state = _views()
    with distckpt.Checkpointer(root) as ck:
        ck.save(1, state)
        out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
        ck.load(out)
    return all(torch.equal(out[k], v) for k, v in state.items())


def test_replicated_lazy_views_at_two_ranks(tmp_path):
    """At world size 2 the replicas' check digested a conjugate or negative view's memory as it
    lies (view_as_real / view refused it): every rank's sync save failed, naming no key. Found by
    a helper (2026-11-29); plain DCP saves them."""
    from dist_harness import run_ranks

    assert run_ranks(_replicated_views, 2, tmp_path, str(tmp_path / "root"), timeout=120) == [True, True]


def test_tensors_pickle_cannot_carry_reach_the_writer_process(tmp_path):
    """Tensors that travel to the writer process pickled (empty ones, those inside values) of a
    dtype torch's own pickling cannot read back (float8, complex32, uint16: "UntypedStorage has
    no attribute dtype") ended the writer silently: "exited (code 0) before answering", no key,
    no cause. Found by a helper (2026-11-29); sync and thread-mode saves took them."""
    state = {
        "tup": (torch.randn(3).to(torch.float8_e5m2), torch.randn(2, dtype=torch.chalf)),
        "empty8": torch.empty(0, 4, dtype=torch.float8_e4m3fn),
        "empty16": torch.empty(0, dtype=torch.uint16),
        "w": torch.randn(8),
    }
    with distckpt.Checkpointer(tmp_path, async_mode="process") as ck:
        ck.save(1, state, blocking=False)
        ck.wait()
        out = {
            "tup": (torch.zeros(3, dtype=torch.float8_e5m2), torch.zeros(2, dtype=torch.chalf)),
            "empty8": torch.empty(0, 4, dtype=torch.float8_e4m3fn),
            "empty16": torch.empty(0, dtype=torch.uint16),
            "w": torch.zeros(8),
        }
        ck.load(out)
    assert torch.equal(out["tup"][0].view(torch.uint8), state["tup"][0].view(torch.uint8))
    assert torch.equal(out["tup"][1].view(torch.int32), state["tup"][1].view(torch.int32))
    assert out["empty8"].shape == (0, 4) and out["empty16"].dtype == torch.uint16 and torch.equal(out["w"], state["w"])
