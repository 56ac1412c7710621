"""``--lora`` builds the peft model before capture (:mod:`fxshard.capture.lora`); its options are refused, before
anything is captured, where they cannot mean anything: a rank below 1, LoRA flags without ``--lora``, targets that
match no module (naming them and the module names there are), a target that is no layer LoRA adapts, and ``--lora``
on a model that is a peft model already."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.capture.lora import LoraError, LoraOptions, base_name, target_pattern
from fxshard.capture.modelfile import load_model_file
from fxshard.errors import LayoutError
from fxshard.ir.layout import Layout

MODELS = Path(__file__).resolve().parent / "models"
LLAMA, PEFT_LLAMA = MODELS / "lora_llama.py", MODELS / "peft_llama.py"


@pytest.mark.parametrize("rank", [0, -4])
def test_a_rank_below_one_is_refused(rank):
    with pytest.raises(LayoutError, match=rf"--lora {rank}: a LoRA rank .* must be at least 1"):
        Layout(lora=rank)


def test_lora_options_without_a_rank_are_refused():
    with pytest.raises(LayoutError, match="--lora-alpha, --lora-targets set up LoRA adapters, and --lora"):
        Layout(lora_alpha=32, lora_targets="q_proj")


def test_targets_matching_no_module_are_named_with_the_modules_there_are():
    mf = load_model_file(LLAMA, LoraOptions(4, targets=("q_proj", "qkv_proj", "layers.9.*")))
    with pytest.raises(LoraError, match=r"--lora-targets qkv_proj,layers\.9\.\* match no module of LlamaForCausalLM; "
                                        r".*named down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj"):
        mf.build_model(0)


def test_a_target_that_is_not_a_layer_lora_adapts_is_refused():
    mf = load_model_file(LLAMA, LoraOptions(4, targets=("self_attn",)))
    with pytest.raises(LoraError, match=r"match model\.layers\.0\.self_attn \(LlamaAttention\), which is not a layer"):
        mf.build_model(0)


def test_lora_on_a_peft_model_is_refused():
    with pytest.raises(LoraError, match="returns a peft model already"):
        load_model_file(PEFT_LLAMA, LoraOptions(4)).build_model(0)


def test_globs_and_names_adapt_the_modules_peft_would():
    model = load_model_file(LLAMA, LoraOptions(4, 16, ("layers.0.*.q_proj", "down_proj"))).build_model(0)
    adapted = sorted({n.rsplit(".lora_A", 1)[0] for n, p in model.named_parameters() if ".lora_A." in n})
    assert adapted == ["base_model.model.model.layers.0.mlp.down_proj",
                       "base_model.model.model.layers.0.self_attn.q_proj",
                       "base_model.model.model.layers.1.mlp.down_proj"]
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)
    assert not __import__("re").fullmatch(target_pattern("q_proj"), "model.layers.0.self_attn.xq_proj")


def test_adapters_are_drawn_alike_on_a_meta_base_and_a_real_one():
    mf = load_model_file(LLAMA, LoraOptions(4, targets=("q_proj",)))
    real, meta = mf.build_model(0), mf.build_model(0, meta=True)
    adapters = {n: p for n, p in real.named_parameters() if ".lora_" in n}
    on_meta = dict(meta.named_parameters())
    assert adapters and all(on_meta[n].equal(p) for n, p in adapters.items())
    assert on_meta["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].is_meta
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
