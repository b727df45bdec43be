"""Non-tensor records with equal bytes (an optimizer's hyperparameters repeat once per parameter:
``optim.param_groups.<fqn>.lr`` ...) are decoded once per load and their value copied: each key
still gets its own object, equal to what was saved, and each record's bytes are still checked
against its own digest before anything is decoded."""

from __future__ import annotations

import dataclasses
import enum
import io
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import distckpt
from distckpt.load import planner as load_planner
from distckpt.state.values import item_digest
from test_values_zoo import Bag


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Cfg:
    items: list
    name: str = "cfg"


def _extras(k: int) -> dict:
    out = {}
    for i in range(6):  # six keys of each value: equal records
        out[f"list{i}"] = [k, 2, {"x": 3}]
        out[f"dict{i}"] = {"lr": 0.1 * k, "betas": (0.9, 0.99)}
        out[f"array{i}"] = np.arange(4.0) * k
        out[f"float{i}"] = np.float64(0.5 * k)
        out[f"path{i}"] = Path(f"/data/shard{k}")
        out[f"enum{i}"] = Color.RED
        out[f"tuple{i}"] = (0.9 * k, 0.999)
        out[f"cfg{i}"] = Cfg([k, 2])
    return out


def test_equal_records_decode_once_into_separate_equal_values(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 3)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    saved = _extras(1)
    with distckpt.Checkpointer(tmp_path, safe_types=[Color, Cfg], save_rng=False) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim, "extra": Bag(saved)})
    loads = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or real(*a, **k))
    fresh_model = torch.nn.Linear(3, 3)
    fresh_optim = torch.optim.AdamW(fresh_model.parameters(), lr=0.5)
    state = {"model": fresh_model, "optim": fresh_optim, "extra": Bag(_extras(0))}
    with distckpt.Checkpointer(tmp_path, safe_types=[Color, Cfg]) as ckpt:
        ckpt.load(state)
    got = state["extra"].state
    assert set(got) == set(saved)
    for key, value in saved.items():
        if isinstance(value, np.ndarray):
            assert isinstance(got[key], np.ndarray) and np.array_equal(got[key], value), key
        else:
            assert got[key] == value and type(got[key]) is type(value), key
    # Separate objects: changing one key's value changes no other key's.
    got["list0"][2]["x"] = 99
    got["dict0"]["lr"] = 7
    got["array0"][0] = -1
    got["cfg0"].items.append(5)
    assert got["cfg1"] == Cfg([1, 2]) and got["cfg1"] is not got["cfg0"]
    assert got["list1"] == [1, 2, {"x": 3}] and got["dict1"]["lr"] == 0.1 and got["array1"][0] == 0 and got["array1"][1] == 1
    assert fresh_optim.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
    # Far fewer decodes than records: eight distinct extras (six copies each) plus the optimizer's
    # distinct hyperparameters, instead of one torch.load per record.
    records = len(saved) + len(optim.param_groups[0]) * 2
    assert len(loads) < records / 2, (len(loads), records)


def _item(key: str) -> ReadItem:
    none = torch.Size([])
    return ReadItem(LoadItemType.BYTE_IO, MetadataIndex(key), none, MetadataIndex(key), none, none)


def test_an_equal_record_with_a_wrong_digest_is_refused_even_after_its_twin_decoded():
    buf = io.BytesIO()
    torch.save([1, 2, 3], buf)
    data = buf.getvalue()
    planner = load_planner.SafeLoadPlanner(value_digests={"a": item_digest(data), "b": "0" * 64})
    planner.set_up_planner({"a": None, "b": None})
    planner.load_bytes(_item("a"), io.BytesIO(data))
    assert planner.original_state_dict["a"] == [1, 2, 3]
    with pytest.raises(distckpt.IntegrityError, match="'b'"):
        planner.load_bytes(_item("b"), io.BytesIO(data))
    assert planner.original_state_dict["b"] is None


# saving: one torch.save per distinct plain value ----------------------------------------------
def _count_byte_records(monkeypatch) -> list:
    """Every torch.save DCP's planner makes of a non-tensor item (distckpt's writer serializes
    tensors itself), as the type of the value."""
    from torch.distributed.checkpoint import default_planner

    calls: list = []
    real = torch.save
    monkeypatch.setattr(default_planner.torch, "save", lambda obj, *a, **k: calls.append(type(obj)) or real(obj, *a, **k))
    return calls


