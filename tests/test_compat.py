"""distckpt's private torch APIs (distckpt/_compat.py) exist and behave as distckpt expects in the
torch under test, and that torch is inside the range pyproject.toml declares (the range is what
has been tested: ``bash tests/compat.sh VERSION`` runs this suite under each release of it)."""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties

REPO = Path(__file__).resolve().parents[1]


def _declared_torch_requirement() -> str:
    """The torch requirement of ``[project] dependencies`` in pyproject.toml, e.g. ``torch>=2.11,<2.15``."""
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        found = re.findall(r'^\s*"(torch\s*[<>=!~][^"]*)"', text, re.MULTILINE)
    else:
        deps = tomllib.loads(text)["project"]["dependencies"]
        found = [d for d in deps if re.match(r"torch\s*[<>=!~]", d)]
    assert len(found) == 1, f"expected one torch requirement in pyproject.toml, found {found}"
    return found[0]


def _release(text: str) -> tuple[int, ...]:
    """``2.14.1+cu130`` -> (2, 14, 1); ``2.11`` -> (2, 11, 0)."""
    parts = [int(x) for x in re.match(r"\d+(?:\.\d+)*", text).group(0).split(".")]
    return tuple((parts + [0, 0, 0])[:3])


def _contains_simple(spec: str, version: str) -> bool:
    """Whether ``version`` satisfies ``spec`` (``>=2.11,<2.15``), comparing releases only: the
    operators a torch range uses, for where ``packaging`` is not installed."""
    ops = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
           "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}  # fmt: skip
    current = _release(version)
    for clause in spec.split(","):
        op, bound = re.match(r"\s*(>=|<=|==|!=|<|>)\s*([\d.]+)\s*$", clause).groups()
        if not ops[op](current, _release(bound)):
            return False
    return True


