"""Single-process tests of the pure logic: values, manifest, retention, sampler, storage, errors."""

from __future__ import annotations

import json
import math
import pickle
import warnings

from pathlib import Path

import pytest
import torch
from torch import nn

import distckpt
from distckpt.load.reader import checkpoint_reader
from direct_reads import count_direct_reads
from distckpt.state import values
from distckpt.errors import CheckpointError, StateMismatchError
from distckpt.integrity.manifest import FileRecord, Manifest, parse_step_dir, step_dir
from distckpt.storage.retention import steps_to_delete

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize(
    "value",
    [0, -3, 1.5, float("inf"), "x", True, None, [1, "a"], (1, (2, 3)), {"a": {"b": [1, 2]}}, {1: "one", 2.5: "f"}, {"__distckpt_tuple__": 1}],
)
def test_plain_values_round_trip_exactly(value):
    back = values.decode(values.encode(value))
    assert back == value and type(back) is type(value)


def test_nan_round_trips():
    assert math.isnan(values.decode(values.encode(float("nan"))))


def test_non_plain_value_is_refused_with_its_key():
    with pytest.raises(TypeError, match=r"state\['extras'\].*object"):
        values.encode({"a": object()}, "extras")


def test_step_dir_names_sort_and_parse():
    assert parse_step_dir(step_dir(42)) == 42
    assert sorted([step_dir(100), step_dir(9)]) == [step_dir(9), step_dir(100)]
    assert parse_step_dir("step_x") is None and parse_step_dir("other") is None
    assert parse_step_dir(step_dir(10**12)) == 10**12 and parse_step_dir(step_dir(0)) == 0
    # Only the name step_dir makes: other tools' folders and second names of one step are no step.
    for name in ("step_100", "step_0000000042", "step_00000004\u0662", "step_000000042\n", " step_000000042", "step_+00000042"):
        assert parse_step_dir(name) is None, repr(name)


def test_manifest_round_trip_and_malformed():
    m = Manifest(3, 2, {"model": {"kind": "module"}}, {"a.distcp": FileRecord(10, "ff")}, "crc32", "2.13", "0.1")
    back = Manifest.from_json(m.to_json())
    assert back == m and back.total_bytes == 10
    with pytest.raises(ValueError, match="malformed manifest X"):
        Manifest.from_json(b"{}", "X")
    raw = json.loads(m.to_json())
    raw["files"] = {"../../etc/passwd": {"size": 1, "checksum": None}}
    with pytest.raises(distckpt.UnsafeCheckpointError, match="outside the checkpoint"):
        Manifest.from_json(json.dumps(raw), "Y")


def test_retention_keeps_newest():
    assert steps_to_delete([1, 2, 3, 4], None) == []
    assert steps_to_delete([4, 1, 3, 2], 2) == [1, 2]
    assert steps_to_delete([7], 1) == []
    with pytest.raises(ValueError):
        steps_to_delete([1], 0)


def test_errors_survive_pickling_with_their_details():
    e = pickle.loads(pickle.dumps(CheckpointError("boom", {1: "OSError: disk full"})))
    assert e.failures == {1: "OSError: disk full"} and "rank 1: OSError: disk full" in str(e)
    m = pickle.loads(pickle.dumps(StateMismatchError(["a"], ["b"], {"c": ((1,), (2,))}, "here")))
    assert m.missing == ["a"] and m.unexpected == ["b"] and "c: checkpoint [1] vs state [2]" in str(m)


