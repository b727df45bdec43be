"""Which step a checkpointer with a local tier and a replica resumes, lists and describes.

``load``, ``latest_step`` and ``manifest`` must agree, and none may take a step the root no
longer holds (a rollback) or another job's commit (a shared replica, ``job=``) for this run's.
Found by a helper (2026-12-06, /tmp/attack34)."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

import distckpt
from dist_harness import run_ranks

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:distckpt:UserWarning"),
]

STEP = "step_{:09d}".format


def _state(value: float, tag: str = "") -> dict:
    return {"w": torch.full((4,), value), "tag": tag}


def _load(ckpt: distckpt.Checkpointer, step: int | None = None) -> tuple[int, str, str]:
    state = _state(-1.0)
    got = ckpt.load(state, step=step)
    return got, state["tag"], ckpt.last_load_report.tier


def test_a_step_deleted_at_the_root_is_not_resumed_from_the_replica_and_tier(tmp_path):
    """The root rolled back (its newest step deleted by hand); the replica and the tier still
    hold that step. The replica's listing was merged into the root's, so ``load`` resumed the
    deleted step 3 from the tier while ``latest_step()`` said 2."""
    root, rep, tier = tmp_path / "root", tmp_path / "rep", tmp_path / "tier"
    with distckpt.Checkpointer(root, replicate_to=rep, local_dir=tier) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, _state(float(s), f"X{s}"))
        ckpt.replica.wait()
    shutil.rmtree(root / STEP(3))
    with distckpt.Checkpointer(root, replicate_to=rep, local_dir=tier) as ckpt:
        assert ckpt.latest_step() == 2
        assert ckpt.manifest().step == 2
        assert _load(ckpt)[:2] == (2, "X2")


def test_step_n_of_a_named_job_is_the_roots_commit_of_that_number(tmp_path):
    """``job="A"`` with a tier holding A's old step 5; the root's step 5 is now job B's. Because
    the root's listing left B's step out, the tier's copy was never compared with the root's
    manifest and A's stale state loaded (without ``job=`` or the tier, B's)."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, keep_last=1, job="A", local_dir=tier) as a:
        for s in (5, 6):
            a.save(s, _state(float(s), f"A{s}"))
    assert not (root / STEP(5)).exists() and (tier / STEP(5)).exists()
    with distckpt.Checkpointer(root, job="B") as b:
        b.save(5, _state(500.0, "B5"))
    with distckpt.Checkpointer(root, job="A", local_dir=tier) as a:
        assert a.manifest(5).job == "B"
        assert _load(a, step=5) == (5, "B5", "root")
        assert _load(a)[:2] == (6, "A6")  # its own newest, from the tier


@pytest.mark.parametrize("job", [None, "J"])  # J: both roots' jobs of one name (a job can't tell roots apart)
def test_another_roots_step_n_on_a_shared_replica_does_not_hide_this_roots_tier_copy(tmp_path, job):
    """The root retired step 2, its tier keeps it, and the replica it shares with another root
    holds that root's step 2. The tier's copy was compared with the replica's (another root's)
    manifest, refused, and the other root's state loaded in its place."""
    r1, r2, rep, tier = tmp_path / "r1", tmp_path / "r2", tmp_path / "rep", tmp_path / "tier"
    with distckpt.Checkpointer(r1, keep_last=1, replicate_to=rep, replicate_keep_last=1, local_dir=tier, job=job) as x:
        for s in (1, 2, 3):
            x.save(s, _state(float(s), f"X{s}"))
            x.replica.wait()
        mine = x.manifest(3).job
    with distckpt.Checkpointer(r2, replicate_to=rep, job=job) as y:
        y.save(2, _state(200.0, "Y2"))
        y.replica.wait()
    with distckpt.Checkpointer(r1, replicate_to=rep, local_dir=tier, job=job) as x:
        assert x.manifest(2).job == mine and x.manifest(2).root == x.storage.url
        assert _load(x, step=2) == (2, "X2", "local")


def test_latest_step_refuses_a_replica_of_several_jobs_as_load_does(tmp_path):
    """Root unreachable, a replica shared by two jobs, a tier holding this job's older steps:
    ``load`` refused (which job's cannot be told) but ``latest_step()`` returned the other job's
    newest step, and ``manifest()`` its manifest."""
    r1, r2, rep, tier = tmp_path / "r1", tmp_path / "r2", tmp_path / "rep", tmp_path / "tier"
    with distckpt.Checkpointer(r1, replicate_to=rep, local_dir=tier) as x:
        for s in (1, 2):
            x.save(s, _state(float(s), f"X{s}"))
        x.replica.wait()
    with distckpt.Checkpointer(r2, replicate_to=rep) as y:
        y.save(3, _state(300.0, "Y3"))
        y.replica.wait()
    os.rename(r1, tmp_path / "away")
    with distckpt.Checkpointer(r1, replicate_to=rep, local_dir=tier) as x:
        for call in (x.latest_step, x.manifest, lambda: x.load(_state(0.0))):
            with pytest.raises(distckpt.CheckpointError, match="steps of 2 jobs"):
                call()