def _contains(spec: str, version: str) -> bool:
    """Whether ``version`` satisfies ``spec``: packaging's rule where it is installed."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        return _contains_simple(spec, version)
    # A nightly of a release inside the range counts as inside; local labels (+cpu) are ignored.
    return SpecifierSet(spec).contains(Version(version), prereleases=True)


@pytest.mark.parametrize("contains", [_contains, _contains_simple])
def test_range_parser(contains):
    assert contains(">=2.11,<2.15", "2.11.0+cu130") and contains(">=2.11,<2.15", "2.14.1")
    assert contains(">=2.11,<2.15", "2.13.0+cpu") and contains(">=2.11, <2.15", "2.12.1")
    assert not contains(">=2.11,<2.15", "2.10.1") and not contains(">=2.11,<2.15", "2.15.0")


def test_torch_under_test_is_inside_the_declared_range():
    requirement = _declared_torch_requirement()
    spec = re.sub(r"^torch\s*", "", requirement).split(";")[0].strip()
    # A range with a tested floor and ceiling, not one pinned minor and not open-ended.
    assert ">=" in spec and "<" in spec.replace("<=", ""), f"pyproject's {requirement!r} is not a bounded range"
    assert _contains(spec, torch.__version__), (
        f"torch {torch.__version__} is outside pyproject's {requirement!r}: run `bash tests/compat.sh "
        f"{torch.__version__.split('+')[0]}` and widen the range (and the README's table) if it passes"
    )


def test_every_private_api_resolves():
    from distckpt import _compat

    assert callable(_compat.flatten_state_dict) and callable(_compat.unflatten_state_dict)
    assert callable(_compat.set_element)
    assert _compat.FsspecDcpFileSystem is not None
    assert _compat.PyTorchFileReader is not None and _compat.PyTorchFileWriter is not None
    assert _compat.storage_name_of_dtype(torch.bfloat16) == "BFloat16Storage"
    assert _compat.dtype_from_storage_name("FloatStorage") == torch.float32
    assert callable(_compat.rebuild_tensor_v2)
    assert callable(_compat.split_by_size_and_type)
    assert [f.name for f in dataclasses.fields(_compat.StorageInfo)][:3] == ["relative_path", "offset", "length"]
    assert set(_compat.MEM_FORMAT_ENCODING.__members__) >= {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST"}
    assert _compat.StridedShard is not None
    assert callable(_compat.load_flat) and _compat.Stateful is not None
    assert _compat.TORCH_VERSION == _release(torch.__version__)
    # object_collective_device asks torch (its fallback only guesses from the backend's name)
    import torch.distributed.distributed_c10d as c10d

    assert callable(getattr(c10d, "_get_object_coll_device", None))


def test_nested_dict_round_trip_and_set_element():
    from distckpt import _compat

    nested = {"model": {"w": torch.ones(2)}, "opt": {"state": {0: {"step": 3}}}, "lst": [1, {"a": 2}]}
    flat, mapping = _compat.flatten_state_dict(nested)
    assert set(flat) == {"model.w", "opt.state.0.step", "lst.0", "lst.1.a"}
    assert mapping["model.w"] == ("model", "w") and mapping["lst.1.a"] == ("lst", 1, "a")
    back = _compat.unflatten_state_dict(flat, mapping)
    assert back["lst"] == [1, {"a": 2}] and torch.equal(back["model"]["w"], torch.ones(2))
    target = {"model": {"w": None}}
    _compat.set_element(target, mapping["model.w"], 7)
    assert target == {"model": {"w": 7}}


def test_torch_record_writer_and_reader():
    """write_torch_record is torch.save's zip format (torch.load reads it back, with or without
    record CRCs); the reader finds each record and its offset, as distckpt's readers need."""
    from distckpt import _compat

    value = {"t": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    for crc in (True, False):
        buf = io.BytesIO()
        _compat.write_torch_record(value, buf, crc)
        data = buf.getvalue()
        assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["t"], value["t"])
        reader = _compat.PyTorchFileReader(io.BytesIO(data))
        storage = next(r for r in reader.get_all_records() if r.startswith("data/"))
        offset = reader.get_record_offset(storage)
        assert data[offset : offset + 24] == value["t"].numpy().tobytes()
        assert reader.get_record(storage) == value["t"].numpy().tobytes()
        # torch.save pickles tensors with this rebuild function, by name (exports must too).
        assert b"torch._utils\n_rebuild_tensor_v2" in reader.get_record("data.pkl")
    rebuild = _compat.rebuild_tensor_v2
    assert (rebuild.__module__, rebuild.__name__) == ("torch._utils", "_rebuild_tensor_v2")
    alignment = _compat.storage_alignment()
    assert alignment >= 1


