"""Hugging Face folders that could be read two ways, and weights that cannot be written faithfully,
are errors naming the files and keys (issue #28):

* a folder holding both ``model.safetensors`` and an index naming other files (transformers loads
  the single file, an index reader the shards);
* tied weights stored under both keys with different values (one of them would win by file order);
* ``save_pretrained(dtype=torch.int8 / torch.bool)`` casting floating-point weights (truncated);
* a tensor named ``__metadata__`` (the safetensors header's reserved key: the file is unreadable).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import distckpt
from distckpt.tools import convert, hf, hf_convert
from distckpt.tools.catalog import locate
from distckpt.tools.safetensors_io import INDEX_NAME

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled:UserWarning")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_folder_with_a_single_file_and_an_index_is_refused_naming_both(tmp_path):
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    hf.save_pretrained(_model(0), str(sharded), max_shard_size=1000)
    hf.save_pretrained(_model(1), str(single))
    shutil.copy(single / "model.safetensors", sharded / "model.safetensors")
    fresh = _model(5)
    before = _state(fresh)
    with pytest.raises(distckpt.IntegrityError, match=rf"model\.safetensors.*{INDEX_NAME}.*model-00001-of-0000\d"):
        hf.load_pretrained(fresh, str(sharded))
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()), "nothing was loaded"
    # An index naming the single file itself (what save_pretrained writes for one file) is one checkpoint.
    hf.load_pretrained(fresh, str(single))
    assert all(torch.equal(v, _model(1).state_dict()[k]) for k, v in fresh.state_dict().items())



def _as_diffusers(folder) -> None:
    """Rename a sharded publish as diffusers names its files (diffusion_pytorch_model-*, its index)."""
    index = json.loads((folder / INDEX_NAME).read_text())
    renamed = {}
    for key, name in index["weight_map"].items():
        renamed[key] = name.replace("model-", "diffusion_pytorch_model-")
    for name in set(index["weight_map"].values()):
        (folder / name).rename(folder / name.replace("model-", "diffusion_pytorch_model-"))
    (folder / INDEX_NAME).unlink()
    index["weight_map"] = renamed
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))


def test_another_librarys_index_is_read(tmp_path):
    # diffusers shards a UNet as diffusion_pytorch_model-0000N-of-0000M.safetensors + its index:
    # without the index, several files were refused as an unfinished publish.
    folder = tmp_path / "unet"
    hf.save_pretrained(_model(2), str(folder), max_shard_size=1000)
    _as_diffusers(folder)
    fresh = _model(5)
    hf.load_pretrained(fresh, str(folder))
    assert all(torch.equal(v, _model(2).state_dict()[k]) for k, v in fresh.state_dict().items())
    # The single-file rule holds for it as for transformers' names: a stray single file beside
    # the index is ambiguous, under either library's name.
    for single in ("diffusion_pytorch_model.safetensors", "model.safetensors"):
        save_file(_state(_model(3)), str(folder / single))
        with pytest.raises(distckpt.IntegrityError, match=rf"holds both {single} and diffusion_pytorch_model\.safetensors\.index\.json"):
            hf.load_pretrained(_model(5), str(folder))
        (folder / single).unlink()
    # transformers' own index, where there is one, is the checkpoint (as transformers reads it).
    hf.save_pretrained(_model(4), str(tmp_path / "tf"), max_shard_size=1000)
    for f in (tmp_path / "tf").iterdir():
        shutil.copy(f, folder / f.name)
    hf.load_pretrained(fresh, str(folder))
    assert all(torch.equal(v, _model(4).state_dict()[k]) for k, v in fresh.state_dict().items())
    # Its shards without it (a publish into this folder cut short after it removed its index)
    # are another checkpoint beside diffusers' index: refused, not diffusers' weights loaded.
    (folder / INDEX_NAME).unlink()
    with pytest.raises(distckpt.IntegrityError, match=r"holds both model-00001-of-0000\d\.safetensors.*diffusion_pytorch_model"):
        hf.load_pretrained(_model(5), str(folder))
    for f in folder.glob("model-*.safetensors"):
        f.unlink()
    (folder / ".distckpt-publish.json").unlink(missing_ok=True)
    hf.load_pretrained(fresh, str(folder))
    assert all(torch.equal(v, _model(2).state_dict()[k]) for k, v in fresh.state_dict().items())
    # A malformed one is named.
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text('{"weight_map": {"0.weight": "../x.safetensors"}}')
    with pytest.raises(distckpt.UnsafeCheckpointError, match=r"diffusion_pytorch_model\.safetensors\.index\.json names file"):
        hf.load_pretrained(_model(5), str(folder))



def test_other_index_files_beside_a_single_file_are_not_its_index(tmp_path):
    """An adapter's index, or a macOS '._' copy, beside model.safetensors: the single file is the
    checkpoint (as transformers loads it), as before diffusers' index was read."""
    folder = tmp_path / "m"
    hf.save_pretrained(_model(6), str(folder))
    (folder / "adapter_model.safetensors.index.json").write_text('{"weight_map": {}}')
    (folder / "._model.safetensors.index.json").write_bytes(b"\x00\x05\x16\x07 not json")
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    fresh = _model(5)
    hf.load_pretrained(fresh, str(folder))
    assert all(torch.equal(v, _model(6).state_dict()[k]) for k, v in fresh.state_dict().items())


