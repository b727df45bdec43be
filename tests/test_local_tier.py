"""The fast recovery tier (issue 33): every committed step also kept in each node's ``local_dir``
and in a peer node's; recovery from there without reading the root.

Four gloo ranks as two simulated nodes of two (``LOCAL_WORLD_SIZE=2``, one ``local_dir`` per
node), FSDP2 model + AdamW. One run saves (async) two steps; a second run resumes, one scenario
after another, each set up by rank 0 between barriers:

* the root moved away (no byte of it can be read) and node 0's own copy of a file damaged: that
  file from node 1's replica, bit-exact;
* node 1's tier wiped too: step 2 from node 0's copies, what node 1's ranks read sent by node 0's
  ranks, bit-exact;
* both copies of one file damaged, root back: the root, exact (never a wrong state);
* both nodes' tiers wiped: the root;
* the root newer than the local tier: the root.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

import distckpt
from dist_harness import run_ranks
from distckpt.storage import local_tier
from models import assert_same, full_model_state, full_optim_state, make_model, make_optimizer, make_wide_model, train_steps, wrap
from step_layout import keys_by_file

pytestmark = [pytest.mark.xdist_group("local_tier"), pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")]
WORLD = 4


def _node_dir(base: str, rank: int) -> str:
    return f"{base}/node{rank // 2}"


def _save_body(rank: int, world: int, root: str, nodes: str) -> tuple:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two simulated nodes of two ranks
    model = wrap(make_model(seed=0), "fsdp", world)
    optim = make_optimizer(model, "fsdp")
    train_steps(model, optim, range(2), rank, world)
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank)) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim, "step": 1}, blocking=False)
        train_steps(model, optim, range(2, 3), rank, world)
        ckpt.save(2, {"model": model, "optim": optim, "step": 2}, blocking=False)
        ref = full_model_state(model), full_optim_state(model, optim)  # the state at save(2)
        ckpt.wait()
    return ref


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _prepare(scenario: str, root: Path, nodes: Path) -> None:
    """(rank 0, between barriers) Set the scene of one scenario on disk."""
    away = root.with_name(root.name + ".away")
    step2 = "step_000000002"
    if scenario == "damaged_own_copy":
        root.rename(away)
        _flip(nodes / "node0" / step2 / "__0_0.distcp")
    elif scenario == "peer":
        shutil.rmtree(nodes / "node1")
    elif scenario == "both_copies_damaged":
        away.rename(root)
        for node in ("node0", "node1"):
            if (nodes / node / step2 / "__1_0.distcp").exists():  # node 1 got back only what it reads
                _flip(nodes / node / step2 / "__1_0.distcp")
    elif scenario == "both_nodes_lost":
        shutil.rmtree(nodes)
    elif scenario == "root_newer":
        # Local tiers hold step 2 again (the last load restored them); the root gets a step 3.
        pass


def _load_body(rank: int, world: int, root: str, nodes: str, scenarios: list[str]) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out = {}
    for scenario in scenarios:
        if rank == 0:
            _prepare(scenario, Path(root), Path(nodes))
        dist.barrier()
        if scenario == "root_newer":
            # A save of step 3 to the root only (no local tier): the root is newer.
            model = wrap(make_model(seed=0), "fsdp", world)
            optim = make_optimizer(model, "fsdp")
            train_steps(model, optim, range(1), rank, world)
            with distckpt.Checkpointer(root) as plain:
                plain.save(3, {"model": model, "optim": optim, "step": 3})
        model = wrap(make_model(seed=1), "fsdp", world)
        optim = make_optimizer(model, "fsdp")
        state = {"model": model, "optim": optim, "step": 0}
        with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank)) as ckpt:
            step = ckpt.load(state)
            report = ckpt.last_load_report
        out[scenario] = (step, state["step"], report.tier, dict(report.sources), full_model_state(model), full_optim_state(model, optim))
        dist.barrier()
    return out


@pytest.mark.timeout(300)
def test_recovery_from_the_local_tier_and_peers_without_the_root(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    refs = run_ranks(_save_body, WORLD, tmp_path, str(root), str(nodes), timeout=200)
    ref_model, ref_optim = refs[0]
    # Both nodes hold every file of both steps (own files teed by the writers, the peer's sent).
    files = {p.name for p in (root / "step_000000002").iterdir()}
    for node in ("node0", "node1"):
        for step in ("step_000000001", "step_000000002"):
            assert {p.name for p in (nodes / node / step).iterdir()} == files | {local_tier.ROOT_MARK}, (node, step)
    scenarios = ["damaged_own_copy", "peer", "both_copies_damaged", "both_nodes_lost", "root_newer"]
    results = run_ranks(_load_body, WORLD, tmp_path, str(root), str(nodes), scenarios, timeout=250)

    for rank, res in enumerate(results):
        step, step_value, tier, sources, model_sd, optim_sd = res["peer"]
        assert (step, step_value, tier) == (2, 2, "local"), rank
        assert_same(ref_model, model_sd, f"rank {rank} model (peer)")
        assert_same(ref_optim, optim_sd, f"rank {rank} optimizer (peer)")
        if rank >= 2:  # node 1 lost everything: what its ranks read came from node 0's ranks
            assert sources["__2_0.distcp"] in ("rank 0", "rank 1") and sources["manifest.json"] == "rank 0"
            # (What node 1's ranks read includes node 0's files here: replicated optimizer values
            # are written once, by any rank; test_a_node_gets_only_the_files_its_ranks_read.)
            assert sources[".metadata"] in ("rank 0", "rank 1")
        else:
            assert set(sources.values()) == {"local"}

        step, _, tier, sources, model_sd, optim_sd = res["damaged_own_copy"]
        assert (step, tier) == (2, "local"), rank
        assert_same(ref_model, model_sd, f"rank {rank} model (damaged own copy)")
        if rank < 2:
            assert sources["__0_0.distcp"] in ("rank 2", "rank 3")

        step, _, tier, _, model_sd, optim_sd = res["both_copies_damaged"]
        assert (step, tier) == (2, "root"), rank
        assert_same(ref_model, model_sd, f"rank {rank} model (both copies damaged)")
        assert_same(ref_optim, optim_sd, f"rank {rank} optimizer (both copies damaged)")

        step, _, tier, _, model_sd, _ = res["both_nodes_lost"]
        assert (step, tier) == (2, "root"), rank
        assert_same(ref_model, model_sd, f"rank {rank} model (both nodes lost)")

        step, step_value, tier, _, _, _ = res["root_newer"]
        assert (step, step_value, tier) == (3, 3, "root"), rank


def test_decide_is_pure_and_prefers_intact_copies():
    """The recovery decision on hand-made reports: the newest step whose every file is intact
    somewhere; transfers only to nodes that lack a file; a disagreement of manifests skips a step."""
    nodes = local_tier.Nodes((0, 0, 1, 1))
    files = ["__0_0.distcp", "__1_0.distcp", ".metadata", "manifest.json"]

    def holding(intact, sha="a"):
        return local_tier.Holding(sha, files, intact)

    # Step 5 complete on node 0 only; node 1 lost everything.
    reports = [{5: holding(["manifest.json", "__0_0.distcp", ".metadata"])}, {5: holding(["__1_0.distcp"])}, {}, {}]
    d = local_tier.decide(nodes, reports, root_steps=[4, 5], want=None)
    assert d.step == 5 and {(f, dst) for f, _, dst in d.transfers} == {(f, r) for f, r in zip(files, [2, 3, 2, 3])}
    assert all(src in (0, 1) for _, src, _ in d.transfers)
    assert local_tier.decide(nodes, reports, root_steps=None, want=None).step == 5  # root unreachable
    # The root's newest is another step: not this one (newer: the tier lags; older: step 5 was
    # deleted at the root, or is an earlier life's), unless asked for by number.
    assert local_tier.decide(nodes, reports, root_steps=[4, 6], want=None).step is None
    assert local_tier.decide(nodes, reports, root_steps=[4], want=None).step is None
    assert local_tier.decide(nodes, reports, root_steps=[4], want=5).step == 5
    assert local_tier.decide(nodes, reports, root_steps=[], want=None).step is None
    # A file intact nowhere: not recoverable.
    reports[1] = {5: holding([])}
    d = local_tier.decide(nodes, reports, root_steps=None, want=None)
    assert d.step is None and "__1_0.distcp" in d.reason
    # Different manifests for the same step (root unreachable): an older complete step.
    full = ["manifest.json", "__0_0.distcp", ".metadata", "__1_0.distcp"]
    reports = [{7: holding(full, "x"), 6: holding(full)}, {}, {7: holding(full, "y"), 6: holding(full)}, {}]
    d = local_tier.decide(nodes, reports, root_steps=None, want=None)
    assert d.step == 6 and d.transfers == [] and "newer step(s) 7 " in d.reason and "different manifests" in d.reason
    assert local_tier.decide(nodes, reports, root_steps=None, want=7).step is None
    assert local_tier.decide(nodes, reports, root_steps=[6, 7], want=None).step is None


def test_decide_names_every_candidates_reason_and_passes_failed_steps_by():
    """With the root unreachable, a step an earlier attempt could not load is passed by for the
    next older one, and where no step serves, the reason names each (the newest's alone hid why
    the older ones could not serve)."""
    nodes = local_tier.Nodes((0, 0))
    files = ["__0_0.distcp", ".metadata", "manifest.json"]
    reports = [{s: local_tier.Holding("a", files, files) for s in (1, 2)}, {}]
    d = local_tier.decide(nodes, reports, root_steps=None, want=None)
    assert (d.step, d.later) == (2, True)
    d = local_tier.decide(nodes, reports, root_steps=None, want=None, failed={2: "loading it failed (bad)"})
    assert d.step == 1 and not d.later and "loading it failed (bad)" in d.reason
    reports = [{2: local_tier.Holding("a", files, files[1:]), 1: local_tier.Holding("a", files, files[:2])}, {}]
    d = local_tier.decide(nodes, reports, root_steps=None, want=None)
    assert d.step is None and "step 2: 1 file(s)" in d.reason and "step 1: 1 file(s)" in d.reason, d.reason


def test_options_are_checked():
    with pytest.raises(ValueError, match="local_dir"):
        distckpt.Checkpointer("/tmp/x", local_dir="s3://bucket/tier")
    with pytest.raises(ValueError, match="local_keep"):
        distckpt.Checkpointer("/tmp/x", local_dir="/tmp/y", local_keep=0)
    with pytest.raises(ValueError, match="local_peers"):
        distckpt.Checkpointer("/tmp/x", local_dir="/tmp/y", local_peers=2)
    for local in ("/tmp/x", "/tmp/x/tier", "/tmp"):  # the tier deletes its old steps: never the root's
        with pytest.raises(ValueError, match="overlap"):
            distckpt.Checkpointer("/tmp/x", local_dir=local)


@pytest.mark.parametrize("blocking, mode", [(True, "process"), (False, "thread"), (False, "process")])
def test_one_process_resumes_from_its_tier_without_the_root(tmp_path, blocking, mode):
    """One process (one node, no peers): sync, thread and writer-process saves all keep their
    files in the tier; the newest step loads from there, exactly, with the root moved away."""
    import torch

    root, tier = tmp_path / "root", tmp_path / "tier"
    model = torch.nn.Linear(8, 4)
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=2, async_mode=mode) as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.save(step, {"model": model, "step": step}, blocking=blocking)
        ckpt.wait()
    assert sorted(p.name for p in tier.iterdir()) == ["step_000000002", "step_000000003"]  # local_keep=2
    in_root = {p.name for p in (root / "step_000000003").iterdir()}
    assert {p.name for p in (tier / "step_000000003").iterdir()} == in_root | {local_tier.ROOT_MARK}
    want = model.weight.detach().clone()
    root.rename(tmp_path / "away")
    fresh = {"model": torch.nn.Linear(8, 4), "step": 0}
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        assert ckpt.load(fresh) == 3 and fresh["step"] == 3
        assert ckpt.last_load_report.tier == "local" and set(ckpt.last_load_report.sources.values()) == {"local"}
    assert torch.equal(fresh["model"].weight, want)
    # The same tier under another root (another job's, left in the same directory): not recovered from.
    with distckpt.Checkpointer(tmp_path / "other_root", local_dir=tier) as ckpt:
        with pytest.raises(FileNotFoundError):
            ckpt.load({"model": torch.nn.Linear(8, 4), "step": 0})


def test_latest_step_and_steps_agree_with_load_when_the_root_is_unreachable(tmp_path):
    """With the root's mount missing, load resumes from the tier; latest_step() said None (and
    steps(tier="all") []), so a job following the quickstart started fresh, and its first save
    retired the tier's copies of the newer steps as an earlier life's."""
    import torch

    root, tier = tmp_path / "mnt" / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4,), float(step)), "step": step})
        assert ckpt.steps(tier="local") == [2, 3] and ckpt.steps(tier="all") == [1, 2, 3]
    shutil.rmtree(tmp_path / "mnt")
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        assert ckpt.latest_step() == 3
        assert ckpt.steps(tier="all") == [2, 3] and ckpt.steps(tier="local") == [2, 3] and ckpt.steps() == []
        state = {"w": torch.zeros(4), "step": 0}
        assert ckpt.load(state) == ckpt.latest_step() == 3 and state["step"] == 3
    with distckpt.Checkpointer(tmp_path / "other_root", local_dir=tier) as ckpt:
        assert ckpt.latest_step() is None and ckpt.steps(tier="local") == []  # another root's tier
    with pytest.raises(ValueError, match="no local tier"):
        distckpt.Checkpointer(tmp_path / "r").steps(tier="local")


@pytest.mark.parametrize("replica_has", [[2], []])
def test_with_the_root_gone_a_lagging_replica_does_not_hide_the_tiers_newer_step(tmp_path, replica_has):
    """The root's mount gone, the replica there but behind (step 3's upload cut off, or nothing
    uploaded yet): its listing was taken for the root's, so load resumed step 2 silently (or
    raised FileNotFoundError with an empty replica) while the tier held step 3 whole."""
    import torch

    root, rep, tier = tmp_path / "mnt" / "root", tmp_path / "replica", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier, replicate_to=str(rep), keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4,), float(step)), "step": step})
    for step in (1, 2, 3):
        if step not in replica_has:
            shutil.rmtree(rep / f"step_{step:09d}", ignore_errors=True)
    shutil.rmtree(tmp_path / "mnt")
    with distckpt.Checkpointer(root, local_dir=tier, replicate_to=str(rep), keep_last=2) as ckpt:
        assert ckpt.latest_step() == 3
        state = {"w": torch.zeros(4), "step": 0}
        assert ckpt.load(state) == 3 and state["step"] == 3 and ckpt.last_load_report.tier == "local"
        assert torch.equal(state["w"], torch.full((4,), 3.0))
        # A step of the replica's number is still checked against the replica's manifest.
        assert ckpt.load(state, step=2) == 2 and state["step"] == 2


def test_decide_with_a_lagging_replica_takes_the_tiers_steps_from_its_newest_on():
    nodes = local_tier.Nodes((0,))
    files = ["__0_0.distcp", ".metadata", "manifest.json"]
    reports = [{s: local_tier.Holding("a", files, files) for s in (2, 3)}]
    assert local_tier.decide(nodes, reports, root_steps=[2], want=None, lagging=True).step == 3
    assert local_tier.decide(nodes, reports, root_steps=[], want=None, lagging=True).step == 3
    assert local_tier.decide(nodes, reports, root_steps=[4], want=None, lagging=True).step is None  # replica newer
    assert local_tier.decide(nodes, reports, root_steps=[2], want=None).step == 2  # the root's listing: its newest only


def test_copies_a_full_tier_left_incomplete_never_retire_its_last_whole_step(tmp_path, monkeypatch):
    """A full tmpfs: steps 2 and 3 kept a manifest without their data file (the save warned).
    Retention counted them and deleted step 1, the only whole copy: with the root's mount then
    gone, nothing could be recovered. Now incomplete copies do not count."""
    import errno

    import torch

    real = local_tier.LocalCopy.write

    def full_after_step_1(self, data):
        if self._f is not None and "step_000000001" not in self.path and self.path.endswith(".distcp"):
            self._fail(OSError(errno.ENOSPC, "No space left on device"))
        real(self, data)

    monkeypatch.setattr(local_tier.LocalCopy, "write", full_after_step_1)
    root, tier = tmp_path / "mnt" / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            with pytest.warns(UserWarning, match="local-tier copy is incomplete") if step > 1 else contextlib.nullcontext():
                ckpt.save(step, {"w": torch.full((1024,), float(step)), "step": step})
        assert ckpt.steps(tier="local") == [1, 3, 4]  # step 1 whole, and the newest 2 (incomplete)
    monkeypatch.setattr(local_tier.LocalCopy, "write", real)
    shutil.rmtree(tmp_path / "mnt")
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        state = {"w": torch.zeros(1024), "step": 0}
        assert ckpt.load(state) == 1 and state["step"] == 1 and torch.equal(state["w"], torch.full((1024,), 1.0))
        assert ckpt.last_load_report.tier == "local"


def test_a_tier_filled_for_a_while_frees_its_extra_steps_once_a_copy_is_whole(tmp_path, monkeypatch):
    """A passing episode (the tmpfs full during steps 2 and 3): the last whole step (1) stays
    beside them, and once a new copy is whole (4), only the newest local_keep stay. Keeping
    local_keep whole steps beside the incomplete ones held the tmpfs full, so no copy was ever
    whole again. Found by a helper (2026-12-06)."""
    import errno

    import torch

    real = local_tier.LocalCopy.write

    def full_at_2_and_3(self, data):
        if self._f is not None and ("step_000000002" in self.path or "step_000000003" in self.path) and self.path.endswith(".distcp"):
            self._fail(OSError(errno.ENOSPC, "No space left on device"))
        real(self, data)

    monkeypatch.setattr(local_tier.LocalCopy, "write", full_at_2_and_3)
    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=2) as ckpt:
        ckpt.save(1, {"w": torch.ones(64)})
        for step in (2, 3):
            with pytest.warns(UserWarning, match="local-tier copy is incomplete"):
                ckpt.save(step, {"w": torch.ones(64)})
        assert ckpt.steps(tier="local") == [1, 2, 3]
        ckpt.save(4, {"w": torch.ones(64)})
        assert ckpt.steps(tier="local") == [3, 4]
        ckpt.save(5, {"w": torch.ones(64)})
        assert ckpt.steps(tier="local") == [4, 5]


def _full_on_node_0_body(rank: int, world: int, root: str, nodes: str, phase: str):
    import errno
    import warnings

    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two nodes of one rank
    tier = f"{nodes}/node{rank}"
    if phase == "save":
        real = local_tier.LocalCopy.write

        def full(self, data):
            if rank == 0 and self._f is not None and ("step_000000002" in self.path or "step_000000003" in self.path) and self.path.endswith(".distcp"):
                self._fail(OSError(errno.ENOSPC, "No space left on device"))
            real(self, data)

        local_tier.LocalCopy.write = full
        warnings.simplefilter("ignore")
        with distckpt.Checkpointer(root, local_dir=tier, local_keep=1, local_peers=0) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(step, {"w": torch.full((64,), float(rank * 10 + step))})
        return sorted(os.listdir(tier))
    state = {"w": torch.zeros(64)}
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=1, local_peers=0) as ckpt:
        return ckpt.load(state), float(state["w"][0]), ckpt.last_load_report.tier


@pytest.mark.timeout(150)
def test_the_last_step_whole_on_every_node_is_kept_on_every_node(tmp_path):
    """Two nodes, local_peers=0: node 0's tmpfs full for steps 2 and 3. Each node judged
    whole-ness alone: node 0 kept step 1 (its last whole copy), node 1 kept only step 3 (whole
    there) and deleted its step 1, so no step was whole anywhere and with the root gone nothing
    could be recovered. Found by a helper (2026-12-06)."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    tiers = run_ranks(_full_on_node_0_body, 2, tmp_path, str(root), str(nodes), "save", timeout=120)
    assert tiers == [["step_000000001", "step_000000003"]] * 2
    root.rename(tmp_path / "gone")
    got = run_ranks(_full_on_node_0_body, 2, tmp_path, str(root), str(nodes), "load", timeout=120)
    assert got == [(1, 1.0, "local"), (1, 11.0, "local")]


