"""The plans models ship: every transformers parallel style is followed or named in one note, never warned
about; OLMo2 (its own plan: gathered q/k/v, a row-parallel o_proj on a replicated input) splits every layer
the same way and trains like one device; a MoE model compiles with one note and no warning."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest
import transformers
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

from fxshard.compiler import compile_program
from fxshard.driver import verify
from fxshard.errors import FxshardWarning
from fxshard.ir.context import Layout, spec
from fxshard.plan.styles import Style, colwise, hf_style, replicate, rowwise, vocab_parallel

MODELS = Path(__file__).resolve().parent / "models"
_PLAN = re.compile(r"^\s*(base_model_tp_plan|_tp_plan|base_model_ep_plan|_ep_plan)\s*(?::[^=\n]*)?=\s*\{", re.M)


def _shipped_styles() -> dict[str, set[str]]:
    """Every style name in the plans of the installed transformers' models -> the models using it."""
    found: dict[str, set[str]] = {}
    for path in Path(transformers.__file__).parent.glob("models/*/*.py"):
        src = path.read_text()
        for m in _PLAN.finditer(src):
            start, depth = m.end() - 1, 0
            for end in range(start, len(src)):
                depth += {"{": 1, "}": -1}.get(src[end], 0)
                if depth == 0:
                    break
            plan = ast.parse(src[start:end + 1], mode="eval").body
            for value in plan.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.setdefault(value.value, set()).add(path.parent.name)
    return found


def test_every_transformers_style_is_followed_or_named_in_a_note():
    shipped = _shipped_styles()
    assert {"colwise", "rowwise", "rowwise_split_input", "moe_tp_experts", "grouped_gemm"} <= set(shipped)
    for name in sorted(set(shipped) | set(ALL_PARALLEL_STYLES.keys())):
        try:
            what = hf_style(name)
        except KeyError:
            pytest.fail(f"transformers style {name!r} (used by {sorted(shipped.get(name, []))[:5]}) has no entry in "
                        "fxshard.plan.styles: map it to a Style, mark it implied, or say what fxshard does instead")
        assert what is None or isinstance(what, Style) or (isinstance(what, str) and len(what) > 40), (name, what)


@pytest.mark.parametrize("name, style", [
    ("colwise", colwise()), ("rowwise", rowwise()), ("colwise_gather_output", colwise(gather_output=True)),
    # transformers: RowwiseParallel(input_layouts=Replicate()): the same split, its input sliced on each rank
    ("rowwise_split_input", rowwise()), ("rowwise_rep", rowwise()), ("packed_colwise", colwise(packed=0)),
    ("embedding_rowwise", vocab_parallel()), ("embedding_colwise", colwise()),
    ("replicated_with_grad_allreduce", replicate()), ("all_reduce", None), ("local_params", None),
])
def test_transformers_styles_map_to_their_fxshard_equivalent(name, style):
    assert hf_style(name) == style


def _layer_collectives(gm) -> dict[str, list[tuple[str, str]]]:
    """Per decoder layer: the (module inside the layer, collective) sequence."""
    layers: dict[str, list[tuple[str, str]]] = {}
    for node in gm.graph.nodes:
        s = node.meta.get("fxshard")
        m = re.match(r"model\.layers\.(\d+)\.(.*)", s.fqn) if s is not None and s.collective else None
        if m:
            layers.setdefault(m.group(1), []).append((m.group(2), s.collective))
    return layers


def test_olmo2_splits_every_layer_the_same_way():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = compile_program(MODELS / "hf_olmo2.py", Layout(tp=2))
    ctx, gm = result.ctx, result.gm
    assert str(ctx.plan.styles["model.layers.0.self_attn.o_proj"]) == "rowwise()"  # rowwise_split_input
    layers = _layer_collectives(gm)
    assert len(layers) == 2 and layers["0"] == layers["1"], layers
    # layer 0's q/k/v read the vocab-parallel lookup directly: its partial sum is reduced, the weights stay split
    assert not [n for n in ctx.notes if "no sharding rule" in n], ctx.notes
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name.endswith("q_proj_weight"):
            assert str(spec(node).placement) == "S(0)", node.name


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["hf_olmo2.py", "hf_qwen3_moe.py"])
def test_models_own_plans_train_at_tp2_like_one_device(model):
    # OLMo2: without its copy_to, the reduced lookup entering layer 0's q/k/v got a partial gradient (2.6e-4);
    # Qwen3-MoE: the experts split over tp by its plan's moe_tp_experts
    result = verify(MODELS / model, Layout(tp=2), steps=3)
    assert result.ok, result.summary()


def test_moe_model_compiles_with_one_note_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx = compile_program(MODELS / "hf_qwen3_moe.py", Layout(tp=2)).ctx
    notes = [n for n in ctx.notes if "own parallel plan" in n]
    assert len(notes) == 1, ctx.notes
    (note,) = notes
    # moe_tp_experts is honored (tests/test_moe_tensor_parallel.py), its weights' packed_colwise/rowwise implied by it;
    # the expert-parallel plan is --ep's
    assert "the expert-parallel plan is what --ep N does" in note
    for style in ("ep_dispatch_experts", "grouped_gemm"):
        assert style in note
    for style in ("moe_tp_experts", "packed_colwise", "experts stay whole"):
        assert style not in note
    assert str(ctx.plan.styles["model.layers.1.mlp.experts"]) == "moe_tp_experts()"
    assert "3 entries match no module of this configuration" in note and "model.layers.*.mlp.gate_proj" in note
    assert str(ctx.plan.styles["model.layers.1.self_attn.q_proj"]) == "colwise()"  # the rest of the plan holds
    assert not [n for n in ctx.notes if "generator" in n], ctx.notes  # SDPA without dropout draws nothing


def test_a_user_plan_key_matching_nothing_is_a_warning_at_the_callers_line(models):
    with pytest.warns(FxshardWarning, match="'mlp.fc_middle' matches no module") as caught:
        compile_program(models / "mlp.py", Layout(tp=2), plan={"mlp.fc_in": "colwise", "mlp.fc_out": "rowwise",
                                                               "mlp.fc_middle": "colwise"})
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]  # not a line of fxshard's source
