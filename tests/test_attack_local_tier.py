"""Attacks on the fast recovery tier (``Checkpointer(local_dir=...)``, distckpt.storage.local_tier).

Each test states the property it checks. Single-process tests run as one node (no peers);
distributed ones use run_ranks with ``LOCAL_WORLD_SIZE=2`` to simulate two nodes of two ranks
(one ``local_dir`` per node), as tests/test_local_tier.py does.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distckpt
from dist_harness import run_ranks
from distckpt.storage import local_tier

pytestmark = [
    pytest.mark.xdist_group("local_tier_attack"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:distckpt:UserWarning"),
]

STEP = "step_{:09d}".format


def _model(value: float) -> torch.nn.Linear:
    m = torch.nn.Linear(4, 3)
    with torch.no_grad():
        m.weight.fill_(value)
        m.bias.fill_(value)
    return m


def _save_steps(root, tier, steps, **kw) -> None:
    with distckpt.Checkpointer(root, local_dir=tier, **kw) as ckpt:
        for s in steps:
            ckpt.save(s, {"model": _model(float(s)), "step": s})


def _load(root, tier, step=None, **kw) -> tuple[int, float, str]:
    state = {"model": _model(-1.0), "step": -1}
    with distckpt.Checkpointer(root, local_dir=tier, **kw) as ckpt:
        got = ckpt.load(state, step=step)
        tier_used = ckpt.last_load_report.tier
    return got, float(state["model"].weight[0, 0]), tier_used


# -- wrong state: a step the root no longer holds is resurrected from the tier ----------------
def test_step_deleted_at_the_root_is_not_resurrected_from_the_tier(tmp_path):
    """A user rolls back (deletes the bad newest step at the root) and restarts: ``load()`` must
    resume the root's newest step (2), not the deleted step 3 that the tier still holds."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1, 2, 3])
    shutil.rmtree(root / STEP(3))  # rollback: step 3 is gone from the root
    step, value, _ = _load(root, tier)
    assert (step, value) == (2, 2.0)


def test_stale_newer_step_from_an_earlier_life_is_not_loaded_after_a_rollback(tmp_path):
    """Rollback then new saves: steps 1..4 saved, root steps 3-4 deleted, training resumes from 2
    and saves a new step 3. The tier keeps the old step 4 (retention never removes steps newer
    than the save), and the next ``load()`` must still resume the new step 3."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1, 2, 3, 4])
    for s in (3, 4):
        shutil.rmtree(root / STEP(s))
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        ckpt.save(3, {"model": _model(33.0), "step": 3})
    step, value, _ = _load(root, tier)
    assert (step, value) == (3, 33.0)


@pytest.mark.parametrize("want", [None, 3])
def test_a_step_saved_again_at_the_root_without_the_tier_is_not_served_from_the_tier(tmp_path, want):
    """Rollback, then a fix-up run without the tier saves a new step 3: the tier still held the
    deleted step 3 under that number, matched by number alone, and ``load()`` returned it (the
    state the user had thrown away, no warning). Found by a helper (2026-11-29)."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1, 2, 3])
    shutil.rmtree(root / STEP(3))
    with distckpt.Checkpointer(root) as fix:  # no local_dir
        fix.save(3, {"model": _model(33.0), "step": 3})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step, value, where = _load(root, tier, step=want)
    assert (step, value, where) == (3, 33.0, "root")
    if want is None:  # (a step asked for by number: the root serves it, logged)
        assert any("step 3 is not the root's" in str(w.message) for w in seen), [str(w.message) for w in seen]