class Tied(nn.Module):
    """A language-model-like module whose output projection shares the input embedding."""

    def __init__(self, seed: int = 0, vocab: int = 10) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, vocab, bias=False)
        self.head.weight = self.embed.weight


def _tied_file(path, embed: torch.Tensor, head: torch.Tensor, norm: nn.LayerNorm) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # The duplicate first: a reader filling the tied tensor in file order would keep embed.weight.
    save_file({"head.weight": head.contiguous(), "embed.weight": embed.contiguous(),
               "norm.weight": norm.weight.detach().clone(), "norm.bias": norm.bias.detach().clone()},
              str(path / "model.safetensors"))  # fmt: skip


def test_tied_weights_stored_with_different_values_are_refused(tmp_path):
    src = Tied(0)
    embed = src.embed.weight.detach().clone()
    head = embed.clone()
    head[3, 1] += 1.0  # one element differs
    _tied_file(tmp_path / "differ", embed, head, src.norm)
    model = Tied(7)
    before = _state(model)
    with pytest.raises(ValueError, match=r"embed\.weight.*head\.weight|head\.weight.*embed\.weight") as info:
        hf.load_pretrained(model, str(tmp_path / "differ"))
    assert "model.safetensors" in str(info.value) and "different values" in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the model was left untouched"
    # Equal values under both keys (an untied save of a tied model) load as before.
    _tied_file(tmp_path / "same", embed, embed.clone(), src.norm)
    report = hf.load_pretrained(model, str(tmp_path / "same"))
    assert torch.equal(model.embed.weight, embed) and model.head.weight is model.embed.weight
    assert not report.missing and not report.unexpected


