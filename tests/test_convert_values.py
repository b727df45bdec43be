"""``convert --to torch`` writes values as a load gives them back, never distckpt's encoded form.

Values JSON cannot hold (``np.float64`` hyper-parameters, tuples of them, Enum members, paths,
arrays) are stored in distckpt's encoded form (:mod:`distckpt.state.encoded`). The export used to
copy that form into the output as if it were the value: ``('__distckpt_value__', 'value', ...)``
tuples where the training code had a float or an Enum. Now each value is decoded as a load
decodes it; what plain data can hold is written in plain types (``torch.load(weights_only=True)``
reads the file), the rest is left out and reported with the reason.
"""

from __future__ import annotations

import collections
import enum
from pathlib import Path

import numpy as np
import torch

from distckpt import Checkpointer
from distckpt.state.encoded import MARKER
from distckpt.tools.catalog import locate
from distckpt.tools.convert import export_torch


class Phase(enum.Enum):
    WARMUP = 1
    MAIN = 2


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for kv in value.items() for v in kv for s in _strings(v)]
    return []


def test_values_are_exported_decoded_in_plain_types_or_reported(tmp_path):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    optim.param_groups[0]["lr"] = np.float64(0.25)  # as a NumPy schedule writes it
    state = {
        "model": model,
        "optim": optim,
        "epoch": 3,
        "best": np.float64(0.5),
        "pair": (np.int64(7), "x"),
        "phase": Phase.MAIN,
        "out": Path("/runs/a"),
        "arr": np.arange(4),
        "counts": collections.OrderedDict(a=np.int32(1)),
    }
    with Checkpointer(str(tmp_path / "root"), safe_types=(Phase,)) as ckpt:
        ckpt.save(1, state)
    summary = export_torch(locate(str(tmp_path / "root")), str(tmp_path / "full.pt"))
    got = torch.load(tmp_path / "full.pt", weights_only=True)  # plain types only: no allow-list needed

    assert got["epoch"] == 3
    assert got["best"] == 0.5 and type(got["best"]) is float
    assert got["counts"] == {"a": 1} and type(got["counts"]["a"]) is int
    assert got["pair"] == (7, "x") and type(got["pair"]) is tuple and type(got["pair"][0]) is int
    lrs = [v for k, v in got["optim"].items() if k.endswith(".lr")]
    assert lrs == [0.25, 0.25] and all(type(v) is float for v in lrs), got["optim"]
    assert torch.equal(got["model"]["weight"], model.weight.detach())
    assert not [s for s in _strings(got) if MARKER in s], "distckpt's encoded form leaked into the export"
    reasons = dict(item.split(" (", 1) for item in summary["skipped"])
    assert set(reasons) == {"phase", "out", "arr"}, summary["skipped"]
    assert "safe_types" in reasons["phase"] and "PosixPath" in reasons["out"] and "ndarray" in reasons["arr"]
    assert not {"phase", "out", "arr"} & set(got)


def test_encoded_values_on_request_and_only_for_torch(tmp_path, capsys):
    """``--encoded-values`` keeps the form plain ``dcp.load`` sees (what the export wrote before)."""
    from distckpt.tools.cli import main

    with Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(2, 2), "best": np.float64(0.5), "out": Path("/runs/a")})
    assert main(["convert", str(tmp_path / "root"), str(tmp_path / "enc.pt"), "--to", "torch", "--encoded-values", "-q"]) == 0
    got = torch.load(tmp_path / "enc.pt", weights_only=True)
    assert got["best"] == (MARKER, "value", (MARKER, "numpy.scalar", ("<f8", 0.5))), got["best"]
    assert got["out"][0] == MARKER
    assert main(["convert", str(tmp_path / "root"), str(tmp_path / "o.safetensors"), "--to", "safetensors", "--encoded-values"]) != 0
    assert "--encoded-values applies to --to torch" in capsys.readouterr().err


def test_an_empty_key_inside_a_dict_is_exported_beside_its_siblings(tmp_path):
    """{"m": {"a": t, "": u}} is flattened to the keys m.a and "m.": the export took "m." for the
    top-level name "m" and replaced the dict it held, so m.a was lost, silently (and in the other
    order a tensor stood where a dict was expected: a TypeError)."""
    a, u = torch.zeros(2), torch.ones(2)
    with Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.save(1, {"m": {"a": a, "": u}, "v": {"x": 1, "": 2}, "epoch": 3})
    export_torch(locate(str(tmp_path / "root")), str(tmp_path / "full.pt"))
    got = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(got["m"]) == {"a", ""} and torch.equal(got["m"]["a"], a) and torch.equal(got["m"][""], u)
    assert got["v"] == {"x": 1, "": 2} and got["epoch"] == 3


