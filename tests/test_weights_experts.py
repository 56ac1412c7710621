"""``--weights DIR`` from Hugging Face mixture-of-experts folders: the hub layout, one tensor per expert.

transformers 5 holds a layer's experts stacked (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
``save_pretrained`` (and ``fxshard export``) write one tensor per expert under the hub names (Qwen3-MoE
``mlp.experts.{e}.gate_proj.weight``, Mixtral ``block_sparse_moe.experts.{e}.w1.weight``), and ``from_pretrained``
stacks them by transformers' conversion table, which fxshard follows (:mod:`fxshard.codegen.hub_layout`).
Tiny Qwen3-MoE, Mixtral and DeepSeek-V3 folders are saved here (DeepSeek-V3: MLA attention, a dense first layer,
shared experts beside the routed ones, and a router whose ``e_score_correction_bias`` buffer is set non-zero before
saving, so reading it from the folder is checked, not assumed).  Checked: every rank's tensors equal their slices of
``from_pretrained``'s stacked ones and it reads only its pieces (under ``--ep`` its experts' tensors and no other;
under tp with ``moe_tp_experts`` half of every expert tensor); 3 training steps at tp=2 (also bf16) and dp=2 ep=2
equal single-device training of ``from_pretrained`` (losses, and parameters within ``fxshard verify``'s tolerance);
an ep checkpoint exported with ``fxshard export`` compiles back with ``--weights`` to the same parameters bit for bit;
a checkpoint already stacked still reads; a missing or misshapen expert tensor is named at compile time.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fxshard.capture.modelfile import load_model_file
from fxshard.check.verify import DEFAULT_PARAM_RTOL, compare_parameters, gather_parameters, update_share
from fxshard.codegen.manifest import import_rank_file, read_manifest
from fxshard.driver import compile as compile_model
from fxshard.errors import WeightsError
from fxshard.ir.context import Layout
from fxshard.ir.placement import take
from fxshard.runtime import load_state
from fxshard.testing import case_result, matrix, selected_cases, spawn_cases
from fxshard.train.checkpoint import CheckpointConfig, CheckpointReader
from fxshard.train.optim import OptimConfig
from fxshard.train.reference import reference_losses

STEPS = 3
REL, BF16_REL = 1e-5, 2e-2

MODEL_FILE = '''import torch
from transformers import AutoConfig, AutoModelForCausalLM

DIR = {folder!r}


def make_model():  # the folder's configuration, random weights: fxshard captures it on meta tensors
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR))


def make_inputs():
    ids = torch.randint(2, {vocab}, (4, 8))
    return {{"input_ids": ids, "labels": ids.clone(), "use_cache": False}}
'''

CASES = {  # id -> (folder, layout)
    "qwen-tp2": ("qwen", Layout(tp=2)),  # moe_tp_experts (the model's own plan): every expert split in two
    "qwen-dp2-ep2": ("qwen", Layout(dp=2, ep=2)),  # two whole experts of four per rank
    "mixtral-tp2": ("mixtral", Layout(tp=2)),
    "mixtral-dp2-ep2": ("mixtral", Layout(dp=2, ep=2)),
    "qwen-tp2-bf16": ("qwen", Layout(tp=2, dtype="bf16")),  # bf16 compute, the slices read into fp32 masters
    "qwen-pp2": ("qwen", Layout(pp=2)),  # each stage reads its own layers' experts
    "deepseek-tp2": ("deepseek", Layout(tp=2)),  # routed experts split inside, shared experts and MLA by the plan
    "deepseek-dp2-ep2": ("deepseek", Layout(dp=2, ep=2)),
}
# make test's representatives (whole experts under ep, whose run saves the checkpoint export reads; experts split
# inside beside MLA and shared experts); make test-matrix runs every case
KEEP = ("qwen-dp2-ep2", "deepseek-tp2")
MOE_LAYERS = {"qwen": 2, "mixtral": 2, "deepseek": 1}  # DeepSeek-V3's first layer is dense (first_k_dense_replace)


def _configs():
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    qwen = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=32, pad_token_id=1)
    mixtral = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=32, router_jitter_noise=0.0)
    deepseek = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                                first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32, pad_token_id=1)
    return {"qwen": qwen, "mixtral": mixtral, "deepseek": deepseek}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """save_pretrained folders (seed 3: not the weights make_model() draws), and a stacked copy of Qwen's."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe-folders")
    found = {}
    for name, config in _configs().items():
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config)
        if name == "deepseek":  # from_config leaves the bias at zero, where a bias never read would pass unseen
            bias = model.model.layers[1].mlp.gate.e_score_correction_bias
            bias.copy_(torch.linspace(-0.5, 0.5, bias.numel()))
        model.save_pretrained(root / name)
        found[name] = root / name
        if name == "mixtral":  # sharded with an index: the pieces of one stacked tensor in several files
            model.save_pretrained(root / "mixtral_sharded", max_shard_size="40KB")
            found["mixtral_sharded"] = root / "mixtral_sharded"
        if name == "qwen":  # as some conversions store it: the model's own state dict, experts stacked
            (root / "qwen_stacked").mkdir()
            shutil.copy(root / name / "config.json", root / "qwen_stacked")
            save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
                       or not config.tie_word_embeddings}, str(root / "qwen_stacked" / "model.safetensors"),
                      metadata={"format": "pt"})
            found["qwen_stacked"] = root / "qwen_stacked"
    return found