def test_sampler_position_is_world_size_independent():
    ref = distckpt.GlobalBatchSampler(100, 12, rank=0, world_size=1, seed=3)
    seen = [ref.next_batch() for _ in range(10)]
    # 2 ranks for 4 batches, then resume at 3 ranks: union of ranks == the 1-rank batches.
    two = [distckpt.GlobalBatchSampler(100, 12, rank=r, world_size=2, seed=3) for r in range(2)]
    for b in range(4):
        assert sum((s.next_batch() for s in two), []) == seen[b]
    state = two[0].state_dict()
    three = [distckpt.GlobalBatchSampler(100, 12, rank=r, world_size=3, seed=3) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    for b in range(4, 10):  # crosses the epoch boundary (8 batches per epoch)
        assert sum((s.next_batch() for s in three), []) == seen[b]
    with pytest.raises(ValueError, match="global_batch_size"):
        distckpt.GlobalBatchSampler(100, 10, rank=0, world_size=3)
    other = distckpt.GlobalBatchSampler(100, 24, rank=0, world_size=1, seed=3)
    with pytest.raises(ValueError, match="global_batch_size=12"):
        other.load_state_dict(state)


def test_storage_redacts_credentials_in_urls():
    s = distckpt.Storage("http://user:secret@bucket/prefix?token=abc")
    assert "secret" not in repr(s) and "abc" not in s.display("x")
    # A password holding "@": everything up to the last "@" of the host part is user info (the
    # first "@" left "ss@host", the password's tail, in every display and manifest).
    s = distckpt.Storage("memory://bob:p@ss@host/ckpt")
    assert s.url == "memory://host/ckpt" and s.identity() == s.url
    # Azure's container@account is the storage's name, not a user: two containers stay two roots.
    from distckpt.storage.base import _redact

    assert _redact("abfs://a@acct.dfs.core.windows.net/x") != _redact("abfs://b@acct.dfs.core.windows.net/x")
    assert _redact("az://user:secret@acct/run") == "az://acct/run"  # ... but a password goes there too


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _state(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return model, opt, sched


def test_single_process_round_trip_of_everything(tmp_path):
    model, opt, sched = _state(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    counter = _Counter()
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    counter.n = 7
    extras = {"ema": torch.arange(3.0), "count": 4}
    state = {"model": model, "optim": opt, "sched": sched, "scaler": scaler, "counter": counter,
             "step": 2, "data": {"samples": 24, "order": (1, 2)}, "extras": extras, "t": torch.ones(2)}
    ckpt = distckpt.Checkpointer(tmp_path / "ck")
    ckpt.save(2, state)
    rng_next = torch.rand(3)  # what the generator gives right after the save

    model2, opt2, sched2 = _state(1)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    counter2 = _Counter()
    extras2 = {"ema": torch.zeros(3), "count": 0}
    data2: dict = {}
    state2 = {"model": model2, "optim": opt2, "sched": sched2, "scaler": scaler2, "counter": counter2,
              "step": 0, "data": data2, "extras": extras2, "t": torch.zeros(2)}
    torch.manual_seed(999)
    assert ckpt.load(state2) == 2
    assert torch.equal(torch.rand(3), rng_next), "torch RNG restored"
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])
    assert sched2.state_dict() == sched.state_dict()
    assert scaler2.get_scale() == 1024.0
    assert counter2.n == 7 and state2["step"] == 2
    assert state2["data"] is data2 and data2 == {"samples": 24, "order": (1, 2)}
    assert torch.equal(extras2["ema"], torch.arange(3.0)) and extras2["count"] == 4
    assert torch.equal(state2["t"], torch.ones(2))


def test_optimizer_that_never_stepped_is_not_changed_by_save(tmp_path):
    model, opt, _ = _state(0)
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(0, {"model": model, "optim": opt})
    assert not opt.state, "saving must not initialize optimizer state"
    model2, opt2, _ = _state(1)
    opt2.param_groups[0]["lr"] = 5.0
    ckpt.load({"model": model2, "optim": opt2})
    assert not opt2.state and opt2.param_groups[0]["lr"] == 0.1


def test_optimizer_without_its_module_is_refused(tmp_path):
    model, opt, _ = _state(0)
    with pytest.raises(ValueError, match=r"optimizer state\['optim'\].*no single module"):
        distckpt.Checkpointer(tmp_path).save(1, {"optim": opt})


def test_gan_two_models_two_optimizers(tmp_path):
    g, og, _ = _state(0)
    d, od, _ = _state(1)
    for m, o in ((g, og), (d, od)):
        m(torch.randn(2, 4)).sum().backward()
        o.step()
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"gen": g, "disc": d, "opt_g": og, "opt_d": od})
    g2, og2, _ = _state(2)
    d2, od2, _ = _state(3)
    ckpt.load({"gen": g2, "disc": d2, "opt_g": og2, "opt_d": od2})
    assert torch.equal(og2.state_dict()["state"][0]["exp_avg"], og.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(od2.state_dict()["state"][0]["exp_avg"], od.state_dict()["state"][0]["exp_avg"])


def test_wrapper_prefixes_are_not_saved(tmp_path):
    model, _, _ = _state(0)
    compiled = torch.compile(model, backend="eager")
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"model": compiled})
    from distckpt.integrity.stepfiles import read_metadata

    md = read_metadata(ckpt.storage, ckpt.manifest(1))
    saved = {k for k in md.state_dict_metadata if k.startswith("model.")}
    assert saved == {f"model.{k}" for k in model.state_dict()}, saved  # no _orig_mod. / module.
    plain, _, _ = _state(5)
    ckpt.load({"model": plain})  # loads into an uncompiled model
    assert torch.equal(plain[0].weight, model[0].weight)