def test_strided_shard_and_mesh_without_groups():
    """A mesh built without process groups has the coordinate of the rank it is given, and torch's
    chunk helper (the block DCP writes for a DTensor) shards by ``_StridedShard`` as by ``Shard``
    (distckpt's planner counts both as sharding; ``is_shard()`` says False for the strided one)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from distckpt import _compat

    for rank in (0, 1):
        mesh = _compat.mesh_without_groups([0, 1], ("dp",), rank)
        assert tuple(mesh.get_coordinate()) == (rank,) and mesh.mesh.tolist() == [0, 1]
        for placement in (Shard(0), _compat.StridedShard(0, split_factor=2)):
            shape, _ = compute_local_shape_and_global_offset((8, 3), mesh, [placement])
            assert tuple(shape) == (4, 3), placement
        shape, offset = compute_local_shape_and_global_offset((8, 3), mesh, [Replicate()])
        assert tuple(shape) == (8, 3) and tuple(offset) == (0, 0)
    assert not _compat.group_is_registered(object())


def test_model_key_fqns_strips_wrappers():
    from distckpt import _compat

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert _compat.model_key_fqns(model, "0.weight") == "0.weight"

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = model

    # torch strips "module." only for DDP (and "_orig_mod." for torch.compile), not any attribute.
    assert _compat.model_key_fqns(Wrapper(), "module.0.weight") == "module.0.weight"
    assert _compat.model_key_fqns(torch.compile(model), "_orig_mod.0.weight") == "0.weight"


@pytest.mark.parametrize("name", ["FsspecDcpFileSystem"])
def test_fsspec_filesystem_has_dcp_interface(name):
    from distckpt import _compat

    cls = getattr(_compat, name)
    for method in ("create_stream", "concat_path", "rename", "init_path", "mkdir", "exists", "rm_file"):
        assert callable(getattr(cls, method, None)), method


class _Counter:
    """A stateful value inside a flat state dict: DCP loads it through its own methods."""

    def __init__(self) -> None:
        self.n = torch.zeros(3)
        self.loaded = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        self.loaded += 1


def test_load_flat_is_dcp_load_without_the_stateful_checks(tmp_path, monkeypatch):
    """load_flat loads what dcp.load loads, skips DCP's per-value Stateful check for tensors and
    plain values, and hands a state dict holding a Stateful value to dcp.load itself."""
    import torch.distributed.checkpoint as dcp

    from distckpt import _compat

    saved = {"w": torch.arange(6.0), "lr": 0.5, "betas": (0.9, 0.99), "name": "x", "c": _Counter()}
    saved["c"].n = torch.tensor([1.0, 2.0, 3.0])
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    checks = []
    real = isinstance
    from torch.distributed.checkpoint import state_dict_loader

    for module in (_compat, state_dict_loader):  # distckpt's checks and dcp.load's own
        monkeypatch.setattr(module, "isinstance", lambda v, t: checks.append(t) or real(v, t), raising=False)

    flat = {"w": torch.zeros(6), "lr": 0.0, "betas": None, "name": ""}
    _compat.load_flat(flat, dcp.FileSystemReader(str(tmp_path)), dcp.DefaultLoadPlanner())
    assert torch.equal(flat["w"], torch.arange(6.0)) and flat["lr"] == 0.5 and flat["betas"] == (0.9, 0.99) and flat["name"] == "x"
    assert _compat.Stateful not in checks

    with_stateful = {"w": torch.zeros(6), "c": _Counter()}
    _compat.load_flat(with_stateful, dcp.FileSystemReader(str(tmp_path)), dcp.DefaultLoadPlanner())
    assert _compat.Stateful in checks  # dcp.load's own path
    assert with_stateful["c"].loaded == 1 and torch.equal(with_stateful["c"].n, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(with_stateful["w"], torch.arange(6.0))


# torch 2.15 ---------------------------------------------------------------------------------------
def test_importing_distckpt_warns_nothing_deprecated():
    """torch 2.15 deprecated ``torch.distributed.checkpoint._fsspec_filesystem`` (a
    DeprecationWarning on import): distckpt takes the class from where the running torch keeps it."""
    import subprocess
    import sys

    code = "import distckpt, distckpt.storage.objectstore, distckpt.tools.cli, distckpt.load.reader, distckpt.save.writer"
    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]


def _as_torch_2_15_writes_it(raw: bytes, strides: object) -> bytes:
    """``.metadata`` re-pickled as the DCP of torch 2.15 writes it: each ``TensorProperties``' state
    with a sixth item, its ``strides`` (``strides`` in place of the one torch 2.15 itself writes)."""
    import copyreg
    import pickle

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if type(obj) is not TensorProperties:
                return NotImplemented
            state = obj.__getstate__()
            return copyreg.__newobj__, (TensorProperties,), (*state[:5], strides)

    out = io.BytesIO()
    Pickler(out, protocol=4).dump(pickle.loads(raw))
    return out.getvalue()


def _saved_with_strides(tmp_path: Path, strides: object) -> tuple[Path, Path, dict]:
    import distckpt
    from forge import reseal

    root = tmp_path / "ck"
    state = {"w": torch.arange(12.0).reshape(3, 4), "t": torch.arange(30.0).reshape(5, 6).t(), "n": {"step": 7}}
    distckpt.Checkpointer(root).save(1, state)
    d = root / "step_000000001"
    reseal(d, ".metadata", _as_torch_2_15_writes_it((d / ".metadata").read_bytes(), strides))
    return root, d, state


def test_a_checkpoint_written_under_torch_2_15_reads_under_this_torch(tmp_path):
    """torch 2.15 pickles ``TensorProperties`` with a sixth field (``strides``), which the DCP of
    2.11-2.14 cannot unpickle ("too many values to unpack"); distckpt reads it under every torch of
    its range (load, verify --state, ls)."""
    import distckpt
    from cli_runner import run_cli
    from distckpt.integrity.safe_pickle import load_metadata

    root, d, state = _saved_with_strides(tmp_path, (7, 1))
    md = load_metadata((d / ".metadata").read_bytes(), str(d / ".metadata"))
    props = md.state_dict_metadata["w"].properties
    assert type(props).__name__ == "TensorProperties" and props.strides == (7, 1) and props.dtype == torch.float32
    loaded = {"w": torch.zeros(3, 4), "t": torch.zeros(6, 5), "n": {"step": 0}}
    distckpt.Checkpointer(root).load(loaded)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["t"], state["t"]) and loaded["n"] == {"step": 7}
    run = run_cli("verify", str(root), "--state")
    assert run.returncode == 0 and run.stdout.startswith("OK"), (run.returncode, run.stdout, run.stderr)
    run = run_cli("ls", str(root))
    assert run.returncode == 0 and "committed" in run.stdout, (run.stdout, run.stderr)
    run = run_cli("convert", str(root), str(tmp_path / "out.pt"), "--to", "torch", "--all", "--quiet")
    assert run.returncode == 0, (run.stdout, run.stderr)
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(exported["w"], state["w"]) and torch.equal(exported["t"], state["t"]), sorted(exported)


@pytest.mark.parametrize("strides", ["x", (1, -1), (1.5,), ((1,),)])
def test_malformed_strides_are_an_integrity_error_naming_the_tensor(tmp_path, strides):
    import distckpt

    root, _, _ = _saved_with_strides(tmp_path, strides)
    with pytest.raises(distckpt.IntegrityError, match=r"tensor '(w|t)': its property strides is .*not None or a tuple of ints"):
        distckpt.Checkpointer(root).load({"w": torch.zeros(3, 4), "t": torch.zeros(6, 5), "n": {"step": 0}})


@pytest.mark.skipif(
    "strides" not in {f.name for f in dataclasses.fields(TensorProperties)}, reason="TensorProperties has strides from torch 2.15 on"
)
def test_metadata_records_each_tensors_strides_as_plain_dcp_does(tmp_path):
    """torch 2.15's DCP records each tensor's strides; distckpt's shared properties (one object per
    kind, pickled once) must not give one tensor another's."""
    import pickle

    import torch.distributed.checkpoint as dcp

    import distckpt

    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3), "t": torch.arange(30.0).reshape(5, 6).t(),
             "e": torch.ones(1, 4).expand(3, 4)}  # fmt: skip
    distckpt.Checkpointer(tmp_path / "ours").save(1, state)
    dcp.save(dict(state), checkpoint_id=str(tmp_path / "dcp"))
    ours = pickle.loads((tmp_path / "ours" / "step_000000001" / ".metadata").read_bytes()).state_dict_metadata
    theirs = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes()).state_dict_metadata
    for key, value in state.items():
        assert ours[key].properties.strides == theirs[key].properties.strides == value.stride(), key


def test_a_tensor_with_dcps_checkpointable_fields_is_refused_by_name(tmp_path):
    """torch 2.15's DCP saves a plain tensor carrying ``global_shape``, ``global_offsets``,
    ``local_offsets`` and ``local_sizes`` as shards of a global tensor; distckpt, which plans by a
    tensor's own shape, refuses it by key instead of failing later on "inconsistent save plans"."""
    import distckpt
    from distckpt import _compat

    if not _compat.CHECKPOINTABLE_TENSOR_FIELDS:
        pytest.skip("DCP's CheckpointableTensor is torch 2.15's")

    shard = torch.ones(2, 4)
    shard.global_shape, shard.global_offsets, shard.local_offsets, shard.local_sizes = (4, 4), ((0, 0),), ((0, 0),), ((2, 4),)
    ckpt = distckpt.Checkpointer(tmp_path)
    for blocking in (True, False):
        with pytest.raises(TypeError, match=r"cannot save 'model.w': it carries DCP's CheckpointableTensor fields"):
            ckpt.save(1, {"model": {"w": shard}}, blocking=blocking)
            ckpt.wait()
    assert ckpt.steps() == []
    ckpt.close()
