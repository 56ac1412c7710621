"""Where LoRA adapters go over tp (:mod:`fxshard.plan.lora`): the placements each gets from its base, the rank files'
notation for them, a peft model file and ``--lora`` compiling to one program, and the refusals at tp > 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.compiler import compile_program
from fxshard.driver import compile as compile_model
from fxshard.errors import PlanError
from fxshard.ir.context import spec
from fxshard.ir.layout import Layout
from fxshard.ir.placement import Replicate, Shard

MODELS = Path(__file__).resolve().parents[1] / "models"
LLAMA, PEFT_LLAMA = MODELS / "lora_llama.py", MODELS / "peft_llama.py"
GPT2 = Path(__file__).resolve().parents[2] / "samples" / "gpt2.py"
LAYER = "base_model.model.model.layers.0"


def _placements(result) -> dict[str, object]:
    """Parameter FQN -> its placement over tp."""
    state = result.ctx.program.state_by_name()
    return {state[n.name].fqn: spec(n).placement for n in result.gm.graph.nodes
            if n.op == "placeholder" and n.name in state and state[n.name].kind == "parameter"}


def test_adapters_follow_their_bases_split():
    result = compile_program(LLAMA, Layout(tp=2, lora=4, lora_targets="q_proj,o_proj,up_proj,down_proj"))
    got = _placements(result)
    for column in ("self_attn.q_proj", "mlp.up_proj"):  # B split on its output as the base, A whole
        assert got[f"{LAYER}.{column}.base_layer.weight"] == Shard(0)
        assert got[f"{LAYER}.{column}.lora_B.default.weight"] == Shard(0)
        assert got[f"{LAYER}.{column}.lora_A.default.weight"] == Replicate()
    for row in ("self_attn.o_proj", "mlp.down_proj"):  # A split on its input as the base, B whole
        assert got[f"{LAYER}.{row}.base_layer.weight"] == Shard(1)
        assert got[f"{LAYER}.{row}.lora_A.default.weight"] == Shard(1)
        assert got[f"{LAYER}.{row}.lora_B.default.weight"] == Replicate()
    plan = dict(line.split(": ", 1) for line in result.ctx.plan.describe())
    assert plan[f"{LAYER}.self_attn.q_proj.lora_B.default"] == "colwise()  [lora]"
    assert plan[f"{LAYER}.self_attn.o_proj.base_layer"] == "rowwise()  [model]"


@pytest.mark.slow  # GPT-2's 4 layers
def test_a_packed_conv1d_base_splits_its_adapter_by_the_same_blocks():
    got = _placements(compile_program(GPT2, Layout(tp=2, lora=4, lora_targets="c_attn,c_proj")))
    prefix = "base_model.model.transformer.h.0"
    assert got[f"{prefix}.attn.c_attn.base_layer.weight"] == Shard(1, 3)  # Conv1D: [in, out], q|k|v
    assert got[f"{prefix}.attn.c_attn.lora_B.default.weight"] == Shard(0, 3)  # Linear: [out, r]
    assert got[f"{prefix}.attn.c_proj.lora_A.default.weight"] == Shard(1)
    assert got[f"{prefix}.mlp.c_proj.lora_B.default.weight"] == Replicate()


@pytest.mark.slow  # the rank files generated and checked
def test_the_rank_file_shows_the_adapters_in_the_usual_notation(tmp_path):
    result = compile_model(LLAMA, Layout(tp=2, lora=4, lora_targets="q_proj,o_proj"), out=tmp_path)
    code = result.sources["rank_pp0_tp1.py"]
    lines = code.splitlines()
    b = next(x for x in lines if "self.self_attn_q_proj_lora_B_default_weight = " in x)
    assert "torch.empty((16, 4)" in b and "S(0) on tp  global [32, 4]" in b and "frozen" not in b
    a = next(x for x in lines if "self.self_attn_o_proj_lora_A_default_weight = " in x)
    assert "torch.empty((4, 16)" in a and "S(1) on tp" in a
    base = next(x for x in lines if "self.self_attn_q_proj_base_layer_weight = " in x)
    assert base.rstrip().endswith("frozen")
    assert "# self_attn.o_proj.lora_B.default  Linear  LoRA B, whole" in code
    # the row-parallel adapter's partial sums [tokens, r] are reduced before B, the base's before the sum
    assert "all_reduce(linear_6, self.tp)" in code and "[4, 16, 4] f32 P(sum) -> R" in code


@pytest.mark.slow  # two compiles
def test_a_peft_model_file_and_the_lora_flags_compile_to_one_program():
    flags = compile_program(LLAMA, Layout(tp=2, lora=4, lora_alpha=8, lora_targets="q_proj,v_proj,o_proj,down_proj"))
    wrapped = compile_program(PEFT_LLAMA, Layout(tp=2))
    assert flags.gm.code == wrapped.gm.code
    assert flags.ctx.plan.describe() == wrapped.ctx.plan.describe()
    assert _placements(flags) == _placements(wrapped)
    ours, theirs = flags.ctx.program.tensors, wrapped.ctx.program.tensors
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)


def test_lora_on_a_vocab_parallel_embedding_is_refused_naming_it():
    with pytest.raises(PlanError, match=r"base_model\.model\.model\.embed_tokens: LoRA on this Embedding has no "
                                        r"split rule at tp=2"):
        compile_program(LLAMA, Layout(tp=2, lora=4, lora_targets="embed_tokens,q_proj"))


def test_lora_on_an_embedding_compiles_at_tp1():
    result = compile_program(LLAMA, Layout(lora=4, lora_targets="embed_tokens"))
    assert any("lora_embedding_A" in fqn for fqn in _placements(result))
