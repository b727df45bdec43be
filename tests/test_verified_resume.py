"""Verified resume: silent divergences injected into the load path are caught and named on every rank.

Each fault is injected into a wrapped copy of distckpt's load path (the real path runs, then the
fault is applied, or the reader drops an item), the way such bugs would slip in: a shard placed
one row off, a chunk never read, a bf16 round-trip of an fp32 tensor, two ranks' per-rank
values swapped. A DDP replica perturbed by one ulp before a save is reported at the save.
"""

from __future__ import annotations

import io

import pytest
import torch

import distckpt
from dist_harness import run_ranks
from distckpt.state.statecheck import ReplicaDriftError, StateDivergedError
from models import make_model, make_optimizer, train_steps, wrap


def _fsdp_layout(model, world: int, layout: str):
    """FSDP2 on a 1-D mesh (``fsdp``), HSDP on a (1, world) mesh (``hsdp``) or with columns
    sharded instead of rows (``cols``): the same world size, other layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    if layout == "fsdp":
        return wrap(model, "fsdp", world)
    kwargs: dict = {"mesh": init_device_mesh("cpu", (world,))}
    if layout == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    elif layout == "cols":
        # FSDP2 shards dim 1 only evenly: the first layer's 10 columns
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % world == 0 else Shard(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _default_check_cases(rank: int, world: int, root: str, root_w1: str) -> dict:
    """Loads with the default ``verify_state=None`` and a fault injected after the real load
    path: the check must run (and catch it) when the world size or the layout changed, not when
    nothing changed. ``root_w1`` was saved by one process (a plain model)."""
    from torch.distributed.tensor import DTensor

    import distckpt.load.phases as loading
    import distckpt.load.run as ck

    def corrupt(model) -> None:
        p = next(model.parameters())
        local = p.to_local() if isinstance(p, DTensor) else p
        with torch.no_grad():
            local.view(-1)[:1] += 1.0

    def load(root_: str, state: dict, fault: bool):
        original = loading.apply_load

        def apply(group, manifest, plan, st):
            original(group, manifest, plan, st)
            if fault:
                corrupt(st["model"])

        ck.apply_load = apply
        try:
            distckpt.Checkpointer(root_).load(state)
            return None
        except StateDivergedError as exc:
            return exc.diverged
        finally:
            ck.apply_load = original

    # Saved at this world size: FSDP2 rows on a 1-D mesh; DDP with a plain optimizer; DDP with ZeRO.
    fsdp = wrap(make_model(0), "fsdp", world)
    distckpt.Checkpointer(root + "-dflt-fsdp").save(1, {"model": fsdp})
    for kind in ("ddp", "zero"):
        model = wrap(make_model(0), kind, world)
        optim = make_optimizer(model, kind)
        train_steps(model, optim, range(1), rank, world)
        distckpt.Checkpointer(f"{root}-dflt-{kind}").save(1, {"model": model, "optim": optim})

    def fresh(kind: str) -> dict:
        if kind in ("fsdp", "hsdp", "cols"):
            return {"model": _fsdp_layout(make_model(3), world, kind)}
        if kind == "plain":
            return {"model": make_model(3)}
        model = wrap(make_model(3), kind, world)
        return {"model": model, "optim": make_optimizer(model, kind)}

    cases = {
        "world_size": (root_w1, "plain"),  # 1 process -> 2 ranks, plain both times
        "ddp_to_zero": (root + "-dflt-ddp", "zero"),
        "zero_to_ddp": (root + "-dflt-zero", "ddp"),
        "fsdp_to_hsdp": (root + "-dflt-fsdp", "hsdp"),
        "fsdp_rows_to_cols": (root + "-dflt-fsdp", "cols"),
        "unchanged": (root + "-dflt-fsdp", "fsdp"),
    }
    out = {}
    for name, (source, kind) in cases.items():
        out[name] = (load(source, fresh(kind), fault=True), load(source, fresh(kind), fault=False))

    # Saved without fingerprints: the default skips the due check with one warning (per root);
    # verify_state=True refuses before reading, with the same error on every rank.
    distckpt.Checkpointer(root + "-nofp", fingerprint=False).save(1, {"model": fsdp})
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            distckpt.Checkpointer(root + "-nofp").load(fresh("hsdp"))
    unverified = [str(w.message) for w in caught if "not verified" in str(w.message)]
    target = fresh("hsdp")
    before = target["model"][0].weight.to_local().clone()
    try:
        distckpt.Checkpointer(root + "-nofp").load(target, verify_state=True)
        refused = None
    except distckpt.CheckpointError as exc:
        refused = str(exc)
    untouched = torch.equal(target["model"][0].weight.to_local(), before)
    out["no_fingerprints"] = (unverified, refused, untouched)
    return out


def _fault_body(rank: int, world: int, root: str, root_w1: str | None = None) -> dict:
    from torch.distributed.tensor import DTensor

    import distckpt.load.phases as loading
    from distckpt.load import reader as _reader

    model = wrap(make_model(0), "fsdp", world)
    optim = make_optimizer(model, "fsdp")
    train_steps(model, optim, range(2), rank, world)
    ckpt = distckpt.Checkpointer(root, verify_state=True)
    state = {"model": model, "optim": optim, "mine": torch.full((5,), float(rank))}
    ckpt.save(1, state)
    original_apply, original_read = loading.apply_load, _reader.CheckpointReader.read_data
    out: dict = {}

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    faults = {
        "row_off_by_one": lambda st: local(st["model"][0].weight).data.copy_(local(st["model"][0].weight).roll(1, 0)),
        "bf16_round_trip": lambda st: local(st["model"][2].bias).data.copy_(local(st["model"][2].bias).bfloat16().float()),
        "per_rank_swapped": lambda st: st["mine"].fill_(float(1 - rank)),
    }
    for name, corrupt in [*faults.items(), ("chunk_skipped", None), ("clean", None)]:
        fresh = wrap(make_model(3), "fsdp", world)
        target = {"model": fresh, "optim": make_optimizer(fresh, "fsdp"), "mine": torch.zeros(5)}
        train_steps(fresh, target["optim"], range(1), rank, world)  # so the optimizer has state

        def apply(group, manifest, plan, st, corrupt=corrupt):
            original_apply(group, manifest, plan, st)
            if corrupt is not None:
                with torch.no_grad():
                    corrupt(st)

        def read(self, plan, planner, name=name):
            if name == "chunk_skipped" and rank == 1:
                plan.items = [i for i in plan.items if i.storage_index.fqn != "model.4.weight"]
            return original_read(self, plan, planner)

        loading.apply_load, _reader.CheckpointReader.read_data = apply, read
        import distckpt.load.run as ck

        ck.apply_load = apply
        try:
            ckpt.load(target)
            out[name] = None
        except StateDivergedError as exc:
            out[name] = (exc.diverged, str(exc))
        finally:
            loading.apply_load, _reader.CheckpointReader.read_data = original_apply, original_read
            ck.apply_load = original_apply

    # A DDP replica perturbed by one ulp before a save: reported, naming the key and ranks.
    ddp = wrap(make_model(0), "ddp", world)
    if rank == 1:
        with torch.no_grad():
            w = ddp.module[0].weight
            w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))
    strict = distckpt.Checkpointer(root + "-ddp", on_replica_drift="error")
    try:
        strict.save(1, {"model": ddp})
        out["drift"] = None
    except ReplicaDriftError as exc:
        out["drift"] = str(exc)
    # The same from an async save, where each rank stages only its share of the replicas.
    try:
        strict.save(2, {"model": ddp}, blocking=False)
        strict.wait()
        out["drift_async"] = None
    except ReplicaDriftError as exc:
        out["drift_async"] = str(exc)
    strict.close()
    ckpt.close()
    if root_w1 is not None:
        out["default"] = _default_check_cases(rank, world, root, root_w1)
    return out


def test_injected_divergences_are_caught_and_named(tmp_path):
    root_w1 = str(tmp_path / "w1")
    distckpt.Checkpointer(root_w1).save(1, {"model": make_model(0)})
    results = run_ranks(_fault_body, 2, tmp_path, str(tmp_path / "ck"), root_w1)
    # The default (verify_state=None) checks loads that change the world size or the layout at
    # the same world size (DDP <-> ZeRO, FSDP2 1-D -> HSDP, other placements), and only those.
    for r, res in enumerate(results):
        for case, outcome in res["default"].items():
            if case == "no_fingerprints":
                continue
            with_fault, clean = outcome
            assert clean is None, f"rank {r}: {case}: false alarm on a clean load: {clean}"
            if case == "unchanged":
                assert with_fault is None, f"rank {r}: the default checked a load that changed nothing"
            else:
                assert with_fault == ["model.0.weight"], f"rank {r}: {case}: the default check did not run ({with_fault})"
        unverified, refused, untouched = res["default"]["no_fingerprints"]
        assert len(unverified) == 1 and "step 1" in unverified[0], (r, unverified)
        assert refused is not None and "step 1" in refused and "verify_state=False" in refused, (r, refused)
        assert untouched, f"rank {r}: a refused verified load must not change the state"
    assert results[0]["default"]["no_fingerprints"][1] == results[1]["default"]["no_fingerprints"][1]
    expected = {
        "row_off_by_one": "model.0.weight",
        "bf16_round_trip": "model.2.bias",
        "per_rank_swapped": None,  # per-rank keys: mine.rank_0 / mine.rank_1
        "chunk_skipped": "model.4.weight",
    }
    for r, res in enumerate(results):
        assert res["clean"] is None, f"rank {r}: false alarm on a clean load: {res['clean']}"
        for fault, key in expected.items():
            assert res[fault] is not None, f"rank {r}: {fault} was not caught"
            diverged, message = res[fault]
            if key is not None:
                assert key in diverged, (fault, diverged)
            else:
                assert {"mine.rank_0", "mine.rank_1"} <= set(diverged), diverged
            assert "differs from the state saved" in message
        for mode in ("drift", "drift_async"):
            assert res[mode] is not None and "model.0.weight" in res[mode] and "[0] vs [1]" in res[mode], (mode, res[mode])
    for fault in expected:
        assert results[0][fault] == results[1][fault], f"{fault}: the same error on every rank"


def test_verification_is_on_by_default_only_when_the_layout_changes(tmp_path, monkeypatch):
    import distckpt.load.verify as verify

    calls = []
    original = verify.diverged_keys
    monkeypatch.setattr(verify, "diverged_keys", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = make_model(0)
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"model": model})
    assert ckpt.manifest(1).fingerprints.keys() >= {"model.0.weight", "model.4.bias"}
    ckpt.load({"model": make_model(1)})
    assert calls == [], "same world size and parallelism: not checked unless asked"
    ckpt.load({"model": make_model(1)}, verify_state=True)
    assert calls == [1]
    off = distckpt.Checkpointer(tmp_path / "off", fingerprint=False)
    off.save(1, {"model": model})
    assert off.manifest(1).fingerprints == {}
    with pytest.raises(ValueError, match="on_replica_drift"):
        distckpt.Checkpointer(tmp_path, on_replica_drift="maybe")


def test_verify_state_true_refuses_what_it_cannot_prove(tmp_path):
    import json

    from distckpt.integrity.manifest import MANIFEST_NAME, step_dir

    model = make_model(0)
    off = distckpt.Checkpointer(tmp_path / "off", fingerprint=False)
    off.save(3, {"model": model})
    fresh = make_model(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(distckpt.CheckpointError, match=r"step 3 .*no state fingerprints.*verify_state=False"):
        off.load({"model": fresh}, verify_state=True)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()), "refused before reading"
    with pytest.raises(distckpt.CheckpointError, match="no state fingerprints"):
        distckpt.Checkpointer(tmp_path / "off", verify_state=True).load({"model": fresh})
    assert off.load({"model": fresh}) == 3  # the default: nothing changed, nothing to check, quiet
    # Some requested tensors without a fingerprint (e.g. replicas that drifted at save): named.
    ckpt = distckpt.Checkpointer(tmp_path / "on")
    ckpt.save(1, {"model": model})
    path = tmp_path / "on" / step_dir(1) / MANIFEST_NAME
    raw = json.loads(path.read_text())
    del raw["fingerprints"]["model.2.weight"]
    path.write_text(json.dumps(raw))
    with pytest.raises(distckpt.CheckpointError, match=r"1 requested tensor\(s\) have no recorded fingerprint.*model\.2\.weight"):
        ckpt.load({"model": make_model(1)}, verify_state=True)
    # Not requested: not judged (a partial load of the other keys still proves what it loads).
    ckpt.load({"model": make_model(1)}, verify_state=True, exclude="model.2.*")


def test_verify_state_recomputes_fingerprints_from_the_files(tmp_path):
    import json
    import pickle
    import subprocess

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from cli_runner import run_cli

    from distckpt.integrity.manifest import MANIFEST_NAME, step_dir

    model = make_model(0)
    distckpt.Checkpointer(tmp_path).save(1, {"model": model})

    def verify() -> subprocess.CompletedProcess:
        return run_cli("verify", str(tmp_path), "--state")

    done = verify()
    assert done.returncode == 0 and "fingerprints of" in done.stdout, done.stderr
    # Flip one float inside a tensor record and re-seal the file's checksum (checksums then pass).
    d = tmp_path / step_dir(1)
    md = pickle.loads((d / ".metadata").read_bytes())
    info = md.storage_data[MetadataIndex("model.0.weight", torch.Size([0, 0]))]
    path = d / info.relative_path
    from distckpt.integrity.torchfile import raw_layout

    data = bytearray(path.read_bytes())
    layout = raw_layout(io.BytesIO(bytes(data[info.offset : info.offset + info.length])))
    data[info.offset + layout.data_offset + 5] ^= 0x40  # inside the tensor's bytes
    path.write_bytes(bytes(data))
    raw = json.loads((d / MANIFEST_NAME).read_text())
    from distckpt.integrity.manifest import digest_of

    raw["files"][info.relative_path]["checksum"] = digest_of(bytes(data), raw["checksum_algorithm"])
    (d / MANIFEST_NAME).write_text(json.dumps(raw))
    done = verify()
    assert done.returncode == 1 and "model.0.weight" in done.stderr, done.stderr


def test_state_diverged_error_is_a_full_state_mismatch_error():
    err = StateDivergedError(["k"], "here")  # usable wherever a StateMismatchError is handled
    assert isinstance(err, distckpt.StateMismatchError)
    assert err.per_rank == {} and err.missing == [] and "state does not match" in err.describe()
    # Every attribute a StateMismatchError has (unread_on, added later, was missing: an
    # AttributeError for handlers reading it, and for describe()), also after a pickle round trip.
    import pickle

    base = vars(distckpt.StateMismatchError([], [], {}))
    for got in (err, pickle.loads(pickle.dumps(err))):
        assert {k: getattr(got, k) for k in base if k != "where"} == {k: v for k, v in base.items() if k != "where"}


class _Counted(torch.nn.Module):
    """A module with a non-tensor extra state (a counter each rank keeps for itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def get_extra_state(self) -> dict:
        return {"seen": self.seen}

    def set_extra_state(self, state: dict) -> None:
        self.seen = state["seen"]


def _value_drift_body(rank: int, world: int, root: str) -> dict:
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    inner = _Counted()
    model = DDP(inner)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for name, change in (("extra", lambda: setattr(inner, "seen", 10 + rank)), ("lr", lambda: optim.param_groups[0].update(lr=0.1 * (rank + 1)))):
        inner.seen, optim.param_groups[0]["lr"] = 0, 0.1
        change()
        for policy in ("error", "warn", "ignore"):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                try:
                    with distckpt.Checkpointer(f"{root}/{name}-{policy}", on_replica_drift=policy) as ckpt:
                        ckpt.save(1, {"model": model, "optim": optim})
                    outcome = "saved"
                except ReplicaDriftError as exc:
                    outcome = str(exc)
            out[name, policy] = (outcome, [str(w.message) for w in seen if "not tensors differ" in str(w.message)])
    inner.seen, optim.param_groups[0]["lr"] = 0, 0.1
    with distckpt.Checkpointer(f"{root}/alike", on_replica_drift="error") as ckpt:  # (no false alarm)
        ckpt.save(1, {"model": model, "optim": optim})
    return out


@pytest.mark.timeout(200)
def test_non_tensor_values_that_differ_between_ranks_are_drift(tmp_path):
    """A DDP module's non-tensor extra state, or an optimizer's learning rate, that differs
    between ranks was written once (one rank's copy), silently, with on_replica_drift="error"
    too: every rank then resumed with that rank's values. As tensor drift: refused, warned or
    ignored by on_replica_drift, on every rank alike, naming the entry and the ranks."""
    res = run_ranks(_value_drift_body, 2, tmp_path, str(tmp_path), timeout=180)
    for out in res:
        for name, entry in (("extra", "model"), ("lr", "optim")):
            refused, _ = out[name, "error"]
            assert "values that are not tensors differ between ranks" in refused and f"{entry} (ranks [0] vs [1])" in refused, out
            saved, warned = out[name, "warn"]
            assert saved == "saved" and len(warned) == 1 and entry in warned[0], out
            assert out[name, "ignore"] == ("saved", []), out


def test_values_are_digested_only_for_the_drift_check():
    """Only module/optimizer entries' values, and only where a policy checks them: every value
    of every entry was digested at every save (2 s a save for a sampler's 2M-int list)."""
    from distckpt.save import assign

    flat = {"model._extra_state": {"seen": 1}, "sampler.perm": list(range(10)), "model.w": torch.ones(2)}
    assert set(assign.describe(flat, values_of={"model"}).values) == {"model"}
    assert assign.describe(flat).values == {}


def _rng_save(rank: int, world_size: int, root: str) -> list[float]:
    torch.manual_seed(100 + rank)
    distckpt.Checkpointer(root, checksum=None).save(1, {"w": torch.ones(4)})
    return torch.rand(3).tolist()


def _rng_load(rank: int, world_size: int, root: str, verify_state: bool | None) -> object:
    torch.manual_seed(7)
    try:
        distckpt.Checkpointer(root, checksum=None).load({"w": torch.zeros(4)}, verify_state=verify_state)
    except StateDivergedError as exc:
        return str(exc)
    return torch.rand(3).tolist()


def test_restored_rng_states_are_judged_at_the_same_world_size(tmp_path):
    """A checkpoint saved with checksum=None has its fingerprints as the only proof of its bytes;
    the RNG states (fingerprinted at save) were never judged, so a damaged one, or two ranks'
    states swapped, seeded the generators silently, also with verify_state=True."""
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from distckpt.integrity.manifest import step_dir
    from distckpt.integrity.torchfile import raw_layout

    root = str(tmp_path / "ck")
    after_save = run_ranks(_rng_save, 2, tmp_path, root)
    assert run_ranks(_rng_load, 2, tmp_path, root, True) == after_save  # restored exactly: no false alarm
    d = tmp_path / "ck" / step_dir(1)
    md = pickle.loads((d / ".metadata").read_bytes())
    where = {r: md.storage_data[MetadataIndex(f"_rng.rank_{r}.torch", torch.Size([0]))] for r in (0, 1)}
    paths = {r: d / where[r].relative_path for r in (0, 1)}
    assert paths[0] != paths[1]
    # Swap the two ranks' RNG states in place (same sizes: every other byte stays where it was).
    data = {r: bytearray(paths[r].read_bytes()) for r in (0, 1)}
    spans = {}
    for r in (0, 1):
        info = where[r]
        layout = raw_layout(io.BytesIO(bytes(data[r][info.offset : info.offset + info.length])))
        spans[r] = (info.offset + layout.data_offset, info.offset + layout.data_offset + layout.nbytes)
    a, b = (bytes(data[r][slice(*spans[r])]) for r in (0, 1))
    assert len(a) == len(b) and a != b
    data[0][slice(*spans[0])], data[1][slice(*spans[1])] = b, a
    for r in (0, 1):
        paths[r].write_bytes(bytes(data[r]))
    for verify_state in (True, None):  # None: due, checksum=None leaves nothing else to prove the bytes
        got = run_ranks(_rng_load, 2, tmp_path, root, verify_state)
        assert all(isinstance(g, str) and "_rng.rank_0.torch" in g and "_rng.rank_1.torch" in g for g in got), got


class _DrawsInStateDict:
    """An object whose state_dict() draws from torch's generator (a nonce, a sampler that
    reshuffles when asked): the state check calls it after the load restored the generators."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict:
        self.calls += 1
        return {"nonce": int(torch.randint(0, 1 << 30, ()).item()) * 0}

    def load_state_dict(self, sd: dict) -> None:
        pass


def test_the_state_check_leaves_the_restored_generators_as_loaded(tmp_path):
    """The state check re-extracts every entry's state after the load restored the RNG: an
    object whose state_dict() draws from torch's generator moved a checked resume to another
    random stream than an unchecked one (and, the restored states being judged, was taken for
    damage). A torchdata loader (its state_dict() starts an iterator, which takes a seed) too."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def state() -> dict:
        return {
            "w": torch.ones(2),
            "loader": StatefulDataLoader(list(range(20)), batch_size=2, shuffle=True),
            "nonce": _DrawsInStateDict(),
        }

    torch.manual_seed(3)
    saved = state()
    next(iter(saved["loader"]))
    distckpt.Checkpointer(tmp_path).save(1, saved)
    expected = torch.rand(4)
    for verify_state in (False, True):
        torch.manual_seed(11)
        loaded = state()
        distckpt.Checkpointer(tmp_path).load(loaded, verify_state=verify_state)
        assert loaded["nonce"].calls == (2 if verify_state else 1)  # (its load target, then the check)
        assert torch.equal(torch.rand(4), expected), verify_state