def _three_saves_body(rank: int, world: int, root: str, nodes: str) -> None:
    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank), local_keep=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((8,), float(rank * 10 + step)), "step": step}, blocking=step != 2)


@pytest.mark.timeout(120)
def test_whole_copies_on_two_nodes_count_for_local_keep(tmp_path):
    # Each node holds its own ranks' files and its peer node's: that copy is whole, so
    # local_keep=1 keeps one step per node (an incomplete copy would keep an older one too).
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_three_saves_body, WORLD, tmp_path, str(root), str(nodes), timeout=100)
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (nodes / node).iterdir()) == ["step_000000003"], node


def test_a_damaged_root_manifest_is_named_as_a_possible_cause_not_only_a_resave(tmp_path):
    # The warning said only "saved again at the root since the tier kept it" for a root manifest
    # that was garbage; the load then failed on it (never the tier's copy: which step the root
    # holds cannot be told).
    import torch

    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
    (root / "step_000000001" / "manifest.json").write_text("{not json")
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        with pytest.warns(UserWarning, match="manifest of it differs .*or damaged there"):
            with pytest.raises(distckpt.IntegrityError):
                ckpt.load({"w": torch.zeros(4)})


def test_verify_of_a_tier_copy_checks_what_the_node_holds(tmp_path):
    """With three nodes or more a node's tier holds its own ranks' files and its peer node's
    only: `distckpt verify` of a healthy node's local_dir failed, calling the others missing.
    Now they are named as on other nodes; what the node holds is still verified."""
    import json

    import torch
    from cli_runner import run_cli

    root, tier = tmp_path / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier, thread_count=2) as ckpt:
        ckpt.save(1, {"w": torch.ones(64), "v": torch.zeros(64)})
    step = tier / "step_000000001"
    data = sorted(p for p in step.iterdir() if p.suffix == ".distcp")
    assert len(data) >= 2
    data[0].unlink()  # as if it were another node's file
    out = run_cli("verify", str(tier))
    assert out.returncode == 0 and "1 data file(s) are not on this node" in out.stdout, out
    report = json.loads(run_cli("verify", str(tier), "--json").stdout)
    assert report["ok"] and report["not_on_this_node"] == [data[0].name]
    assert run_cli("verify", str(tier), "--state").returncode == 1  # needs every file
    raw = bytearray(data[1].read_bytes())
    raw[-1] ^= 0xFF
    data[1].write_bytes(bytes(raw))
    out = run_cli("verify", str(tier))
    assert out.returncode == 1 and data[1].name in out.stderr, out
    # A root's step missing a file still fails.
    (root / "step_000000001" / data[0].name).unlink()
    out = run_cli("verify", str(root))
    assert out.returncode == 1 and f"{data[0].name}: missing" in out.stderr, out