# -- load(step=N) for a step only the tier holds -----------------------------------------------
def test_load_of_an_older_step_only_the_tier_holds(tmp_path):
    """keep_last=1 at the root, local_keep=2: the tier still holds step 1 intact; load(step=1)
    should read it (or at least not fail with FileNotFoundError while an intact copy exists)."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1, 2], keep_last=1, local_keep=2)
    assert (tier / STEP(1) / "manifest.json").exists() and not (root / STEP(1)).exists()
    step, value, where = _load(root, tier, step=1)
    assert (step, value, where) == (1, 1.0, "local")


# -- deleting what it did not write ------------------------------------------------------------
def test_local_dir_that_is_the_root_through_a_symlink_is_refused_or_harmless(tmp_path):
    """local_dir is a symlink to the root: the overlap check compares unresolved paths, and the
    tier's retention (local_keep=1) then deletes committed steps of the root (keep_last=None)."""
    root = tmp_path / "root"
    root.mkdir()
    link = tmp_path / "tier_link"
    link.symlink_to(root, target_is_directory=True)
    try:
        _save_steps(root, link, [1, 2, 3], local_keep=1)
    except ValueError:
        return  # refused up front: fine
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [STEP(1), STEP(2), STEP(3)]


def test_root_with_tilde_and_local_dir_expanded_is_refused_or_harmless(tmp_path, monkeypatch):
    """The root expands ``~`` (LocalStorage), the overlap check does not: root ``~/ckpt`` and
    local_dir ``$HOME/ckpt`` are the same directory, accepted, and retention deletes root steps."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    try:
        _save_steps("~/ckpt", home / "ckpt", [1, 2, 3], local_keep=1)
    except ValueError:
        return
    assert sorted(p.name for p in (home / "ckpt").iterdir() if p.name.startswith("step_")) == [STEP(1), STEP(2), STEP(3)]


def test_local_dir_with_tilde_is_expanded_like_the_root(tmp_path, monkeypatch):
    """``local_dir="~/tier"`` should mean $HOME/tier (as the root does), not a directory named
    ``~`` in the current directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    _save_steps(tmp_path / "root", "~/tier", [1])
    assert not (cwd / "~").exists()
    assert (home / "tier" / STEP(1) / "manifest.json").exists()


def test_refused_resave_of_a_committed_step_keeps_its_tier_copy(tmp_path):
    """save(2) twice: the second is refused (StepExistsError), but clear_step already removed
    the tier's copy of the committed step 2 (it runs in the prepare exchange, before the claim)."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        ckpt.save(1, {"model": _model(1.0), "step": 1})
        ckpt.save(2, {"model": _model(2.0), "step": 2})
        with pytest.raises(distckpt.errors.StepExistsError):
            ckpt.save(2, {"model": _model(9.0), "step": 2})
    assert (tier / STEP(2) / "manifest.json").exists()
    root.rename(tmp_path / "away")  # root unreachable: the tier decides
    step, value, where = _load(root, tier)
    assert (step, value, where) == (2, 2.0, "local")  # not step 1 (an older state)


def test_two_roots_sharing_one_local_dir_do_not_delete_each_others_steps(tmp_path):
    """Two checkpointers (two roots, e.g. model and data loader) share local_dir. Retention
    counts the other root's steps as its own (it ignores .distckpt-root): B's fresh step 1 is
    deleted right after its commit because A's steps 2-3 are newer."""
    tier = tmp_path / "tier"
    _save_steps(tmp_path / "a", tier, [1, 2, 3])
    _save_steps(tmp_path / "b", tier, [1])
    (tmp_path / "b").rename(tmp_path / "b_away")
    step, value, where = _load(tmp_path / "b", tier)
    assert (step, value, where) == (1, 1.0, "local")


def test_save_to_another_root_does_not_remove_this_roots_tier_copy(tmp_path):
    """B (another root, same local_dir) saving step 3 removes A's committed tier copy of step 3
    (clear_step does not look at .distckpt-root): files the tier did not write for B."""
    tier = tmp_path / "tier"
    _save_steps(tmp_path / "a", tier, [2, 3])
    _save_steps(tmp_path / "b", tier, [3])
    (tmp_path / "a").rename(tmp_path / "a_away")
    step, value, where = _load(tmp_path / "a", tier)
    assert (step, value, where) == (3, 3.0, "local")