def test_equal_hyperparameters_are_serialized_once_per_save_and_load_back(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    calls = _count_byte_records(monkeypatch)
    with distckpt.Checkpointer(tmp_path, save_rng=False) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        ckpt.save(2, {"model": model, "optim": optim})
    # get_optimizer_state_dict flattens the hyperparameters per parameter (16 parameters here).
    per_param = len(optim.param_groups[0]) - 1  # all but "params"
    records = 16 * per_param
    distinct = len({distckpt.save.planner.plain_key(v) for k, v in optim.param_groups[0].items() if k != "params"})
    assert distinct < per_param + 1 and len(calls) <= 2 * distinct + 2, (calls, records)
    # Each key still loads its own value, with distckpt and with plain DCP.
    fresh_model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.5, betas=(0.1, 0.2))
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load({"model": fresh_model, "optim": fresh})
    assert fresh.param_groups[0]["lr"] == 0.01 and fresh.param_groups[0]["betas"] == (0.8, 0.9)
    import torch.distributed.checkpoint as dcp

    plain = {"optim": {"param_groups": {"0.weight": {"lr": 0.0}, "7.bias": {"lr": 0.0, "betas": None}}}}
    dcp.load(plain, checkpoint_id=str(tmp_path / "step_000000002"), no_dist=True)
    assert plain["optim"]["param_groups"] == {"0.weight": {"lr": 0.01}, "7.bias": {"lr": 0.01, "betas": (0.8, 0.9)}}


_NAN = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]  # a NaN with a payload


def _tricky() -> dict:
    """Values that Python calls equal (or that are NaN) but that are stored differently."""
    values = {
        "int": 1, "float": 1.0, "bool": True, "npfloat": np.float64(1.0), "enum": Color.RED,
        "zero": 0.0, "negzero": -0.0, "nan": float("nan"), "payload": _NAN,
        "tuple": (1,), "list": [1], "tuple_f": (1.0,), "str": "1", "bytes": b"1",
        "nested": ((1, 2.0), "x"), "none": None,
    }  # fmt: skip
    out = {}
    for name, value in values.items():
        for i in range(3):
            out[f"{name}{i}"] = value
    # A list holding one list twice loads aliased; an equal list of two lists must not.
    inner = [1, 2]
    out["aliased"] = [inner, inner]
    out["separate"] = [[1, 2], [1, 2]]
    return out


def _bits(v):
    if type(v) is float:
        return struct.pack("<d", v)
    if type(v) in (tuple, list):
        return type(v)(_bits(x) for x in v)
    return v


@pytest.mark.parametrize("blocking", [True, False])
def test_values_equal_in_python_keep_their_own_type_and_bits(tmp_path, blocking):
    saved = _tricky()
    with distckpt.Checkpointer(tmp_path, safe_types=[Color], save_rng=False, async_mode="thread") as ckpt:
        ckpt.save(1, {"extra": Bag(saved)}, blocking=blocking)
        ckpt.wait()
    state = {"extra": Bag({k: None for k in saved})}
    with distckpt.Checkpointer(tmp_path, safe_types=[Color]) as ckpt:
        ckpt.load(state)
    got = state["extra"].state
    for key, value in saved.items():
        assert type(got[key]) is type(value), key
        if isinstance(value, np.floating):
            assert value.tobytes() == got[key].tobytes(), key
        else:
            assert _bits(got[key]) == _bits(value), key
    assert got["aliased"][0] is got["aliased"][1]
    assert got["separate"][0] is not got["separate"][1]
    assert got["list0"] is not got["list1"]  # each key its own object


def test_plain_key_tells_apart_what_is_stored_apart():
    from distckpt.save.planner import plain_key

    keys = [plain_key(v) for v in (1, 1.0, True, 0.0, -0.0, "1", b"1", (1,), [1], (1.0,), None, float("nan"), _NAN)]
    assert None not in keys and len(set(keys)) == len(keys)
    assert plain_key(0.1) == plain_key(0.1) and plain_key((0.9, 0.999)) == plain_key((0.9, 0.999))
    # Not plain: subclasses, mutable containers inside containers, long or deep values.
    for v in (np.float64(1.0), Color.RED, {"a": 1}, [[1]], ([1],), "x" * 65, 10**70, (((1,),),), list(range(65)), {1}, 1j):
        assert plain_key(v) is None, v