def test_a_tier_that_cannot_be_written_warns_and_the_root_commits(tmp_path):
    """A local tier that cannot take a step (here a file where the step's directory must go,
    which the tier never removes: it is not the tier's) does not fail the save: the step is
    committed at the root, one warning names the problem, and the load reads the root."""
    import torch

    root, tier = tmp_path / "root", tmp_path / "tier"
    tier.mkdir()
    (tier / "step_000000001").write_text("in the way")
    model = torch.nn.Linear(4, 4)
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        with pytest.warns(UserWarning, match="keeps no local-tier copy"):
            ckpt.save(1, {"model": model})
        assert ckpt.steps() == [1]
    with distckpt.Checkpointer(root, local_dir=tier) as ckpt:
        assert ckpt.load({"model": torch.nn.Linear(4, 4)}) == 1
        assert ckpt.last_load_report.tier == "root"


def _one_node_blocked_body(rank: int, world: int, root: str, nodes: str) -> tuple:
    import warnings

    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank), save_rng=False) as ckpt:
            ckpt.save(1, {"w": torch.full((4,), float(rank))}, blocking=False)
            ckpt.wait()
            ckpt.save(2, {"w": torch.full((4,), float(rank))}, blocking=False)
            ckpt.wait()
            steps = ckpt.steps()
    return steps, [str(w.message) for w in caught if "keeps no local-tier copy" in str(w.message)]