def _model_file(folder: Path) -> Path:
    path = folder.parent / f"{folder.name}_model.py"
    path.write_text(MODEL_FILE.format(folder=str(folder), vocab=128))
    return path


def _from_pretrained(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return {n: p.detach() for n, p in model.named_parameters()}


def _load_ranks(out: Path, monkeypatch):
    """Every rank entry's loaded module tensors, and the expert pieces it read: (name, bytes)."""
    import fxshard.runtime.slices as slices

    original, reads = slices.read_region, []

    def recorded(files, piece, region):
        value = original(files, piece, region)
        reads.append((piece["name"], value.numel() * value.element_size()))
        return value

    monkeypatch.setattr(slices, "read_region", recorded)
    for entry in read_manifest(out).ranks:
        reads.clear()
        module = import_rank_file(out / entry.file).RankModule({a: None for a in ("dp", "pp", "tp", "ep")})
        load_state(module, out / entry.weights)
        yield entry, dict(module.named_parameters()) | dict(module.named_buffers()), list(reads)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen-tp2", "qwen-dp2-ep2", "mixtral-tp2", "mixtral-dp2-ep2", "mixtral_sharded-tp2",
                                  "qwen_stacked-tp2", "deepseek-tp2", "deepseek-dp2-ep2"])
def test_each_rank_reads_only_its_experts_pieces(folders, case, tmp_path, monkeypatch):
    name, layout = case.split("-")[0], Layout(tp=2) if case.endswith("tp2") else Layout(dp=2, ep=2)
    folder = folders[name]
    on_disk = {}
    for file in sorted(folder.glob("*.safetensors")):
        on_disk |= load_file(str(file))
    keys = set(on_disk)
    expert = {"qwen": "model.layers.1.mlp.experts.3.up_proj.weight", "mixtral":
              "model.layers.1.block_sparse_moe.experts.3.w3.weight", "deepseek":
              "model.layers.1.mlp.experts.3.up_proj.weight"}.get(name.removesuffix("_sharded"))
    moe_layers = MOE_LAYERS.get(name.removesuffix("_sharded").removesuffix("_stacked"), 2)
    stacked = "model.layers.1.mlp.experts.gate_up_proj"
    assert (expert in keys and stacked not in keys) if expert else stacked in keys  # hub layout on disk, or stacked
    full = _from_pretrained(folder)
    compile_model(_model_file(folder), layout, out=tmp_path, weights=folder)
    for entry, own, reads in _load_ranks(tmp_path, monkeypatch):
        for key, t in entry.tensors.items():
            if t.kind == "parameter":
                assert torch.equal(own[key], take(full[t.source], t.slice)), f"{case} {entry.file}: {key}"
            elif t.source.endswith("e_score_correction_bias"):
                # a saved buffer: the folder's value, not the compiled one
                assert torch.equal(own[key], take(on_disk[t.source], t.slice)), f"{case} {entry.file}: {key}"
                assert own[key].abs().sum() > 0
        if name == "deepseek":  # every rank routes, so every rank holds the router's bias
            assert any(t.source.endswith("e_score_correction_bias") for t in entry.tensors.values()), entry.file
        if not expert:
            assert reads == []  # stacked: read as one tensor each, by the plain path
            continue
        names = {n for n, _ in reads}
        experts = {n.split(".experts.")[1].split(".")[0] for n in names}
        if layout.ep > 1:  # its two experts' tensors, whole, and no other expert's
            assert experts == {"0", "1"} if entry.coords.ep == 0 else {"2", "3"}, (entry.coords, experts)
            assert all(b == on_disk[n].numel() * 4 for n, b in reads)
        else:  # every expert, half of each tensor: its rows of gate and up, its columns of down
            assert experts == {"0", "1", "2", "3"} and len(reads) == len(names) == moe_layers * 4 * 3
            assert all(2 * b == on_disk[n].numel() * 4 for n, b in reads)
        built = [t for t in entry.tensors.values() if t.checkpoint is not None and t.checkpoint.pieces]
        if name == "mixtral_sharded":
            assert len({p.file for t in built for p in t.checkpoint.pieces}) > 1
        assert len(built) == 2 * moe_layers
        assert sum(b for _, b in reads) == sum(4 * torch.Size(t.shape).numel() for t in built)


def _train_one(out: str, ckpt: CheckpointConfig | None):
    from harness import run_options

    from fxshard.train.launch import train

    state: dict = {}
    losses = train(Path(out), run_options(STEPS, OptimConfig(), ckpt), log=lambda *_: None, final_state=state)
    return losses, state


