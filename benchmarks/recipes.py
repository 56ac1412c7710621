"""Published training runs of the peers, each with its source: what :mod:`benchmarks.auto_recipes` predicts at.

Every figure is the publication's own (its page and commit named, and the row); every setting fxshard predicts
with is the recipe's own where fxshard has it (precision, recompute, sequence, batch, microbatch, virtual stages,
Megatron's distributed optimizer as ZeRO 1, sequence parallelism with tp), and :attr:`Recipe.differs` says what
the recipe runs that fxshard's program does not (or the other way round).  Nothing here ran on a GPU::

    from benchmarks.recipes import RECIPES
    RECIPES[0].published, RECIPES[0].layout.describe()
"""

from __future__ import annotations

from dataclasses import dataclass

from fxshard.ir.layout import Layout

BRIDGE = "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/df0289c180dd20ff26933455c7a0a11084f6a36f/"
BRIDGE_SUMMARY = (f"Megatron-Bridge performance summary ({BRIDGE}docs/performance-summary.md), table "
                  "'{release} NeMo Container, DGX-H100', row {row}")
BRIDGE_LLAMA = ("Megatron-Bridge recipe: src/megatron/bridge/recipes/llama/llama3.py at 0d5f5558 "
                "(recompute_granularity None, use_distributed_optimizer, sequence_parallel, tp_comm_overlap, "
                "overlap_grad_reduce, overlap_param_gather), scripts/performance/configs/llama/"
                "{workload} at {commit} ({preset}), llama3_llm_pretrain.py at 2a0d46e2 (grad_reduce_in_fp32 False)")
TITAN = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (https://github.com/pytorch/torchtitan/blob/"
         "31a17bfdb70bab6f62a13d21816a5339b911d6e3/benchmarks/llama3_h100_202412_torchtitan.md), {row}")
TITAN_H100 = ("H100 96GB HBM2e at 500 W (2.4 TB/s; its peak, the page says, lies between the SXM's and the NVL's): "
              "predicted on the h100 profile with the NVL's bf16 peak (835 TFLOP/s, the lower bound) and 2.4 TB/s")


@dataclass(frozen=True)
class Recipe:
    """One published run: where and what it measured, and fxshard's nearest layout for it."""

    name: str
    model: str  # the model file fxshard captures
    gpus: int
    seq: int
    global_batch: int
    layout: Layout  # the recipe's own layout and recompute, as fxshard's flags (bf16: mixed precision)
    precision: str  # what the linears compute in: bf16, or fp8 (--dtype fp8: bf16 with float8 products)
    published: float  # tokens/s per GPU
    memory: float | None  # GiB the publication measured on its most loaded rank, where it gives one
    source: str  # the publication, its commit, the table and row
    recipe: str  # what the run is: layout, precision, recompute, kernels (and where the settings are read from)
    differs: str  # what fxshard's program does differently at that layout
    megatron: bool = False  # a Megatron-Core run: compare the memory with Megatron's theoretical formula
    hardware: str = "h100"  # the shipped profile, or "h100-hbm2e-500w" (TITAN_H100)