# -- hostile contents ---------------------------------------------------------------------------
def test_symlinked_step_file_in_the_tier_falls_back_to_the_root(tmp_path):
    """A step file in the tier replaced by a symlink to identical bytes elsewhere: the inventory
    follows it (intact), the load refuses it with UnsafeCheckpointError, which _load_local does
    not catch: the whole load fails although the root holds the step."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1])
    target = tier / STEP(1) / "__0_0.distcp"
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.copyfile(target, elsewhere)
    target.unlink()
    target.symlink_to(elsewhere)
    step, value, _ = _load(root, tier)
    assert (step, value) == (1, 1.0)


def test_step_dir_symlink_in_the_tier_falls_back_to_the_root(tmp_path):
    """The tier's step directory is a symlink to a copy of itself elsewhere."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1])
    moved = tmp_path / "moved_step"
    shutil.move(str(tier / STEP(1)), moved)
    (tier / STEP(1)).symlink_to(moved, target_is_directory=True)
    step, value, _ = _load(root, tier)
    assert (step, value) == (1, 1.0)
    assert moved.exists()  # nothing deleted through the link


def test_forged_manifest_with_traversal_is_ignored(tmp_path):
    """(passes) A forged manifest naming ``../`` files is rejected by the manifest parser; the
    load reads the root."""
    import json

    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1])
    man = tier / STEP(1) / "manifest.json"
    raw = json.loads(man.read_text())
    raw["files"]["../../evil"] = {"size": 1, "checksum": None}
    man.write_text(json.dumps(raw))
    step, value, where = _load(root, tier)
    assert (step, value, where) == (1, 1.0, "root")


def test_leftover_part_files_and_manifestless_step_do_not_count(tmp_path):
    """(passes) A crash left .part files and a newer step without manifest: the newest
    committed step loads from the tier; the leftovers never win."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1, 2])
    junk = tier / STEP(3)
    junk.mkdir()
    (junk / "__0_0.distcp.part").write_bytes(b"x" * 10)
    (tier / STEP(2) / "__0_0.distcp.part").write_bytes(b"y" * 10)
    step, value, where = _load(root, tier)
    assert (step, value, where) == (2, 2.0, "local")


def test_root_mark_missing_or_different_reads_the_root(tmp_path):
    """(passes) No .distckpt-root, or another root's: never recovered from."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1])
    (tier / STEP(1) / local_tier.ROOT_MARK).unlink()
    assert _load(root, tier)[2] == "root"
    (tier / STEP(1) / local_tier.ROOT_MARK).write_text(str(tmp_path / "other"))
    assert _load(root, tier)[2] == "root"