@pytest.fixture(scope="module")
def trained(folders, tmp_path_factory, request):
    """{case: (per-rank (losses, final state), manifest)} of the selected CASES in one spawn of 2 ranks; the ep
    checkpoint (saved by qwen-dp2-ep2's run)."""
    tmp = tmp_path_factory.mktemp("moe-train")
    outs = {case: tmp / case for case in selected_cases(request, CASES)}
    for case in outs:
        name, layout = CASES[case]
        compile_model(_model_file(folders[name]), layout, out=outs[case], weights=folders[name])
    ckpt = tmp / "qwen-ep-ckpt"
    items = [(case, (str(outs[case]), CheckpointConfig(ckpt, STEPS) if case == "qwen-dp2-ep2" else None))
             for case in outs]
    found = spawn_cases(_train_one, 2, items)
    return {case: (found[case], read_manifest(outs[case])) for case in outs}, ckpt


def _single(folder: Path, dtype: str) -> tuple[list[float], dict]:
    """Single-device training of from_pretrained(folder), from the same batches."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    mf = load_model_file(_model_file(folder))
    mf = dataclasses.replace(mf, make_model=lambda: AutoModelForCausalLM.from_pretrained(folder))
    final: dict = {}
    return reference_losses(mf, STEPS, OptimConfig(), dtype=dtype, final_state=final), final


@pytest.mark.distributed
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_training_from_a_hub_moe_folder_equals_from_pretrained(folders, trained, case):
    name, layout = CASES[case]
    per_rank = case_result({case: trained[0][case][0]}, case)
    manifest = trained[0][case][1]
    want, final = _single(folders[name], layout.dtype)
    rel = BF16_REL if layout.mixed else REL
    for step, (got, ref) in enumerate(zip(per_rank[0][0], want, strict=True), 1):
        assert abs(got - ref) <= rel * abs(ref), f"{case} step {step}: {got} vs from_pretrained {ref}"
    params = gather_parameters(manifest, states={r: state for r, (_, state) in enumerate(per_rank)})
    rows = compare_parameters(params, final, _from_pretrained(folders[name]))
    assert {r["fqn"] for r in rows} == set(final)
    share = update_share(rows)
    assert share <= DEFAULT_PARAM_RTOL[layout.dtype], f"{case}: parameters differ by {share:.2e} of the update"


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["qwen-dp2-ep2"])  # the case whose run saved the checkpoint: the fixture trains it
def test_export_of_an_ep_checkpoint_compiles_back_bit_for_bit(folders, trained, tmp_path, monkeypatch, case):
    from fxshard.train.export import export_hf

    _, ckpt = trained
    export_hf(ckpt, tmp_path / "hf")  # the latest step: 3
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.2.gate_proj.weight" in set(f.keys())  # the hub layout, one per expert
    saved = CheckpointReader(ckpt / f"step-{STEPS:08d}")
    for layout, out in ((Layout(dp=2, ep=2), tmp_path / "ep2"), (Layout(tp=2), tmp_path / "tp2")):
        compile_model(_model_file(folders["qwen"]), layout, out=out, weights=tmp_path / "hf")
        for entry, own, _ in _load_ranks(out, monkeypatch):
            for key, t in entry.tensors.items():
                if t.kind == "parameter":
                    assert torch.equal(own[key], take(saved.tensor(saved.canonical(t.source)), t.slice)), (out, key)


def _copy(folder: Path, tmp_path: Path) -> Path:
    shutil.copytree(folder, tmp_path / folder.name)
    return tmp_path / folder.name


def test_missing_expert_tensor_is_named(folders, tmp_path):
    folder = _copy(folders["qwen"], tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"tensor model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight is missing "
                                           r"from the checkpoint: the model's model\.layers\.1\.mlp\.experts\."
                                           r"gate_up_proj stacks 4 experts"):
        compile_model(_model_file(folder), Layout(dp=2, ep=2), weights=folder)
    for e in range(4):  # a whole layer's experts: the stacked name, and the per-expert names transformers reads
        for w in ("gate", "up"):
            tensors.pop(f"model.layers.1.mlp.experts.{e}.{w}_proj.weight", None)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"tensor model\.layers\.1\.mlp\.experts\.gate_up_proj is missing from the "
                                           r"checkpoint, neither stacked nor one tensor per expert as "
                                           r"transformers' table reads it \('mlp\.experts\.\*\.gate_proj\.weight', "
                                           r"'mlp\.experts\.\*\.up_proj"):
        compile_model(_model_file(folder), Layout(dp=2, ep=2), weights=folder)


def test_expert_tensor_of_another_shape_is_named(folders, tmp_path):
    folder = _copy(folders["mixtral"], tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"  # [H, I] = [32, 16]
    tensors[name] = tensors[name][:, :8].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    assert config["intermediate_size"] == 16
    with pytest.raises(WeightsError, match=rf"model\.safetensors: tensor {re.escape(name)} has shape "
                                           r"\[32, 8\], the model \(its config\) expects \[32, 16\] for it"):
        compile_model(_model_file(folder), Layout(tp=2), weights=folder)
