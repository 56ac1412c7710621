"""Tier 1: where the pipeline is cut, what crosses stages, and the errors that stop a bad layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.check.rank_trace import load_rank_source
from fxshard.compiler import compile_program
from fxshard.driver import compile as compile_model
from fxshard.errors import LayoutError, PlanError
from fxshard.ir.autograd import requires_grad
from fxshard.ir.cut import balance
from fxshard.ir.layout import Coords, Layout
from fxshard.ir.stages import pipeline_stages


def _blocks(result) -> list[int]:
    return [row["blocks"] for row in result.ctx.pipeline.table]


@pytest.mark.parametrize("layout,counts", [
    (Layout(pp=2), [4, 4]),
    (Layout(pp=4), [2, 2, 2, 2]),
    (Layout(pp=2, schedule="interleaved-1f1b"), [2, 2, 2, 2]),  # 2 virtual stages per rank
    (Layout(pp=4, schedule="interleaved-1f1b"), [1] * 8),
])
def test_automatic_cut_of_uniform_model_gives_equal_block_counts(samples, layout, counts):
    result = compile_program(samples / "gpt.py", layout)
    assert result.ctx.pipeline.source == "auto"
    assert _blocks(result) == counts
    flops = [row["flops"] for row in result.ctx.pipeline.table]
    assert flops[1] == flops[-2] if len(flops) > 2 else True  # middle stages: identical blocks, identical cost


def test_balance_minimizes_the_largest_stage():
    assert balance([1.0] * 8, 4) == [2, 2, 2, 2]
    # 5 uniform blocks on 2 stages: the extra block goes where the head is not
    assert balance([1.0] * 5, 2, before=0.1, after=0.5) == [3, 2]
    assert balance([1.0] * 5, 2, before=0.5, after=0.1) == [2, 3]
    # heterogeneous blocks: costs, not counts, are balanced
    assert balance([4.0, 1.0, 1.0, 1.0, 1.0], 2) == [1, 4]


def test_marker_in_forward_sets_the_cut_and_does_nothing_eagerly(models):
    mf = load_model_file(models / "marked.py")
    model, (x, y) = mf.build()
    assert torch.isfinite(model(x, y))  # fxshard.pipeline_split() is a no-op outside compile
    # markers win over split_before and over automatic balancing
    result = compile_program(models / "marked.py", Layout(pp=3), plan={"split_before": ["layers.2", "layers.3"]})
    assert result.ctx.pipeline.source == "markers"
    assert _blocks(result) == [1, 2, 1]


def test_long_skip_connection_is_sent_through_the_stages_between(models):
    result = compile_model(models / "marked.py", Layout(pp=3))
    stage0, stage1, stage2 = pipeline_stages(result.gm, result.ctx)
    skip = next(n for n in stage0.outputs if n.name == "proj_skip")  # skip = self.proj(x), needed by the head
    assert skip in stage1.inputs and skip in stage1.outputs and skip in stage2.inputs
    assert skip in requires_grad(result.gm, result.ctx.params)
    assert "proj_skip                float32 [2, 16]  computed by proj in stage 0, passed on; gradient flows back" in \
        result.sources["rank_pp1_tp0.py"]


def test_split_before_in_the_plan_sets_the_cut(samples):
    result = compile_program(samples / "gpt.py", Layout(pp=2), plan={"split_before": ["blocks.3"]})
    assert result.ctx.pipeline.source == "split_before"
    assert _blocks(result) == [3, 5]


def test_split_before_from_a_plan_file(tmp_path, samples):
    from fxshard.compiler import load_plan_file

    plan = tmp_path / "plan.py"
    plan.write_text("SPLIT_BEFORE = ['blocks.2', 'blocks.4', 'blocks.7']\n")
    result = compile_program(samples / "gpt.py", Layout(pp=4), plan=load_plan_file(plan))
    assert _blocks(result) == [2, 2, 3, 1]


def test_rotary_tables_are_recomputed_not_sent(samples):
    result = compile_model(samples / "llama.py", Layout(pp=2))
    stage1 = pipeline_stages(result.gm, result.ctx)[1]
    assert stage1.recomputed, "stage 1 should rebuild rotary cos/sin and the causal mask from buffers"
    assert [n.name for n in stage1.inputs] == ["model_layers_1_hidden_states"]  # received: the hidden state
    assert [n.name for n in stage1.batch] == ["labels"]  # taken from its microbatch, not sent
    code = result.sources["rank_pp1_tp0.py"]
    assert "(recomputed here, not received)" in code
    assert "self.model_rotary_emb_inv_freq" in code  # the buffer lives in both stages


def test_stage_code_says_what_it_receives_and_sends(samples):
    result = compile_model(samples / "gpt.py", Layout(pp=4, tp=2))
    code = result.sources["rank_pp1_tp1.py"]
    assert "class Stage1(torch.nn.Module):" in code
    assert "# receives from stage 0 on pp rank 0 (global rank 1), per microbatch:" in code
    assert "# sends to stage 2 on pp rank 2 (global rank 5), per microbatch:" in code
    assert "INPUTS = (('blocks_1_out', (2, 16, 64), torch.float32, True),)" in code
    assert "return (blocks_3_out,)  # to stage 2" in code
    assert "BATCH" not in code  # the targets: only the last stage takes them
    last = result.sources["rank_pp3_tp1.py"]
    assert "BATCH = ('targets',)  # taken by keyword, not sent" in last
    assert "def forward(self, blocks_5_out, *, targets):" in last
    entry = result.manifest.rank(Coords(pp=1, tp=1))
    assert [s.index for s in entry.stages] == [1]
    assert result.manifest.inputs[0].shape == (8, 16)  # a step's batch; 4 microbatches of 2
    assert result.manifest.inputs[0].microbatch_shape == (2, 16)


def test_interleaved_rank_file_holds_several_stages(samples):
    result = compile_model(samples / "gpt.py", Layout(pp=2, schedule="interleaved-1f1b"))
    code = result.sources["rank_pp1_tp0.py"]
    assert "class Stage1(" in code and "class Stage3(" in code
    assert "rt.sum_tied_grads([stages[3].lm_head_weight], groups[\"tied:lm_head.weight\"])" in code


# ---------------------------------------------------------------- bad input: clear errors before launch

def test_more_stages_than_blocks(samples):
    with pytest.raises(LayoutError, match=r"--pp 16 needs 16 pipeline stages but the model has 8 repeated blocks "
                                          r"\(blocks.0 .. blocks.7, Block\).*use --pp <= 8"):
        compile_program(samples / "gpt.py", Layout(pp=16, schedule="gpipe"))


def test_batch_that_microbatches_do_not_divide(samples):
    with pytest.raises(LayoutError, match=r"--microbatches 3: the batch of 8 .*does not divide into 3 equal "
                                          r"microbatches; use --microbatches in \[2, 4, 8\]"):
        compile_program(samples / "gpt.py", Layout(pp=2, microbatches=3))


def test_fewer_microbatches_than_the_schedule_needs(samples):
    with pytest.raises(LayoutError, match=r"--microbatches 2: schedule 1f1b at pp=4 needs at least 4 microbatches"):
        compile_program(samples / "gpt.py", Layout(pp=4, microbatches=2))
    # GPipe runs any count
    assert compile_program(samples / "gpt.py", Layout(pp=4, schedule="gpipe", microbatches=2)).ctx.microbatches == 2


def test_explicit_cut_that_leaves_a_stage_empty(samples):
    with pytest.raises(PlanError, match=r"split_before: the cut before blocks.3 leaves pipeline stage 1 empty"):
        compile_program(samples / "gpt.py", Layout(pp=3, schedule="gpipe"),
                        plan={"split_before": ["blocks.3", "blocks.3"]})
    with pytest.raises(PlanError, match=r"split_before: the cuts leave pipeline stage 0 empty"):
        compile_program(samples / "gpt.py", Layout(pp=2), plan={"split_before": ["wte"]})


def test_split_before_unknown_module(samples):
    with pytest.raises(PlanError, match=r"'blocks.99' names no module .*blocks.0 .. blocks.7"):
        compile_program(samples / "gpt.py", Layout(pp=2), plan={"split_before": ["blocks.99"]})


def test_marker_count_must_match_stages(models):
    with pytest.raises(PlanError, match=r"marks 2 pipeline cut\(s\).*--pp 4 needs 3"):
        compile_program(models / "marked.py", Layout(pp=4))


def test_zero3_with_zero_bubble_is_refused_before_it_trains_wrongly():
    # torch's split backward would compute weight gradients against the resharded FSDP2 parameters
    with pytest.raises(LayoutError, match="--zero 3 with --schedule zero-bubble.*use --zero 2"):
        Layout(dp=2, pp=2, zero=3, schedule="zero-bubble")
    Layout(dp=2, pp=2, zero=2, schedule="zero-bubble")  # parameters stay gathered: trains correctly (tested)
    Layout(pp=2, zero=3, schedule="zero-bubble")  # dp = 1: nothing is sharded


def test_virtual_stages_need_an_interleaved_schedule():
    with pytest.raises(LayoutError, match="--virtual-stages 2: schedule 1f1b runs one stage per pp rank"):
        Layout(pp=2, virtual_stages=2)


def test_blocks_are_the_outermost_list_of_any_classes():
    from fxshard.ir.cut import find_blocks

    jamba = {"model.layers": "ModuleList", "model.layers.0": "Mamba", "model.layers.1": "Attention",
             "model.layers.2": "Mamba", "model.layers.3": "Attention"}
    blocks = find_blocks(jamba)
    assert (blocks.prefix, blocks.cls, blocks.names) == ("model.layers", "Attention/Mamba",
                                                         [f"model.layers.{i}" for i in range(4)])
    # T5's sublayers (self-attention, cross-attention, feed-forward) are inside a block, not blocks
    t5 = {"decoder.block.0": "T5Block", "decoder.block.1": "T5Block", "decoder.block.0.layer.0": "SelfAttn",
          "decoder.block.0.layer.1": "CrossAttn", "decoder.block.0.layer.2": "FF",
          "decoder.block.1.layer.0": "SelfAttn",
          "decoder.block.1.layer.1": "CrossAttn", "decoder.block.1.layer.2": "FF"}
    assert find_blocks(t5).prefix == "decoder.block"
    # a list of one class wins a tie with one of several
    assert find_blocks({"a.0": "X", "a.1": "Y", "b.0": "Z", "b.1": "Z"}).prefix == "b"


def test_a_layer_called_several_times_is_a_block_per_call(models):
    from fxshard.capture.program import capture
    from fxshard.ir.cut import find_blocks

    program = capture(load_model_file(models / "hf_albert_mlm.py"))
    shared = "albert.encoder.albert_layer_groups.0"
    assert find_blocks(program.module_types).names == [shared]
    assert find_blocks(program.module_types, program.gm).names == [f"{shared}@{k}" for k in range(4)]
    result = compile_program(models / "hf_albert_mlm.py", Layout(pp=2))
    stages = pipeline_stages(result.gm, result.ctx)
    held = [{n.name for n in st.state} for st in stages]
    query = "p_model_albert_encoder_albert_layer_groups_0_albert_layers_0_attention_query_weight"
    assert query in held[0] and query in held[1]  # both stages call the shared layer: both hold it
    assert [row["blocks"] for row in result.ctx.pipeline.table] == [2, 2]


@pytest.mark.parametrize("model,layout", [
    ("samples/llama.py", Layout(pp=2)),
    # tp and cp beside pp: make test-matrix (make test keeps pp alone, on the sample and on transformers models)
    pytest.param("samples/llama.py", Layout(tp=2, pp=2, schedule="interleaved-1f1b"), marks=pytest.mark.matrix),
    pytest.param("samples/llama.py", Layout(cp=2, pp=2), marks=pytest.mark.matrix),
    ("tests/models/llama_padded.py", Layout(pp=2, microbatches=4)),  # transformers: a padding mask, labels
    ("tests/models/hf_bert_qa.py", Layout(pp=2, microbatches=2)),  # transformers: a mask, start/end positions
])
def test_only_activations_a_gradient_flows_through_cross_stages(model, layout):
    # torch 2.11's PipelineStage makes every received buffer require a gradient (an integer one cannot) and sends
    # a gradient back for each: user inputs, and values computed from them alone, are taken from the microbatch
    root = Path(__file__).resolve().parents[2]
    result = compile_model(root / model, layout)
    names = {i.name for i in result.manifest.inputs if i.is_tensor}
    for entry in result.manifest.ranks:
        module = load_rank_source(result.sources[entry.file], entry.file)
        for st in entry.stages:
            sent = [*(st.inputs if st.index else ()), *st.outputs]
            assert sent
            for v in sent:
                assert getattr(torch, v.dtype).is_floating_point and v.requires_grad, (entry.file, st.index, v)
            cls = getattr(module, st.class_name)
            assert [(n, tuple(s), d, g) for n, s, d, g in cls.INPUTS] == \
                [(v.name, v.shape, getattr(torch, v.dtype), v.requires_grad) for v in st.inputs]
            assert set(getattr(cls, "BATCH", ())) <= names
    assert not [n for n in result.manifest.notes if "torch 2.11" in n], result.manifest.notes
    if "padded" in model:  # the last stage rebuilds the padding mask from the batch's attention_mask
        last = load_rank_source(result.sources["rank_pp1_tp0.py"], "rank_pp1_tp0.py").Stage1
        assert last.BATCH == ("attention_mask", "labels")


def test_a_send_no_gradient_flows_back_to_is_noted(tmp_path):
    # a frozen first stage sends activations without a gradient: torch 2.13 runs it, torch 2.11 cannot
    model = tmp_path / "frozen_first.py"
    model.write_text(
        "import torch\nimport fxshard\n\n\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)\n"
        "        self.a.requires_grad_(False)\n\n"
        "    def forward(self, x):\n"
        "        h = self.a(x)\n"
        "        fxshard.pipeline_split()\n"
        "        return self.b(h).mean()\n\n\n"
        "def make_model():\n    return M()\n\n\n"
        "def make_inputs():\n    return (torch.randn(4, 8),)\n")
    notes = [n for n in compile_model(model, Layout(pp=2)).manifest.notes if "torch 2.11" in n]
    assert len(notes) == 1 and notes[0].startswith("pipeline stage 0 sends ") \
        and "a tensor no gradient flows back to" in notes[0], notes