class Tied4(nn.Module):
    """One tensor under four keys, as T5 ties ``shared``, both ``embed_tokens`` and ``lm_head``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shared = nn.Embedding(6, 4)
        self.enc = nn.Embedding(6, 4)
        self.dec = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.enc.weight = self.dec.weight = self.head.weight = self.shared.weight


@pytest.mark.parametrize("strict", [True, False])
def test_a_tied_tensor_of_more_than_two_keys_compares_every_stored_key(tmp_path, strict):
    """Only a stored key that was the model's first name for the tensor was compared: with
    ``enc``, ``dec`` (different values) and ``head`` stored and ``shared`` not, the load passed and
    the last one read won silently; with ``enc`` alone stored the other keys were reported
    missing. Found by a helper (2026-11-29)."""
    x = torch.randn(6, 4)
    y = x + 1
    path = tmp_path / "differ"
    path.mkdir()
    save_file({"enc.weight": x, "dec.weight": y, "head.weight": x.clone()}, str(path / "model.safetensors"))
    model = Tied4(3)
    before = _state(model)
    with pytest.raises(ValueError, match=r"different values.*dec\.weight.*enc\.weight"):
        hf.load_pretrained(model, str(path), strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the model was left untouched"
    one = tmp_path / "one"
    one.mkdir()
    save_file({"enc.weight": x}, str(one / "model.safetensors"))
    report = hf.load_pretrained(model, str(one), strict=strict)
    assert torch.equal(model.shared.weight, x) and model.head.weight is model.shared.weight
    assert not report.missing and report.tied == {"shared.weight": "enc.weight", "dec.weight": "enc.weight", "head.weight": "enc.weight"}
    same = tmp_path / "same"
    same.mkdir()
    save_file({"enc.weight": y, "dec.weight": y.clone(), "head.weight": y.clone()}, str(same / "model.safetensors"))
    hf.load_pretrained(model, str(same), strict=strict)
    assert torch.equal(model.shared.weight, y)


def _tied_fsdp_job(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Tied(7, vocab=12)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    try:
        hf.load_pretrained(model, path)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_tied_weights_differing_in_one_ranks_shard_fail_on_every_rank(tmp_path):
    from dist_harness import run_ranks

    src = Tied(0, vocab=12)
    embed = src.embed.weight.detach().clone()
    head = embed.clone()
    head[-1, -1] += 1.0  # only in the last rows: rank 1's shard under FSDP2 at 2 ranks
    _tied_file(tmp_path / "differ", embed, head, src.norm)
    outcomes = run_ranks(_tied_fsdp_job, 2, tmp_path, str(tmp_path / "differ"))
    assert outcomes[0] == outcomes[1] and "different values" in outcomes[0], outcomes


def test_save_pretrained_refuses_integer_and_bool_dtypes_for_floating_weights(tmp_path):
    model = _model(0)
    for dtype in (torch.int8, torch.bool, torch.int64):
        out = tmp_path / f"pub-{dtype}".replace("torch.", "")
        with pytest.raises(TypeError, match=rf"'0\.weight'.*torch\.float32.*{dtype}"):
            hf.save_pretrained(model, str(out), dtype=dtype)
        assert not out.exists(), "nothing published"
    # The offline exports refuse the same casts.
    distckpt.Checkpointer(tmp_path / "ck", save_rng=False).save(1, {"model": model})
    with pytest.raises(TypeError, match=r"0\.weight.*torch\.int8"):
        hf_convert.export_hf(locate(str(tmp_path / "ck")), str(tmp_path / "hf"), dtype=torch.int8)
    with pytest.raises(TypeError, match=r"0\.weight.*torch\.bool"):
        convert.export_safetensors(locate(str(tmp_path / "ck")), str(tmp_path / "x.safetensors"), dtype=torch.bool)
    with pytest.raises(TypeError, match=r"0\.weight.*torch\.int8"):
        convert.export_torch(locate(str(tmp_path / "ck")), str(tmp_path / "x.pt"), dtype=torch.int8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    # Floating-point casts still work; integer tensors are never cast.
    hf.save_pretrained(model, str(tmp_path / "bf16"), dtype=torch.bfloat16)


class Reserved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("__metadata__", nn.Parameter(torch.ones(3)))
        self.lin = nn.Linear(2, 2)


def test_a_tensor_named_like_the_safetensors_metadata_is_refused_at_save(tmp_path):
    with pytest.raises(ValueError, match="'__metadata__'.*reserved"):
        hf.save_pretrained(Reserved(), str(tmp_path / "pub"))
    assert not (tmp_path / "pub").exists()
    # The same name reached by removing a prefix, in the offline exports.
    distckpt.Checkpointer(tmp_path / "ck", save_rng=False).save(1, {"model": {"x.__metadata__": torch.ones(2), "x.w": torch.ones(2)}})
    with pytest.raises(ValueError, match="'__metadata__'.*reserved"):
        convert.export_safetensors(locate(str(tmp_path / "ck")), str(tmp_path / "x.safetensors"), key="model.x")
    with pytest.raises(ValueError, match="'__metadata__'.*reserved"):
        hf_convert.export_hf(locate(str(tmp_path / "ck")), str(tmp_path / "hf"), key="model.x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def _two_shards(folder, value: float) -> None:
    """a in the first shard; b then c in the second."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.full((4,), value)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.full((4,), value + 1), "c": torch.full((4,), value + 2)}, str(folder / "model-00002-of-00002.safetensors"))
    files = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": files}))


class ABC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.zeros(4)) for _ in range(3))