@pytest.mark.timeout(120)
def test_one_nodes_tier_that_cannot_take_a_step_keeps_it_out_of_every_tier(tmp_path):
    """Where one node's tier cannot take a step (something not the tier's in the way), every
    rank is told (one warning each, async saves too) and no node keeps a copy of that step: a
    copy on some nodes only could never be recovered as a whole. The next step is kept again."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    (nodes / "node1").mkdir(parents=True)
    (nodes / "node1" / "step_000000001").write_text("in the way")
    results = run_ranks(_one_node_blocked_body, WORLD, tmp_path, str(root), str(nodes), timeout=100)
    for rank, (steps, warned) in enumerate(results):
        assert steps == [1, 2], (rank, steps)
        assert len(warned) == 1 and "step 1" in warned[0], (rank, warned)
    assert not (nodes / "node0" / "step_000000001").exists()
    assert (nodes / "node1" / "step_000000001").read_text() == "in the way"
    for node in ("node0", "node1"):
        assert (nodes / node / "step_000000002" / "manifest.json").is_file(), node


def test_an_older_step_recovered_with_the_root_unreachable_is_said(tmp_path):
    """The tier's newest step has a damaged file (no other copy) and the root cannot be listed:
    the load takes the tier's older step, which is what it has, but says so on every rank with
    why (it did so silently: latest_step() said 2, load() gave 1)."""
    import torch

    root, tier = tmp_path / "mnt" / "root", tmp_path / "tier"
    with distckpt.Checkpointer(root, local_dir=tier, local_keep=2, save_rng=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((1000,), float(step)), "step": step})
    data = tier / "step_000000002" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-1])
    shutil.rmtree(tmp_path / "mnt")
    state = {"w": torch.zeros(1000), "step": 0}
    with distckpt.Checkpointer(root, local_dir=tier, save_rng=False) as ckpt:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert ckpt.load(state) == 1
    said = [str(w.message) for w in seen if "an older one" in str(w.message)]
    assert len(said) == 1 and re.search(r"recovered step 1 from the local tier, an older one: the tier's newer step\(s\) 2 cannot be served \(.*__0_0\.distcp", said[0]), said
    assert seen[[str(w.message) for w in seen].index(said[0])].filename == __file__  # (the caller's load())
    assert state["step"] == 1 and torch.equal(state["w"], torch.full((1000,), 1.0))


@pytest.mark.timeout(120)
def test_recovery_with_the_s3_server_stopped(tmp_path):
    """Root on S3 (a real moto server on 127.0.0.1); the server stopped before the restart: the
    load recovers the newest step from the local tier (listing the root fails: the tier decides)."""
    pytest.importorskip("moto")
    import torch

    from s3_server import S3Server

    server = S3Server().start()
    try:
        bucket = server.make_bucket("tier")
        url, opts = f"s3://{bucket}/job", server.storage_options
        model = torch.nn.Linear(6, 3)
        with distckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "tier") as ckpt:
            for step in (1, 2):
                with torch.no_grad():
                    model.bias.add_(step)
                ckpt.save(step, {"model": model})
    finally:
        server.stop()
    fresh = {"model": torch.nn.Linear(6, 3)}
    with distckpt.Checkpointer(url, storage_options=opts, local_dir=tmp_path / "tier") as ckpt:
        # What load resumes, as latest_step() says (it raised the store's ConnectionError).
        assert ckpt.latest_step() == 2 and ckpt.steps(tier="all") == [1, 2]
        with pytest.raises(OSError):
            ckpt.steps()  # the root's own listing: the store's error, as without a tier
        assert ckpt.load(fresh) == 2 and ckpt.last_load_report.tier == "local"
    assert torch.equal(fresh["model"].bias, model.bias) and torch.equal(fresh["model"].weight, model.weight)


def _dies_receiving_body(rank: int, world: int, root: str, nodes: str) -> str:
    """Steps 1 and 2 saved; rank 2 is killed (SIGKILL) as its peer transfer of step 2 begins,
    after the root committed the step. The survivors' save fails or warns; none hangs."""
    import signal

    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    real = local_tier.transfer

    def dying(group, directory, moves, manifest):
        if group.rank == 2 and directory.endswith("step_000000002"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(group, directory, moves, manifest)

    local_tier.transfer = dying
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    ckpt = distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank), timeout=20)
    ckpt.save(1, {"model": model, "step": 1})
    with torch.no_grad():
        model.weight.add_(1.0)
    try:
        ckpt.save(2, {"model": model, "step": 2})
        return "saved"
    except Exception as exc:  # noqa: BLE001 - a dead peer fails the survivors' collectives
        return type(exc).__name__