def test_unloadable_newest_tier_step_with_the_root_unreachable_loads_the_older_one(tmp_path):
    """The README: with the root unreachable, the tier's newest step that can serve is loaded.
    Step 2's copy passes the tier's checks (every file intact) but its load fails (a value not
    the one its manifest records): both attempts fail, and the load went to the unreachable root
    (FileNotFoundError) although step 1 was whole in the tier."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1, 2])
    root.rename(tmp_path / "away")
    manifest = tier / STEP(2) / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["value_digests"]["step"] = "0" * 64
    manifest.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=r"recovered step 1 from the local tier, an older one: .*step\(s\) 2 "):
        assert _load(root, tier) == (1, 1.0, "local")
    with pytest.raises(FileNotFoundError):  # step=2 asked for: no other step is taken instead
        _load(root, tier, step=2)


def test_a_root_named_another_way_keeps_its_tier(tmp_path):
    """The tier's mark is the root's identity (links resolved, as manifests record it): a restart
    naming the root through a link (or ``//``) took the tier's steps for another root's. It read
    the root instead, its retention never removed them (more than ``local_keep`` steps on a
    tmpfs, forever), and with the root unreachable, a restart under the first name resumed the
    first life's step 2 although step 5 of the same root was there, silently."""
    real, link, tier = tmp_path / "real", tmp_path / "link", tmp_path / "tier"
    _save_steps(real, tier, [1, 2])
    link.symlink_to(real)
    assert _load(link, tier)[2] == "local"
    _save_steps(link, tier, [4, 5])
    assert sorted(p.name for p in tier.iterdir()) == [STEP(4), STEP(5)]
    real.rename(tmp_path / "away")
    for name in (str(real), "/" + str(real), str(link)):
        assert _load(name, tier) == (5, 5.0, "local"), name


def test_a_mark_written_as_the_root_was_spelt_is_still_this_roots(tmp_path):
    """Tiers written before the mark was the root's identity carry the root as it was named: a
    link to the root counts as this root."""
    real, link, tier = tmp_path / "real", tmp_path / "link", tmp_path / "tier"
    link.symlink_to(real, target_is_directory=True)
    real.mkdir()
    _save_steps(real, tier, [1])
    (tier / STEP(1) / local_tier.ROOT_MARK).write_text(str(link))  # the old form
    assert _load(real, tier) == (1, 1.0, "local")


def test_a_root_linked_on_its_own_filesystem_keeps_its_tier_while_that_is_down(tmp_path):
    """``mnt/ckpt -> runs/7``, the link on the filesystem that goes down: while down, the link
    cannot be resolved, so a mark holding only the resolved root matched none of the tier's
    steps when the tier must serve (FileNotFoundError). The mark holds the root as spelt too."""
    mnt, tier = tmp_path / "mnt", tmp_path / "tier"
    (mnt / "runs" / "7").mkdir(parents=True)
    (mnt / "ckpt").symlink_to("runs/7")
    _save_steps(mnt / "ckpt", tier, [1, 2])
    mnt.rename(tmp_path / "down")
    mnt.mkdir()  # an empty mount point
    assert _load(mnt / "ckpt", tier) == (2, 2.0, "local")


def test_a_link_re_pointed_to_another_run_never_takes_the_first_runs_tier(tmp_path):
    """``ckpt -> runs/7`` saves, then ``ckpt -> runs/8`` (a new run): one spelling, two roots.
    A mark matching on either name made the new run resume runs/7's step 5 (its fresh load,
    silently) and retire runs/7's steps from the tier. The identity decides; the spelling only
    where the root is not there to resolve (a fresh root named so is then taken as unreachable,
    as before)."""
    ckpt, tier = tmp_path / "ckpt", tmp_path / "tier"
    (tmp_path / "runs" / "7").mkdir(parents=True)
    ckpt.symlink_to("runs/7")
    _save_steps(ckpt, tier, [1, 2, 3], local_keep=5)
    ckpt.unlink()
    ckpt.symlink_to("runs/8")  # (runs/8 made by the save)
    with pytest.raises(FileNotFoundError):
        _load(ckpt, tier)
    _save_steps(ckpt, tier, [4], local_keep=1)
    assert sorted(p.name for p in tier.iterdir()) == [STEP(1), STEP(2), STEP(3), STEP(4)]  # runs/7's kept
    (tmp_path / "runs" / "8").rename(tmp_path / "away8")
    assert _load(ckpt, tier) == (4, 4.0, "local")  # its own newest, not runs/7's
    # The link removed, not re-pointed: a fresh root by that name, runs/7 still there, is
    # another root (its load resumed runs/7's newest step from the tier, silently).
    (tmp_path / "away8").rename(tmp_path / "runs" / "8")
    shutil.rmtree(tier / STEP(4))
    ckpt.unlink()
    with pytest.raises(FileNotFoundError):
        _load(ckpt, tier)


def test_a_garbage_mark_in_the_tier_is_no_roots(tmp_path):
    """A mark holding a NUL byte (zero-filled after a crash): the old-mark check resolved it as a
    path and raised a bare ValueError from every save (after its commit: the retry then got
    StepExistsError), on the node's first rank only."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    (tier / STEP(5)).mkdir(parents=True)
    (tier / STEP(5) / local_tier.ROOT_MARK).write_bytes(b"\x00" * 16)
    _save_steps(root, tier, [1, 2])
    root.rename(tmp_path / "away")
    assert _load(root, tier) == (2, 2.0, "local")
    assert (tier / STEP(5)).exists()  # (not this root's: never touched)


def test_pathlike_relative_and_trailing_slash_local_dir_are_one_tier(tmp_path, monkeypatch):
    """(passes) Path, relative str and trailing slash name the same tier."""
    monkeypatch.chdir(tmp_path)
    _save_steps(tmp_path / "root", Path("tier"), [1])
    (tmp_path / "root").rename(tmp_path / "away")
    assert _load(tmp_path / "root", str(tmp_path / "tier") + "/") == (1, 1.0, "local")


# -- distributed ----------------------------------------------------------------------------
def _node_dir(base: str, rank: int) -> str:
    return f"{base}/node{rank // 2}"


FULL = torch.arange(64, dtype=torch.float32)


def _sharded(world: int, fill: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return distribute_tensor(fill.clone(), mesh, [Shard(0)], src_data_rank=None)


def _enospc_tee_save_body(rank: int, world: int, root: str, nodes: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    if rank == 1:  # node 0's tmpfs is full for rank 1's file (its root write succeeds)

        def full_tmpfs(self, data):
            if self._f is not None:
                self._fail(OSError(errno.ENOSPC, "No space left on device"))

        local_tier.LocalCopy.write = full_tmpfs
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank), checksum=None) as ckpt:
        ckpt.save(1, {"w": _sharded(world, FULL), "step": 1})


def _sharded_load_body(rank: int, world: int, root: str, nodes: str, lws: str) -> tuple:
    os.environ["LOCAL_WORLD_SIZE"] = lws
    state = {"w": _sharded(world, torch.zeros(64)), "step": 0}
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank)) as ckpt:
        try:
            step = ckpt.load(state)
        except Exception as exc:  # noqa: BLE001
            return ("error", f"{type(exc).__name__}: {exc}"[:300])
        report = ckpt.last_load_report
    return step, state["step"], report.tier, state["w"].full_tensor()


@pytest.mark.timeout(200)
def test_failed_tee_never_becomes_a_zero_filled_peer_copy(tmp_path):
    """checksum=None; rank 1's tee fails (ENOSPC). after_commit still sends rank 1's file to its
    peer: the sender cannot read it and sends zeros (local_tier.transfer), the receiver has no
    checksum to reject them and keeps them under the final name, and node 1's manifest is
    written. That zero-filled file is 'intact' (right size) to recovery: it is sent to node 0
    and loaded. The load must restore the saved tensor (from the root if need be)."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_enospc_tee_save_body, 4, tmp_path, str(root), str(nodes), timeout=120)
    peer_copy = nodes / "node1" / STEP(1) / "__1_0.distcp"
    root_copy = root / STEP(1) / "__1_0.distcp"
    results = run_ranks(_sharded_load_body, 4, tmp_path, str(root), str(nodes), "2", timeout=120)
    for rank, res in enumerate(results):
        assert res[0] != "error", (rank, res)
        step, value, _, full = res
        assert (step, value) == (1, 1) and torch.equal(full, FULL), rank  # holds: the load's own checks catch it
    # ... but the tier keeps a zero-filled file under its final name, recorded as step 1's.
    assert not (peer_copy.exists() and peer_copy.read_bytes() != root_copy.read_bytes()), "zero-filled peer copy kept"


def _save_4_body(rank: int, world: int, root: str, nodes: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank)) as ckpt:
        ckpt.save(1, {"w": _sharded(world, FULL), "step": 1}, blocking=False)
        ckpt.wait()


