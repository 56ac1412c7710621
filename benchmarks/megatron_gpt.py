"""The benchmarks' GPT written by hand for tensor parallelism, the way Megatron-LM does it.

This is the baseline fxshard's generated code should match: the same architecture as
``benchmarks/models/gpt.py``, with

- ``f`` (:class:`CopyToParallel`): identity forward, all-reduce of the gradient backward, at the
  input of every column-parallel region;
- ``g`` (:class:`ReduceFromParallel`): all-reduce forward, identity backward, at the output of every
  row-parallel linear (the bias is added after the sum, once);
- a vocab-parallel token embedding (each rank looks up its rows, then ``g``), tied to the LM head,
  which is column-parallel over the vocabulary and feeds Megatron-LM's vocab-parallel cross entropy
  (:class:`VocabParallelCrossEntropy`, as in ``megatron/core/tensor_parallel/cross_entropy.py``):
  three all-reduces of one number per token (the logits' max, the target's logit, the sum of the
  exponentials), and the logits are never gathered.

Per layer that is 2 all-reduces forward and 2 backward; the embedding adds one forward, the LM
head's ``f`` one backward, the loss three small forward all-reduces.  It does the same matrix work, in
the same order, as fxshard's code for that model (``fxshard compile benchmarks/models/gpt.py --tp 2``),
whose cross entropy gathers each rank's logsumexp and target logit instead (one all-gather), so the
losses agree to rounding::

    model = MegatronGPT(full_model, group=dist.group.WORLD)   # slices full_model's weights
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's ``_VocabParallelCrossEntropy``: per-token loss from logits split over the vocabulary.

    Forward all-reduces the max (for stability), the target's logit (held by one rank) and the sum of
    the exponentials; backward is local: softmax minus the one-hot target, times the incoming gradient.
    """

    @staticmethod
    def forward(ctx, logits, target, start, end, group):
        logits_max = logits.max(dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= end)
        local = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)
        exp_logits = logits.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local)
        return torch.log(sum_exp) - predicted

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local = ctx.saved_tensors
        grad_input = softmax.clone()
        grad_input.scatter_add_(-1, local.unsqueeze(-1), (outside.to(softmax.dtype) - 1).unsqueeze(-1))
        return grad_input.mul_(grad.unsqueeze(-1)), None, None, None, None


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.detach().chunk(world, dim=0)[rank].clone()


def _cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.detach().chunk(world, dim=1)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """``y_r = x W_r^T + b_r`` with this rank's rows of ``W`` and ``b``; the input must have passed ``f``."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(_rows(full.weight, rank, world))
        self.bias = nn.Parameter(_rows(full.bias, rank, world)) if full.bias is not None else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = g(x_r W_r^T) + b`` with this rank's columns of ``W``; ``b`` is whole and added once."""

    def __init__(self, full: nn.Linear, rank: int, world: int, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(_cols(full.weight, rank, world))
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return ReduceFromParallel.apply(F.linear(x, self.weight), self.group) + self.bias


class ParallelAttention(nn.Module):
    def __init__(self, full, rank: int, world: int, group):
        super().__init__()
        self.group, self.local_heads = group, full.heads // world
        self.q_proj = ColumnParallelLinear(full.q_proj, rank, world)
        self.k_proj = ColumnParallelLinear(full.k_proj, rank, world)
        self.v_proj = ColumnParallelLinear(full.v_proj, rank, world)
        self.o_proj = RowParallelLinear(full.o_proj, rank, world, group)

    def forward(self, x):
        b, s, _ = x.shape
        x = CopyToParallel.apply(x, self.group)
        q = self.q_proj(x).view(b, s, self.local_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.local_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.local_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class ParallelMLP(nn.Module):
    def __init__(self, full, rank: int, world: int, group):
        super().__init__()
        self.group = group
        self.fc_in = ColumnParallelLinear(full.fc_in, rank, world)
        self.fc_out = RowParallelLinear(full.fc_out, rank, world, group)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(CopyToParallel.apply(x, self.group))))


class ParallelBlock(nn.Module):
    def __init__(self, full, rank: int, world: int, group):
        super().__init__()
        self.ln_1, self.ln_2 = _copy_layer_norm(full.ln_1), _copy_layer_norm(full.ln_2)
        self.attn = ParallelAttention(full.attn, rank, world, group)
        self.mlp = ParallelMLP(full.mlp, rank, world, group)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _copy_layer_norm(full: nn.LayerNorm) -> nn.LayerNorm:
    ln = nn.LayerNorm(full.normalized_shape, eps=full.eps)
    ln.load_state_dict(full.state_dict())
    return ln


class MegatronGPT(nn.Module):
    """This rank's part of a tensor-parallel GPT; ``forward(idx, targets)`` returns the loss."""

    def __init__(self, full, group=None):
        super().__init__()
        self.group = group = group or dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        vocab = full.wte.weight.shape[0]
        self.vocab_start, self.vocab_end = rank * vocab // world, (rank + 1) * vocab // world
        # one parameter for the tied token embedding and LM head: this rank's vocabulary rows
        self.wte_weight = nn.Parameter(_rows(full.wte.weight, rank, world))
        self.wpe = nn.Embedding.from_pretrained(full.wpe.weight.detach().clone(), freeze=False)
        self.blocks = nn.ModuleList(ParallelBlock(b, rank, world, group) for b in full.blocks)
        self.ln_f = _copy_layer_norm(full.ln_f)

    def embed(self, idx):
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = F.embedding((idx - self.vocab_start).masked_fill(outside, 0), self.wte_weight)
        return ReduceFromParallel.apply(local.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        x = CopyToParallel.apply(self.ln_f(x), self.group)
        logits = F.linear(x, self.wte_weight)
        losses = VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 self.vocab_start, self.vocab_end, self.group)
        return losses.mean()
