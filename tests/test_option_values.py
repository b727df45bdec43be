"""Option and argument values a careless user passes (a string from a config file, a number out
of range): each is a ValueError naming the option, before anything is written; never a save
thread that dies and leaves wait() blocked, or a flag taken by its truth. Found by a helper."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

import distckpt
from distckpt.save import run as save_run

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


@pytest.mark.parametrize("option, value", [
    ("background_nice", "10"), ("background_nice", None), ("background_nice", 1.5), ("background_nice", -1),
    ("timeout", 0), ("timeout", -5), ("timeout", None), ("timeout", "30"), ("timeout", float("nan")),
    ("timeout", timedelta(0)), ("timeout", 1e300), ("timeout", 8_640_000_000), ("timeout", timedelta.max),
    ("backend", "glo"), ("backend", 5), ("backend", "cpu:glo"), ("process_group", "x"),
    # As torch parses backends (not stripped: " gloo" failed the first save, blaming a dead
    # peer), and a timeout gloo would count as 0 ms (every collective timed out at once).
    ("backend", " gloo"), ("backend", "cpu: gloo"), ("timeout", 1e-9), ("timeout", timedelta(microseconds=400)),
    ("lease_s", 1e-6), ("lease_s", float("inf")), ("lease_s", "600"), ("lease_s", True),
    ("thread_count", 10**6), ("thread_count", 0),
    ("save_rng", "False"), ("verify", 0), ("sync_files", None), ("fingerprint", "no"), ("skip_torch_record_crc", 1),
    ("verify_state", "always"), ("safe_types", 5), ("safe_types", "Mode"),
])  # fmt: skip
def test_bad_option_values_are_refused_naming_the_option(tmp_path, option, value):
    with pytest.raises(ValueError, match=rf"^{option} (must be|takes)"):
        distckpt.Checkpointer(tmp_path / "root", **{option: value})
    assert not (tmp_path / "root").exists()


def test_good_values_of_those_options_are_taken(tmp_path):
    import numpy as np

    ckpt = distckpt.Checkpointer(
        tmp_path, background_nice=np.int64(0), timeout=np.int64(30), lease_s=np.float32(600), thread_count=np.int32(4),
        save_rng=np.bool_(False), verify_state=True, backend="cpu:gloo,cuda:nccl",
    )  # fmt: skip
    assert ckpt.options.timeout == timedelta(seconds=30) and ckpt.options.save_rng is False and ckpt.options.lease_s == 600.0
    ckpt.close()
    ckpt = distckpt.Checkpointer(tmp_path, lease_s=1, timeout=timedelta(days=365))
    assert distckpt.Checkpointer(tmp_path, timeout=timedelta(minutes=1)).options.timeout == timedelta(minutes=1)
    ckpt.save(1, {"w": torch.ones(2)})
    ckpt.close()


def test_load_arguments_that_are_not_what_they_say_are_refused(tmp_path):
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
        state = {"w": torch.zeros(2)}
        with pytest.raises(ValueError, match="step must be a non-negative int or None, got -1"):
            ckpt.load(state, step=-1)  # was: 'step_-00000001 does not exist'
        with pytest.raises(ValueError, match=r"load\(strict=\.\.\.\) must be True or False, got 'no'"):
            ckpt.load(state, strict="no")  # was: strict, by its truth
        with pytest.raises(ValueError, match=r"load\(verify_state=\.\.\.\) must be None, True or False"):
            ckpt.load(state, verify_state="always")
        assert ckpt.load(state, step=1) == 1 and torch.equal(state["w"], torch.ones(2))


def test_a_failure_before_an_async_save_starts_writing_is_raised_by_wait(tmp_path, monkeypatch):
    # The thread lowered its priority before its try/finally: an error there (a background_nice
    # the constructor let through) left the save never done, and wait(), close() and the
    # interpreter's exit blocked for ever.
    def broken(nice):
        raise TypeError("nice")

    monkeypatch.setattr(save_run, "lower_priority", broken)
    ckpt = distckpt.Checkpointer(tmp_path, async_mode="thread")
    ckpt.save(1, {"w": torch.ones(2)}, blocking=False)
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(pytest.raises(TypeError, ckpt.wait)), daemon=True)
    waiter.start()
    waiter.join(60)
    assert outcome, "wait() still blocked"
    monkeypatch.undo()
    ckpt.save(2, {"w": torch.ones(2)})
    ckpt.close()