@pytest.mark.timeout(250)
def test_saved_at_4_ranks_on_2_nodes_loads_at_2_ranks_from_the_tier(tmp_path):
    """(passes) Save at 4 ranks as two nodes, load at 2 ranks on one node (node 0's tier, which
    holds node 1's files as peer copies), root moved away: exact, from the tier."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_save_4_body, 4, tmp_path, str(root), str(nodes), timeout=120)
    root.rename(tmp_path / "away")
    results = run_ranks(_sharded_load_body, 2, tmp_path, str(root), str(nodes), "2", timeout=120)
    for rank, res in enumerate(results):
        assert res[0] != "error", (rank, res)
        step, value, tier, full = res
        assert (step, value, tier) == (1, 1, "local") and torch.equal(full, FULL), rank


def _one_node_error_warnings_body(rank: int, world: int, root: str, tier: str) -> tuple:
    os.environ.pop("LOCAL_WORLD_SIZE", None)  # one host: one node
    warnings.filterwarnings("error", message=r".*local_peers=1 but every rank runs on one node")
    t0 = time.monotonic()
    ckpt = distckpt.Checkpointer(root, local_dir=tier, timeout=15)
    try:
        ckpt.save(1, {"x": torch.ones(4)})
        outcome = "saved"
    except BaseException as exc:  # noqa: BLE001 - training goes on (e.g. a retry policy)
        outcome = type(exc).__name__
    elapsed = time.monotonic() - t0
    dist.barrier()  # the job goes on: rank 0 is alive, not gone
    return outcome, elapsed


@pytest.mark.timeout(150)
def test_a_coordinator_only_warning_turned_error_never_strands_the_other_ranks(tmp_path):
    """Warnings as errors (pytest -W error, filterwarnings=error): after_commit warns 'one node'
    on the coordinator only, between collectives; the coordinator leaves the save with the
    exception while rank 1 waits in the final all_gather until the group's timeout. Every rank
    must end the save alike, and promptly (the root committed the step)."""
    res = run_ranks(_one_node_error_warnings_body, 2, tmp_path, str(tmp_path / "root"), str(tmp_path / "tier"), timeout=120)
    assert res[0][0] == res[1][0], res
    assert max(r[1] for r in res) < 12, res


def _subgroup_body(rank: int, world: int, root: str, nodes: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # ranks 0,1 on node 0; ranks 2,3 on node 1
    pg = dist.new_group([0, 2], backend="gloo")  # one rank per node checkpoints
    if rank in (0, 2):
        with distckpt.Checkpointer(root, process_group=pg, local_dir=_node_dir(nodes, rank)) as ckpt:
            ckpt.save(1, {"x": torch.arange(8.0)})
    dist.barrier()


@pytest.mark.timeout(150)
def test_nodes_of_a_subgroup_are_the_ranks_nodes(tmp_path):
    """process_group=new_group([0, 2]) in a job of two nodes of two: Nodes.gather takes the
    group rank // LOCAL_WORLD_SIZE (0 and 0), so global ranks 0 and 2 count as one node: no peer
    copies, and node 1's tier never gets a manifest (only 'local rank 0' writes it)."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_subgroup_body, 4, tmp_path, str(root), str(nodes), timeout=120)
    got = sorted(p.name for p in (nodes / "node1" / STEP(1)).iterdir()) if (nodes / "node1" / STEP(1)).exists() else []
    assert "manifest.json" in got and "__0_0.distcp" in got, got