def _resume_body(rank: int, world: int, root: str, nodes: str) -> tuple:
    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    state = {"model": torch.nn.Linear(4, 4), "step": 0}
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank)) as ckpt:
        step = ckpt.load(state)
        return step, state["step"], ckpt.last_load_report.tier, state["model"].weight.detach().clone()


@pytest.mark.timeout(200)
def test_a_peer_that_dies_while_receiving_never_leaves_a_wrong_step(tmp_path):
    import torch

    root, nodes = tmp_path / "root", tmp_path / "nodes"
    outcomes = run_ranks(_dies_receiving_body, WORLD, tmp_path, str(root), str(nodes), expect_dead=frozenset({2}), timeout=120, pg_timeout=20)
    assert outcomes[2] is None and all(o in ("saved", "CheckpointError") for o in outcomes[:2] + outcomes[3:]), outcomes
    assert (root / "step_000000002" / "manifest.json").exists()  # committed before the transfer
    # Node 1's half-received step: no manifest there (its writer died before writing it), and
    # no half-written file under a final name.
    assert not (nodes / "node1" / "step_000000002" / "manifest.json").exists()
    results = run_ranks(_resume_body, WORLD, tmp_path, str(root), str(nodes), timeout=120)
    # Every rank resumes step 2 exactly (from the root, or from the tier where it is complete).
    torch.manual_seed(0)
    want = torch.nn.Linear(4, 4).weight.detach() + 1.0
    for rank, (step, value, tier, weight) in enumerate(results):
        assert (step, value) == (2, 2) and tier in ("root", "local"), (rank, tier)
        assert torch.equal(weight, want), rank


def _sharded_save_body(rank: int, world: int, root: str, nodes: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    mesh = init_device_mesh("cpu", (world,))
    state = {"model": {f"w{i}": distribute_tensor(torch.arange(64.0).reshape(16, 4) * (i + 1), mesh, [Shard(0)]) for i in range(3)}}
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank), save_rng=False) as ckpt:
        ckpt.save(1, state)


def _sharded_load_body(rank: int, world: int, root: str, nodes: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    mesh = init_device_mesh("cpu", (world,))
    state = {"model": {f"w{i}": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]) for i in range(3)}}
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank), save_rng=False) as ckpt:
        ckpt.load(state)
        report = ckpt.last_load_report
    exact = all(torch.equal(state["model"][f"w{i}"].full_tensor(), torch.arange(64.0).reshape(16, 4) * (i + 1)) for i in range(3))
    return report.tier, dict(report.sources), exact