@pytest.mark.parametrize("remote", [False, True])
def test_a_shard_replaced_during_a_load_is_an_error_not_other_tensors_bytes(tmp_path, remote):
    """The headers are parsed first and the data read later by reopening each file: a shard
    renamed in between with its tensors in another order (a concurrent publish) gave b the bytes
    of c, silently. key_map runs between the two: the hook for that moment. Found by a helper
    (2026-11-29)."""
    import fsspec

    src = tmp_path / "src"
    _two_shards(src, 100.0)
    shard = "model-00002-of-00002.safetensors"
    if remote:
        fs = fsspec.filesystem("memory")
        base = f"/hf-{tmp_path.name}"
        for f in src.iterdir():
            fs.pipe(f"{base}/{f.name}", f.read_bytes())
        path = f"memory://{base}"
    else:
        path = str(src)
    from distckpt.tools.safetensors_io import header_bytes

    # The same size, its tensors in the other order (safetensors' own writer sorts them).
    swapped = tmp_path / "swapped.safetensors"
    c, b = torch.full((4,), 777.0), torch.full((4,), 888.0)
    swapped.write_bytes(header_bytes([("c", c.dtype, c.shape), ("b", b.dtype, b.shape)], {}) + c.numpy().tobytes() + b.numpy().tobytes())

    def replace_then(name: str) -> str:
        if remote:
            fs.pipe(f"{base}/{shard}", swapped.read_bytes())
        else:
            shutil.copy(swapped, src / (shard + ".new"))
            (src / (shard + ".new")).replace(src / shard)
        return name

    model = ABC()
    with pytest.raises(distckpt.IntegrityError, match=r"model-00002-of-00002\.safetensors: the file changed while it was loaded") as info:
        hf.load_pretrained(model, path, key_map=replace_then)
    assert "load again before using the state" in str(info.value)  # a was read in place
    assert torch.equal(model.b, torch.zeros(4)) and torch.equal(model.c, torch.zeros(4)), "nothing of the changed file was used"
    report = hf.load_pretrained(model, path)  # the folder as it is now: one consistent read
    assert report.loaded == 3 and torch.equal(model.b, torch.full((4,), 888.0)) and torch.equal(model.c, torch.full((4,), 777.0))


def _ranks_differ_job(rank: int, world: int, base: str, case: str) -> str:
    model = ABC()
    kwargs: dict = {}
    path = f"{base}/one"
    if case == "strict":
        kwargs["strict"] = rank == 0
    elif case == "key_map":
        kwargs["key_map"] = (lambda k: k) if rank == 0 else (lambda k: None if k == "b" else k)
        kwargs["strict"] = False
    else:  # each rank its node's own copy; rank 1's is of another layout
        path = f"{base}/node{rank}"
    try:
        hf.load_pretrained(model, path, **kwargs)
    except ValueError as exc:
        assert torch.equal(model.a, torch.zeros(4)), "refused before anything was read"
        return str(exc)
    return "loaded"


@pytest.mark.parametrize("case", ["strict", "key_map", "files"])
def test_ranks_that_differ_fail_alike_before_reading(tmp_path, case):
    """Ranks passing different ``strict`` hung: the strict ones raised the missing key, the
    others waited in the read until the process group's timeout. A key_map that differs by rank,
    or per-node copies of different layouts, loaded a mix silently. Found by a helper
    (2026-11-29)."""
    from dist_harness import run_ranks

    from distckpt.tools.safetensors_io import header_bytes

    one = tmp_path / "one"
    one.mkdir()
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, str(one / "model.safetensors"))  # lacks c
    if case == "files":
        a, b, c = (torch.full((4,), float(i)) for i in range(3))
        for rank, order in enumerate([(a, b, c), (c, b, a)]):
            node = tmp_path / f"node{rank}"
            node.mkdir()
            names = "abc" if rank == 0 else "cba"
            body = b"".join(t.numpy().tobytes() for t in order)
            (node / "model.safetensors").write_bytes(header_bytes([(n, t.dtype, t.shape) for n, t in zip(names, order)], {}) + body)
    got = run_ranks(_ranks_differ_job, 2, tmp_path, str(tmp_path), case, timeout=120)
    expect = {"strict": "strict: True on ranks 0; False on ranks 1", "key_map": "key mapping", "files": "files (digest of their headers)"}[case]
    for msg in got:
        assert "the ranks called load_pretrained(" in msg and expect in msg, msg