def test_values_weights_only_loading_reads_are_exported(tmp_path):
    """complex, bytes, sets and tuple-keyed dicts were skipped as "not plain data", although
    ``torch.load(weights_only=True)`` reads them; a frozenset it refuses is still skipped."""
    state = {
        "w": torch.ones(1), "cx": 1 + 2j, "ncx": np.complex64(1 - 1j), "by": b"\x00\xff", "ba": bytearray(b"ab"),
        "st": {1, 2}, "tk": {(1, "a"): 3, None: [b"x"]}, "fz": frozenset({1}),
    }
    with Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.save(1, state)
    summary = export_torch(locate(str(tmp_path / "root")), str(tmp_path / "full.pt"))
    got = torch.load(tmp_path / "full.pt", weights_only=True)
    assert got["cx"] == 1 + 2j and got["ncx"] == 1 - 1j and type(got["ncx"]) is complex
    assert got["by"] == b"\x00\xff" and got["ba"] == bytearray(b"ab") and got["st"] == {1, 2}
    assert got["tk"] == {(1, "a"): 3, None: [b"x"]}
    assert [s.split(" (")[0] for s in summary["skipped"]] == ["fz"] and "frozenset" in summary["skipped"][0]


def test_values_weights_only_cannot_read_are_skipped_not_exported(tmp_path):
    """An int of more than 255 bytes (pickled with LONG4) and an empty bytes (a call of bytes())
    are values weights_only refuses: the export wrote them, and the file could not be read."""
    state = {"w": torch.ones(1), "big": 7**5000, "empty": b"", "ok": 2**100, "inner": [b""]}
    with Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.save(1, state)
    summary = export_torch(locate(str(tmp_path / "root")), str(tmp_path / "full.pt"))
    got = torch.load(tmp_path / "full.pt", weights_only=True)
    assert got["ok"] == 2**100 and "big" not in got and "empty" not in got
    reasons = dict(item.split(" (", 1) for item in summary["skipped"])
    assert set(reasons) == {"big", "empty", "inner"}, summary["skipped"]
    assert "14,037 bits" in reasons["big"] and "empty bytes" in reasons["empty"]

