"""2-D DTensor layouts (a 2x2 mesh: FSDP x TP grids, HSDP-style replicated rows) save, reshard to
1-D and to plain tensors, and verify: the fingerprints the manifest records equal the whole
tensors' own fingerprints, loads at other layouts pass the state check, and a replica that
drifted along the replicated mesh dimension is reported. DTensors on a sub-mesh that ranks of
another sub-mesh hold too (FSDP-only parameters of an FSDP x TP job) are written once, checked
without false alarms, and their drifted copies reported."""

from __future__ import annotations

import pytest
import torch

import distckpt
from dist_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")

# Uneven on purpose: 2x2 meshes split 10 rows and 7 columns into unequal shards; "one_row": the
# first mesh row holds the whole tensor, the second empty blocks (a (1, n) bias under FSDP).
SHAPES = {"grid": (10, 7), "hsdp": (9, 5), "tp_col": (6, 11), "nested": (13, 3), "vec": (11,), "one_row": (1, 5)}


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(shape, generator=g) for k, shape in SHAPES.items()}


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    return {
        "grid": [Shard(0), Shard(1)],  # FSDP rows x TP columns
        "hsdp": [Replicate(), Shard(0)],  # replicated across the first mesh dimension
        "tp_col": [Replicate(), Shard(1)],
        "nested": [Shard(0), Shard(0)],  # both mesh dimensions split the rows
        "vec": [Shard(0), Replicate()],
        "one_row": [Shard(0), Replicate()],
    }


def _save_2d(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from distckpt.state import fingerprint
    from distckpt.state.statecheck import ReplicaDriftError

    mesh = init_device_mesh("cpu", (2, 2))
    full = _full()
    placements = _placements()
    # src_data_rank=None: every rank already holds the same full tensor; no broadcast.
    state = {"model": {k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) for k, v in full.items()}}
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, state)
    recorded = ckpt.manifest(1).fingerprints
    expected = {f"model.{k}": fingerprint.of_tensor(v) for k, v in full.items()}
    # Round trip at the same layout, checked.
    again = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, placements[k], src_data_rank=None) for k, v in full.items()}}
    ckpt.load(again, verify_state=True)
    same = all(torch.equal(again["model"][k].full_tensor(), full[k]) for k in full)
    # Mesh coordinate (1, c) holds a replica of (0, c)'s shard of "hsdp": perturb it on rank 2.
    drifted = {"model": {k: distribute_tensor(v.clone(), mesh, placements[k], src_data_rank=None) for k, v in full.items()}}
    if rank == 2:
        with torch.no_grad():
            drifted["model"]["hsdp"].to_local().view(-1)[0] += 1e-3
    strict = distckpt.Checkpointer(root + "-strict", on_replica_drift="error")
    try:
        strict.save(1, drifted)
        drift = None
    except ReplicaDriftError as exc:
        drift = str(exc)
    strict.close()
    verdicts = _state_check_cases(rank, mesh, full, placements, ckpt.manifest(1).fingerprints)
    ckpt.close()
    sub = _submesh_cases(rank, root + "-sub", full)
    return {"recorded": recorded, "expected": expected, "same": same, "drift": drift, "verdicts": verdicts, "sub": sub}