@pytest.mark.timeout(200)
def test_a_node_gets_only_the_files_its_ranks_read(tmp_path):
    """A purely sharded state (each rank's shards in its own file): after node 1 lost its tier,
    it is sent its ranks' files and .metadata, not node 0's."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_sharded_save_body, WORLD, tmp_path, str(root), str(nodes), timeout=120)
    shutil.rmtree(nodes / "node1")
    root.rename(tmp_path / "away")
    results = run_ranks(_sharded_load_body, WORLD, tmp_path, str(root), str(nodes), timeout=120)
    for rank, (tier, sources, exact) in enumerate(results):
        assert tier == "local" and exact, rank
        if rank >= 2:
            got = {f for f, src in sources.items() if src != "local"}
            data = {f for f in got if f.endswith(".distcp")}
            assert got - data == {".metadata", "manifest.json"} and data, sources
            assert all(f.startswith(("__2_", "__3_")) for f in data), sources  # node 1's ranks' files only
    # Streamed into the load (distckpt.storage.stream), not written to node 1's tier: it keeps
    # .metadata (to plan with) and no data file until the next save.
    kept = [p.name for p in (nodes / "node1" / "step_000000001").iterdir() if p.name.endswith(".distcp")]
    assert not kept, kept


def _fsdp_adamw_body(rank: int, world: int, root: str, nodes: str, load: bool) -> tuple | None:
    import torch

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = wrap(make_wide_model(0), "fsdp", world)
    optim = make_optimizer(model, "fsdp")
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3)
    train_steps(model, optim, range(2), rank, world)
    want = full_model_state(model), full_optim_state(model, optim)
    if not load:
        with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank)) as ckpt:
            ckpt.save(1, {"model": model, "optim": optim, "sched": sched, "step": 2})
        return None
    fresh = wrap(make_wide_model(1), "fsdp", world)
    fresh_optim = make_optimizer(fresh, "fsdp")
    state = {"model": fresh, "optim": fresh_optim, "sched": torch.optim.lr_scheduler.StepLR(fresh_optim, step_size=3), "step": 0}
    with distckpt.Checkpointer(root, local_dir=_node_dir(nodes, rank)) as ckpt:
        ckpt.load(state)
        report = ckpt.last_load_report
    assert_same(want[0], full_model_state(fresh), f"rank {rank} model")
    assert_same(want[1], full_optim_state(fresh, fresh_optim), f"rank {rank} optim")
    return report.tier, dict(report.sources), state["step"]


@pytest.mark.timeout(200)
def test_a_node_recovering_an_fsdp_state_with_an_optimizer_gets_its_share(tmp_path):
    """With an optimizer and a scheduler (their replicated values are written by every rank), a
    node that lost its tier is sent its ranks' files and the small files of values every rank
    reads, never node 0's shards (it used to be sent every file of the step)."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_fsdp_adamw_body, WORLD, tmp_path, str(root), str(nodes), False, timeout=120)
    step = root / "step_000000001"
    sizes = {p.name: p.stat().st_size for p in step.iterdir() if p.name.endswith(".distcp")}
    shutil.rmtree(nodes / "node1")
    root.rename(tmp_path / "away")
    results = run_ranks(_fsdp_adamw_body, WORLD, tmp_path, str(root), str(nodes), True, timeout=120)
    sharded = set(keys_by_file(tmp_path / "away" / "step_000000001")[1])  # the files holding a shard
    node0 = {n for n in sizes if n.startswith(("__0_", "__1_"))}
    assert node0 & sharded and node0 - sharded, sorted(sizes)
    for rank, (tier, sources, value) in enumerate(results):
        assert tier == "local" and value == 2, rank
        if rank >= 2:
            got = {f for f, src in sources.items() if src != "local" and f.endswith(".distcp")}
            # Node 0's files of values every rank reads, none of node 0's shards.
            assert got & node0 == node0 - sharded, (sorted(got), sorted(sharded))


@pytest.mark.parametrize("checksum", ["crc32c", None])
def test_a_tier_load_reads_the_metadata_once(tmp_path, monkeypatch, checksum):
    """Recovery reads and verifies the step's ``.metadata`` (on the coordinator) to plan the
    files each rank needs; the load then reuses it rather than reading it again on the coordinator. Without
    checksums the copies cannot be told apart: the load reads the coordinator's, as from the root."""
    import torch

    from distckpt.load import run as load_run

    reads = []
    real = load_run._read_index
    monkeypatch.setattr(load_run, "_read_index", lambda *a: reads.append(a) or real(*a))
    model = torch.nn.Linear(4, 4)
    with distckpt.Checkpointer(tmp_path / "root", local_dir=tmp_path / "tier", checksum=checksum) as ckpt:
        ckpt.save(1, {"model": model})
    fresh = {"model": torch.nn.Linear(4, 4)}
    with distckpt.Checkpointer(tmp_path / "root", local_dir=tmp_path / "tier", checksum=checksum) as ckpt:
        assert ckpt.load(fresh) == 1 and ckpt.last_load_report.tier == "local"
    assert torch.equal(fresh["model"].weight, model.weight)
    assert len(reads) == (0 if checksum else 1)


def _counted_load_body(rank: int, world: int, root: str, nodes: str) -> dict:
    """``_sharded_load_body`` counting this rank's load planning (distckpt's and DCP's), its
    reads of the step's ``.metadata`` and distckpt's collectives during the load."""
    import torch.distributed.checkpoint.default_planner as dcp_planner

    from distckpt import _dist
    from distckpt import checkpointer as checkpointer_module
    from distckpt.load import run as load_run

    counts = {"plan_load": 0, "dcp_plan": 0, "all_gather": 0, "metadata": 0}

    def counting(owner: object, name: str, key: str) -> None:
        real = getattr(owner, name)

        def counted(*args: object, **kwargs: object) -> object:
            counts[key] += 1
            return real(*args, **kwargs)

        setattr(owner, name, counted)

    counting(load_run, "plan_load", "plan_load")
    counting(dcp_planner, "create_default_local_load_plan", "dcp_plan")
    counting(_dist.Group, "all_gather", "all_gather")
    counting(checkpointer_module, "read_metadata", "metadata")
    tier, sources, exact = _sharded_load_body(rank, world, root, nodes)
    return {"tier": tier, "exact": exact, "sources": sources, **counts}


def _tier_files(node: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(node)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in node.rglob("*") if p.is_file()}