def test_manifest_of_a_step_only_the_tier_can_serve(tmp_path):
    """Root unreachable: ``steps("all")`` and ``latest_step()`` named the tier's step 1, and
    ``load`` resumed it, but ``manifest()`` said the root does not exist."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        ckpt.save(1, _state(1.0, "one"))
        made = ckpt.manifest(1)
    os.rename(root, tmp_path / "away")
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        assert ckpt.latest_step() == 1
        for got in (ckpt.manifest(), ckpt.manifest(1)):
            assert (got.step, got.files) == (1, made.files)
        with pytest.raises(FileNotFoundError):
            ckpt.manifest(2)


def _typo_body(rank: int, world: int, base: str) -> tuple[str, list[str]]:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # each rank a node of its own, each its own local_dir
    root, tier = f"{base}/root", f"{base}/node{rank}"
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(4, 2), "step": 1})
    dist.barrier()
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                ckpt.load({"model": torch.nn.Linear(4, 2), "step": 0}, exclude="stpe")
                got = "loaded"
            except ValueError as exc:
                got = str(exc)
    return got, [str(w.message) for w in seen if "local tier" in str(w.message)]


def test_a_typo_in_a_pattern_is_the_same_error_on_every_node_of_the_tier(tmp_path):
    """Nodes with local_dirs of their own: the typo's ``ValueError`` named each node's path, so
    the ranks' errors differed, were merged into a ``CheckpointError`` and taken for damaged
    copies (two warnings, every copy re-checksummed, then the root)."""
    out = run_ranks(_typo_body, 2, tmp_path, str(tmp_path), timeout=120)
    assert out[0][0] == out[1][0] and "'stpe'" in out[0][0] and "matches nothing" in out[0][0], out
    assert out[0][1] == out[1][1] == [], out


@pytest.mark.parametrize("job", [None, "J", "new run", "through a link", "old manifests"])
def test_step_n_saved_again_is_the_replicas_not_the_tiers_stale_copy(tmp_path, monkeypatch, job):
    """A rollback to step 1 and a new step 2 (by the same job, resumed through load, or by a new
    run that did not load: a new job; through a symbolic link to the root; or by a release whose
    manifests record no root), then the root retired step 2 while the replica keeps it. The tier
    of a node that kept the old step 2 must not serve it: the replica's newer commit of this
    root's step 2 is the one. (The first form of the fix above compared with the root alone, the
    second with the replica's commit by the same job only, the third with the root's URL as
    written: each loaded the stale copy in one of these.)"""
    new_run, link, unrecorded = job == "new run", job == "through a link", job == "old manifests"
    job = None if job in ("new run", "through a link", "old manifests") else job
    if unrecorded:  # as a release before manifests recorded their root wrote them
        from distckpt.save import phases

        made = phases.Manifest
        monkeypatch.setattr(phases, "Manifest", lambda **fields: made(**{**fields, "root": None}))
    root, rep, tier, old = (tmp_path / n for n in ("root", "rep", "tier", "old"))
    kw = dict(replicate_to=rep, replicate_keep_last=None, job=job)
    with distckpt.Checkpointer(root, local_dir=tier, **kw) as ckpt:
        ckpt.save(1, _state(1.0, "a1"))
        ckpt.save(2, _state(2.0, "a2"))
        ckpt.replica.wait()
    shutil.copytree(tier, old)  # a node that keeps the step 2 of before the rollback
    shutil.rmtree(root / STEP(2))
    shutil.rmtree(rep / STEP(2))
    if link:
        os.symlink(root, tmp_path / "alias")
    with distckpt.Checkpointer(tmp_path / "alias" if link else root, keep_last=1, local_dir=tmp_path / "other", **kw) as ckpt:
        if not new_run:
            ckpt.load(_state(0.0), step=1)
        ckpt.save(2, _state(22.0, "b2"))
        ckpt.save(3, _state(3.0, "b3"))
        ckpt.replica.wait()
    assert not (root / STEP(2)).exists()
    if unrecorded:
        monkeypatch.undo()
        assert json.loads((rep / STEP(2) / "manifest.json").read_text())["root"] is None
    with distckpt.Checkpointer(root, local_dir=old, **kw) as ckpt:
        assert _load(ckpt, step=2) == (2, "b2", "replica")
        assert ckpt.manifest(2).files == distckpt.Checkpointer(rep).manifest(2).files


def test_a_named_job_resumes_its_own_step_from_the_tier_with_the_root_unreachable(tmp_path):
    """Two jobs share a root and a local_dir. With the root unreachable the tier's newest step
    was taken whoever saved it: job B resumed job A's step 5."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=5, job="B") as b:
        b.save(1, _state(1.0, "B1"))
        b.save(2, _state(2.0, "B2"))
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=5, job="A") as a:
        a.save(5, _state(5.0, "A5"))
    os.rename(root, tmp_path / "away")
    with distckpt.Checkpointer(root, local_dir=tier, job="B") as b:
        assert b.latest_step() == 2
        assert b.manifest().job == "B"
        assert _load(b) == (2, "B2", "local")