def test_damaged_tier_copy_with_verify_false_is_not_loaded_over_the_intact_root(tmp_path):
    """verify=False (skip checksums on load): the tier judges its copies by size only (both
    attempts of _load_local use check=verify), so a tier copy with one float changed is loaded
    while the root's copy is intact. README: 'A damaged copy: the other copy ... never a wrong
    state'; without the tier this load returns the saved state."""
    import struct

    root, tier = tmp_path / "root", tmp_path / "tier"
    _save_steps(root, tier, [1], verify=False)
    one = struct.pack("<4f", 1.0, 1.0, 1.0, 1.0)
    f = next(p for p in sorted((tier / STEP(1)).glob("__0_*.distcp")) if one in p.read_bytes())
    data = f.read_bytes()
    f.write_bytes(data.replace(one, struct.pack("<4f", 7.0, 1.0, 1.0, 1.0), 1))
    state = {"model": _model(-1.0), "step": -1}
    with distckpt.Checkpointer(root, local_dir=tier, verify=False) as ckpt:
        assert ckpt.load(state) == 1
    assert torch.equal(state["model"].weight, torch.ones(3, 4)) and torch.equal(state["model"].bias, torch.ones(3))


def _damaged_copy_error_warnings_body(rank: int, world: int, root: str, tier: str) -> tuple:
    os.environ.pop("LOCAL_WORLD_SIZE", None)  # one host: one node
    ckpt = distckpt.Checkpointer(root, local_dir=tier, timeout=15)
    ckpt.save(1, {"x": torch.arange(64.0)})
    ckpt.close()
    if rank == 0:  # one byte of a data file of the tier's copy, same size: the first load fails
        victim = sorted(Path(tier, STEP(1)).glob("__*.distcp"))[0]
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    warnings.filterwarnings("error", message=r".*from the local tier failed")
    t0 = time.monotonic()
    try:
        with distckpt.Checkpointer(root, local_dir=tier, timeout=15) as again:
            again.load({"x": torch.zeros(64)})
        outcome = "loaded"
    except BaseException as exc:  # noqa: BLE001 - the warning, raised as an error
        outcome = type(exc).__name__
    return outcome, time.monotonic() - t0