L = Layout
RECIPES = [
    Recipe(
        "llama3-70b", "samples/llama70b.py", 64, 8192, 128,
        L(tp=4, pp=8, dp=2, zero=1, schedule="interleaved-1f1b", virtual_stages=5, microbatches=64, sp=True,
          dtype="bf16", recompute="none"),
        "fp8", 1602, None, BRIDGE_SUMMARY.format(release="25.11", row="LLAMA3_70B (64 GPUs, FP8-CS, GBS 128, MBS 1)"),
        "TP4 PP8 VP5 DP2, FP8 current scaling, no recompute, distributed optimizer, sequence parallel, TP "
        "communication overlapped with the GEMMs (userbuffers); "
        + BRIDGE_LLAMA.format(workload="llama3_workload_base_configs.py", commit="00919dcf",
                              preset="LLAMA3_70B_PRETRAIN_CONFIG_H100_FP8_CS_V1"),
        "Transformer Engine's fused layers (one kernel for RMSNorm, for RoPE, for SwiGLU, the FP8 casts fused "
        "into them) against transformers' modules op by op, each at the memory bandwidth, and eager float8 casts "
        "(the 'other ops' of the compute split); TP all-gathers and reduce-scatters overlapped with the GEMMs "
        "against blocking ones (the tp term); gradients reduce-scattered during backward against after it. "
        "Memory: at no recompute fxshard's program keeps about 1.2 times the formula's bytes a layer (the memory "
        "tables say which tensors: the norms' normalized outputs, the MLP's 6·ffn against a GELU's 4·ffn) and "
        "fits the 80 GB at the recipe's own setting, since the exact program changes of the memory section",
        megatron=True),
    Recipe(
        "llama3.1-405b", "samples/llama405b.py", 1024, 8192, 512,
        L(tp=8, pp=8, cp=2, dp=8, zero=1, schedule="interleaved-1f1b", virtual_stages=8, microbatches=64, sp=True,
          dtype="bf16", recompute="none"),
        "fp8", 292, None,
        BRIDGE_SUMMARY.format(release="25.11", row="LLAMA3.1_405B (1024 GPUs, FP8-CS, GBS 512, MBS 1)"),
        "TP8 PP8 CP2 VP8 DP8, FP8 current scaling, no recompute, distributed optimizer, sequence parallel, TP "
        "overlap; the embedding and the loss each count as a layer in the pipeline split "
        "(account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split); "
        + BRIDGE_LLAMA.format(workload="llama31_workload_base_configs.py", commit="0013c9a8",
                              preset="LLAMA31_405B_PRETRAIN_CONFIG_H100_FP8_CS_V1"),
        "as the 70B; cp is costed analytically (keys and values all-gathered, fxshard's cp_mode allgather, where "
        "Megatron runs its ring (p2p) attention); 126 layers over 64 virtual stages: fxshard's balance also gives "
        "the first and last stage one layer; FP8: fxshard compiles it (tensorwise, each fp8 linear's amaxes "
        "all-reduced over cp x tp: tests/test_fp8.py trains tp2 sp cp2 as one device)",
        megatron=True),
    Recipe(
        "deepseek-v3", "benchmarks/models/deepseek_v3.py", 1024, 4096, 8192,
        L(tp=2, pp=8, dp=64, ep=64, zero=1, schedule="interleaved-1f1b", virtual_stages=4, microbatches=128,
          sp=True, dtype="bf16", recompute="selective"),
        "fp8", 1297, None,
        BRIDGE_SUMMARY.format(release="25.09", row="DeepSeekV3 (dropless) (1024 GPUs, GBS 8192, MBS 1; "
                                                   "FP8: the table's footnote reads its parenthesized "
                                                   "figure as FP8 with blockwise scales)"),
        "TP2 PP8 VP4 EP64, FP8, recompute of MLA's up-projections and the MLPs (recompute_modules), HybridEP "
        "dispatch, the all-to-all not overlapped (moe_a2a_overlap False), layout 'Et|(tt|)*30mL' (embedding and one "
        "layer, 30 stages of two, MTP and loss): "
        "scripts/performance/configs/deepseek/deepseek_workload_base_configs.py "
        "at 04264182 (DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V1); fxshard's nearest recompute: selective",
        "the pipeline: fxshard's balance of 61 layers over 32 stages leaves 6 to 8 MoE layers a rank (rank 0, the "
        "critical one: the embedding, two dense layers and 6 MoE), and the critical rank waits for the busiest "
        "ones' two MoE layers more (the stage imbalance term); Megatron's layout also gives ranks 2 to 6 eight "
        "MoE layers, so its step is bounded by the same rank's work: the imbalance is not a difference of the "
        "runs, and the bubble proper is (pp-1)/(vp·m) = 7/512 of the work, as published; "
        "the all-to-alls block in both runs (moe_a2a_overlap False), but fxshard's carry several times the "
        "bytes: "
        "fxshard gathers a MoE layer's tokens over tp before the router (docs/expert-parallel.md), so at TP2 each tp "
        "rank dispatches and computes every token of its dp rank: twice the all-to-all bytes and the expert FLOPs of "
        "Megatron's, where each tp rank sends its own S/tp; fxshard's all-to-all sends each (token, expert) row, "
        "HybridEP a token once per node (DeepSeek-V3 routes a token to at most 4 nodes, to 8 experts); fxshard's "
        "selective recompute runs the MoE layer's dispatch and combine again (a third of the ep term), where "
        "Megatron recomputes MLA's up-projections and the MLPs only; the other ops run unfused at the memory "
        "bandwidth (the compute split), the tp collectives block; no multi-token-prediction module in "
        "transformers' model (Megatron's run computes one more: this favours fxshard); FP8: fxshard's fp8 "
        "program has the attention, dense and shared-expert linears in fp8 (MLA's down-projections as "
        "`split='rows'`) beside routed experts whose grouped products stay bf16, as torchao's recipe leaves them, "
        "where Megatron's blockwise FP8 covers the experts too",
        megatron=True),
    Recipe(
        "llama3-8b", "benchmarks/models/llama3_8b.py", 8, 8192, 16,
        L(dp=8, zero=3, dtype="bf16", recompute="selective"),
        "bf16", 5762, 82.4, TITAN.format(row="Table 1 (Llama 3.1 8B, 8 GPUs, local batch 2), row FSDP"),
        "FSDP 8, BF16, eager, selective activation checkpointing (torchtitan's per-op policy: it saves the matmul "
        "outputs but every other one, which it recomputes)",
        "fxshard's selective recompute keeps every matmul output (more memory, less recompute: torchtitan's "
        "policy runs about half the forward matmuls again); FSDP's gathers and reduce-scatters are predicted "
        "hidden behind compute (the dp term); the rest of the over-prediction is most likely the profile's: its "
        "matmul and memory efficiencies (0.72 and 0.8 of the datasheet peaks) and kernel launch cost are "
        "stated, not measured on an H100 (no GPU here; `fxshard calibrate --model` on one sets its "
        "compute_scale); " + TITAN_H100,
        hardware="h100-hbm2e-500w"),
    Recipe(
        "llama3-70b-titan", "samples/llama70b.py", 256, 8192, 512,
        L(tp=8, dp=32, zero=3, sp=True, dtype="bf16", recompute="full"),
        "fp8", 829, 71.9, TITAN.format(row="Table 4 (Llama 3.1 70B, 256 GPUs, local batch 16), row 2D"),
        "FSDP 32 x TP 8 with sequence parallelism, torch.compile, Float8 linears (tensorwise, the output layer in "
        "bf16), full activation checkpointing",
        "torch.compile's fused kernels are not in the profile (fxshard predicts its eager program); " + TITAN_H100,
        hardware="h100-hbm2e-500w"),
]