def test_tensors_of_dtypes_without_a_storage_class_are_exported(tmp_path):
    """uint16/uint32/uint64 and the float8 types have no ``<X>Storage`` class: torch.save pickles
    them through ``_rebuild_tensor_v3``. The export failed with the dtype as its only message."""
    state = {"m": {
        "u16": torch.tensor([1, 65535], dtype=torch.uint16), "u32": torch.tensor([7, 2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([2**63 + 5], dtype=torch.uint64), "f8": torch.randn(5).to(torch.float8_e4m3fn),
        "f8b": torch.randn(3).to(torch.float8_e5m2), "f": torch.randn(3),
    }}
    with Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.save(1, state)
    export_torch(locate(str(tmp_path / "root")), str(tmp_path / "full.pt"))
    got = torch.load(tmp_path / "full.pt", weights_only=True)["m"]
    assert set(got) == set(state["m"])
    for k, t in state["m"].items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
    flat = export_torch(locate(str(tmp_path / "root")), str(tmp_path / "flat.pt"), key="m")
    assert flat["tensors"] == 6 and torch.load(tmp_path / "flat.pt", weights_only=True)["u16"].dtype == torch.uint16


def test_a_cast_leaves_packed_float4_tensors_as_they_are(tmp_path):
    """``--dtype bf16`` failed the whole export on a float4_e2m1fn_x2 tensor (two values a byte:
    torch defines no cast) with torch's bare '"copy_" not implemented'; it keeps its dtype, as
    integer tensors do, and the others are cast."""
    packed = torch.tensor([0x12, 0x34, 0xAB], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.save(1, {"model": {"w": packed, "f": torch.randn(3), "e8": torch.ones(2).to(torch.float8_e8m0fnu)}})
    export_torch(locate(str(tmp_path / "root")), str(tmp_path / "o.pt"), key="model", dtype=torch.bfloat16)
    got = torch.load(tmp_path / "o.pt", weights_only=True)
    assert got["w"].dtype == torch.float4_e2m1fn_x2 and torch.equal(got["w"].view(torch.uint8), packed.view(torch.uint8))
    assert got["f"].dtype == torch.bfloat16 and got["e8"].dtype == torch.bfloat16 and torch.equal(got["e8"], torch.ones(2, dtype=torch.bfloat16))


def test_a_users_value_that_looks_encoded_is_exported_and_verified_as_a_load_gives_it(tmp_path):
    """A plain top-level value is stored as JSON text and loads back as saved, even a tuple that
    looks like distckpt's encoded form. The export decoded it again (0.1 for the first, a skipped
    entry for a path), and ``verify --state`` called a malformed lookalike damaged."""
    from distckpt.tools.cli import main

    v = (MARKER, "numpy.scalar", ("<f8", 0.1))
    bad = (MARKER, "path", ("nonsense",))
    state = {"w": torch.ones(1), "tag": v, "cfg": {"a": v, "b": (MARKER, "path", ("PosixPath", "/x"))}, "odd": bad}
    with Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.save(1, state)
    got = {"w": torch.zeros(1), "tag": None, "cfg": None, "odd": None}
    with Checkpointer(str(tmp_path / "root")) as ckpt:
        ckpt.load(got)
    assert got["tag"] == v and got["odd"] == bad and got["cfg"] == state["cfg"]
    summary = export_torch(locate(str(tmp_path / "root")), str(tmp_path / "o.pt"))
    out = torch.load(tmp_path / "o.pt", weights_only=True)
    assert not summary["skipped"] and out["tag"] == v and out["cfg"] == state["cfg"] and out["odd"] == bad
    assert main(["verify", str(tmp_path / "root"), "--state", "-q"]) == 0


def test_a_cast_beyond_the_target_range_is_named_and_step_counters_keep_their_dtype(tmp_path: Path) -> None:
    """``convert --dtype fp16`` wrote a weight of 1e6 as inf, exit 0 and only "wrote ..."; a full
    ``--to torch --dtype bf16`` made an optimizer's step 70001 into 70144."""
    import json

    from cli_runner import run_cli
    from safetensors.torch import load_file

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    for s in o.state.values():
        s["step"].fill_(70001.0)
    with torch.no_grad():
        m.weight[0, 0] = 1e6
    with Checkpointer(tmp_path / "ck") as c:
        c.save(1, {"model": m, "optim": o})
    for to, out in (("hf", tmp_path / "hf"), ("safetensors", tmp_path / "w.safetensors"), ("torch", tmp_path / "w.pt")):
        got = run_cli("convert", str(tmp_path / "ck"), "--to", to, str(out), "--dtype", "fp16", "--json")
        assert got.returncode == 0 and "beyond the range of torch.float16" in got.stderr and "model.weight" in got.stderr, got
        assert json.loads(got.stdout)["beyond_range"] == ["model.weight"], got.stdout
    assert torch.isinf(load_file(str(tmp_path / "hf" / "model.safetensors"))["weight"][0, 0])  # (as asked, but said)
    quiet = run_cli("convert", str(tmp_path / "ck"), "--to", "safetensors", str(tmp_path / "b.safetensors"), "--dtype", "bf16")
    assert quiet.returncode == 0 and "beyond the range" not in quiet.stderr, quiet.stderr
    full = run_cli("convert", str(tmp_path / "ck"), "--to", "torch", str(tmp_path / "full.pt"), "--dtype", "bf16")
    assert full.returncode == 0, full.stderr
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    steps = [v for k, v in loaded["optim"].items() if k.endswith(".step")]
    assert steps and all(v.dtype == torch.float32 and v.item() == 70001.0 for v in steps), steps
    assert loaded["model"]["weight"].dtype == torch.bfloat16
    # (every export: --key optim to safetensors made it 70144 too, silently)
    keyed = run_cli("convert", str(tmp_path / "ck"), "--to", "safetensors", str(tmp_path / "o.safetensors"), "--key", "optim", "--dtype", "bf16")
    assert keyed.returncode == 0, keyed.stderr
    counters = {k: v for k, v in load_file(str(tmp_path / "o.safetensors")).items() if k.endswith(".step")}
    assert counters and all(v.dtype == torch.float32 and v.item() == 70001.0 for v in counters.values()), counters