def test_strict_mismatch_names_keys_and_shapes(tmp_path):
    model, _, _ = _state(0)
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"model": model, "step": 1})
    other = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2), nn.Linear(2, 2))
    with pytest.raises(StateMismatchError) as info:
        ckpt.load({"model": other})
    err = info.value
    assert err.missing == ["model.2.bias", "model.2.weight"]
    assert err.unexpected == ["step"]
    assert set(err.mismatched) == {"model.0.weight", "model.0.bias", "model.1.weight"}
    assert err.mismatched["model.0.weight"] == ((3, 4), (5, 4))
    before = other[1].bias.detach().clone()
    with pytest.warns(UserWarning, match="partial load"):
        ckpt.load({"model": other}, strict=False)
    assert torch.equal(other[1].bias, model[1].bias) and not torch.equal(before, other[1].bias)
    assert ckpt.last_load_report.missing == ["model.2.bias", "model.2.weight"]


def test_missing_root_and_step_raise_file_not_found(tmp_path):
    model, _, _ = _state(0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        distckpt.Checkpointer(tmp_path / "nope").load({"model": model})
    ckpt = distckpt.Checkpointer(tmp_path / "ck")
    ckpt.save(3, {"model": model})
    with pytest.raises(FileNotFoundError, match=r"step 4 not found .*committed steps: \[3\]"):
        ckpt.load({"model": model}, step=4)
    assert ckpt.latest_step() == 3 and distckpt.Checkpointer(tmp_path / "empty").latest_step() is None


def test_commit_protocol_and_retention(tmp_path):
    model, _, _ = _state(0)
    root = tmp_path / "ck"
    ckpt = distckpt.Checkpointer(root, keep_last=2)
    ckpt.save(1, {"model": model})
    # Interrupted saves: data but no manifest. Invisible, then cleaned by the next save once
    # their lease is stale: the writer died (a dead pid on this host), released it after a
    # failure, or there is no record at all (and no change for a lease).
    import json
    import os
    import socket
    import subprocess
    import time

    dead = subprocess.Popen(["true"])
    dead.wait()
    leftovers = {
        5: {"writer": "x", "host": socket.gethostname(), "pid": dead.pid, "time": time.time(), "released": False},
        6: {"writer": "y", "host": "elsewhere", "pid": 1, "time": time.time(), "released": True},
        7: None,
        8: None,
    }
    for s, record in leftovers.items():
        (root / step_dir(s)).mkdir()
        (root / step_dir(s) / "__0_0.distcp").write_bytes(b"partial")
        if record is not None:
            (root / step_dir(s) / ".owner").write_text(json.dumps(record))
        else:  # no record: stale once unchanged for a whole lease
            for p in (root / step_dir(s) / "__0_0.distcp", root / step_dir(s)):
                os.utime(p, (time.time() - 3600,) * 2)
    assert ckpt.steps() == [1] and ckpt.latest_step() == 1
    with pytest.raises(FileNotFoundError, match="incomplete"):
        ckpt.load({"model": model}, step=5)
    ckpt.save(2, {"model": model})
    # (a step directory appears with its record inside; one without a record is a leftover)
    assert not any((root / step_dir(s)).exists() for s in (5, 6, 7, 8))
    with pytest.raises(distckpt.StepExistsError, match="step 2 is already committed"):
        ckpt.save(2, {"model": model})
    ckpt.save(3, {"model": model})
    assert ckpt.steps() == [2, 3]
    ckpt.close()  # retired steps' files are unlinked in the background; close() waits for that
    assert sorted(p.name for p in root.iterdir()) == [step_dir(2), step_dir(3)]


def test_checkpoint_is_plain_dcp_loadable(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, _, _ = _state(0)
    distckpt.Checkpointer(tmp_path).save(1, {"model": model})
    other, _, _ = _state(1)
    sd = {"model": other.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / step_dir(1)))
    assert torch.equal(sd["model"]["0.weight"], model[0].weight)


def test_bad_state_keys_are_refused(tmp_path):
    ckpt = distckpt.Checkpointer(tmp_path)
    for bad in ("", "a.b", "_rng"):
        with pytest.raises(ValueError, match="state key"):
            ckpt.save(1, {bad: 1})
    with pytest.raises(ValueError, match="keep_last"):
        distckpt.Checkpointer(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="step must be"):
        ckpt.save(-1, {"x": 1})


def test_tensors_are_read_straight_into_their_destination(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from distckpt.integrity.manifest import read_manifest

    tensors = {f"t{i}": torch.randn(100 + i, 33) for i in range(5)} | {"half": torch.randn(7).bfloat16()}
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"w": tensors})
    manifest = read_manifest(ckpt.storage, 1)
    for verify in (True, False):
        dest = {k: torch.zeros_like(v) for k, v in tensors.items()}
        direct = count_direct_reads(monkeypatch)
        reader = checkpoint_reader(ckpt.storage, step_dir(1), files=manifest.files if verify else None, checksum=manifest.checksum_algorithm)
        dcp.load({"w": dest}, storage_reader=reader, no_dist=True)
        assert direct.count == len(tensors)
        for k in tensors:
            assert torch.equal(dest[k], tensors[k])