@pytest.mark.timeout(150)
def test_a_retry_warning_turned_error_fails_every_rank_alike(tmp_path):
    """A damaged tier copy fails the first local load, and the retry is announced with a warning.
    With warnings as errors, that warning must end the load on every rank alike, at once: warned
    on the coordinator only, it left rank 1 waiting in the retry's collectives until the timeout."""
    res = run_ranks(_damaged_copy_error_warnings_body, 2, tmp_path, str(tmp_path / "root"), str(tmp_path / "tier"), timeout=120)
    assert res[0][0] == res[1][0] == "UserWarning", res
    assert max(r[1] for r in res) < 12, res


@pytest.mark.filterwarnings("ignore:distckpt. local_peers=1")
def test_a_local_world_size_that_is_no_count_tells_nodes_by_host_name(tmp_path, monkeypatch):
    """``LOCAL_WORLD_SIZE="²"`` passed ``str.isdigit`` and failed the save in ``int()`` with a bare
    ValueError; like any other value that is not a count, it now means "tell nodes by host name"."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "²")
    with distckpt.Checkpointer(tmp_path / "root", local_dir=tmp_path / "tier") as ckpt:
        ckpt.save(1, {"w": torch.ones(3)})
    assert (tmp_path / "tier" / STEP(1)).is_dir()


def test_the_tier_never_deletes_a_step_folder_holding_what_it_did_not_write(tmp_path):
    """A tier step folder holding something the tier does not write (here another job's root,
    put inside it) was removed whole by the tier's retention, that root's committed steps with
    it. It is kept, warned once, as the root's retention keeps such steps. Found by a helper."""
    import shutil

    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=1) as a:
        a.save(5, {"model": _model(5.0), "step": 5})
        other = tier / STEP(5) / "runB"
        # (A Checkpointer refuses a root inside a committed step now: the root is made beside
        # and moved in, as a user's mv would.)
        with pytest.raises(ValueError, match="lies inside the committed step"):
            distckpt.Checkpointer(other, job="B")
        with distckpt.Checkpointer(tmp_path / "runB", job="B") as b:
            b.save(1, {"model": _model(1.0), "step": 1})
        shutil.move(tmp_path / "runB", other)
        (tier / STEP(5) / "notes.txt").write_text("mine")
        with pytest.warns(UserWarning, match=r"holds files the tier does not write \('notes.txt', 'runB/'\)"):
            a.save(6, {"model": _model(6.0), "step": 6})
        a.save(7, {"model": _model(7.0), "step": 7})  # the step before goes as always
    assert (other / STEP(1) / "manifest.json").is_file() and (tier / STEP(5) / "notes.txt").read_text() == "mine"
    assert not (tier / STEP(6)).exists() and (tier / STEP(7) / "manifest.json").is_file()


