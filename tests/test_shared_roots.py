"""Jobs sharing a root (or a replica), as two runs of a sweep do: retention counts and deletes
only this job's steps, also when a step number it deleted is saved again by another job.
Found by an attack on shared folders (2026-11-29)."""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt.integrity.manifest import read_manifest
from distckpt.storage.base import Storage

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _state(v: float) -> dict:
    return {"w": torch.full((4,), float(v))}


def _jobs(ck: distckpt.Checkpointer) -> dict[int, str | None]:
    return {s: ck.manifest(s).job for s in ck.steps()}


def test_a_number_another_job_saved_again_is_not_taken_for_this_jobs(tmp_path):
    """Run A deleted its steps 100 and 200 and remembered them as its own; run B then committed
    100 and 200, and A's next retention deleted B's steps (B's newest included)."""
    root = str(tmp_path / "root")
    with distckpt.Checkpointer(root, keep_last=2, job="sweep-A") as a, distckpt.Checkpointer(root, keep_last=2, job="sweep-B") as b:
        for s in (100, 200, 300, 400):
            a.save(s, _state(s))
        for s in (100, 200):
            b.save(s, _state(s + 1))
        a.save(500, _state(500))
        assert _jobs(a) == {100: "sweep-B", 200: "sweep-B", 400: "sweep-A", 500: "sweep-A"}
        # The other way round: a number A remembered as B's, deleted and saved again by A, is A's.
        b.save(300, _state(301))  # B's retention: B keeps 200, 300; deletes its 100
        a.save(100, _state(100))  # A saves 100 again (a resume from an older step)
        a.save(600, _state(600))
        assert _jobs(a) == {200: "sweep-B", 300: "sweep-B", 500: "sweep-A", 600: "sweep-A"}


def test_a_replica_shared_by_two_jobs_keeps_the_other_jobs_steps(tmp_path):
    rep = str(tmp_path / "rep")
    with distckpt.Checkpointer(str(tmp_path / "a"), keep_last=None, replicate_to=rep, replicate_keep_last=2, job="A") as a, \
            distckpt.Checkpointer(str(tmp_path / "c"), keep_last=None, replicate_to=rep, replicate_keep_last=2, job="C") as c:  # fmt: skip
        for s in (10, 20, 30):
            a.save(s, _state(s))
            a.replica.wait()
        c.save(10, _state(11))
        c.replica.wait()
        a.save(40, _state(40))
        a.replica.wait()
        assert a.steps(tier="replica") == [10, 30, 40]
        assert read_manifest(Storage(rep), 10).job == "C"


def test_a_named_job_resumes_its_own_newest_step(tmp_path):
    """Two runs of a sweep on one root, each with ``job=``: a restart of one (``latest_step()``
    then ``load(state)``, the README's pattern) resumed the other run's newer step, silently.
    Found by a helper (2026-11-29)."""
    root = str(tmp_path / "root")
    with distckpt.Checkpointer(root, job="lr1e-3") as a, distckpt.Checkpointer(root, job="lr1e-4") as b:
        a.save(100, _state(1.0))
        b.save(200, _state(2.0))
    with distckpt.Checkpointer(root, job="lr1e-3") as a:
        assert a.latest_step() == 100 and a.manifest().step == 100
        state = _state(0.0)
        assert a.load(state) == 100 and torch.equal(state["w"], _state(1.0)["w"])
        assert a.load(state, step=200) == 200  # another job's step, asked for by number
        a.save(300, _state(3.0))  # (a resume of another job's step does not make it this job's)
        assert a.manifest(300).job == "lr1e-3"
    with distckpt.Checkpointer(root, job="new-run") as fresh:
        assert fresh.latest_step() is None
        with pytest.raises(FileNotFoundError, match="other jobs'"):
            fresh.load(_state(0.0))
    with distckpt.Checkpointer(root) as anyone:  # no job name: the newest, whoever saved it
        assert anyone.latest_step() == 300


def test_another_writers_unreadable_manifest_neither_stops_a_named_job_nor_its_retention(tmp_path):
    """A step of another job on a shared root whose manifest cannot be parsed (a commit cut
    short, or a planted manifest.json): latest_step() and load() of job "a" raised its
    IntegrityError, and every save's retention failed on it (the root grew without bound)."""
    import os
    import warnings

    root = str(tmp_path / "root")
    w = torch.arange(10.0)
    with distckpt.Checkpointer(root, job="a", keep_last=2) as ck:
        ck.save(1, {"w": w, "step": 1})
        ck.save(2, {"w": w + 1, "step": 2})
    with distckpt.Checkpointer(root, job="b") as ck:
        ck.save(3, {"w": w + 100, "step": 3})
    manifest = tmp_path / "root" / "step_000000003" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    with pytest.warns(UserWarning, match=r"step_000000003/manifest.json cannot be read .*job 'a' neither resumes nor retires"):
        ck = distckpt.Checkpointer(root, job="a", keep_last=2)
        assert ck.latest_step() == 2
    st = {"w": torch.zeros(10), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (said once per step and process)
        assert ck.load(st) == 2 and st["step"] == 2 and torch.equal(st["w"], w + 1)
        ck.save(4, {"w": w + 4, "step": 4})
        ck.close()
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000000002", "step_000000003", "step_000000004"]
    with pytest.warns(UserWarning, match=r"job 'c' neither resumes .*if it is this job's own, its commit is damaged"):
        assert distckpt.Checkpointer(root, job="c").latest_step() is None  # (each job is told)


def test_a_step_of_a_newer_distckpt_is_not_passed_by_as_unreadable(tmp_path):
    """A manifest of a newer format is intact, not damaged: a named job took it for another
    writer's cut-short commit and resumed an older step, where an unnamed one said to upgrade."""
    import json

    root = str(tmp_path / "root")
    with distckpt.Checkpointer(root, job="a") as ck:
        ck.save(1, {"w": torch.ones(2)})
        ck.save(2, {"w": torch.ones(2)})
    manifest = tmp_path / "root" / "step_000000002" / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["format_version"] = 99
    manifest.write_text(json.dumps(raw))
    for job in ("a", None):
        with pytest.raises(distckpt.IntegrityError, match="newer than this distckpt understands.*upgrade distckpt"):
            distckpt.Checkpointer(root, job=job).load({"w": torch.zeros(2)})
    with pytest.raises(distckpt.IntegrityError, match="newer than this distckpt understands.*upgrade distckpt"):
        distckpt.Checkpointer(root, job="a").latest_step()