def test_latest_step_takes_the_replicas_newest_the_tier_holds_as_load_does(tmp_path):
    """The root wiped (there, empty), the replica shared with another root: its newest step is
    this root's, which the tier holds, and load resumes it from there; ``latest_step()`` and
    ``manifest()`` refused instead ("steps of 2 jobs")."""
    r1, r2, rep, tier = tmp_path / "r1", tmp_path / "r2", tmp_path / "rep", tmp_path / "tier"
    with distckpt.Checkpointer(r2, replicate_to=rep, job="Y") as y:
        y.save(1, _state(100.0, "Y1"))
        y.replica.wait()
    with distckpt.Checkpointer(r1, replicate_to=rep, replicate_keep_last=None, local_dir=tier, job="X") as x:
        x.save(2, _state(2.0, "X2"))
        x.replica.wait()
    shutil.rmtree(r1 / STEP(2))
    with distckpt.Checkpointer(r1, replicate_to=rep, local_dir=tier) as x:
        assert x.latest_step() == 2
        assert x.manifest().job == "X"
        assert _load(x) == (2, "X2", "local")


def test_a_tier_copy_newer_than_the_replicas_commit_of_the_step_is_served(tmp_path):
    """A rollback at the root only (the replica keeps the old step 3), a re-save of step 3 whose
    upload fails (the replica holds this job's older commit), then the root retires step 3. The
    tier's copy is this root's last commit of step 3: comparing with the replica's by job alone
    loaded the replica's older one."""
    root, rep, tier = tmp_path / "root", tmp_path / "rep", tmp_path / "tier"
    kw = dict(replicate_to=rep, replicate_keep_last=None, local_dir=tier, local_keep=5)
    with distckpt.Checkpointer(root, **kw) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, _state(float(s), f"old{s}"))
        ckpt.replica.wait()
    shutil.rmtree(root / STEP(3))
    with distckpt.Checkpointer(root, keep_last=1, **kw) as ckpt:
        ckpt.load(_state(0.0), step=2)
        for s in (3, 4, 5):  # (the root keeps step 3 until its upload is given up: 3 attempts)
            ckpt.save(s, _state(10.0 * s, f"new{s}"))
        ckpt.replica.wait(raise_on_failure=False)
    made = {w: json.loads((w / STEP(3) / "manifest.json").read_text())["created_unix"] for w in (rep, tier)}
    assert not (root / STEP(3)).exists() and made[rep] < made[tier]
    with distckpt.Checkpointer(root, **kw) as ckpt:
        assert _load(ckpt, step=3) == (3, "new3", "local")
        assert ckpt.manifest(3).created_unix == made[tier]


def test_a_tier_folder_without_a_manifest_is_named_as_such_by_the_cli(tmp_path):
    """After a streamed recovery, a replaced node's tier holds the step's folder with only its
    mark and .metadata. ``ls`` called it ``plain dcp`` (a label that means "inspect/convert read
    it") and ``inspect``/``convert`` then failed naming a manifest that is not there."""
    from cli_runner import run_cli

    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        ckpt.save(1, {"w": torch.arange(8.0), "step": 1})
    folder = tier / STEP(1)
    for f in folder.iterdir():
        if f.name not in (".distckpt-root", ".metadata"):
            f.unlink()
    listed = run_cli("ls", str(tier), "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout)["steps"][0]["status"] == "incomplete tier copy", listed.stdout
    for args in (("inspect", str(folder)), ("verify", str(folder)), ("convert", str(folder), "--to", "torch", str(tmp_path / "o.pt"))):
        got = run_cli(*args)
        assert got.returncode == 1 and "local tier's copy without manifest.json" in got.stderr, (args, got.stderr)
    assert not (tmp_path / "o.pt").exists()
