"""Concurrent writers on one root: nothing that committed is lost, a step has one writer.

Two independent jobs (separate processes, no shared process group) save to the same root at
the same time: on distinct steps, and on the same steps. No sleeps: each writer just saves as
fast as it can, and the checks are on what returned and what is on disk afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import warnings

import pytest
import torch

import distckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")

ROUNDS = 12


def _values(writer: int, step: int) -> dict:
    return {"w": {"a": torch.full((64, 64), float(writer * 1000 + step)), "b": torch.arange(10) + step}, "who": writer}


def _writer(writer: int, root: str, steps: list[int], out: mp.Queue) -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled", category=UserWarning)
    ckpt = distckpt.Checkpointer(root)
    done, refused, other = [], [], []
    for i, step in enumerate(steps):
        try:
            ckpt.save(step, _values(writer, step), blocking=bool(i % 2))
            ckpt.wait()
            done.append(step)
        except distckpt.StepExistsError:
            refused.append(step)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            other.append(f"{step}: {type(exc).__name__}: {exc}")
    ckpt.close()
    out.put((writer, done, refused, other))


def _run(root: str, plans: dict[int, list[int]]) -> dict[int, tuple]:
    ctx = mp.get_context("forkserver")
    out = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(w, root, steps, out)) for w, steps in plans.items()]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        w, done, refused, other = out.get(timeout=240)
        results[w] = (done, refused, other)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def _check_committed(root: str, step: int, writer: int) -> None:
    got = _values(-1, -1)
    assert distckpt.Checkpointer(root).load(got, step=step) == step
    want = _values(writer, step)
    assert got["who"] == writer and all(torch.equal(got["w"][k], want["w"][k]) for k in want["w"]), (step, writer)


def test_two_writers_on_distinct_steps_lose_nothing(tmp_path):
    root = str(tmp_path / "ck")
    results = _run(root, {1: [2 * i + 1 for i in range(ROUNDS)], 2: [2 * i + 2 for i in range(ROUNDS)]})
    for w, (done, refused, other) in results.items():
        assert other == [] and refused == [], (w, other, refused)
    committed = distckpt.Checkpointer(root).steps()
    assert committed == list(range(1, 2 * ROUNDS + 1)), "a save that returned was deleted"
    for w, (done, _, _) in results.items():
        for step in done:
            _check_committed(root, step, w)


def test_two_writers_of_the_same_steps_never_both_commit(tmp_path):
    root = str(tmp_path / "ck")
    steps = list(range(100, 100 + ROUNDS))
    results = _run(root, {1: steps, 2: steps})
    for w, (_, _, other) in results.items():
        assert other == [], (w, other)
    (done1, refused1, _), (done2, refused2, _) = results[1], results[2]
    assert not set(done1) & set(done2), "both writers reported success for the same step"
    assert sorted(done1 + refused1) == steps and sorted(done2 + refused2) == steps
    assert distckpt.Checkpointer(root).steps() == sorted(done1 + done2)
    for w, done in ((1, done1), (2, done2)):
        for step in done:
            _check_committed(root, step, w)


def test_a_save_that_fails_while_staging_releases_its_step(tmp_path, monkeypatch):
    # A staging failure leaves nothing behind (an async save creates its step directory, under
    # a lease, only after staging), holds no lease, and the next save works.
    import pytest

    from distckpt.save import staging
    from distckpt.integrity.manifest import step_dir

    def fail(self, state_dict, skip=frozenset(), verify=None):
        raise RuntimeError("staging failed")

    ckpt = distckpt.Checkpointer(tmp_path)
    monkeypatch.setattr(staging.Stager, "stage", fail)
    with pytest.raises(RuntimeError, match="staging failed"):
        ckpt.save(1, {"w": torch.ones(3)}, blocking=False)
    assert ckpt._saver.lease is None and not (tmp_path / step_dir(1)).exists()
    monkeypatch.undo()
    ckpt.save(2, {"w": torch.ones(3)})
    assert ckpt.steps() == [2] and not (tmp_path / step_dir(1)).exists()
    ckpt.close()


def test_a_step_whose_owner_record_vanished_while_written_is_not_blamed_on_another_writer(tmp_path, monkeypatch):
    """The root deleted (``rm -rf``) during an async save: the writes made the step's folder
    again, without its owner record, and the save failed with "another writer took it over"
    (there was none). It now says the record is gone and why. Found by a helper (2026-11-29)."""
    import threading

    from distckpt.save import writer as _writer
    from distckpt.storage.ownership import OWNER_NAME

    entered, release = threading.Event(), threading.Event()
    orig = _writer._ChecksumStream.write

    def write(stream, b):  # a disk that stalls until the test lets it go
        entered.set()
        release.wait(120)
        return orig(stream, b)

    monkeypatch.setattr(_writer._ChecksumStream, "write", write)
    root = tmp_path / "root"
    with distckpt.Checkpointer(root, async_mode="thread") as ck:
        ck.save(1, {"w": torch.zeros(1 << 16)}, blocking=False)
        assert entered.wait(120)
        (root / "step_000000001" / OWNER_NAME).unlink()  # what rm -rf did to it
        release.set()
        with pytest.raises(distckpt.CheckpointError, match="owner record is gone .*deleted while the step was being written"):
            ck.wait()
        assert ck.steps() == []
        ck.save(2, {"w": torch.ones(1 << 16)})
        assert ck.steps() == [2]
