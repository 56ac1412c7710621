"""One set of initial weights for every tool: the Hugging Face Llama's state dict (what fxshard compiles, seed 0)
renamed and rearranged into torchtitan's ``Llama3Model`` and Megatron-Core's ``GPTModel`` (local spec).

- **torchtitan** keeps one linear per projection but rotates query/key pairs as complex numbers (adjacent pairs,
  Meta's layout), where Hugging Face rotates halves: q and k rows are permuted back, as torchtitan's own
  ``Llama3StateDictAdapter.from_hf`` does (``_reverse_permute``).
- **Megatron-Core** rotates halves like Hugging Face (``rotary_interleaved=False``), but fuses q, k and v into one
  ``linear_qkv`` laid out per key/value group (the group's query heads, then its key, then its value) and gate and up
  into one ``linear_fc1`` ([gate; up]); under tensor parallelism each rank holds its own groups and its own slice of
  gate and of up, so the fused tensors are built per rank.  Pipeline stages number their layers from 0.

Pure tensor work (no peer imported), so it is checked without the peers installed::

    tt = torchtitan_state(hf.state_dict(), heads=8, kv_heads=4)
    mc = megatron_state(hf.state_dict(), heads=8, kv_heads=4, tp=2, tp_rank=0, layers=range(0, 2), first=True,
                        last=False)
"""

from __future__ import annotations

import torch

HF_LAYER = "model.layers.{}."


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half row order of q (or k) back to Meta's adjacent pairs (torchtitan's
    ``_reverse_permute``)."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def torchtitan_state(hf: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of torchtitan's ``Llama3Model`` (``fuse_qkv=False``) holding ``hf``'s
    weights; torch.distributed.checkpoint's ``set_model_state_dict`` shards it onto a parallelized model."""
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
           "lm_head.weight": hf["lm_head.weight"]}
    for i in range(_layer_count(hf)):
        src, dst = HF_LAYER.format(i), f"layers.{i}."
        out |= {dst + "attention.qkv_linear.wq.weight": _unpermute(hf[src + "self_attn.q_proj.weight"], heads),
                dst + "attention.qkv_linear.wk.weight": _unpermute(hf[src + "self_attn.k_proj.weight"], kv_heads),
                dst + "attention.qkv_linear.wv.weight": hf[src + "self_attn.v_proj.weight"],
                dst + "attention.wo.weight": hf[src + "self_attn.o_proj.weight"],
                dst + "feed_forward.w1.weight": hf[src + "mlp.gate_proj.weight"],
                dst + "feed_forward.w2.weight": hf[src + "mlp.down_proj.weight"],
                dst + "feed_forward.w3.weight": hf[src + "mlp.up_proj.weight"],
                dst + "attention_norm.weight": hf[src + "input_layernorm.weight"],
                dst + "ffn_norm.weight": hf[src + "post_attention_layernorm.weight"]}
    return out


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Megatron's ``linear_qkv`` rows: per key/value group, its ``heads // kv_heads`` query heads, its key, its
    value."""
    per = heads // kv_heads
    d = q.shape[0] // heads
    qg, kg, vg = q.view(kv_heads, per * d, -1), k.view(kv_heads, d, -1), v.view(kv_heads, d, -1)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, q.shape[1])


def megatron_state(hf: dict[str, torch.Tensor], heads: int, kv_heads: int, tp: int, tp_rank: int,
                   layers: range, first: bool, last: bool) -> dict[str, torch.Tensor]:
    """The state dict of one Megatron-Core ``GPTModel`` rank (local spec, RMSNorm, SwiGLU, no biases): tensor-parallel
    rank ``tp_rank`` of ``tp``, holding global ``layers`` (numbered from 0 on its stage), the embedding if ``first``,
    the final norm and output layer if ``last``."""

    def rows(t):  # column-parallel: this rank's rows
        return t.chunk(tp, dim=0)[tp_rank].contiguous()

    def cols(t):  # row-parallel: this rank's columns
        return t.chunk(tp, dim=1)[tp_rank].contiguous()

    out = {}
    if first:
        out["embedding.word_embeddings.weight"] = rows(hf["model.embed_tokens.weight"])
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        out["output_layer.weight"] = rows(hf["lm_head.weight"])
    for local, i in enumerate(layers):
        src, dst = HF_LAYER.format(i), f"decoder.layers.{local}."
        qkv = _fused_qkv(hf[src + "self_attn.q_proj.weight"], hf[src + "self_attn.k_proj.weight"],
                         hf[src + "self_attn.v_proj.weight"], heads, kv_heads)
        out |= {dst + "input_layernorm.weight": hf[src + "input_layernorm.weight"],
                dst + "self_attention.linear_qkv.weight": rows(qkv),  # whole groups per rank
                dst + "self_attention.linear_proj.weight": cols(hf[src + "self_attn.o_proj.weight"]),
                dst + "pre_mlp_layernorm.weight": hf[src + "post_attention_layernorm.weight"],
                dst + "mlp.linear_fc1.weight": torch.cat([rows(hf[src + "mlp.gate_proj.weight"]),
                                                          rows(hf[src + "mlp.up_proj.weight"])]),
                dst + "mlp.linear_fc2.weight": cols(hf[src + "mlp.down_proj.weight"])}
    return out


def _layer_count(hf: dict) -> int:
    return len({k.split(".")[2] for k in hf if k.startswith("model.layers.")})