def _publish_differ_job(rank: int, world: int, out: str, case: str) -> str:
    torch.manual_seed(0)
    model = ABC()
    kwargs: dict = {"max_shard_size": "20B" if rank == 0 else "5GB"} if case == "max_shard_size" else {}
    if case == "dtype":
        kwargs["dtype"] = torch.bfloat16 if rank == 0 else None
    if case == "on_replica_drift":
        kwargs["on_replica_drift"] = "error" if rank == 0 else "warn"
    try:
        return repr(hf.save_pretrained(model, out, **kwargs)["files"])
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("case", ["max_shard_size", "dtype", "on_replica_drift"])
def test_publishing_ranks_that_differ_fail_alike_and_publish_nothing(tmp_path, case):
    """Ranks passing different max_shard_size (a per-node config) each wrote the shards of their
    own layout: the folder was committed with an index naming shards no rank wrote, and no error
    anywhere (from_pretrained then failed on a missing file). Found by a helper (2026-12-06)."""
    from dist_harness import run_ranks

    out = tmp_path / "pub"
    got = run_ranks(_publish_differ_job, 2, tmp_path, str(out), case, timeout=120)
    for msg in got:
        assert "the ranks called save_pretrained(" in msg and f"{case}:" in msg, msg
    assert not out.exists()


