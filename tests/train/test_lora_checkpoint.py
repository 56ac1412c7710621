"""A LoRA compile's checkpoints hold the adapters and their Adam state alone, resume under another layout, and
export as peft saves adapters (``export --peft``, loaded by ``peft.PeftModel.from_pretrained``) or as the merged
model (``export --hf --merge``), each giving the logits of the same peft model trained on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import spawn

from fxshard.capture.modelfile import load_model_file
from fxshard.driver import compile as compile_model
from fxshard.ir.layout import Layout
from fxshard.train.checkpoint import CheckpointConfig, CheckpointError, CheckpointReader
from fxshard.train.digests import header
from fxshard.train.optim import OptimConfig

MODELS = Path(__file__).resolve().parents[1] / "models"
LLAMA = MODELS / "lora_llama.py"
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
STEPS, SAVED, REL = 4, 2, 1e-5


def _lora(**layout) -> Layout:
    return Layout(lora=4, lora_alpha=8, lora_targets=TARGETS, **layout)


def _train_saving(rank: int, world: int, out: str, steps: int, ckpt: CheckpointConfig):
    from harness import run_options

    from fxshard.train.launch import train

    return train(Path(out), run_options(steps, OptimConfig(), ckpt), log=lambda *_: None)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    batch = load_model_file(LLAMA).build_inputs(0)
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dp=2 ZeRO 1 run saving at step 2 and 4, and the same run resumed from step 2 at tp=2."""
    tmp = tmp_path_factory.mktemp("lora-ckpt")
    compile_model(LLAMA, _lora(dp=2, zero=1), out=tmp / "dp2")
    compile_model(LLAMA, _lora(tp=2), out=tmp / "tp2")
    ckpt = tmp / "ckpt"
    whole = spawn(_train_saving, 2, str(tmp / "dp2"), STEPS, CheckpointConfig(ckpt, SAVED), timeout=600)[0]
    resumed = spawn(_train_saving, 2, str(tmp / "tp2"), STEPS,
                    CheckpointConfig(ckpt / f"step-{SAVED:08d}", resume=True), timeout=600)[0]
    return tmp, ckpt, whole, resumed


@pytest.mark.distributed
def test_the_checkpoint_holds_the_adapters_and_resumes_under_another_layout(saved):
    tmp, ckpt, whole, resumed = saved
    assert len(resumed) == STEPS - SAVED
    assert all(abs(g - w) <= REL * abs(w) for g, w in zip(resumed, whole[SAVED:], strict=True)), (resumed, whole)
    reader = CheckpointReader(ckpt)
    model = load_model_file(LLAMA).for_layout(_lora()).build_model(0)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(reader.sources) == trained  # the adapters alone, each with its Adam state
    assert all(reader.has_state(n) for n in trained)
    assert reader.frozen == {n for n, _ in model.named_parameters(remove_duplicate=False)} - trained
    # the tensors' bytes (a shard's header also holds each tensor's digest, a large part of so small a model's files)
    size = sum(f.stat().st_size - 8 - len(header(f)) for f in reader.path.glob("*.safetensors"))
    every = sum(p.numel() for p in model.parameters())
    assert size < 0.2 * 12 * every  # a full checkpoint: every parameter and its two Adam moments in fp32


@pytest.mark.distributed
def test_export_peft_loads_with_peft_and_merge_gives_the_same_model(saved):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fxshard.train.export import export_hf, export_peft
    from fxshard.train.reference import reference_losses

    tmp, ckpt, whole, _ = saved
    export_peft(ckpt, tmp / "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (tmp / "adapter").iterdir()}
    base = load_model_file(LLAMA).build_model(0)  # the base as the compile built it (make_model() at seed 0)
    loaded = PeftModel.from_pretrained(base, tmp / "adapter")
    final: dict = {}
    mf = load_model_file(LLAMA).for_layout(_lora())
    assert reference_losses(mf, STEPS, OptimConfig(), final_state=final) == pytest.approx(whole, rel=REL)
    single = mf.build_model(0)
    single.load_state_dict(final)
    want = _logits(single)
    assert torch.allclose(_logits(loaded), want, rtol=0, atol=1e-5)
    export_hf(ckpt, tmp / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_logits(merged), want, rtol=0, atol=1e-5)
    with pytest.raises(CheckpointError, match="--merge"):
        export_hf(ckpt, tmp / "unmerged")
