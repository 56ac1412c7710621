"""LoRA adapters trained at every layout exactly as the same peft model on one device (issue 44, section 3).

Each case compiles a tiny Llama (or GPT-2, whose ``Conv1D`` bases are packed q/k/v and row-parallel projections) with
``--lora``, trains 3 AdamW steps on real gloo process groups and compares with the peft-wrapped model trained on one
device: losses within 1e-5 relative, parameters within 1e-3 of the single-device update (``fxshard verify``'s
measure; the frozen base contributes nothing to either), and every base weight bit-identical to its initial value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import assert_matches_single_device, compile_and_train, single_device

from fxshard.capture.modelfile import load_model_file
from fxshard.check.verify import gather_parameters
from fxshard.ir.layout import Layout
from fxshard.testing import case_result, matrix, selected_cases
from fxshard.train.optim import OptimConfig

MODELS = Path(__file__).resolve().parent / "models"
LLAMA, PEFT_LLAMA, GPT2 = MODELS / "lora_llama.py", MODELS / "peft_llama.py", \
    Path(__file__).resolve().parents[1] / "samples" / "gpt2.py"
ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
STEPS, REL, BF16_REL = 3, 1e-5, 2e-2


def lora(targets: str = ALL, **layout) -> Layout:
    return Layout(lora=4, lora_alpha=8, lora_targets=targets, **layout)


CASES = {
    "llama-tp2": (LLAMA, lora(tp=2)),
    "llama-pp2": (LLAMA, lora(pp=2)),
    "llama-dp2-zero1": (LLAMA, lora(dp=2, zero=1)),
    "llama-dp2-zero3": (LLAMA, lora(dp=2, zero=3)),
    "llama-tp2-dp2-zero1": (LLAMA, lora(tp=2, dp=2, zero=1)),
    "llama-pp2-dp2-zero3": (LLAMA, lora(pp=2, dp=2, zero=3)),
    "llama-tp2-pp2-dp2-zero1": (LLAMA, lora(tp=2, pp=2, dp=2, zero=1)),  # world 8: all three axes at once
    "llama-tp2-sp": (LLAMA, lora(tp=2, sp=True)),
    "llama-tp2-dropout": (LLAMA, lora("q_proj,o_proj,gate_proj,down_proj", tp=2, lora_dropout=0.1)),
    "llama-dp2-zero2-bf16": (LLAMA, lora(dp=2, zero=2, dtype="bf16")),
    "gpt2-tp2": (GPT2, lora("c_attn,c_proj,c_fc", tp=2)),
    "peft-llama-tp2": (PEFT_LLAMA, Layout(tp=2)),
}
# make test's representatives: tp (column and row bases), pp with ZeRO 3, GPT-2's packed Conv1D; make test-matrix the
# rest
KEEP = ("llama-tp2", "llama-pp2-dp2-zero3", "gpt2-tp2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    chosen = {case: (path, layout, OptimConfig()) for case, (path, layout) in CASES.items()
              if case in selected_cases(request, CASES)}
    return compile_and_train(chosen, tmp_path_factory, STEPS)


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_lora_trains_as_the_peft_model_on_one_device(trained, case):
    path, layout = CASES[case]
    per_rank, manifest = case_result(trained, case)
    want, single = single_device(path, STEPS, OptimConfig(), layout.dtype, layout)
    assert_matches_single_device(case, path, layout, per_rank, manifest, want, single,
                                 BF16_REL if layout.mixed else REL)
    params = gather_parameters(manifest, states={r: st for r, (_, st, *_) in enumerate(per_rank)})
    model = load_model_file(path).for_layout(layout).build_model(0)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters), sorted(adapters)[:3]
    # the base as it started: at the compute dtype as one device's recipe holds it; FSDP2 (ZeRO 2/3) keeps its fp32
    # shards and gathers them in the compute dtype
    held = torch.float32 if layout.zero >= 2 and layout.dp > 1 else layout.compute_dtype
    for name, p in model.named_parameters():
        if name not in adapters:
            got = params[manifest.tied.get(name, name)]
            assert torch.equal(got.float(), p.detach().to(held).float()), f"{case}: {name}"