@pytest.mark.timeout(200)
def test_a_recovery_plans_once_and_a_restart_rewrites_nothing(tmp_path):
    """Recovery plans each rank's load to know which files a node needs; the load then reuses
    that plan (DCP's planning of a sharded state is a tenth of a tier load). A restart whose
    nodes all hold the step sends, writes and gathers nothing beyond what it must: the tier's
    files are untouched (same inode, same mtime) and the load takes at most seven collectives
    (distckpt's group of a fresh Checkpointer, the nodes, the inventory, whether every rank
    planned, the plan exchange, the read, the apply; twelve before the fast path). The step's ``.metadata``
    is read and verified once, by the coordinator, not by every rank (its safety scans are pure
    Python: four ranks scanning at once on two cores cost a recovery ~0.1 s)."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    run_ranks(_sharded_save_body, WORLD, tmp_path, str(root), str(nodes), timeout=120)
    before = {n: _tier_files(nodes / n) for n in ("node0", "node1")}
    results = run_ranks(_counted_load_body, WORLD, tmp_path, str(root), str(nodes), timeout=120)
    for rank, got in enumerate(results):
        assert got["tier"] == "local" and got["exact"], (rank, got)
        assert set(got["sources"].values()) == {"local"}, got
        assert (got["plan_load"], got["dcp_plan"]) == (1, 1), (rank, got["plan_load"], got["dcp_plan"], got["all_gather"])
        assert got["all_gather"] <= 7, (rank, got)  # (the apply's outcome: after every rank has read)
        assert got["metadata"] == (1 if rank == 0 else 0), (rank, got)
    assert {n: _tier_files(nodes / n) for n in ("node0", "node1")} == before
    # A lost node: its files come from the peer, and still one plan per rank.
    shutil.rmtree(nodes / "node1")
    results = run_ranks(_counted_load_body, WORLD, tmp_path, str(root), str(nodes), timeout=120)
    for rank, got in enumerate(results):
        assert got["tier"] == "local" and got["exact"], (rank, got)
        assert (got["plan_load"], got["dcp_plan"]) == (1, 1), (rank, got["plan_load"], got["dcp_plan"], got["all_gather"])
        assert got["metadata"] == (1 if rank == 0 else 0), (rank, got)
    assert any(src != "local" for src in results[2]["sources"].values())


def test_a_plan_made_for_other_metadata_is_not_reused(tmp_path, monkeypatch):
    """``load(planned=...)`` reuses a plan only with the very metadata it was made with (the
    preread one); given another, the load plans again, and loads the same values."""
    import torch

    from distckpt._dist import Group
    from distckpt.integrity.manifest import read_manifest
    from distckpt.integrity.stepfiles import read_metadata
    from distckpt.load import run as load_run
    from distckpt.options import CheckpointerOptions
    from distckpt.storage.base import Storage

    model = torch.nn.Linear(4, 4)
    with distckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(1, {"model": model})
    storage = Storage(str(tmp_path / "root"))
    manifest = read_manifest(storage, 1)
    plans = []
    real = load_run.plan_load
    monkeypatch.setattr(load_run, "plan_load", lambda *a, **k: plans.append(1) or real(*a, **k))
    for same in (True, False):
        fresh = {"model": torch.nn.Linear(4, 4)}
        made_with = read_metadata(storage, manifest, verify=True)
        planned = load_run.plan_ahead(Group(), manifest, made_with, fresh, True, None, None)
        used = made_with if same else read_metadata(storage, manifest, verify=True)
        plans.clear()
        load_run.load(Group(), CheckpointerOptions(str(tmp_path / "root")), [storage], fresh, 1, True, True, None, None, None, preread=(manifest, used), planned=planned)
        assert len(plans) == (0 if same else 1), same
        assert torch.equal(fresh["model"].weight, model.weight) and torch.equal(fresh["model"].bias, model.bias)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_copy_failing_again_as_it_is_dropped_is_recorded_not_raised(tmp_path):
    """A full tmpfs fails a buffered write, and again the close that drops the copy (it flushes
    the rest): that second ENOSPC escaped into the root's writer and failed the save, leaving
    the .part file behind (found by a helper on a real 1 MB tmpfs). /dev/full is a real file
    that is always full."""
    errors: list[str] = []
    copy = local_tier.LocalCopy(str(tmp_path / "step_000000001"), "__0_0.distcp", errors)
    part = tmp_path / "step_000000001" / ("__0_0.distcp" + local_tier.PART)
    assert part.exists()
    copy._f.close()
    copy._f = open("/dev/full", "wb", buffering=1 << 16)  # noqa: SIM115 - closed by the copy
    copy.write(b"x" * 5000)  # buffered: no error yet
    copy.write(b"y" * 70000)  # flushes: ENOSPC, the copy dropped (its close fails again)
    copy.write(b"z")  # dropped: nothing more happens
    copy.finish()
    assert len(errors) == 1 and "No space left" in errors[0], errors
    assert not part.exists() and not (tmp_path / "step_000000001" / "__0_0.distcp").exists()


def _small_tmpfs(path, size: str = "256k") -> bool:
    """Mount a small tmpfs at ``path`` (root in a container that allows it), else False."""
    import subprocess

    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_a_full_real_tmpfs_never_fails_a_save(tmp_path):
    """README: a tier that cannot be written never fails a save. On a real small tmpfs (not a
    patched write) the step commits at the root, a warning names the copy, no .part is left."""
    import subprocess

    import torch

    tier = tmp_path / "tier"
    if not _small_tmpfs(tier):
        pytest.skip("cannot mount a tmpfs here")
    try:
        state = {f"t{i}": torch.full((300,), float(i)) for i in range(600)}  # ~720 KB in small records
        for blocking in (True, False):
            root = tmp_path / f"root{blocking}"
            with distckpt.Checkpointer(root, local_dir=tier, local_keep=1, local_peers=0, async_mode="thread") as ckpt:
                with pytest.warns(UserWarning, match="local-tier copy is incomplete"):
                    ckpt.save(1, state, blocking=blocking)
                    ckpt.wait()
                assert ckpt.steps() == [1]
                back = {k: torch.zeros(300) for k in state}
                ckpt.load(back)
                assert all(torch.equal(back[k], state[k]) for k in state)
            assert not [p for p in tier.rglob("*") if p.name.endswith(local_tier.PART)]
            subprocess.run(["rm", "-rf", str(tier / "step_000000001")], check=True)
    finally:
        subprocess.run(["umount", str(tier)], capture_output=True)


def test_a_tier_its_own_step_filled_leaves_no_litter_and_says_why(tmp_path):
    """A real 64 KiB tmpfs that step 0 fills: step 1's folder could not take its mark, kept a
    0-byte .distckpt-root.part and no mark, so nothing ever retired it, and every later step
    added one such folder with a warning blaming "another root's step" (a review finding). The
    folder goes, and the warning names the full tmpfs."""
    import subprocess

    import torch

    tier = tmp_path / "tier"
    if not _small_tmpfs(tier, "64k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        with distckpt.Checkpointer(tmp_path / "root", local_dir=tier, local_peers=0) as ckpt:
            ckpt.save(0, {"w": torch.randn(4000), "x": torch.randn(2000)})
            ckpt.save(1, {"w": torch.randn(20000), "x": torch.randn(10000)})  # fills it (or not: warned if so)
            for step in (2, 3):
                with pytest.warns(UserWarning, match=rf"step {step} is committed at the root, but its local-tier copy is incomplete.*first: .*No space left"):
                    ckpt.save(step, {"w": torch.randn(400), "x": torch.randn(200)})
            assert ckpt.steps() == [0, 1, 2, 3]
        left = sorted(str(p.relative_to(tier)) for p in tier.rglob("*"))
        assert not [n for n in left if n.endswith(local_tier.PART)], left
        assert {n.split("/")[0] for n in left} <= {"step_000000000", "step_000000001"}, left
    finally:
        subprocess.run(["umount", str(tier)], capture_output=True)


def test_a_save_again_after_one_that_failed_at_the_root_warns_of_nothing_stale(tmp_path):
    """A save whose tier folder could not be opened (full) and which then failed at the root
    (full too) left its problem behind: saved again once there was room, the whole copy was
    reported incomplete, naming the old ENOSPC (a review finding). Real 64 KiB tmpfs mounts."""
    import subprocess

    import torch

    tier, root = tmp_path / "tier", tmp_path / "root"
    if not _small_tmpfs(tier, "64k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        assert _small_tmpfs(root, "64k")

        def fill(where):
            with open(where / "filler", "wb", buffering=0) as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"x" * 4096)

        fill(tier)
        fill(root)
        os.truncate(root / "filler", os.path.getsize(root / "filler") - 12288)  # room for a lease, not the data
        state = {"model": torch.nn.Linear(64, 64)}
        ckpt = distckpt.Checkpointer(root, local_dir=tier, local_peers=0)
        with pytest.raises(distckpt.CheckpointError, match="No space left"):
            ckpt.save(1, state)
        os.unlink(tier / "filler")
        os.unlink(root / "filler")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the copy is whole now: nothing to say
            ckpt.save(1, state)
        assert ckpt.steps(tier="local") == [1]
        ckpt.close()
    finally:
        subprocess.run(["umount", str(tier)], capture_output=True)
        subprocess.run(["umount", str(root)], capture_output=True)


def _interrupted_tier_load_body(rank: int, world: int, root: str, nodes: str, where: str = "read") -> dict:
    """Two nodes of one rank save step 1; a new checkpointer loads it from the local tier, one
    rank interrupted (Ctrl-C) at ``where``: rank 1 at its first file read, or rank 0 (the
    coordinator) at its read of the step's .metadata to plan the recovery."""
    import signal

    import distckpt.checkpointer as C
    from distckpt.load import reader as R

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (inherited as ignored where the suite runs as a background job)
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two nodes of one rank
    model = make_model(seed=0)
    with distckpt.Checkpointer(root, local_dir=f"{nodes}/node{rank}") as ckpt:
        ckpt.save(1, {"model": model, "step": 1})
    owner, name, who = (R.CheckpointReader, "_read_file", 1) if where == "read" else (C, "read_metadata", 0)
    real = getattr(owner, name)
    read: list[str] = []
    calls = [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if where == "read":
            read.append(str(args[1].where))
        if rank == who and calls[0] == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    setattr(owner, name, interrupted)
    state = {"model": make_model(seed=1), "step": 0}
    try:
        with distckpt.Checkpointer(root, local_dir=f"{nodes}/node{rank}") as ckpt:
            ckpt.load(state)
        got = "loaded"
    except BaseException as exc:  # noqa: BLE001 - what each rank gets is the point
        got = f"{type(exc).__name__}: {exc}"
    finally:
        setattr(owner, name, real)
    return {"got": got, "read": read, "step": state["step"], "calls": calls[0]}


def test_a_load_from_the_tier_interrupted_does_not_go_on_to_the_root(tmp_path):
    """A Ctrl-C while a rank read the local tier's copy was taken for a damaged copy: every rank
    warned and loaded the whole step from the root, and the interrupted rank's KeyboardInterrupt
    was lost (a preempted job went on). Found by a helper (2026-12-07)."""
    root = str(tmp_path / "root")
    got = run_ranks(_interrupted_tier_load_body, 2, tmp_path, root, str(tmp_path / "nodes"))
    assert got[1]["got"].startswith("KeyboardInterrupt"), got
    assert got[0]["got"].startswith("Interrupted: reading ") and "interrupted on rank(s) [1]" in got[0]["got"], got
    for r in got:
        assert r["read"] and not any(root + "/" in w or w.startswith(root) for w in r["read"]), r["read"]
        assert r["step"] == 0, "no entry took its state"


def test_an_interrupt_in_the_tiers_planning_stops_the_load(tmp_path):
    """A Ctrl-C while the coordinator read the tier step's .metadata to plan the recovery came
    back as Interrupted on every rank, which the planning took for "this rank cannot tell what
    it reads": the load went on reading every file, the interrupt lost. Found by a reviewer
    (2026-12-07)."""
    got = run_ranks(_interrupted_tier_load_body, 2, tmp_path, str(tmp_path / "root"), str(tmp_path / "nodes"), "planning")
    assert got[0]["calls"] >= 1, got
    assert got[0]["got"].startswith("KeyboardInterrupt") and got[1]["got"].startswith("Interrupted: "), got
    assert got[0]["step"] == got[1]["step"] == 0, got


def test_a_tier_copy_damaged_without_checksums_falls_back_to_the_root(tmp_path):
    """Found by an attack helper (2026-12-07, /tmp/attack127): with checksum=None, one changed
    byte in the tier's copy (same size) made every load fail with StateDivergedError (the
    fingerprints caught it) instead of taking the root, as for a damaged copy with checksums:
    every restart failed alike until the tier was deleted by hand."""
    import struct

    import torch
    from torch import nn

    root, tier = str(tmp_path / "root"), str(tmp_path / "tier")

    def model(v: float) -> nn.Linear:
        m = nn.Linear(8, 8)
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(v)
        return m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with distckpt.Checkpointer(root, local_dir=tier, checksum=None) as ck:
            ck.save(1, {"model": model(1.0), "step": 1})
    step = os.path.join(tier, "step_000000001")
    for name in sorted(n for n in os.listdir(step) if n.endswith(".distcp")):
        data = bytearray(open(os.path.join(step, name), "rb").read())
        at = data.find(struct.pack("<f", 1.0) * 8)
        if at >= 0:
            data[at + 3] ^= 0x01  # 1.0 -> another float, same size
            open(os.path.join(step, name), "wb").write(bytes(data))
            break
    else:
        raise AssertionError("no block of 1.0 found to damage")
    for _ in range(2):  # (a restart: the same again)
        state = {"model": model(-1.0), "step": -1}
        with pytest.warns(UserWarning, match="loading step 1 from the local tier failed .*StateDivergedError.*loading from the root"):
            with distckpt.Checkpointer(root, local_dir=tier, checksum=None) as ck:
                assert ck.load(state) == 1 and ck.last_load_report.tier == "root"
        assert state["step"] == 1 and all(bool((p == 1.0).all()) for p in state["model"].parameters())


def test_values_the_states_own_load_changes_are_no_damaged_tier_copy(tmp_path):
    """Found by an attack helper (2026-12-07, /tmp/attack128): with checksums a tier copy's bytes
    are the saved ones, so values that differ after the load (a module's load hook) are the
    state's own doing: raised at once, not taken for a damaged copy (read thrice, warned about)."""
    import warnings

    import torch
    from torch import nn

    class Hooked(nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):
            super()._load_from_state_dict(*args, **kwargs)
            with torch.no_grad():
                self.weight.mul_(2)

    root, tier = str(tmp_path / "root"), str(tmp_path / "tier")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with distckpt.Checkpointer(root, local_dir=tier) as ck:
            ck.save(1, {"model": nn.Linear(8, 8), "step": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "loading step 1 from the local tier failed")
        with distckpt.Checkpointer(root, local_dir=tier) as ck:
            with pytest.raises(distckpt.StateMismatchError, match="local tier's copy.*model.weight"):
                ck.load({"model": Hooked(8, 8), "step": 0}, verify_state=True)
