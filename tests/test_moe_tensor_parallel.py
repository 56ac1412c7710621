"""Tensor parallelism inside mixture-of-experts experts (``moe_tp_experts``) trains as one device does, with each
tp rank holding 1/tp of every expert's intermediate size.

transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 plans name ``moe_tp_experts``; under ``--tp`` fxshard honors it:
``gate_up_proj [E, 2I, H]`` is split S(1)x2 (the gate's and the up half's I/tp columns), ``down_proj [E, H, I]``
S(2), the second grouped matmul's partial sums pass through the combine and are all-reduced over tp once per layer
as ``[tokens, H]``, and the routed rows' and routing weights' gradients are summed over tp (``copy_to``).  Tiny models
are trained for 3 AdamW steps on real gloo process groups through ``fxshard.train.launch.train`` (what ``fxshard run``
runs on each rank), alone at tp=2 and with pp=2, dp=2 ZeRO 1 to 3, --sp, bf16 and recompute; losses must match
single-device training within 1e-5 relative (bf16: 2e-2) and the trained parameters within ``fxshard verify``'s
tolerance, as in ``tests/test_expert_parallel.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from harness import assert_matches_single_device, compile_and_train, single_device

import fxshard
from fxshard.capture.modelfile import load_model_file
from fxshard.check.verify import DEFAULT_PARAM_RTOL, compare_parameters, gather_parameters, update_share
from fxshard.codegen.manifest import read_manifest
from fxshard.compiler import compile_program
from fxshard.driver import compile as compile_model
from fxshard.errors import PlanError, ShardingError
from fxshard.ir.context import spec
from fxshard.ir.layout import TP, Coords, Layout
from fxshard.ir.placement import Shard
from fxshard.testing import case_result, matrix, selected_cases, spawn_cases
from fxshard.train.data import global_batches
from fxshard.train.optim import OptimConfig

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"
QWEN, MIXTRAL, SPARSE = MODELS / "hf_qwen3_moe.py", MODELS / "hf_mixtral.py", MODELS / "hf_moe_sparse.py"
DEEPSEEK = ROOT / "zoo" / "models" / "deepseek_v3.py"
MASKED = MODELS / "hf_mixtral_aux_masked.py"
STEPS = 3
REL = 1e-5
BF16_REL = 2e-2  # as tests/test_training_layouts.py: bf16 losses are rounded to 8 significant bits
EXPERTS = "model.layers.*.mlp.experts"
CASES = {
    "qwen3moe-tp2": (QWEN, Layout(tp=2)),
    "mixtral-tp2": (MIXTRAL, Layout(tp=2)),
    "deepseek-v3-tp2": (DEEPSEEK, Layout(tp=2)),  # shared experts (a dense MLP, split as Linears) beside the routed
    "mixtral-tp2-sp": (MIXTRAL, Layout(tp=2, sp=True)),  # tokens gathered before the router, as without --sp
    # 16 experts, 8 (token, expert) pairs per dp rank: at least half the experts get no row (empty groups)
    "sparse-tp2-dp2-zero1": (SPARSE, Layout(tp=2, dp=2, zero=1)),
    "qwen3moe-tp2-pp2": (QWEN, Layout(tp=2, pp=2)),
    "mixtral-tp2-dp2-zero3": (MIXTRAL, Layout(tp=2, dp=2, zero=3)),
    "qwen3moe-tp2-dp2-zero2-bf16": (QWEN, Layout(tp=2, dp=2, zero=2, dtype="bf16")),
    "mixtral-tp2-dp2-zero1-full": (MIXTRAL, Layout(tp=2, dp=2, zero=1, recompute="full")),
    # a right-padded attention mask; the load-balancing loss over the unmasked tokens of a batch split over dp
    "mixtral-masked-aux-tp2-dp2": (MASKED, Layout(tp=2, dp=2)),
}


# make test's representatives (a shared-expert model, sp, empty expert groups under dp, the masked aux loss);
# make test-matrix runs every case
KEEP = ("deepseek-v3-tp2", "mixtral-tp2-sp", "sparse-tp2-dp2-zero1", "mixtral-masked-aux-tp2-dp2")


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory):
    return compile_and_train({case: (*CASES[case], OptimConfig()) for case in selected_cases(request, CASES)},
                             tmp_path_factory, STEPS)


def _reference(path: Path, dtype: str = "fp32") -> tuple[list[float], dict]:
    return single_device(path, STEPS, OptimConfig(), dtype)


def _expert_entries(entry) -> dict:
    return {k: t for k, t in entry.tensors.items() if ".mlp.experts." in t.source}


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_moe_tp_experts_training_matches_single_device(trained, case):
    path, layout = CASES[case]
    per_rank, manifest = case_result(trained, case)
    want, single = _reference(path, layout.dtype)
    rows = assert_matches_single_device(case, path, layout, per_rank, manifest, want, single,
                                        BF16_REL if layout.mixed else REL)
    experts = [r for r in rows if ".mlp.experts." in r["fqn"]]
    assert experts and update_share(experts) <= DEFAULT_PARAM_RTOL[layout.dtype], case  # the experts on their own


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_each_tp_rank_holds_one_tp_th_of_the_experts(trained, case):
    """From the manifest (gate_up S(1)x2, down S(2)) and measured by the --memory-report probe: the parameters a
    rank holds count each expert weight at 1/tp of its elements."""
    _, layout = CASES[case]
    per_rank, manifest = case_result(trained, case)
    for rank, (_, _, memory) in enumerate(per_rank):
        entry = manifest.rank(layout.coords(rank))
        experts = _expert_entries(entry)
        assert experts, (case, rank)
        for key, t in experts.items():
            want = Shard(1, blocks=2) if t.source.endswith("gate_up_proj") else Shard(2)
            assert t.placements == {TP: want}, (case, key, t.placements)
            assert math.prod(t.shape) * layout.tp == math.prod(t.global_shape), (case, key, t.shape)
            assert t.slice.index == layout.coords(rank).tp and t.slice.parts == layout.tp
        held = sum(math.prod(t.shape) for t in entry.tensors.values() if t.kind == "parameter")
        assert memory["psi"] == held, (case, rank, memory["psi"], held)


def _routed_pairs(path: Path, dp: int) -> list[torch.Tensor]:
    """The expert ids each experts module gets in step 1 on each dp rank, from the one-device model."""
    model_file = load_model_file(path)
    model, batch = model_file.build_model(0), next(global_batches(model_file))
    found = []
    hooks = [m.register_forward_pre_hook(lambda _, args: found.append(args[1].detach().flatten()))
             for name, m in model.named_modules() if name.endswith("mlp.experts")]
    for part in range(dp):
        model(**{k: v.tensor_split(dp)[part] if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    for h in hooks:
        h.remove()
    return found


def test_the_sparse_case_has_experts_without_a_token():
    experts = load_model_file(SPARSE).build_model(0).config.num_experts
    for ids in _routed_pairs(SPARSE, dp=2):
        assert len(set(ids.tolist())) < experts, ids  # some expert gets no row: an empty group on every tp rank


def test_the_rank_file_splits_the_grouped_matmuls_and_reduces_once(tmp_path):
    result = compile_model(QWEN, Layout(tp=2), out=tmp_path / "out")
    source = result.sources["rank_pp0_tp0.py"]
    assert "mlp.experts  Qwen3MoeExperts  expert tensor-parallel" in source
    assert "mlp.experts.gate_up_proj  S(1)x2 on tp  global [4, 32, 32]" in source
    assert "mlp.experts.down_proj  S(2) on tp  global [4, 32, 16]" in source
    lines = source.splitlines()
    first = next(i for i, line in enumerate(lines) if "grouped_mm_fallback.default(" in line)
    assert "[64, 16] f32 S(1)x2" in lines[first]
    # the tp region begins on the experts' input tokens [T, H] = [32, 32], before the rows [T*k, H] are gathered
    # from them: the copy_to's backward all-reduce sums the tokens' gradient, not the rows'
    entry = max(i for i, line in enumerate(lines[:first]) if "rt.copy_to(" in line)
    copied = lines[entry].split(" = ")[0].strip()
    assert "[32, 32] f32 R -> R" in lines[entry], lines[entry]
    assert f"aten.index.Tensor({copied}, " in lines[entry + 1] and "[64, 32] f32" in lines[entry + 1]
    assert not any("rt.copy_to(" in line for line in lines[entry + 1:first + 1])
    second = next(i for i, line in enumerate(lines[first + 1:], first + 1) if "grouped_mm_fallback.default(" in line)
    assert "[64, 32] f32 P(sum)" in lines[second]  # the routed rows' partial sums, reduced after the combine
    # per layer: the attention's and the experts' all-reduce forward, nothing else over tp inside the experts
    assert not any("rt.all_reduce(" in line for line in lines[first:second + 1])
    notes = " ".join(result.ctx.notes)
    assert "moe_tp_experts" not in notes and "packed_colwise" not in notes  # honored, so not a difference to note


def _combine_sizes(path: Path) -> tuple[int, int, int, int]:
    """Tokens T (of one example batch), hidden size H, top-k and MoE layers of a model file, from the model and
    its inputs."""
    model_file = load_model_file(path)
    model, batch = model_file.build_model(0), next(global_batches(model_file))
    layers = sum(name.endswith("mlp.experts") for name, _ in model.named_modules())
    return batch["input_ids"].numel(), model.config.hidden_size, model.config.num_experts_per_tok, layers


@pytest.mark.slow
@pytest.mark.parametrize("path", [QWEN, MIXTRAL, DEEPSEEK], ids=lambda p: p.stem)
def test_the_experts_reduce_once_on_the_tokens_after_the_combine(tmp_path, path):
    """The partial sums of the routed rows ``[T*k, H]`` pass through the combine (times the routing weights, back
    in token order, each token's k rows summed, a cast to their own dtype) and are all-reduced once per MoE layer
    as the ``[T, H]`` tokens: k times fewer bytes.  The routing weights' gradient, computed on each rank from its
    own partial sums, is summed over tp by their ``copy_to`` (``[T*k, 1]``).  In backward, the experts' input
    enters the split through one ``copy_to`` on the ``[T, H]`` tokens before the rows are gathered from them, so the
    rows' gradient is summed over tp as the tokens' (``[T, H]``), not as the rows' (``[T*k, H]``)."""
    tokens, hidden, k, layers = _combine_sizes(path)
    result = compile_model(path, Layout(tp=2), out=tmp_path / "out")
    lines = result.sources["rank_pp0_tp0.py"].splitlines()
    seconds = [i for i, line in enumerate(lines) if "grouped_mm_fallback.default(" in line][1::2]
    assert seconds, path  # identical layers share one block class: each experts module's code appears once
    for second in seconds:
        rest = lines[second + 1:]
        reduced = next(i for i, line in enumerate(rest) if "rt.all_reduce(" in line or "rt.reduce_scatter(" in line)
        assert f"[{tokens}, {hidden}] f32 P(sum) -> R" in rest[reduced], rest[reduced]
        combine = rest[:reduced]
        assert [line.split(" = ")[1].split("(")[0] for line in combine if "P(sum)" in line] == [
            "aten.mul.Tensor", "aten.index.Tensor", "aten.view.default", "aten.sum.dim_IntList", "aten.to.dtype"]
        weights = next(line for line in combine if "rt.copy_to(" in line)
        assert f"[{tokens * k}, 1] f32 R -> R" in weights, weights
    collectives = read_manifest(tmp_path / "out").rank(Coords()).collectives
    reductions = [c.shape for c in collectives if c.op == "all_reduce"]
    assert (tokens * k, hidden) not in reductions and reductions.count((tokens, hidden)) == layers, reductions
    copies = [c.shape for c in collectives if c.op == "copy_to"]
    assert (tokens * k, hidden) not in copies and copies.count((tokens, hidden)) == layers, copies
    assert copies.count((tokens * k, 1)) == layers, copies  # the routing weights'


def test_under_sp_the_experts_input_enters_through_gather_to(tmp_path):
    """Under ``--sp`` the experts' input tokens are split over tp: they enter through ``gather_to`` (all-gather
    forward, reduce-scatter of the ``[T, H]`` gradient backward) before the rows are gathered from them, in place
    of a plain all-gather and a ``copy_to`` on the ``[T*k, H]`` rows."""
    tokens, hidden, k, layers = _combine_sizes(MIXTRAL)
    compile_model(MIXTRAL, Layout(tp=2, sp=True), out=tmp_path / "out")
    collectives = read_manifest(tmp_path / "out").rank(Coords()).collectives
    gathered = [c.shape for c in collectives if c.op == "gather_to"]  # each rank's tokens: [T/tp, H]
    assert gathered.count((tokens // 2, hidden)) == layers, gathered
    copies = [c.shape for c in collectives if c.op == "copy_to"]
    assert (tokens * k, hidden) not in copies and (tokens, hidden) not in copies, copies


# make test keeps test_the_experts_reduce_once_on_the_tokens_after_the_combine (the rank file's reduce)
@pytest.mark.matrix
@pytest.mark.slow
def test_plan_counts_one_token_sized_reduce_per_moe_layer():
    """``fxshard plan``'s tp all-reduce elements: splitting the experts adds, per MoE layer, the tokens' forward
    all-reduce ``T*H`` (not the rows' ``T*k*H``), the tokens' gradient ``T*H`` (the ``copy_to`` before the rows are
    gathered: not the rows' ``T*k*H``) and the routing weights' gradient ``T*k``, over keeping the experts whole."""
    from fxshard.cost.costs import plan_costs

    for path in (QWEN, MIXTRAL, DEEPSEEK):  # DeepSeek-V3's first layer is dense: one MoE layer of two
        tokens, hidden, k, layers = _combine_sizes(path)
        (whole,) = plan_costs(path, Layout(tp=2), plan={EXPERTS: fxshard.replicate()}).ranks
        # the same plan but for the experts: given a plan, the attention is split as that plan says in both (with
        # none, automatic pairing also splits DeepSeek-V3's MLA, whose all-reduces are not the experts')
        (split,) = plan_costs(path, Layout(tp=2), plan={EXPERTS: "moe_tp_experts"}).ranks
        added = split["tp_allreduce"].value - whole["tp_allreduce"].value
        assert added == layers * (tokens * hidden + tokens * hidden + tokens * k), (path.stem, added)


def test_a_user_plan_keeps_the_experts_whole():
    ctx = compile_program(QWEN, Layout(tp=2), plan={EXPERTS: fxshard.replicate()}).ctx
    for node in ctx.params:
        if "experts" in node.name:
            assert str(spec(node).placement) == "R", node.name


def test_an_intermediate_size_tp_does_not_divide_is_refused_naming_the_module():
    with pytest.raises(ShardingError, match=r"model\.layers\.0\.mlp\.experts: moe_tp_experts splits each expert's "
                                            r"intermediate size 6 over tp=4, which 4 does not divide; use tp in "
                                            r"\{1, 2, 3, 6\}, or keep the experts whole .*fxshard\.replicate\(\)"):
        compile_program(MODELS / "hf_qwen3_moe_odd_experts.py", Layout(tp=4))


def test_a_user_plan_on_a_module_without_grouped_matmuls_is_refused():
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp: moe_tp_experts expected two grouped matmuls .*"
                                        r"found 0\. Keep the experts whole"):
        compile_program(QWEN, Layout(tp=2), plan={"model.layers.*.mlp": fxshard.moe_tp_experts()})


def test_experts_whose_columns_are_not_kept_apart_are_refused():
    # GPT-OSS: gate and up interleaved (h[..., ::2], h[..., 1::2]) between the grouped matmuls, and expert biases
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.experts: moe_tp_experts cannot split each row's "
                                        r"columns exactly: slice_\d+ \(aten\.slice\.Tensor\) .* not an op known to "
                                        r"act row by row\. Keep the experts whole"):
        compile_program(MODELS / "hf_gpt_oss.py", Layout(tp=2), plan={EXPERTS: "moe_tp_experts"})


def test_with_ep_the_models_plan_is_a_note_and_a_users_plan_an_error():
    ctx = compile_program(QWEN, Layout(tp=2, dp=2, ep=2)).ctx
    assert any("under --ep 2 the experts are split over ep and stay whole on every tp rank" in n for n in ctx.notes)
    for node in ctx.params:
        if "experts" in node.name:
            assert str(spec(node).placement) == "R", node.name
    with pytest.raises(PlanError, match=r"user plan splits the experts over tp \(moe_tp_experts\) and --ep 2 .* not "
                                        r"supported yet: drop --ep"):
        compile_program(QWEN, Layout(tp=2, dp=2, ep=2), plan={EXPERTS: "moe_tp_experts"})


@pytest.mark.slow
def test_plan_counts_the_experts_split():
    from fxshard.cost.costs import plan_costs

    (whole,) = plan_costs(QWEN, Layout(tp=2), plan={EXPERTS: fxshard.replicate()}).ranks
    (split,) = plan_costs(QWEN, Layout(tp=2)).ranks
    experts = 2 * 4 * 3 * 32 * 16  # layers x experts x (gate, up, down) x H x I
    assert whole["psi"].value - split["psi"].value == experts // 2


def _train_saving(out: str, ckpt):
    from harness import run_options

    from fxshard.train.launch import train

    state: dict = {}
    losses = train(Path(out), run_options(STEPS, OptimConfig(), ckpt), log=lambda *_: None, final_state=state)
    return losses, state


@pytest.mark.distributed
def test_checkpoints_of_split_experts_resume_at_other_layouts_and_export_to_the_transformers_class(tmp_path):
    """A tp=2 run saves every step (each tp rank its 1/tp of every expert); its step-1 checkpoint resumes at tp=2 and
    at dp=2 (the experts whole), both continuing as the uninterrupted run and one device; the exported folder loads
    in ``Qwen3MoeForCausalLM`` with the experts the tp ranks held, joined."""
    from transformers import Qwen3MoeForCausalLM

    from fxshard.train.checkpoint import CheckpointConfig, CheckpointReader
    from fxshard.train.export import export_hf

    layouts = {"tp2": Layout(tp=2), "tp2-resumed": Layout(tp=2), "dp2-resumed": Layout(dp=2)}
    for name, layout in layouts.items():
        compile_model(QWEN, layout, out=tmp_path / name)
    ckpt = tmp_path / "ckpt"
    saved = spawn_cases(_train_saving, 2, [("tp2", (str(tmp_path / "tp2"), CheckpointConfig(ckpt, 1)))])
    resumed = spawn_cases(_train_saving, 2, [(name, (str(tmp_path / name),
                                                      CheckpointConfig(ckpt / "step-00000001", resume=True)))
                                             for name in ("tp2-resumed", "dp2-resumed")])
    want, single = _reference(QWEN)
    uninterrupted = case_result(saved, "tp2")
    for name in ("tp2-resumed", "dp2-resumed"):
        for rank, (losses, _) in enumerate(case_result(resumed, name)):
            for step, (got, ref, one) in enumerate(zip(losses, uninterrupted[0][0][1:], want[1:], strict=True), 2):
                assert abs(got - ref) <= REL * abs(ref), f"{name} rank {rank} step {step}: {got} vs {ref}"
                assert abs(got - one) <= REL * abs(one), f"{name} rank {rank} step {step}: {got} vs one device {one}"
    expert = "model.layers.0.mlp.experts.gate_up_proj"
    assert CheckpointReader(ckpt / "step-00000001").tensor(expert).shape == (4, 32, 32)  # the tp halves joined
    export_hf(ckpt, tmp_path / "hf")
    loaded = dict(Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
    trained = gather_parameters(read_manifest(tmp_path / "tp2"),
                                states={r: st for r, (_, st) in enumerate(uninterrupted)})
    assert set(trained) == set(loaded)
    for name, value in trained.items():  # what the tp ranks held at the end, bit for bit
        assert torch.equal(loaded[name].detach(), value), name
    initial = dict(load_model_file(QWEN).build_model(0).named_parameters(remove_duplicate=False))
    for name in ("dp2-resumed",):
        per_rank = case_result(resumed, name)
        params = gather_parameters(read_manifest(tmp_path / name), states={r: st for r, (_, st) in enumerate(per_rank)})
        assert update_share(compare_parameters(params, single, initial)) <= DEFAULT_PARAM_RTOL["fp32"], name


def _norm_after_backward(out: str) -> float:
    """The global gradient norm ``fxshard run --clip-grad-norm`` clips by in its first step."""
    program = _program_after_backward(out)
    return program.clip_grad_norm_(math.inf)  # the norm, nothing scaled


def _program_after_backward(out: str):
    """``out``'s program after its first batch's forward and backward."""
    from fxshard.train.launch import open_stream
    from fxshard.train.options import RunOptions
    from fxshard.train.program import Program

    program = Program(Path(out), RunOptions(1, OptimConfig(lr=0.0)), torch.device("cpu"))
    program.train_step(next(open_stream(program, "train")))
    return program


@pytest.mark.distributed
def test_global_gradient_norm_counts_each_split_expert_once(tmp_path):
    """Each tp rank's slice of an expert is a different part of its gradient: counted whole, not divided by tp as
    the replicated parameters' are."""
    compile_model(QWEN, Layout(tp=2), out=tmp_path / "tp2")
    found = spawn_cases(_norm_after_backward, 2, [("tp2", (str(tmp_path / "tp2"),))])
    model_file = load_model_file(QWEN)
    model = model_file.build_model(0)
    model(**next(global_batches(model_file))).loss.backward()
    want = torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()
    for rank, got in enumerate(case_result(found, "tp2")):
        assert abs(got - want) <= 1e-5 * want, f"rank {rank}: the norm is {got}, single device {want}"


def _router_grads_after_backward(out: str) -> dict[str, torch.Tensor]:
    """This rank's router weight gradients (``mlp.gate.weight``) after the first step's backward, finished as the
    optimizer step applies them."""
    program = _program_after_backward(out)
    program.finish_gradients()
    return {name: p.grad.clone() for name, p in program.named_parameters() if name.endswith("mlp_gate_weight")}


@pytest.mark.distributed
def test_the_routing_weights_gradient_is_summed_over_tp(tmp_path):
    """The combine multiplies each rank's partial sums by the routing weights, so each rank's gradient for those
    weights (and the router behind them) is a partial sum too: their ``copy_to`` sums it over tp.  Adam's update
    hardly sees a gradient's scale; the gradients themselves are compared, on every tp rank."""
    compile_model(QWEN, Layout(tp=2), out=tmp_path / "tp2")
    found = spawn_cases(_router_grads_after_backward, 2, [("tp2", (str(tmp_path / "tp2"),))])
    model_file = load_model_file(QWEN)
    model = model_file.build_model(0)
    model(**next(global_batches(model_file))).loss.backward()
    for rank, grads in enumerate(case_result(found, "tp2")):
        assert len(grads) == 2, grads.keys()  # both layers' routers
        for name, got in grads.items():
            want = model.get_submodule(name.split(".")[0].replace("_", ".") + ".mlp.gate").weight.grad
            assert (got - want).norm() <= 1e-5 * want.norm(), f"rank {rank} {name}: {got.norm()} vs {want.norm()}"
