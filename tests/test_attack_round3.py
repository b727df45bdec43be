"""Review round 3: the replica's upload thread, and where the Lightning plugin writes its pointers.

* A warning turned into an error (``-W error``, ``warnings.simplefilter("error")``) ended the
  replica's upload thread at the first failed upload: every later step stayed pending forever,
  so ``replica.wait()`` never returned. ``wait`` also took a NaN timeout.
* ``DistckptCheckpointIO.save_checkpoint`` wrote its pointer wherever Lightning's path said:
  into a committed step (replacing its ``manifest.json`` or ``.metadata``: the checkpoint was
  lost), at a step directory a later save needs, into a directory (after the step committed);
  and a local file name holding ``::`` was read by fsspec as a URL chain (the pointer went to
  another file).
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

import distckpt

pytest.importorskip("lightning")

from distckpt.integrations.lightning import DistckptCheckpointIO

sys.path.insert(0, str(Path(__file__).parent))
from dist_harness import run_ranks


# ---------------------------------------------------------------------------------------------
# replica
def test_replica_thread_survives_warnings_as_errors(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    ckpt = distckpt.Checkpointer(str(tmp_path / "root"), replicate_to=str(tmp_path / "afile" / "replica"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # process-wide: the upload thread sees it too
            ckpt.save(1, {"w": torch.ones(3)})
            with pytest.raises(distckpt.ReplicationError, match="step 1"):
                ckpt.replica.wait(timeout=60)
            ckpt.save(2, {"w": torch.ones(3)})
            # Before the fix the thread was dead: step 2 stayed pending (TimeoutError here, a hang without timeout).
            with pytest.raises(distckpt.ReplicationError) as info:
                ckpt.replica.wait(timeout=60)
        assert sorted(info.value.steps) == [1, 2]
        status = ckpt.replica.status()
        assert status.pending == () and [s for s, _ in status.failed] == [1, 2]
    finally:
        ckpt.close()
    assert ckpt.replica.status().pending == ()


@pytest.mark.parametrize("bad", [math.nan, -1, math.inf, "5", True])
def test_replica_wait_refuses_bad_timeouts(tmp_path: Path, bad: object) -> None:
    ckpt = distckpt.Checkpointer(str(tmp_path / "root"), replicate_to=str(tmp_path / "replica"))
    try:
        with pytest.raises(ValueError, match="timeout"):
            ckpt.replica.wait(timeout=bad)  # type: ignore[arg-type]
        assert ckpt.replica.wait(timeout=0) == distckpt.ReplicaStatus((), (), (), ())
    finally:
        ckpt.close()


# ---------------------------------------------------------------------------------------------
# Lightning pointer paths
def _checkpoint(step: int) -> dict:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((4,), float(step))}}


def test_pointer_never_written_into_a_committed_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    io = DistckptCheckpointIO(str(root))
    try:
        io.save_checkpoint(_checkpoint(1), tmp_path / "ck" / "a.ckpt")
        step1 = root / "step_000000001"
        before = {p.name: p.read_bytes() for p in step1.iterdir()}
        for target in ["manifest.json", ".metadata", "__0_0.distcp", "x.ckpt"]:
            with pytest.raises(ValueError, match="step directory"):
                io.save_checkpoint(_checkpoint(2), step1 / target)
        # A step directory a later save would create, the root itself.
        with pytest.raises(ValueError, match="step directory"):
            io.save_checkpoint(_checkpoint(3), root / "step_000000005")
        with pytest.raises(ValueError, match="the root"):
            io.save_checkpoint(_checkpoint(3), root)
        assert {p.name: p.read_bytes() for p in step1.iterdir()} == before
        assert io.checkpointer.steps() == [1]
        assert torch.equal(io.load_checkpoint(tmp_path / "ck" / "a.ckpt")["state_dict"]["w"], torch.full((4,), 1.0))
        io.save_checkpoint(_checkpoint(5), root / "last.ckpt")  # beside the steps: allowed (README)
        assert io.load_checkpoint(root / "last.ckpt")["global_step"] == 5
    finally:
        io.teardown()


def test_pointer_not_written_into_another_checkpoint_or_a_directory(tmp_path: Path) -> None:
    other = distckpt.Checkpointer(str(tmp_path / "other"))
    other.save(7, {"w": torch.ones(2)})
    other.close()
    io = DistckptCheckpointIO(str(tmp_path / "root"))
    try:
        with pytest.raises(ValueError, match="inside the checkpoint"):
            io.save_checkpoint(_checkpoint(1), tmp_path / "other" / "step_000000007" / "manifest.json")
        assert distckpt.Checkpointer(str(tmp_path / "other")).manifest(7).step == 7
        (tmp_path / "adir").mkdir()
        with pytest.raises(ValueError, match="is a directory"):
            io.save_checkpoint(_checkpoint(1), tmp_path / "adir")
        # Refused before saving: no step committed that nothing points at.
        assert io.checkpointer.steps() == []
    finally:
        io.teardown()


def test_local_pointer_name_with_double_colon(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "epoch=1").write_text("the user's file")
    io = DistckptCheckpointIO(str(tmp_path / "root"))
    try:
        path = ck / "epoch=1::step=1.ckpt"
        io.save_checkpoint(_checkpoint(1), path)
        assert path.is_file() and (ck / "epoch=1").read_text() == "the user's file"
        assert io.load_checkpoint(path)["global_step"] == 1
        io.remove_checkpoint(path)
        assert not path.exists() and (ck / "epoch=1").read_text() == "the user's file"
        assert io.checkpointer.steps() == []  # its step went with its only pointer
    finally:
        io.teardown()


class _Strategy:  # what attach() needs: a weak-referenceable object (no trainer attached)
    pass


def _ranks_refuse_pointer_into_step(rank: int, world: int, root: str, ck: str) -> list[str]:
    io = DistckptCheckpointIO(root)
    strategy = _Strategy()
    io.attach(strategy)  # type: ignore[arg-type]
    out = []
    try:
        io.save_checkpoint(_checkpoint(1), f"{ck}/a.ckpt")
        try:
            io.save_checkpoint(_checkpoint(2), f"{root}/step_000000001/manifest.json")
        except ValueError as exc:
            out.append(str(exc))
        out.append(str(io.load_checkpoint(f"{ck}/a.ckpt")["global_step"]))
    finally:
        io.teardown()
    return out


def test_pointer_refusal_on_every_rank(tmp_path: Path) -> None:
    root, ck = str(tmp_path / "root"), str(tmp_path / "ck")
    results = run_ranks(_ranks_refuse_pointer_into_step, 2, tmp_path, root, ck, timeout=120, pg_timeout=60)
    for out in results:
        assert len(out) == 2 and "step directory" in out[0] and out[1] == "1", out


def test_removing_another_jobs_pointer_keeps_this_jobs_step(tmp_path: Path) -> None:
    a = DistckptCheckpointIO(str(tmp_path / "A"), job="a")
    a.save_checkpoint(_checkpoint(1), tmp_path / "ck" / "a.ckpt")
    a.teardown()
    b = DistckptCheckpointIO(str(tmp_path / "B"), job="b")
    b.save_checkpoint(_checkpoint(1), tmp_path / "elsewhere" / "b.ckpt")
    b.teardown()
    b = DistckptCheckpointIO(str(tmp_path / "B"), job="b")  # a later process: elsewhere/ is not a directory it knows
    try:
        b.remove_checkpoint(tmp_path / "ck" / "a.ckpt")  # job a's pointer (step 1 of root A)
        # Before the fix: B's own step 1 was deleted (same number), and b.ckpt pointed at nothing.
        assert b.checkpointer.steps() == [1]
        assert b.load_checkpoint(tmp_path / "elsewhere" / "b.ckpt")["global_step"] == 1
    finally:
        b.teardown()
