"""torchtitan as its trainer builds a model: ``Llama3Model`` from its config (on meta), its ``parallelize_llama``
(tensor parallelism on DTensor, FSDP2 over dp, optionally torch.compile per block) or, under pp, its
``pipeline_llm`` (the model split into stages, each parallelized, stepped by a 1F1B schedule), then
``to_empty`` + ``init_weights`` and the Hugging Face weights loaded over them with torch.distributed.checkpoint's
``set_model_state_dict`` (:func:`benchmarks.peers.weights.torchtitan_state`).

Differences from torchtitan's own trainer, each because the comparison needs the same computation:

- attention is its ``ScaledDotProductAttention`` (causal), not FlexAttention: the batch is whole sequences with no
  document mask, as the other tools see it;
- RoPE without Llama 3.1's frequency scaling, no sequence parallelism, fp32 parameters and reductions, no gradient
  clipping (the norm is still computed, as fxshard's step does), AdamW at the shared settings;
- the loss is the global batch's token mean, as its trainer divides by the global count of valid tokens::

    peer = torchtitan_peer(layout, hf_state, batch, shape, torch.device("cpu"), compile=False)
    loss = peer.step()
"""

from __future__ import annotations

import math
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist

from benchmarks.peers.common import Peer, PeerLayout, local_rows
from benchmarks.peers.shims import sum_reduction_for_gloo, torchtitan_on_cpu
from benchmarks.peers.weights import torchtitan_state


def _model_config(shape: dict):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    from benchmarks.models.peer_llama import NORM_EPS, ROPE_THETA

    dim, vocab = shape["hidden"], shape["vocab"]
    rope = ComplexRoPE.Config(dim=dim // shape["heads"], max_seq_len=shape["seq"], theta=ROPE_THETA, scaling="none")
    layers = _build_llama3_layers(n_layers=shape["layers"], dim=dim, n_heads=shape["heads"], hidden_dim=shape["ffn"],
                                  rope=rope, n_kv_heads=shape["kv_heads"], fuse_qkv=False, attn_backend="flex")
    for layer in layers:  # whole causal sequences, as every tool sees them (FlexAttention's document masks unused)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = NORM_EPS
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab, tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, eps=NORM_EPS),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=layers)


def _configs(layout: PeerLayout, shape: dict, compile: bool, bf16: bool = False):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    shard, replicate = (layout.dp, 1) if layout.sharded else (1, layout.dp)  # FSDP2, or its DDP (replicate)
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=shard, data_parallel_replicate_degree=replicate, tensor_parallel_degree=layout.tp,
        enable_sequence_parallel=False,
        pipeline_parallel_degree=layout.pp, pipeline_parallel_schedule="1F1B", spmd_backend="partial_dtensor",
        pipeline_parallel_microbatch_size=shape["batch"] // layout.dp // layout.microbatches,
        pipeline_parallel_first_stage_less_layers=0, pipeline_parallel_last_stage_less_layers=0)
    training = TrainingConfig(local_batch_size=shape["batch"] // layout.dp, seq_len=shape["seq"], max_norm=math.inf,
                              dtype="float32", mixed_precision_param="bfloat16" if bf16 else "float32")
    return parallelism, training, CompileConfig(enable=compile, components=["model", "loss"])


def _build(layout: PeerLayout, shape: dict, hf_state: dict, device: torch.device, compile: bool, bf16: bool):
    """torchtitan's model parts on this rank, the pipeline schedule (None without pp), the loss and its meshes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.llama3 import parallelize_llama

    set_spmd_backend("partial_dtensor")  # as its trainer does from the config: DTensor on the model-parallel axes
    parallelism, training, compile_config = _configs(layout, shape, compile, bf16)
    shard, replicate = (layout.dp, 1) if layout.sharded else (1, layout.dp)
    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, cp=1, tp=layout.tp, pp=layout.pp, ep=1,
                        world_size=layout.world, spmd_backend="partial_dtensor")
    config = _model_config(shape)
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=shape["vocab"]), compile_config=compile_config)
    common = dict(parallel_dims=dims, training=training, parallelism=parallelism, compile_config=compile_config,
                  ac_config=None, dump_folder=tempfile.gettempdir())
    schedule = None
    if layout.pp > 1:
        schedule, parts, _, _ = pipeline_llm(model, device=device, model_config=config,
                                             parallelize_fn=parallelize_llama, loss_fn=loss_fn, **common)
    else:
        parts = [parallelize_llama(model, **common)]
    full = torchtitan_state(hf_state, shape["heads"], shape["kv_heads"])
    for part in parts:
        part.to_empty(device=device)
        with torch.no_grad():
            part.init_weights(buffer_device=None)  # the RoPE cache; the weights are replaced next
        own = {k: v for k, v in full.items() if k in part.state_dict()}
        set_model_state_dict(part, own, options=StateDictOptions(full_state_dict=True, strict=False))
        part.train()
        if device.type == "cpu":
            sum_reduction_for_gloo(part)
    return parts, schedule, loss_fn, dims


def torchtitan_peer(layout: PeerLayout, hf_state: dict, batch: dict, shape: dict, device: torch.device,
                    compile: bool = False, bf16: bool = False) -> Peer:
    """This rank's torchtitan model parts, optimizer and training step (see the module docstring); ``bf16``: its
    mixed precision (FSDP2's bf16 parameters for compute, fp32 masters and reductions), as its GPU recipes run."""
    if device.type == "cpu":
        torchtitan_on_cpu()
    parts, schedule, loss_fn, dims = _build(layout, shape, hf_state, device, compile, bf16)
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed.utils import clip_grad_norm_

    params = [p for part in parts for p in part.parameters()]
    pp_mesh = dims.get_mesh("pp") if layout.pp > 1 else None
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=True)
    dp_mesh = dims.get_mesh("fsdp" if layout.sharded else "dp_replicate") if layout.dp > 1 else None
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    ids = local_rows(batch["input_ids"], dp_rank, layout.dp).to(device)
    inputs = ids  # next-token targets; the last position has none (ignored), as Hugging Face's shifted labels
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    tokens = torch.tensor(float(ids.shape[0] * (ids.shape[1] - 1) * layout.dp), device=device)  # global targets
    pp_rank = dims.get_mesh("pp").get_local_rank() if layout.pp > 1 else 0
    first, last = pp_rank == 0, pp_rank == layout.pp - 1

    def forward_backward() -> torch.Tensor | None:
        if schedule is None:
            loss, _ = loss_fn(parts[0](inputs), labels, tokens)
            loss.backward()
            return loss.detach()
        losses: list = []
        # torch 2.13's schedules split the batch themselves: step(whole batch, target=...).  torchtitan 0.3.0's
        # trainer passes pre-split arg_mbs= (trainer.py:856), an API of a newer torch than this one.
        args = (inputs,) if first else ()
        schedule.step(*args, target=labels if last else None, losses=losses if last else None,
                      loss_kwargs={"global_valid_tokens": tokens}, return_outputs=False)
        return torch.stack(losses).sum().detach() if last else None

    def step() -> float | None:
        optimizer.zero_grad()
        loss = forward_backward()
        clip_grad_norm_(params, math.inf, foreach=True, pp_mesh=pp_mesh)  # the global norm, as its step reads it
        optimizer.step()
        if loss is None:
            return None
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        if layout.dp > 1:  # each dp rank's sum over its tokens / the global count: the global mean is their sum
            dist.all_reduce(loss, group=dp_mesh.get_group())
        return float(loss)

    return Peer(step=step, reports_loss=last)
