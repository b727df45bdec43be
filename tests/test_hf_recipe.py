"""The README's fine-tuning recipe, run as written (tiny Llama, FSDP2 at 2 ranks, CPU): a model
built on the meta device, sharded, ``to_empty``, then ``load_pretrained``. Non-persistent buffers
(the rotary embedding's ``inv_freq``) are in no checkpoint: after ``to_empty`` they held
uninitialised memory, the load reported nothing missing, and the logits were wrong. The recipe
recomputes them. Found by a helper (2026-12-07)."""
from __future__ import annotations

import pathlib

import pytest
import torch

from dist_harness import run_ranks

transformers = pytest.importorskip("transformers")

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
RECOMPUTE = "model._init_weights(module)"


def _config(tied: bool = False):
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


def _recipe(rank: int, world: int, hf_dir: str, recompute: bool, tied: bool = False) -> float:
    import distckpt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = _config(tied)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.tie_weights()  # as the README says
    if recompute:  # as the README says
        for module in model.modules():
            if module._non_persistent_buffers_set:
                model._init_weights(module)
    report = distckpt.load_pretrained(model, hf_dir)
    assert not report.missing
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return float((model.eval()(x).logits - reference(x).logits).abs().max())


def test_the_readme_recipe_loads_the_weights_and_recomputes_non_persistent_buffers(tmp_path):
    assert RECOMPUTE in README.read_text(), "the README's recipe no longer recomputes non-persistent buffers"
    torch.manual_seed(0)
    hf_dir = str(tmp_path / "hf")
    transformers.AutoModelForCausalLM.from_config(_config()).save_pretrained(hf_dir)
    assert run_ranks(_recipe, 2, tmp_path, hf_dir, True, timeout=150) == [0.0, 0.0]


def test_the_readme_recipe_keeps_tied_embeddings_tied(tmp_path):
    """to_empty() unties a model's tied embeddings (lm_head.weight then is a tensor of its own,
    in no checkpoint of a tied model) where FSDP2 does not manage them (the recipe without
    fully_shard, one process): load_pretrained refused lm_head.weight as missing. The recipe ties
    them again; under FSDP2 that changes nothing."""
    import distckpt

    assert "model.tie_weights()" in README.read_text(), "the README's recipe no longer ties the weights again"
    torch.manual_seed(0)
    hf_dir = str(tmp_path / "hf")
    transformers.AutoModelForCausalLM.from_config(_config(True)).save_pretrained(hf_dir)
    assert run_ranks(_recipe, 2, tmp_path, hf_dir, True, True, timeout=150) == [0.0, 0.0]
    for tie in (False, True):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(_config(True))
        model.to_empty(device="cpu")
        if not tie:
            with pytest.raises(distckpt.StateMismatchError, match="lm_head.weight"):
                distckpt.load_pretrained(model, hf_dir)
            continue
        model.tie_weights()
        assert not distckpt.load_pretrained(model, hf_dir).missing
        assert model.lm_head.weight is model.model.embed_tokens.weight