def test_replicated_shares_split_evenly_and_only_for_replicated_entries():
    from distckpt.save.staging import replicated_shares

    sizes = [("model.a", 100), ("model.b", 60), ("model.c", 50), ("optim.x", 10)]
    same = {"model": "d1", "optim": "o"}
    skips = [replicated_shares([same, dict(same, optim="other")], sizes, r) for r in range(2)]
    # model.* is replicated: split so that each key is staged by exactly one rank.
    assert skips[0] | skips[1] == {"model.a", "model.b", "model.c"} and not skips[0] & skips[1]
    assert skips[0] == {"model.b", "model.c"}  # rank 0 takes the largest, rank 1 the next two
    # optim differs between ranks (ZeRO partitions): every rank stages its own.
    assert "optim.x" not in skips[0] | skips[1]
    assert replicated_shares([same], sizes, 0) == frozenset()


def _record_crcs(step: Path) -> list[int]:
    """The CRC-32 fields of every zip entry in every record of a step's data files."""
    import struct

    crcs = []
    for f in sorted(step.glob("*.distcp")):
        data = f.read_bytes()
        at = data.find(b"PK\x01\x02")  # central-directory entries carry each entry's CRC
        while at != -1:
            crcs.append(struct.unpack_from("<I", data, at + 16)[0])
            at = data.find(b"PK\x01\x02", at + 4)
    return crcs


def test_torch_record_crc_is_left_out_per_record_without_a_process_wide_switch(tmp_path, monkeypatch):
    """distckpt's checksum covers every byte, so torch.save's record CRC is left out by default,
    record by record: torch's process-wide setting is never touched (another thread's
    torch.save keeps its CRCs), and plain DCP reads the files. skip_torch_record_crc=False (or
    no checksum of distckpt's) writes the CRCs, byte for byte as torch.save does."""
    import torch.distributed.checkpoint as dcp
    import torch.serialization as ser

    calls: list[bool] = []
    real = ser.set_crc32_options
    monkeypatch.setattr(ser, "set_crc32_options", lambda on: (calls.append(on), real(on))[1])
    w = torch.arange(4096, dtype=torch.float32)
    distckpt.Checkpointer(tmp_path / "default", save_rng=False).save(1, {"w": w})  # tensors only
    assert calls == [] and ser.get_crc32_options()
    assert set(_record_crcs(tmp_path / "default" / step_dir(1))) == {0}
    loaded = {"w": torch.zeros(4096)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "default" / step_dir(1)))
    assert torch.equal(loaded["w"], w)
    for name, kwargs in (("with-crc", {"skip_torch_record_crc": False}), ("no-checksum", {"checksum": None})):
        distckpt.Checkpointer(tmp_path / name, save_rng=False, **kwargs).save(1, {"w": w})
        crcs = _record_crcs(tmp_path / name / step_dir(1))
        assert crcs and 0 not in crcs, name
    assert calls == []


