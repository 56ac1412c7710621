"""Megatron-Core as its users train with it: ``GPTModel`` with the local (non-Transformer-Engine) layer spec,
wrapped in its ``DistributedDataParallel``, stepped by its own schedule (``get_forward_backward_func``: no pipelining,
or 1F1B over ``pp`` stages) and its own optimizer (``get_megatron_optimizer``: Adam on fp32 masters, the distributed
optimizer under dp > 1, gradient norm over the model-parallel ranks).

The weights are the Hugging Face model's (:func:`benchmarks.peers.weights.megatron_state`); the batch is the same
global batch, each dp rank taking its rows, each pipeline microbatch a slice of those.  Megatron computes the loss per
token ([b, s]); the last position of each sequence has no next token, so its loss is masked out, as Hugging Face's
shifted labels leave it out::

    peer = megatron_peer(layout, hf_state, batch, shape, torch.device("cpu"))
    loss = peer.step()      # the global batch's mean loss on every rank of the last stage, None elsewhere
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from benchmarks.peers.common import Peer, PeerLayout, local_rows, microbatches
from benchmarks.peers.shims import megatron_on_cpu
from benchmarks.peers.weights import megatron_state

# why Megatron's dp layouts on the CPU all-reduce the gradients (DDP) instead of sharding the optimizer (ZeRO 1)
DISTOPT_ON_CPU = ("megatron/core/optimizer/distrib_optimizer.py:420 accepts only `torch.cuda.FloatTensor` (and half "
                  "types) parameters: `TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, "
                  "torch.cuda.HalfTensor, or torch.cuda.BFloat16Tensor. Received torch.FloatTensor`")


def _config(shape: dict, layout: PeerLayout, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.models.peer_llama import NORM_EPS

    return TransformerConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
        num_attention_heads=shape["heads"], num_query_groups=shape["kv_heads"],
        kv_channels=shape["hidden"] // shape["heads"],
        normalization="RMSNorm", layernorm_epsilon=NORM_EPS, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, sequence_parallel=False)


def _model(shape: dict, layout: PeerLayout, hf_state: dict, device: torch.device, dtype: torch.dtype):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from benchmarks.models.peer_llama import ROPE_THETA

    config = _config(shape, layout, dtype)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=shape["vocab"], max_sequence_length=shape["seq"], pre_process=first,
                     post_process=last, position_embedding_type="rope", rotary_base=int(ROPE_THETA),
                     share_embeddings_and_output_weights=False)
    per = shape["layers"] // layout.pp
    state = megatron_state(hf_state, shape["heads"], shape["kv_heads"], layout.tp,
                           ps.get_tensor_model_parallel_rank(), range(pp_rank * per, (pp_rank + 1) * per), first, last)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    return model.to(device), config, first, last


def megatron_peer(layout: PeerLayout, hf_state: dict, batch: dict, shape: dict, device: torch.device,
                  dtype: torch.dtype = torch.float32) -> Peer:
    """This rank's Megatron-Core model, optimizer and training step (see the module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    on_cpu = device.type == "cpu"
    distributed_optimizer = layout.dp > 1 and not on_cpu  # on the CPU it refuses the parameters (DISTOPT_ON_CPU)
    with megatron_on_cpu(on_cpu):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
        model, config, first, last = _model(shape, layout, hf_state, device, dtype)
        ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer))
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=0.0,
            bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=distributed_optimizer), [ddp])
    ids = local_rows(batch["input_ids"], ps.get_data_parallel_rank(), layout.dp).to(device)
    micro = microbatches(_megatron_batch(ids), layout.microbatches)
    fwd_bwd, dp_group = get_forward_backward_func(), ps.get_data_parallel_group()

    def forward_step(data_iterator, module):
        mb = next(data_iterator)
        out = module(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"])

        def loss_func(per_token):
            loss = (per_token.float() * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides the loss in place
        return out, loss_func

    def step() -> float | None:
        with megatron_on_cpu(on_cpu):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            found = fwd_bwd(forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp],
                            num_microbatches=len(micro), seq_length=shape["seq"],
                            micro_batch_size=micro[0]["tokens"].shape[0], forward_only=False)
            optimizer.step()
        if not last:
            return None
        loss = torch.stack([f["lm loss"] for f in found]).mean()
        if layout.dp > 1:  # the global batch's mean: each dp rank's microbatches hold as many tokens
            dist.all_reduce(loss, group=dp_group)
            loss /= layout.dp
        return float(loss)

    return Peer(step=step, context=contextlib.nullcontext, reports_loss=last)


def _megatron_batch(ids: torch.Tensor) -> dict:
    """GPTModel's inputs for ``ids`` ([b, s]): positions, the causal mask (True: masked out), labels shifted left and
    the loss mask that leaves out each sequence's last position."""
    b, s = ids.shape
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    loss_mask = torch.ones(b, s, device=ids.device)
    loss_mask[:, -1] = 0
    return {"tokens": ids, "labels": labels, "loss_mask": loss_mask,
            "position_ids": torch.arange(s, device=ids.device).unsqueeze(0).expand(b, -1),
            "attention_mask": torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), 1)[None, None]}
