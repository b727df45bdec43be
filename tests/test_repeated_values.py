"""Non-tensor records with equal bytes (an optimizer's hyperparameters repeat once per parameter:
``optim.param_groups.<fqn>.lr`` ...) are decoded once per load and their value copied: each key
still gets its own object, equal to what was saved, and each record's bytes are still checked
against its own digest before anything is decoded."""

from __future__ import annotations

import dataclasses
import enum
import io
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
    monkeypatch.setattr(load_planner.torch, "load", lambda *a, **k: loads.append(1) or real(*a, **k))
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
