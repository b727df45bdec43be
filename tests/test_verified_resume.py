"""Verified resume: silent divergences injected into the load path are caught and named on every rank.

Each fault is injected into a wrapped copy of distckpt's load path (the real path runs, then the
fault is applied, or the reader drops an item), the way such bugs would slip in: a shard placed
one row off, a chunk never read, a bf16 round-trip of an fp32 tensor, two ranks' per-rank
values swapped. A DDP replica perturbed by one ulp before a save is reported at the save.
"""

from __future__ import annotations

import pytest
import torch

import distckpt
from dist_harness import run_ranks
from distckpt.statecheck import ReplicaDriftError, StateDivergedError
from models import make_model, make_optimizer, train_steps, wrap


def _fault_body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.tensor import DTensor

    import distckpt._loading as loading
    from distckpt import _reader

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
        import distckpt.checkpointer as ck

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
    return out


def test_injected_divergences_are_caught_and_named(tmp_path):
    results = run_ranks(_fault_body, 2, tmp_path, str(tmp_path / "ck"))
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
    from distckpt import statecheck

    calls = []
    original = statecheck.diverged
    monkeypatch.setattr(statecheck, "diverged", lambda *a: calls.append(1) or original(*a))
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


def test_verify_state_recomputes_fingerprints_from_the_files(tmp_path):
    import json
    import pickle
    import subprocess
    import sys

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from distckpt.manifest import MANIFEST_NAME, step_dir

    model = make_model(0)
    distckpt.Checkpointer(tmp_path).save(1, {"model": model})

    def verify() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "distckpt", "verify", str(tmp_path), "--state"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    done = verify()
    assert done.returncode == 0 and "fingerprints of" in done.stdout, done.stderr
    # Flip one float inside a tensor record and re-seal the file's checksum (checksums then pass).
    d = tmp_path / step_dir(1)
    md = pickle.loads((d / ".metadata").read_bytes())
    info = md.storage_data[MetadataIndex("model.0.weight", torch.Size([0, 0]))]
    path = d / info.relative_path
    from distckpt._torchfile import FileSlice, raw_layout

    with open(path, "rb") as f:
        layout = raw_layout(FileSlice(f, info.offset, info.length))
    data = bytearray(path.read_bytes())
    data[info.offset + layout.data_offset + 5] ^= 0x40  # inside the tensor's bytes
    path.write_bytes(bytes(data))
    raw = json.loads((d / MANIFEST_NAME).read_text())
    from distckpt.manifest import digest_of

    raw["files"][info.relative_path]["checksum"] = digest_of(bytes(data), raw["checksum_algorithm"])
    (d / MANIFEST_NAME).write_text(json.dumps(raw))
    done = verify()
    assert done.returncode == 1 and "model.0.weight" in done.stderr, done.stderr


def test_state_diverged_error_is_a_full_state_mismatch_error():
    err = StateDivergedError(["k"], "here")  # usable wherever a StateMismatchError is handled
    assert isinstance(err, distckpt.StateMismatchError)
    assert err.per_rank == {} and err.missing == [] and "state does not match" in err.describe()
