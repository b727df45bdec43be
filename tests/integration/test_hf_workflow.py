"""The fine-tuning workflow with a real ``transformers`` model (built from a config, no downloads):
Hugging Face weights -> FSDP2 at 2 ranks -> train -> distckpt save -> resume at 3 ranks (which
also loads the Hugging Face weights at 3 ranks, into a model an eval forward left unsharded) ->
publish Hugging Face weights from the job -> ``from_pretrained`` gives equal logits.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import distckpt  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from distckpt.tools import hf  # noqa: E402

pytestmark = pytest.mark.xdist_group("hf_workflow")


def _config():
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip


def _model(seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config())


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(1000 + step))


def _fsdp(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _job(rank: int, world: int, hf_dir: str, root: str, pub: str, phase: str) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    model = _fsdp(_model(100 + rank), world)  # random init differs per rank: the load must overwrite it
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = distckpt.Checkpointer(root)
    out: dict = {}
    if phase == "start":
        report = hf.load_pretrained(model, hf_dir)
        out["report"] = (report.loaded, report.missing, report.unexpected, report.tied, report.bytes_read)
        out["loaded"] = _full(model)
        for step in range(2):
            loss = model(_tokens(step), labels=_tokens(step)).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
        ckpt.save(2, {"model": model, "optim": optim})
    else:
        # Hugging Face weights at 3 ranks (uneven shards), into a model an eval forward left
        # unsharded: load_pretrained must reshard first, or the next forward uses stale weights.
        with torch.no_grad():
            model(_tokens(98))
        report = hf.load_pretrained(model, hf_dir)
        out["report"] = (report.loaded, report.missing, report.unexpected, report.tied, report.bytes_read)
        out["loaded"] = _full(model)
        with torch.no_grad():
            out["pretrained_logits"] = model(_tokens(99)).logits
        assert ckpt.load({"model": model, "optim": optim}) == 2
    out["trained"] = _full(model)
    with torch.no_grad():
        out["logits"] = model(_tokens(99)).logits
    out["published"] = hf.save_pretrained(model, pub, config=model.config, max_shard_size="40KB")
    ckpt.close()
    return out


def test_hf_weights_fsdp2_train_resume_publish(tmp_path):
    hf_dir, root = str(tmp_path / "hf"), str(tmp_path / "ck")
    ref = _model(0)
    ref.save_pretrained(hf_dir, max_shard_size="40KB", safe_serialization=True)
    model_bytes = sum(v.numel() * v.element_size() for k, v in ref.state_dict().items() if k != "lm_head.weight")

    started = run_ranks(_job, 2, tmp_path, hf_dir, root, str(tmp_path / "pub2"), "start")
    expected = ref.state_dict()
    for r, res in enumerate(started):
        loaded, missing, unexpected, tied, bytes_read = res["report"]
        assert (missing, unexpected) == ([], []) and tied == {"lm_head.weight": "model.embed_tokens.weight"}
        for k, v in expected.items():
            assert torch.equal(res["loaded"][k], v), f"rank {r}: {k} after load_pretrained"
        # FSDP2: each rank read its row shards only, about half of the model, never all of it
        assert bytes_read <= 0.6 * model_bytes, (r, bytes_read, model_bytes)
    assert sum(res["report"][4] for res in started) >= model_bytes

    resumed = run_ranks(_job, 3, tmp_path, hf_dir, root, str(tmp_path / "pub3"), "resume")
    with torch.no_grad():
        ref_logits = ref(_tokens(99)).logits
    for r, res in enumerate(resumed):
        loaded, missing, unexpected, tied, bytes_read = res["report"]
        assert (missing, unexpected) == ([], []) and tied == {"lm_head.weight": "model.embed_tokens.weight"}
        for k, v in expected.items():
            assert torch.equal(res["loaded"][k], v), f"rank {r} of 3: {k} after load_pretrained"
        assert torch.allclose(res["pretrained_logits"], ref_logits, rtol=1e-5, atol=1e-6), f"rank {r}: stale weights in the forward"
        assert bytes_read <= 0.45 * model_bytes, (r, bytes_read, model_bytes)
    assert sum(res["report"][4] for res in resumed) >= model_bytes
    for k, v in started[0]["trained"].items():
        assert torch.equal(resumed[0]["trained"][k], v), f"resumed at 3 ranks: {k}"

    for pub, res in ((tmp_path / "pub2", started[0]), (tmp_path / "pub3", resumed[0])):
        assert res["published"]["files"][0] == "model-00001-of-%05d.safetensors" % len(res["published"]["files"])
        loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(pub), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        with torch.no_grad():
            logits = loaded(_tokens(99)).logits
        assert torch.allclose(logits, res["logits"], rtol=1e-5, atol=1e-6)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in res["trained"].items())
        assert not any(p.name.startswith("pub") and ".tmp-" in p.name for p in tmp_path.iterdir())


def _ddp_job(rank: int, world: int, hf_dir: str, pub: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(100 + rank))  # DDP broadcasts rank 0's init; the load must overwrite it
    report = hf.load_pretrained(model, hf_dir)
    loaded = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(_tokens(rank), labels=_tokens(rank)).loss  # each rank its own batch
    loss.backward()  # DDP averages the gradients: the replicas stay equal
    optim.step()
    published = hf.save_pretrained(model, pub, config=model.module.config)
    with torch.no_grad():
        logits = model.module(_tokens(99)).logits
    return {"report": (report.missing, report.unexpected, report.tied), "loaded": loaded, "logits": logits, "files": published["files"]}


def test_hf_weights_into_ddp_and_published_from_ddp(tmp_path):
    hf_dir, pub = str(tmp_path / "hf"), str(tmp_path / "pub")
    ref = _model(0)
    ref.save_pretrained(hf_dir, max_shard_size="40KB", safe_serialization=True)
    results = run_ranks(_ddp_job, 2, tmp_path, hf_dir, pub)
    for r, res in enumerate(results):
        assert res["report"] == ([], [], {"lm_head.weight": "model.embed_tokens.weight"}), (r, res["report"])
        for k, v in ref.state_dict().items():
            assert torch.equal(res["loaded"][k], v), f"rank {r}: {k} after load_pretrained through DDP"
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(pub, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # no "module." prefixes
    with torch.no_grad():
        assert torch.allclose(loaded(_tokens(99)).logits, results[0]["logits"], rtol=1e-5, atol=1e-6)
    assert torch.equal(results[0]["logits"], results[1]["logits"])


def test_key_mapping_strict_and_dtype(tmp_path):
    untied_config = transformers.LlamaConfig(**{**_config().to_dict(), "tie_word_embeddings": False})
    torch.manual_seed(0)
    untied = transformers.LlamaForCausalLM(untied_config)
    untied.save_pretrained(str(tmp_path / "untied"), safe_serialization=True)
    # A bare LlamaModel: strip "model."; the checkpoint's lm_head.weight is then unexpected.
    bare = transformers.LlamaModel(_config())
    with pytest.raises(distckpt.StateMismatchError, match="unexpected keys .*lm_head.weight"):
        hf.load_pretrained(bare, str(tmp_path / "untied"), strip_prefix="model.")
    report = hf.load_pretrained(bare, str(tmp_path / "untied"), strip_prefix="model.", strict=False)
    assert report.unexpected == ["lm_head.weight"] and not report.missing
    assert torch.equal(bare.embed_tokens.weight, untied.model.embed_tokens.weight)
    # Missing keys follow strict like Checkpointer.load: a tied checkpoint has no lm_head.weight.
    ref = _model(0)
    ref.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    with pytest.raises(distckpt.StateMismatchError, match="missing keys .*lm_head.weight"):
        hf.load_pretrained(transformers.LlamaForCausalLM(untied_config), str(tmp_path / "hf"))
    # Publishing in bf16: files hold bf16, and the loader casts back into an fp32 model.
    hf.save_pretrained(ref, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    again = _model(5)
    hf.load_pretrained(again, str(tmp_path / "bf16"))
    assert torch.equal(again.model.norm.weight, ref.model.norm.weight.bfloat16().float())
    with pytest.raises(FileExistsError):
        hf.save_pretrained(ref, str(tmp_path / "bf16"))


def test_hf_from_and_to_s3(tmp_path, s3_server, s3_bucket):
    opts = s3_server.storage_options
    ref = _model(0)
    url = f"s3://{s3_bucket}/pub"
    hf.save_pretrained(ref, url, storage_options=opts, config=ref.config, max_shard_size="40KB")
    fresh = _model(3)
    report = hf.load_pretrained(fresh, url, storage_options=opts)
    assert report.loaded and not report.missing
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), fresh.state_dict().values()))
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    fs.get(f"{s3_bucket}/pub/", str(tmp_path / "dl"), recursive=True)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "dl"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(loaded(_tokens(1)).logits, ref(_tokens(1)).logits)


def test_cli_hf_export_and_import(tmp_path):
    from cli_runner import run_cli

    model = _model(0)  # tied embeddings
    root = str(tmp_path / "ck")
    distckpt.Checkpointer(root).save(4, {"model": model, "optim": torch.optim.AdamW(model.parameters())})

    def cli(*args):
        done = run_cli(*args, "-q")
        assert done.returncode == 0, done.stderr
        return done

    out = tmp_path / "hf"
    cli("convert", root, "--to", "hf", str(out), "--key", "model", "--max-shard-size", "40KB")
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    _config().save_pretrained(str(out))
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.equal(loaded(_tokens(3)).logits, model(_tokens(3)).logits)
    # Back: a Hugging Face directory (saved by transformers, tied: no lm_head.weight in it)
    model.save_pretrained(str(tmp_path / "hf2"), safe_serialization=True)
    cli("convert", str(tmp_path / "hf2"), "--to", "dcp", str(tmp_path / "imported"))
    fresh = _model(9)
    assert distckpt.Checkpointer(str(tmp_path / "imported")).load({"model": fresh}) == 0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
