"""A step deleted while it is read: an evaluation job loads the newest step of a root a training
job saves to with ``keep_last``; the training job commits a newer step and its retention deletes
the one being read. That is no damaged checkpoint: ``load(step=None)`` loads the newest committed
step instead (with a warning), an explicit ``step`` raises :class:`distckpt.StepDeletedError` on
every rank, and the CLI says "deleted", not "failed verification".

The other job is simulated with what it does to the root: a step committed by a rename (the
step directory, manifest included, saved beforehand under another root) and the real retention
(``delete_old_steps``), run at the moment the load reaches a chosen read (observed progress, no
sleeps)."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import distckpt
from cli_runner import run_cli
from dist_harness import run_ranks
from distckpt.integrity import stepfiles
from distckpt.integrity.manifest import step_dir
from distckpt.load import run as load_run
from distckpt.storage.base import Storage
from distckpt.storage.retention import delete_old_steps


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"w{i}": torch.randn(64, 32, generator=g) for i in range(4)}, "step": step}


def _blank() -> dict:
    return {"model": {f"w{i}": torch.zeros(64, 32) for i in range(4)}, "step": -1}


def _prepare(tmp: Path, steps: tuple[int, ...] = (1, 2), future: tuple[int, ...] = (3,)) -> tuple[str, str]:
    """(one process) ``steps`` committed under ``root``; ``future`` committed under another root,
    to be moved in while a load runs (another job's commit)."""
    root, later = str(tmp / "root"), str(tmp / "later")
    with distckpt.Checkpointer(root, save_rng=False) as ck:
        for s in steps:
            ck.save(s, _state(s))
    with distckpt.Checkpointer(later, save_rng=False) as ck:
        for s in future:
            ck.save(s, _state(s))
    return root, later


def _other_job_saves(root: str, later: str, step: int, keep_last: int = 1) -> None:
    """What the training job does to the root: commits ``step`` (its directory appears whole,
    manifest included) and applies its retention."""
    os.rename(os.path.join(later, step_dir(step)), os.path.join(root, step_dir(step)))
    delete_old_steps(Storage(root), keep_last)


def _when(monkeypatch: pytest.MonkeyPatch, at: str, action) -> list[int]:
    """Run ``action`` once, when the load reaches ``at``: ``manifest`` (the step found, its
    manifest not read yet), ``metadata`` (manifest read, .metadata not yet) or ``data`` (the
    first data file opened). Returns a list that counts how often it ran."""
    ran: list[int] = []

    def fire() -> None:
        ran.append(1)
        if len(ran) == 1:
            action()

    if at == "manifest":
        real_manifest = load_run.read_manifest

        def read_manifest(storage, step):
            fire()
            return real_manifest(storage, step)

        monkeypatch.setattr(load_run, "read_manifest", read_manifest)
    elif at == "metadata":
        real_metadata = load_run.read_metadata

        def read_metadata(storage, manifest, verify=True):
            fire()
            return real_metadata(storage, manifest, verify)

        monkeypatch.setattr(load_run, "read_metadata", read_metadata)
    else:
        real_file = stepfiles.StepFiles.file

        def file(self, name):
            if name.endswith(".distcp"):
                fire()
            return real_file(self, name)

        monkeypatch.setattr(stepfiles.StepFiles, "file", file)
    return ran


@pytest.mark.parametrize("at", ["manifest", "metadata", "data"])
def test_the_newest_step_deleted_under_a_load_is_replaced_by_the_newer_one(tmp_path, monkeypatch, at):
    root, later = _prepare(tmp_path)
    ran = _when(monkeypatch, at, lambda: _other_job_saves(root, later, 3))
    out = _blank()
    ck = distckpt.Checkpointer(root)
    with pytest.warns(UserWarning, match=r"step 2 at .* was deleted while it was being loaded .*loading the newest committed step"):
        assert ck.load(out) == 3
    assert ran, "the deletion never ran: the test would prove nothing"
    want = _state(3)
    assert out["step"] == 3
    assert all(torch.equal(out["model"][k], want["model"][k]) for k in want["model"])
    assert ck.steps() == [3]


@pytest.mark.parametrize("at", ["manifest", "metadata", "data"])
def test_an_explicit_step_deleted_under_a_load_says_so(tmp_path, monkeypatch, at):
    root, later = _prepare(tmp_path)
    _when(monkeypatch, at, lambda: _other_job_saves(root, later, 3))
    ck = distckpt.Checkpointer(root)
    with pytest.raises(distckpt.StepDeletedError, match=r"checkpoint step 2 at .*step_000000002 was deleted while it was being loaded"):
        ck.load(_blank(), step=2)
    # A FileNotFoundError, as a missing step is.
    assert issubclass(distckpt.StepDeletedError, FileNotFoundError)


def _with_replica(tmp: Path) -> tuple[str, str, str]:
    """Steps 1 and 2 committed under ``root`` and uploaded to its replica (``replicate_to``);
    step 3 under another root, to be moved in."""
    root, later, remote = str(tmp / "root"), str(tmp / "later"), str(tmp / "remote")
    with distckpt.Checkpointer(root, save_rng=False, replicate_to=remote) as ck:
        for s in (1, 2):
            ck.save(s, _state(s))
        ck.replica.wait()
    with distckpt.Checkpointer(later, save_rng=False) as ck:
        ck.save(3, _state(3))
    return root, later, remote


@pytest.mark.parametrize("at", ["manifest", "metadata", "data"])
def test_an_explicit_step_deleted_from_the_root_under_a_load_is_read_from_the_replica(tmp_path, monkeypatch, at):
    # A fast local root with keep_last, every step uploaded to object storage that keeps them:
    # the step the root retired under the load is still the replica's, and that is what a
    # user asking for it wants.
    root, later, remote = _with_replica(tmp_path)
    ran = _when(monkeypatch, at, lambda: _other_job_saves(root, later, 3))
    out = _blank()
    ck = distckpt.Checkpointer(root, replicate_to=remote)
    with pytest.warns(UserWarning, match=r"step 2 at .* was deleted while it was being loaded.*loading step 2 from the replica instead"):
        assert ck.load(out, step=2) == 2
    assert ran, "the deletion never ran: the test would prove nothing"
    assert not (Path(root) / step_dir(2)).exists() and (Path(remote) / step_dir(2) / "manifest.json").exists()
    want = _state(2)
    assert out["step"] == 2
    assert all(torch.equal(out["model"][k], want["model"][k]) for k in want["model"])
    assert ck.last_load_report.tier == "replica"


def test_another_jobs_commit_of_the_step_on_a_shared_replica_is_not_loaded_in_its_place(tmp_path, monkeypatch):
    # Two jobs replicate to one remote root; the other job's step 2 got there first (this job's
    # upload of it failed). This job's step 2, deleted from its root under the load, is not
    # replaced by the other job's: every value would differ, and the load would adopt its job.
    root, later, remote = str(tmp_path / "root"), str(tmp_path / "later"), str(tmp_path / "remote")
    other = _state(2)
    for v in other["model"].values():
        v.mul_(-1)
    with distckpt.Checkpointer(str(tmp_path / "other_root"), save_rng=False, replicate_to=remote, job="other") as ck:
        ck.save(2, other)
        ck.replica.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this job's own upload of step 2 fails: the other's is there
        with distckpt.Checkpointer(root, save_rng=False, replicate_to=remote) as ck:
            ck.save(2, _state(2))
    with distckpt.Checkpointer(later, save_rng=False) as ck:
        ck.save(3, _state(3))
    _when(monkeypatch, "data", lambda: _other_job_saves(root, later, 3))
    out = _blank()
    with pytest.warns(UserWarning, match="loading step 2 from the replica instead"):
        with pytest.raises(distckpt.StepDeletedError, match=r"was deleted while it was being loaded.*holds another commit of step 2 \(job other\)"):
            distckpt.Checkpointer(root, replicate_to=remote).load(out, step=2)
    assert out["step"] == -1 or out["step"] == 2  # never the other job's values
    assert not any(torch.equal(out["model"][k], other["model"][k]) for k in other["model"])


def test_an_explicit_step_deleted_from_the_root_and_not_in_the_replica_is_a_deletion(tmp_path, monkeypatch):
    # The replica retired step 2 as well (its own keep_last): the deletion is raised, saying
    # the replica was tried, not "step 2 not found" or "never committed".
    root, later, remote = _with_replica(tmp_path)
    ran = _when(monkeypatch, "data", lambda: (_other_job_saves(root, later, 3), shutil.rmtree(Path(remote) / step_dir(2))))
    with pytest.raises(distckpt.StepDeletedError, match=r"step 2 at .* was deleted while it was being loaded.*the replica does not hold it either") as info:
        with pytest.warns(UserWarning, match="loading step 2 from the replica instead"):
            distckpt.Checkpointer(root, replicate_to=remote).load(_blank(), step=2)
    assert ran
    assert "never committed" not in str(info.value) and "not found" not in str(info.value)


def test_an_explicit_step_committed_anew_on_the_root_under_a_load_is_read_from_the_replica(tmp_path, monkeypatch):
    # The root's step 2 is replaced by another commit of step 2 (other values) while it is
    # read: the load reads the replica's copy of the step it began with, never the root's new
    # one (which, without a replica, it refuses) nor a mix of the two.
    root, _, remote = _with_replica(tmp_path)
    other = _state(2)
    for v in other["model"].values():
        v.mul_(-1)
    with distckpt.Checkpointer(str(tmp_path / "anew"), save_rng=False) as ck:
        ck.save(2, other)

    def replace() -> None:
        old = Path(root) / step_dir(2)
        (old / "manifest.json").unlink()
        old.rename(tmp_path / "gone")
        os.rename(tmp_path / "anew" / step_dir(2), old)

    ran = _when(monkeypatch, "data", replace)
    out = _blank()
    with pytest.warns(UserWarning, match=r"committed anew while the step was being loaded.*loading step 2 from the replica instead"):
        assert distckpt.Checkpointer(root, replicate_to=remote).load(out, step=2) == 2
    assert ran
    want = _state(2)
    assert all(torch.equal(out["model"][k], want["model"][k]) for k in want["model"])


def test_a_missing_file_of_a_step_still_committed_is_damage_not_deletion(tmp_path, monkeypatch):
    root, _ = _prepare(tmp_path, future=())
    data = sorted(p for p in (tmp_path / "root" / step_dir(2)).iterdir() if p.suffix == ".distcp")
    _when(monkeypatch, "data", lambda: data[0].unlink())
    with pytest.raises(distckpt.IntegrityError, match="missing") as info:
        distckpt.Checkpointer(root).load(_blank())
    assert not isinstance(info.value, distckpt.StepDeletedError)


def test_a_step_committed_anew_under_a_load_is_not_read_as_a_mix(tmp_path, monkeypatch):
    # Step 2 deleted and committed again by another job (other values) while it is read.
    root, later = _prepare(tmp_path, future=(2,))
    later_state = _state(2)
    for v in later_state["model"].values():
        v.mul_(-1)
    with distckpt.Checkpointer(later, save_rng=False) as ck:
        ck.save(4, later_state)
    os.rename(os.path.join(later, step_dir(4)), os.path.join(tmp_path, "anew"))

    def replace() -> None:
        old = Path(root) / step_dir(2)
        (old / "manifest.json").unlink()
        old.rename(tmp_path / "gone")
        # The new step 2: step 4's files under step 2's name, its manifest rewritten for step 2.
        os.rename(tmp_path / "anew", old)
        import json

        m = json.loads((old / "manifest.json").read_text())
        m["step"] = 2
        (old / "manifest.json").write_text(json.dumps(m))

    ran = _when(monkeypatch, "data", replace)
    with pytest.raises(distckpt.StepDeletedError, match="committed anew while the step was being loaded"):
        # Checksums are what tell the new files from the old ones (verify=False checks nothing).
        distckpt.Checkpointer(root).load(_blank(), step=2)
    assert ran


def test_a_job_that_deletes_every_step_under_the_load_stops_the_retries(tmp_path, monkeypatch):
    # Another job commits faster than this one loads: every attempt's step is gone before it is
    # read. The load gives up after DELETED_RETRIES retries instead of looping for ever.
    steps = tuple(range(1, load_run.DELETED_RETRIES + 3))
    root, later = _prepare(tmp_path, steps=(steps[0],), future=steps[1:])
    nxt = iter(steps[1:])
    real_metadata = load_run.read_metadata

    def read_metadata(storage, manifest, verify=True):
        _other_job_saves(root, later, next(nxt))
        return real_metadata(storage, manifest, verify)

    monkeypatch.setattr(load_run, "read_metadata", read_metadata)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(distckpt.StepDeletedError, match=f"deleted under {load_run.DELETED_RETRIES + 1} loads in a row"):
            distckpt.Checkpointer(root).load(_blank())
    retried = [w for w in seen if "loading the newest committed step" in str(w.message)]
    assert len(retried) == load_run.DELETED_RETRIES


def _ranks_body(rank: int, world: int, root: str, later: str, step: int | None = None, remote: str | None = None) -> dict:
    import pytest as _pytest

    out = {}
    with _pytest.MonkeyPatch.context() as mp:
        # Only rank 0 moves the step in and deletes (the other job runs once): the other rank's
        # own read may or may not have finished by then.
        ran = _when(mp, "data", (lambda: _other_job_saves(root, later, 3)) if rank == 0 else (lambda: None))
        state = _blank()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ck = distckpt.Checkpointer(root, replicate_to=remote)
            out["loaded"] = ck.load(state, step=step)
        out["ran"] = bool(ran)
        out["warned"] = any("was deleted while it was being loaded" in str(w.message) for w in seen)
        expected = 3 if step is None else step
        want = _state(expected)
        out["exact"] = state["step"] == expected and all(torch.equal(state["model"][k], want["model"][k]) for k in want["model"])
        ck.close()
    return out


def test_at_two_ranks_every_rank_moves_on_to_the_newest_step_alike(tmp_path):
    root, later = _prepare(tmp_path)
    results = run_ranks(_ranks_body, 2, tmp_path, root, later, timeout=120)
    assert results[0]["ran"]
    for r in results:
        assert r == {"loaded": 3, "ran": r["ran"], "warned": True, "exact": True}


def test_at_two_ranks_an_explicit_step_deleted_from_the_root_is_read_from_the_replica_alike(tmp_path):
    root, later, remote = _with_replica(tmp_path)
    results = run_ranks(_ranks_body, 2, tmp_path, root, later, 2, remote, timeout=120)
    assert results[0]["ran"]
    for r in results:
        assert r == {"loaded": 2, "ran": r["ran"], "warned": True, "exact": True}


def _failing_body(rank: int, world: int, root: str, later: str, at: str, steps: tuple, remote: str | None = None) -> str:
    """One rank's load of ``steps[rank]`` while the other job (run by rank 0, the coordinator)
    deletes step 2 at ``at``: ``"Type: message"`` of what it raised, or ``"loaded"``."""
    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as mp:
        _when(mp, at, (lambda: _other_job_saves(root, later, 3)) if rank == 0 else (lambda: None))
        ck = distckpt.Checkpointer(root, replicate_to=remote)
        try:
            ck.load(_blank(), step=steps[rank])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return f"{type(exc).__name__}: {exc}"
        finally:
            ck.close()
    return "loaded"


def test_at_two_ranks_an_explicit_step_deleted_is_the_same_error_on_every_rank(tmp_path):
    root, later = _prepare(tmp_path)
    results = run_ranks(_failing_body, 2, tmp_path, root, later, "data", (2, 2), timeout=120)
    assert results[0] == results[1]
    assert results[0].startswith("StepDeletedError: checkpoint step 2 at") and "was deleted while it was being loaded" in results[0]


@pytest.mark.parametrize("command", ["verify", "export"])
def test_the_cli_says_deleted_not_damaged(tmp_path, monkeypatch, command):
    root, later = _prepare(tmp_path)
    ran = _when(monkeypatch, "data", lambda: _other_job_saves(root, later, 3))
    if command == "export":
        args = ["convert", root, str(tmp_path / "out.pt"), "--to", "torch", "--all"]
    else:
        args = ["verify", root]
    res = run_cli(*args)
    code, err = res.returncode, res.stderr
    assert ran, "the deletion never ran"
    assert code == 1
    assert "step 2 at" in err and f"was deleted while it was being {'exported' if command == 'export' else 'verified'}" in err
    assert "FAILED" not in err and "failed verification" not in err
    assert not (tmp_path / "out.pt").exists()


def _s3_training_job(root: str, opts: dict):
    """A training job (``job=``) that saved steps 1 and 2 to ``root``; returns its next save (step
    3, ``keep_last=1``), run by a real Checkpointer: its retention deletes steps 1 and 2 (its own),
    manifest first."""
    with distckpt.Checkpointer(root, storage_options=opts, save_rng=False, job="train") as ck:
        for s in (1, 2):
            ck.save(s, _state(s))

    def next_save() -> None:
        with distckpt.Checkpointer(root, storage_options=opts, keep_last=1, save_rng=False, job="train") as other:
            other.save(3, _state(3))

    return next_save


@pytest.mark.parametrize("at", ["metadata", "data"])
def test_on_s3_a_real_save_with_retention_under_the_load(tmp_path, monkeypatch, s3_server, s3_bucket, at):
    # The other job is a real Checkpointer (keep_last=1) saving step 3 to the same S3 root at the
    # moment the load reaches ``at``: its retention deletes steps 1 and 2 (manifest first).
    root, opts = f"s3://{s3_bucket}/run", s3_server.storage_options
    ran = _when(monkeypatch, at, _s3_training_job(root, opts))
    out = _blank()
    ck = distckpt.Checkpointer(root, storage_options=opts)
    with pytest.warns(UserWarning, match=r"step 2 at s3://.* was deleted while it was being loaded"):
        assert ck.load(out) == 3
    assert ran
    want = _state(3)
    assert out["step"] == 3 and all(torch.equal(out["model"][k], want["model"][k]) for k in want["model"])
    with pytest.raises(FileNotFoundError, match="step 2"):
        ck.load(_blank(), step=2)
    ck.close()


def test_a_non_strict_load_does_not_move_on(tmp_path, monkeypatch):
    # strict=False: keys the newer step lacks would keep what the failed attempt read into them
    # while the report calls them missing; the load raises instead of retrying.
    root, later = _prepare(tmp_path)
    ran = _when(monkeypatch, "data", lambda: _other_job_saves(root, later, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "loading the newest committed step" warning either
        with pytest.raises(distckpt.StepDeletedError, match="step 2 at") as info:
            distckpt.Checkpointer(root).load(_blank(), strict=False)
    assert ran
    # ... and says what a strict load would have done, for the caller to do knowingly.
    assert "strict=False is not attempted again" in str(info.value)
    assert "call load again to read the newest committed step" in str(info.value)


def test_a_non_strict_load_of_an_explicit_step_points_at_the_replica(tmp_path, monkeypatch):
    root, later, remote = _with_replica(tmp_path)
    ran = _when(monkeypatch, "data", lambda: _other_job_saves(root, later, 3))
    with pytest.raises(distckpt.StepDeletedError, match="call load again to read step 2 from the replica, where it holds it"):
        distckpt.Checkpointer(root, replicate_to=remote).load(_blank(), step=2, strict=False)
    assert ran
    # Without a replica there is nothing to point at.
    root2, later2 = _prepare(tmp_path / "plain")
    _when(monkeypatch, "data", lambda: _other_job_saves(root2, later2, 3))
    with pytest.raises(distckpt.StepDeletedError) as info:
        distckpt.Checkpointer(root2).load(_blank(), step=2, strict=False)
    assert "call load again" not in str(info.value)


def test_without_checksums_a_step_committed_anew_is_named_not_a_diverged_state(tmp_path, monkeypatch):
    # checksum=None: the files are not checked, the state check (fingerprints) catches the new
    # values; that they are a new commit of the step, not a diverged state, is what is said.
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    with distckpt.Checkpointer(root, save_rng=False, checksum=None) as ck:
        ck.save(2, _state(2))
    with distckpt.Checkpointer(other, save_rng=False, checksum=None) as ck:
        ck.save(2, dict(_state(5), step=2))  # the same sizes and values: only tensors differ

    def replace() -> None:
        os.rename(os.path.join(root, step_dir(2)), tmp_path / "gone")
        os.rename(os.path.join(other, step_dir(2)), os.path.join(root, step_dir(2)))

    ran = _when(monkeypatch, "data", replace)
    with pytest.raises(distckpt.StepDeletedError, match="committed anew while the step was being loaded"):
        distckpt.Checkpointer(root).load(_blank(), step=2)
    assert ran


def test_ranks_passing_different_steps_fail_alike_when_the_step_is_deleted_first(tmp_path):
    root, later = _prepare(tmp_path)
    # Rank 0 (the coordinator) loads the newest step, rank 1 asks for step 2; step 2 is deleted
    # while the coordinator reads its .metadata, before the ranks compare their arguments.
    results = run_ranks(_failing_body, 2, tmp_path, root, later, "metadata", (None, 2), timeout=120)
    assert all(r.startswith("ValueError") and "step" in r for r in results), results


def test_ranks_passing_different_steps_with_a_replica_lacking_the_step_fail_alike(tmp_path):
    # The coordinator asks for step 2 (deleted from the root under its read, not in the
    # replica), rank 1 for the newest: both follow the coordinator's retry and raise the same.
    root, later, remote = _with_replica(tmp_path)
    shutil.rmtree(Path(remote) / step_dir(2))
    results = run_ranks(_failing_body, 2, tmp_path, root, later, "metadata", (2, None), remote, timeout=120)
    assert results[0] == results[1] and results[0].startswith("StepDeletedError") and "replica does not hold it" in results[0], results


def test_verify_on_s3_of_a_step_deleted_under_it(tmp_path, monkeypatch, s3_server, s3_bucket):
    root, opts = f"s3://{s3_bucket}/run", s3_server.storage_options
    other_job = _s3_training_job(root, opts)
    # The listing of step 2's files is taken (and cached by s3fs) before the deletion: reads
    # then fail as the objects are gone.
    ran = _when(monkeypatch, "data", other_job)
    import json

    res = run_cli("verify", root, *[f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()])
    assert ran, "the deletion never ran"
    assert res.returncode == 1, res.stderr
    assert "step 2 at s3://" in res.stderr and "was deleted while it was being verified" in res.stderr, res.stderr


def test_verify_state_of_a_step_deleted_during_the_fingerprint_pass(tmp_path, monkeypatch):
    from distckpt.tools import cli

    root, later = _prepare(tmp_path)
    real = cli.CheckpointSource
    ran: list[int] = []

    def source(*a, **k):  # the fingerprint pass begins: the checksum pass found nothing wrong
        ran.append(1)
        _other_job_saves(root, later, 3)
        return real(*a, **k)

    monkeypatch.setattr(cli, "CheckpointSource", source)
    res = run_cli("verify", "--state", root)
    assert ran
    assert res.returncode == 1 and "was deleted while it was being verified" in res.stderr, res.stderr
    assert "missing" not in res.stderr.split("(its")[0]


@pytest.mark.parametrize("command", ["verify", "export", "inspect"])
def test_the_cli_finds_the_newest_step_gone_before_it_opens_it(tmp_path, monkeypatch, command):
    # Retention removed step 2's manifest after the root was listed and before the step was
    # opened: never "never committed", never a plain DCP directory exported unverified.
    from distckpt.tools import catalog

    root, later = _prepare(tmp_path)
    real = catalog.committed_steps

    def listed(storage):
        steps = real(storage)
        if steps == [1, 2]:
            _other_job_saves(root, later, 3)
        return steps

    monkeypatch.setattr(catalog, "committed_steps", listed)
    args = {
        "verify": ["verify", root],
        "export": ["convert", root, str(tmp_path / "out.pt"), "--to", "torch", "--all"],
        "inspect": ["inspect", root],
    }[command]
    res = run_cli(*args)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "checkpoint step 2 at" in res.stderr and "was deleted while it was being opened" in res.stderr, res.stderr
    assert not (tmp_path / "out.pt").exists()