def test_crc32c_without_hardware_path_warns_once(monkeypatch):
    import crc32c

    from distckpt.integrity import checksums as integrity

    monkeypatch.setattr(integrity, "_crc32c", None)
    monkeypatch.setattr(crc32c, "hardware_based", False)
    with pytest.warns(RuntimeWarning, match="no CRC32C instruction"):
        h = integrity.new_hasher("crc32c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second hasher says nothing
        h2 = integrity.new_hasher("crc32c")
    h.update(b"123456789")
    h2.update(memoryview(bytearray(b"123456789")))  # writable buffers too, without a copy
    assert h.hexdigest() == h2.hexdigest() == "e3069283"  # the CRC-32C check value


def test_numpy_integers_are_ints_for_steps_and_counts(tmp_path):
    """A step counted in NumPy (or kept as a 0-d integer tensor) and counts read through NumPy
    are integers: saved, loaded and recorded as plain ints. Bools and floats stay refused."""
    import numpy as np

    ckpt = distckpt.Checkpointer(tmp_path, keep_last=np.int64(2), thread_count=np.int32(2), local_keep=np.uint8(2))
    assert type(ckpt.options.keep_last) is int and type(ckpt.options.thread_count) is int
    for step in (np.int64(1), np.int32(2), torch.tensor(3)):
        ckpt.save(step, {"model": nn.Linear(2, 2)})
    assert ckpt.steps() == [2, 3] and ckpt.manifest(np.int64(3)).step == 3
    assert ckpt.load({"model": nn.Linear(2, 2)}, step=np.int16(2)) == 2
    assert json.loads((tmp_path / step_dir(3) / "manifest.json").read_text())["step"] == 3
    for bad in (True, np.True_, 2.0, np.float64(2), "2"):
        with pytest.raises(ValueError, match="keep_last must be None or an int >= 1"):
            distckpt.Checkpointer(tmp_path, keep_last=bad)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        ckpt.save(np.float64(4), {"model": nn.Linear(2, 2)})
    # An async save said "Unknown format code 'd' for object of type 'float'" (found by a helper).
    for bad in (4.0, "4", None):
        with pytest.raises(ValueError, match="step must be a non-negative int, got"):
            ckpt.save(bad, {"model": nn.Linear(2, 2)}, blocking=False)


def test_a_one_element_view_with_a_stride_saves_and_loads(tmp_path):
    """scores[:1, 0] is contiguous (one element) with stride 5: the save failed making a byte
    view of it ("self.stride(-1) must be 1")."""
    scores = torch.arange(1.0, 11.0).view(2, 5)
    state = {"one": scores[1:, 2], "col": scores[:, 0]}
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, state)
    into = torch.zeros(2, 5)
    back = {"one": into[1:, 2], "col": torch.zeros(2)}  # into a strided one-element view, in place
    ckpt.load(back)
    assert into[1, 2] == 8.0 and torch.equal(back["one"], torch.tensor([8.0])) and torch.equal(back["col"], torch.tensor([1.0, 6.0]))


def _strided_one_element_body(rank: int, world: int, root: str) -> float:
    scores = torch.arange(1.0, 11.0).view(2, 5)
    ckpt = distckpt.Checkpointer(root)
    ckpt.save(1, {"one": scores[1:, 2]})  # the same value on both ranks: compared by digest
    back = {"one": torch.zeros(1)}
    ckpt.load(back)
    ckpt.close()
    return float(back["one"])


@pytest.mark.timeout(120)
def test_a_one_element_view_with_a_stride_saves_from_two_ranks(tmp_path):
    from dist_harness import run_ranks

    assert run_ranks(_strided_one_element_body, 2, tmp_path, str(tmp_path / "root"), timeout=90) == [8.0, 8.0]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bfloat16, torch.bool])
def test_one_element_strided_views_of_every_width_save_and_load(tmp_path, dtype):
    """int64/float64 fingerprints view the bytes as int32 words: that view failed too."""
    src = torch.arange(1, 11).view(2, 5).to(dtype)
    ckpt = distckpt.Checkpointer(tmp_path)
    ckpt.save(1, {"s": src[1:, 2]})
    into = torch.zeros(2, 5, dtype=dtype)
    ckpt.load({"s": into[1:, 2]})
    assert torch.equal(into[1:, 2], src[1:, 2])


def test_save_and_load_pretrained_with_a_one_element_strided_buffer(tmp_path):
    from distckpt.tools.hf import load_pretrained, save_pretrained

    class M(torch.nn.Module):
        def __init__(self, big: torch.Tensor) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("one", big[1:, 2])

    src = M(torch.arange(1.0, 11.0).view(2, 5))
    save_pretrained(src, tmp_path / "hf")
    dst = M(torch.zeros(2, 5))
    load_pretrained(dst, tmp_path / "hf")
    assert torch.equal(dst.one, torch.tensor([8.0])) and torch.equal(dst.lin.weight, src.lin.weight)