def test_a_step_folder_of_another_root_appearing_after_the_check_is_never_written(tmp_path, monkeypatch):
    """``local_dir`` is another job's root, which commits step 5 after this save checked the
    tier's folder of step 5 and before the tier opened it (two jobs saving one step number at
    once; forced here at that observed point): the tier wrote its mark, files and manifest into
    the other job's committed step (its load then returned this job's weights), and its
    retention later deleted it. Found by a helper (2026-11-29)."""
    root, shared = tmp_path / "root", tmp_path / "other_root"
    a = distckpt.Checkpointer(root, local_dir=shared, local_peers=0, job="A")
    b = distckpt.Checkpointer(shared, job="B")
    original = local_tier.LocalTier.open_step

    def open_step(self, group, step):
        if self.root == local_tier.root_mark(a.storage) and step == 5:
            b.save(5, {"model": _model(500.0), "step": 5})
        return original(self, group, step)

    monkeypatch.setattr(local_tier.LocalTier, "open_step", open_step)
    with pytest.warns(UserWarning, match="does not carry this root's mark"):
        a.save(5, {"model": _model(5.0), "step": 5})
    monkeypatch.setattr(local_tier.LocalTier, "open_step", original)
    state = {"model": _model(-1.0), "step": -1}
    assert b.load(state, step=5) == 5 and float(state["model"].weight[0, 0]) == 500.0
    assert b.manifest(5).job == "B" and not (shared / STEP(5) / local_tier.ROOT_MARK).exists()
    a.close()
    with distckpt.Checkpointer(root, local_dir=shared, local_peers=0, job="A", local_keep=1) as a2:
        a2.save(6, {"model": _model(6.0), "step": 6})
        a2.save(7, {"model": _model(7.0), "step": 7})
    assert b.load(state, step=5) == 5 and float(state["model"].weight[0, 0]) == 500.0
    b.close()


def test_a_root_never_takes_another_jobs_tier_copies_for_its_steps(tmp_path):
    """Job A's ``local_dir`` is job B's root (both on one node's tmpfs): A's tier copies land
    there as ``step_*`` folders with A's manifest. B resumed A's newest step as its own (A's
    weights, loaded silently by ``load(state)``), listed it, counted it in ``keep_last``, and
    ``load(step=N)`` read it. A folder carrying the tier's mark is a tier's copy of another
    root's step: no root lists, loads or retires it (noticed 2026-11-29, left alone then)."""
    root_a, shared = tmp_path / "a", tmp_path / "shared"
    with distckpt.Checkpointer(shared, keep_last=1) as b:
        b.save(1, {"model": _model(1.0), "step": 1})
    with distckpt.Checkpointer(root_a, local_dir=shared, local_peers=0) as a:
        a.save(7, {"model": _model(7.0), "step": 7})
    assert (shared / STEP(7) / local_tier.ROOT_MARK).is_file()
    with distckpt.Checkpointer(shared, keep_last=1) as b:
        assert b.steps() == [1] and b.latest_step() == 1
        state = {"model": _model(-1.0), "step": -1}
        assert b.load(state) == 1 and float(state["model"].weight[0, 0]) == 1.0
        with pytest.raises(FileNotFoundError, match="local tier's copy"):
            b.load(state, step=7)
        with pytest.raises(FileNotFoundError, match="local tier's copy"):
            b.manifest(7)
        with pytest.raises(Exception, match="local tier's copy"):
            b.save(7, {"model": _model(70.0), "step": 7})
        b.save(2, {"model": _model(2.0), "step": 2})  # keep_last=1 retires B's step 1, never A's copy
        assert b.steps() == [2]
    assert (shared / STEP(7) / "manifest.json").is_file()
    # A's own tier still serves its copy.
    with distckpt.Checkpointer(root_a, local_dir=shared, local_peers=0) as a:
        state = {"model": _model(-1.0), "step": -1}
        assert a.load(state) == 7 and float(state["model"].weight[0, 0]) == 7.0
        assert a.last_load_report.tier == "local"
    # The tools show the folder as what it is; a tier's own directory still opens.
    from cli_runner import run_cli

    listed = run_cli("ls", "--json", str(shared))
    assert listed.returncode == 0, listed.stderr
    assert [(r["step"], r["status"]) for r in json.loads(listed.stdout)["steps"]] == [(2, "committed"), (7, "tier copy")]
    assert "step_000000002" in run_cli("verify", str(shared)).stdout
    with distckpt.Checkpointer(tmp_path / "c", local_dir=tmp_path / "tier_c", local_peers=0) as c:
        c.save(3, {"model": _model(3.0), "step": 3})
        c.save(4, {"model": _model(4.0), "step": 4})
    assert "step_000000004" in run_cli("verify", str(tmp_path / "tier_c")).stdout