def _submesh_cases(rank: int, root: str, full: dict) -> dict:
    """DTensors on the sub-mesh ``a`` of an (a, b) mesh: ranks (0, 2) form one, (1, 3) the other,
    and both hold the same blocks. Saved with ``on_replica_drift="error"`` (no false alarm from
    the copies on the other mesh), loaded with the state check, then a copy drifts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from distckpt._dist import Group
    from distckpt.load.verify import diverged_keys
    from distckpt.state import fingerprint, statecheck
    from distckpt.state.statecheck import ReplicaDriftError

    sub = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["a"]
    layout = {"sub_shard": [Shard(0)], "sub_rep": [Replicate()]}

    def make(values: dict) -> dict:
        return {k: distribute_tensor(values[k].clone(), sub, pl, src_data_rank=None) for k, pl in layout.items()}

    values = {"sub_shard": full["grid"], "sub_rep": full["vec"]}
    out: dict = {}
    with distckpt.Checkpointer(root, on_replica_drift="error") as ckpt:
        ckpt.save(1, {"model": make(values)})
        out["fingerprints"] = {k: ckpt.manifest(1).fingerprints.get(f"model.{k}") == fingerprint.of_tensor(v) for k, v in values.items()}
        again = {"model": make({k: torch.zeros_like(v) for k, v in values.items()})}
        ckpt.load(again, verify_state=True)
        out["same"] = {k: torch.equal(again["model"][k].full_tensor(), v) for k, v in values.items()}
        saved = ckpt.manifest(1).fingerprints
    # The state check with a copy on the second mesh perturbed (rank 3 holds block 1 of sub_shard
    # and a copy of sub_rep), against the gathered-parts verdict.
    group, keys = Group(None), [f"model.{k}" for k in layout]
    out["verdicts"] = {}
    for name, faulty in {"clean": None, "shard_copy": "sub_shard", "replica_copy": "sub_rep"}.items():
        flat = {f"model.{k}": v for k, v in make(values).items()}
        if rank == 3 and faulty is not None:
            with torch.no_grad():
                flat[f"model.{faulty}"].to_local().view(-1)[-1] += 0.5
        new = diverged_keys(group, lambda: flat, saved, keys, "state check")
        old = statecheck.diverged(group.all_gather(fingerprint.local_parts(flat)), saved, keys)
        out["verdicts"][name] = (new, old)
    # A save whose copies on the two meshes differ is refused, naming the key.
    drifted = make(values)
    if rank == 3:
        with torch.no_grad():
            drifted["sub_rep"].to_local()[0] += 1e-3
    try:
        with distckpt.Checkpointer(root + "-drift", on_replica_drift="error") as ckpt:
            ckpt.save(1, {"model": drifted})
        out["drift"] = None
    except ReplicaDriftError as exc:
        out["drift"] = str(exc)
    return out


# Which rank perturbs which tensor's local block after a "load" (mesh coordinate of rank r: (r // 2, r % 2)).
FAULTS = {
    "clean": {},
    "hsdp_replica": {2: "hsdp"},  # (1, 0) holds a replica of (0, 0)'s block
    "grid_shard": {1: "grid"},
    "tp_col_replica": {3: "tp_col"},
    "vec_replica": {1: "vec"},  # Shard(0) x Replicate(): (0, 1) is a replica of (0, 0)
    "two_keys": {0: "nested", 3: "hsdp"},
}


def _state_check_cases(rank: int, mesh, full: dict, placements: dict, saved: dict) -> dict:
    """The collective state check's verdict and the old gathered-parts verdict for each fault."""
    from torch.distributed.tensor import distribute_tensor

    from distckpt._dist import Group
    from distckpt.load.verify import diverged_keys
    from distckpt.state import fingerprint, statecheck

    group = Group(None)
    keys = [f"model.{k}" for k in full]
    out = {}
    for name, faults in FAULTS.items():
        flat = {f"model.{k}": distribute_tensor(v.clone(), mesh, placements[k], src_data_rank=None) for k, v in full.items()}
        if rank in faults:
            with torch.no_grad():
                flat[f"model.{faults[rank]}"].to_local().view(-1)[-1] += 0.5
        new = diverged_keys(group, lambda: flat, saved, keys, "state check")
        old = statecheck.diverged(group.all_gather(fingerprint.local_parts(flat)), saved, keys)
        out[name] = (new, old)
    return out


def _load_1d(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    target = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.dim() - 1)], src_data_rank=None) for k, v in full.items()}}
    ckpt = distckpt.Checkpointer(root)
    ckpt.load(target, verify_state=True)
    ckpt.close()
    return {k: torch.equal(target["model"][k].full_tensor(), full[k]) for k in full}


@pytest.mark.timeout(240)
def test_2d_layouts_fingerprint_reshard_and_report_drift(tmp_path):
    root = str(tmp_path / "ck")
    results = run_ranks(_save_2d, 4, tmp_path, root, timeout=200)
    for r, res in enumerate(results):
        assert res["recorded"].items() >= res["expected"].items(), f"rank {r}: 2-D fingerprints differ from the whole tensors'"
        assert res["same"], f"rank {r}: same-layout round trip"
        assert res["drift"] is not None and "model.hsdp" in res["drift"], (r, res["drift"])
        assert "model.grid" not in res["drift"]
        for name, (new, old) in res["verdicts"].items():
            want = sorted({f"model.{k}" for k in FAULTS[name].values()})
            assert new == old == want, f"rank {r}: {name}: collective {new}, gathered {old}, expected {want}"
        sub = res["sub"]
        assert all(sub["fingerprints"].values()) and all(sub["same"].values()), (r, sub)
        for name, (new, old) in sub["verdicts"].items():
            want = [] if name == "clean" else [f"model.{'sub_shard' if name == 'shard_copy' else 'sub_rep'}"]
            assert new == old == want, f"rank {r}: sub-mesh {name}: collective {new}, gathered {old}, expected {want}"
        assert sub["drift"] is not None and "model.sub_rep" in sub["drift"] and "sub_shard" not in sub["drift"], sub["drift"]
    # 4 ranks (2x2) -> 2 ranks, column-sharded, with the state check on.
    for r, equal in enumerate(run_ranks(_load_1d, 2, tmp_path, root)):
        assert all(equal.values()), (r, equal)
    # -> 1 process, plain tensors, checked.
    full = _full()
    plain = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    with distckpt.Checkpointer(root) as ckpt:
        ckpt.load(plain, verify_state=True)
    for k, v in full.items():
        assert torch.equal(plain["model"][k], v), k