def test_careless_arguments_are_refused_not_ignored(tmp_path, monkeypatch):
    """An empty path (an unset variable) loaded whatever the working directory held; storage
    options with a local path, and strip_prefix beside key_map, were ignored. Found by a helper
    (2026-11-29); Checkpointer refuses the same for its root."""
    save_file({"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    model = ABC()
    with pytest.raises(ValueError, match=r"path must be a local path or an fsspec URL.*got ''"):
        hf.load_pretrained(model, "")
    with pytest.raises(ValueError, match=r"storage_options configure the filesystem of a URL.*local path"):
        hf.load_pretrained(model, str(tmp_path), storage_options={"anon": True})
    with pytest.raises(ValueError, match=r"key_map replaces strip_prefix and add_prefix"):
        hf.load_pretrained(model, str(tmp_path), strip_prefix="x.", key_map=lambda k: k)
    with pytest.raises(ValueError, match=r"out must be a local path"):
        hf.save_pretrained(model, "  ")
    assert torch.equal(model.a, torch.zeros(4))
    hf.load_pretrained(model, ".")  # the working directory, named
    assert torch.equal(model.a, torch.ones(4))


def _pipeline_stage_job(rank: int, world: int, path: str) -> list:
    stage = nn.Module()
    if rank == 0:
        stage.a = nn.Parameter(torch.zeros(4))
    else:
        stage.b, stage.c = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    report = hf.load_pretrained(stage, path)
    return [report.loaded, sorted(k for k, v in stage.state_dict().items() if torch.equal(v, torch.ones(4)))]


def test_pipeline_stages_load_their_parts(tmp_path):
    """Each rank a different stage of the model: the comparison of ranks' key mappings took the
    mapping of each rank's own keys, which differs by stage, and refused the load. It compares
    where the checkpoint's keys go. Found by a helper reviewing the check (2026-11-29)."""
    from dist_harness import run_ranks

    save_file({"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    assert run_ranks(_pipeline_stage_job, 2, tmp_path, str(tmp_path), timeout=120) == [[1, ["a"]], [2, ["b", "c"]]]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_key_renamed_onto_a_skipped_keys_name_gets_the_renamed_tensor(tmp_path, sharded):
    """Model surgery with key_map (drop layer 1 of 3, shift layer 2 down): checkpoint key l.2 is
    mapped to the model's l.1, the checkpoint's own l.1 skipped (None, strict=False). Both went
    under the name l.1 to the reader, and the one listed last in the files (l.1 sorts after l.2
    in one file) filled the model's l.1, reported 'unexpected' (unused). Found by a helper."""
    saved = {f"l.{i}": torch.full((4,), float(i)) for i in range(3)}
    if sharded:
        tmp_path.mkdir(exist_ok=True)
        save_file({"l.0": saved["l.0"], "l.2": saved["l.2"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
        save_file({"l.1": saved["l.1"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
        weight_map = {"l.0": "model-00001-of-00002.safetensors", "l.2": "model-00001-of-00002.safetensors", "l.1": "model-00002-of-00002.safetensors"}
        (tmp_path / INDEX_NAME).write_text(__import__("json").dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(saved, str(tmp_path / "model.safetensors"))

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.ParameterList([nn.Parameter(torch.zeros(4)) for _ in range(2)])

    model = Two()
    report = hf.load_pretrained(model, str(tmp_path), strict=False, key_map={"l.0": "l.0", "l.1": None, "l.2": "l.1"}.get)
    assert torch.equal(model.l[0], saved["l.0"]) and torch.equal(model.l[1], saved["l.2"])
    assert report.loaded == 2 and report.unexpected == ["l.1"] and not report.missing


@pytest.mark.parametrize("index", ["transformers", "diffusers"])
def test_a_sharded_folder_on_a_store_imports(tmp_path, index):
    """`convert URL --to dcp` of a sharded folder on an object store (memory:// here) downloaded
    the shards without their index, and the download was refused as an unfinished publish."""
    local = tmp_path / "hf"
    hf.save_pretrained(_model(9), str(local), max_shard_size=1000)
    if index == "diffusers":
        _as_diffusers(local)
    import fsspec

    url = f"memory://{tmp_path.name}-{index}/hf"
    fs = fsspec.filesystem("memory")
    for f in local.iterdir():
        fs.pipe(f"{url}/{f.name}", f.read_bytes())
    hf_convert.import_hf(url, str(tmp_path / "ck"))
    fresh = _model(5)
    distckpt.Checkpointer(str(tmp_path / "ck")).load({"model": fresh})
    assert all(torch.equal(v, _model(9).state_dict()[k]) for k, v in fresh.state_dict().items())


def test_load_pretrained_refuses_destinations_it_cannot_fill(tmp_path):
    """As Checkpointer.load does: a model built on the meta device (to_empty() forgotten)
    returned 'loaded' with every weight still on meta; an expand()ed buffer failed half-way with
    torch's error naming no key; an overlapping as_strided window loaded silently wrong."""
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"lin.weight": torch.ones(4, 4), "lin.bias": torch.ones(4), "buf": torch.arange(12.0).reshape(3, 4)}, str(src / "model.safetensors"))

    class M(nn.Module):
        def __init__(self, buf: torch.Tensor) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("buf", buf)

    with torch.device("meta"):
        meta = M(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"into tensors on the meta device: 'buf', 'lin.weight'.*to_empty"):
        distckpt.load_pretrained(meta, str(src))
    for buf in (torch.zeros(1, 4).expand(3, 4), torch.zeros(16).as_strided((3, 4), (2, 1))):
        m = M(buf)
        before = m.lin.weight.detach().clone()
        with pytest.raises(ValueError, match=r"cannot load 'buf' of .* into a tensor whose elements share memory"):
            distckpt.load_pretrained(m, str(src))
        assert torch.equal(m.lin.weight, before)  # refused before anything was read


def test_a_key_map_that_is_no_function_or_returns_no_key_is_named(tmp_path):
    """A dict (transformers' from_pretrained takes key_mapping as one) failed as "'dict' object
    is not callable", a key_map returning a list as "unhashable type: 'list'", naming neither
    key_map nor the key. Found by a helper (2026-12-07, /tmp/attack115)."""
    from safetensors.torch import save_file

    model = nn.Linear(2, 2)
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TypeError, match=r"key_map must be a function .* got dict; for a dict of exact keys pass key_map=mapping.get"):
        hf.load_pretrained(model, str(tmp_path), key_map={"weight": "weight"})
    with pytest.raises(TypeError, match=r"key_map\('(weight|bias)'\) returned list; it must return the model key \(str\) or None"):
        hf.load_pretrained(model, str(tmp_path), key_map=lambda k: [k])
    assert not hf.load_pretrained(model, str(tmp_path), key_map={"weight": "weight", "bias": "bias"}.get).missing
