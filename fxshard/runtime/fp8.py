"""FP8 linears (``--dtype fp8``, ``--fp8 tensorwise|rowwise``): torchao's float8 training recipes, in the runtime.

A linear ``y = x @ w.T`` computes its three matrix products in float8 with dynamic scaling, as torchao 0.18's
``Float8Linear`` does (``torchao/float8/float8_linear.py``, ``float8_scaling_utils.py``, ``float8_ops.py``): each
operand's scale is ``finfo(fp8).max / amax`` (in float64, then float32; rowwise: rounded down to a power of 2), the
operand is scaled, clamped and cast, and ``torch._scaled_mm`` multiplies with the inverse scales into the input's dtype.
tensorwise: one scale per tensor, e4m3 forward, e5m2 for the output gradient; rowwise: one scale per row of each
product's operands (per token, per output or input feature), e4m3 everywhere.  The high-precision input and weight are
saved for backward and cast again there, as torchao does.  Same math, bit for bit (``tests/runtime/test_fp8_linear.py``
against torchao's ``Float8Linear`` on one device), written here because the runtime depends on torch alone and torchao's
tensor subclass does not capture with ``torch.export`` (torch 2.13: "Unable to cast NotImplemented to Tensor").

Under tensor parallelism a scale must be the one the whole tensor has on one device: where the linear's weight is
split (``split="out"``: column-parallel, ``"in"``: row-parallel), or its input's tokens are (``"rows"``: a linear
tp leaves whole reading sequence parallelism's shard, such as MLA's down-projections), the amaxes that span the split
dimension are all-reduced with MAX over the tp group, once in forward and once in backward, each one small buffer
(:func:`amax_elements`); a rowwise amax per feature of features tp splits, or per token of tokens it splits, is each
rank's own, and is not::

    y = fp8_linear(x, w, b, "tensorwise")                          # one device, or a linear tp does not split
    y = fp8_linear_tp(x, groups["tp"], w, b, "tensorwise", "in")   # row-parallel: partial sums, global scales

Under sequence parallelism the column-parallel linears that read one gathered input are one
:func:`fp8_linears_regathered` call, which keeps the shard for backward (passes/overlap.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from fxshard.runtime.guard import call_site as _site
from fxshard.runtime.guard import guarded

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's: no division by zero for an all-zero tensor
SPLITS = (None, "in", "out", "rows")  # which dimension of the weight the tp group splits; rows: the input's tokens


@dataclass(frozen=True)
class Recipe:
    """One of torchao's ``Float8LinearRecipeName``s: the granularity, the gradient's fp8 dtype, the scale rounding."""

    name: str
    rowwise: bool
    grad_dtype: torch.dtype
    pow2: bool


RECIPES = {"tensorwise": Recipe("tensorwise", False, E5M2, False), "rowwise": Recipe("rowwise", True, E4M3, True)}
# torchtitan's default filter_fqns: the vocabulary projection keeps its precision; LoRA adapters too (their rank is
# far below what an fp8 product repays, and docs/lora.md keeps them at the run's dtype)
SKIPPED_NAMES = ("lm_head", "output")
ALIGN = 16  # torch._scaled_mm on CUDA needs both dimensions multiples of 16 (torchao's filter)


def fp8_module(fqn: str, module: torch.nn.Module) -> bool:
    """Whether the module at ``fqn`` computes in fp8: an ``nn.Linear`` with both sizes multiples of 16, not the
    output head (``lm_head``, ``output``) and not a LoRA adapter; the compile and the single-device reference ask
    this same question::

        >>> linear = torch.nn.Linear(64, 128)
        >>> fp8_module("layers.0.mlp.up_proj", linear), fp8_module("lm_head", linear)
        (True, False)
    """
    if not isinstance(module, torch.nn.Linear):
        return False
    if fqn.rsplit(".", 1)[-1] in SKIPPED_NAMES or re.search(r"\.lora_(A|B)\.", f".{fqn}."):
        return False
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def _amax(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """torchao's ``tensor_to_amax``: the largest magnitude, of the whole tensor or along ``dim`` (kept)."""
    return torch.max(torch.abs(t)) if dim is None else torch.amax(torch.abs(t), dim=dim, keepdim=True)


def _scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """torchao's ``amax_to_scale``: fp8's largest value over the amax, in float64, as float32."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def _cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's ``_ToFloat8ConstrFunc``: scaled in float32, saturated, cast."""
    top = torch.finfo(dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(0) > t.stride(1) and t.stride(1) == 1


def _mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
        fast_accum: bool) -> torch.Tensor:
    """torchao's ``preprocess_addmm`` + ``addmm_float8_unwrapped``: ``a`` row-major, ``b`` column-major, the
    inverse scales; rowwise without fast accumulation scales after the product, and runs in bf16 for a float32
    output (``torch._scaled_mm`` has no rowwise float32 output)."""
    a = a if _row_major(a) else a.contiguous()
    b = b.t().contiguous().t() if _row_major(b) else b
    a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
    rowwise = a_scale.dim() == 2
    post = None
    if rowwise and not fast_accum:
        post = a_inv * b_inv
        a_inv = a_inv.new_ones(())
        b_inv = a_inv.new_ones(())
    dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=dtype, use_fast_accum=fast_accum)
    if post is not None:
        out *= post
    return out.to(out_dtype) if dtype != out_dtype else out


def amax_elements(recipe: str, rows, in_features: int, out_features: int, direction: str, split: str = "in"):
    """The float32 values one ``fp8_linear_tp`` call all-reduces (MAX) in ``direction`` (local sizes): tensorwise, the
    input's and the weight's amax forward, the gradient's backward; rowwise, each token's amax (of the input forward,
    of the gradient backward), and the weight's per output feature forward where tp splits its input features
    (``split="in"``), per input feature backward where tp splits its output features (``"out"``), the amaxes that
    span the split; a per-feature amax of features tp splits is each rank's own.  Tokens split (``"rows"``,
    rowwise): forward the weight's per output feature (the same on every rank: one all-reduce a direction, as every
    call), backward the weight gradient's amaxes over the tokens, the output gradient's per output feature and the
    input's per input feature::

        >>> amax_elements("tensorwise", 64, 32, 16, "forward"), amax_elements("rowwise", 64, 32, 16, "backward", "out")
        (2, 96)
        >>> [amax_elements("rowwise", 64, 32, 16, direction, "rows") for direction in ("forward", "backward")]
        [16, 48]
    """
    if not RECIPES[recipe].rowwise:
        return 2 if direction == "forward" else 1
    if split == "rows":
        return out_features if direction == "forward" else out_features + in_features
    if direction == "forward":
        return rows + (out_features if split == "in" else 0)
    return rows + (in_features if split == "out" else 0)


def _reduced(amaxes: list[torch.Tensor], group, what: str, site) -> list[torch.Tensor]:
    """Each amax all-reduced with MAX over ``group``, all in one buffer."""
    flat = torch.cat([a.reshape(-1).to(torch.float32) for a in amaxes])
    if torch.compiler.is_compiling():
        flat = funcol.all_reduce(flat, "max", group)
    else:
        with guarded(what, group, flat, site):
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    out, at = [], 0
    for a in amaxes:
        out.append(flat[at:at + a.numel()].view(a.shape).to(a.dtype))
        at += a.numel()
    return out


class _Fp8Matmul(torch.autograd.Function):
    """torchao's ``matmul_with_hp_or_float8_args`` on 2-D ``x`` and the weight ``w`` (``[out, in]``)."""

    @staticmethod
    def forward(ctx, x, w, recipe: Recipe, group, split, site):
        ctx.recipe, ctx.group, ctx.split, ctx.site = recipe, group, split, site
        ctx.save_for_backward(x, w)
        wt = w.t()
        amax_x, amax_w = _amax(x, -1 if recipe.rowwise else None), _amax(wt, 0 if recipe.rowwise else None)
        if group is not None and (split == "in" or not recipe.rowwise):  # every amax spans the split
            amax_x, amax_w = _reduced([amax_x, amax_w], group, "all_reduce max (fp8 amax of fp8_linear_tp)", site)
        elif group is not None and split == "rows":  # rowwise, tokens split: each token's amax is its rank's own;
            # the weight is whole, its amaxes the same on every rank (reduced all the same: the call's one op)
            (amax_w,) = _reduced([amax_w], group, "all_reduce max (fp8 amax of fp8_linear_tp)", site)
        elif group is not None:  # rowwise, output features split: the weight's are each rank's own; x is whole
            (amax_x,) = _reduced([amax_x], group, "all_reduce max (fp8 amax of fp8_linear_tp)", site)
        sx, sw = _scale(amax_x, E4M3, recipe.pow2), _scale(amax_w, E4M3, recipe.pow2)
        ctx.scales = (sx, sw)
        return _mm(_cast(x, sx, E4M3), sx, _cast(wt, sw, E4M3), sw, x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        r = ctx.recipe
        wt = w.t()
        amax_g = _amax(grad, -1 if r.rowwise else None)
        over_tokens = None  # rowwise: the weight gradient's amaxes over the tokens, where tp splits them
        if r.rowwise and ctx.split == "rows":  # each token's amaxes and the whole weight's are this rank's own
            sg, sw = _scale(amax_g, r.grad_dtype, r.pow2), _scale(_amax(wt, -1), E4M3, r.pow2)
            over_tokens = _reduced([_amax(grad, 0), _amax(x, 0)], ctx.group,
                                   "all_reduce max (fp8 amax of fp8_linear_tp, backward)", ctx.site)
        elif r.rowwise:  # the weight again, per input feature (torchao's weight_for_grad_input cast)
            amaxes = [amax_g, _amax(wt, -1)]
            spanning = amaxes if ctx.split == "out" else amaxes[:1]  # input features split: each rank's own
            if ctx.group is not None:
                spanning = _reduced(spanning, ctx.group, "all_reduce max (fp8 amax of fp8_linear_tp, backward)",
                                    ctx.site)
                amaxes = spanning + amaxes[len(spanning):]
            sg, sw = _scale(amaxes[0], r.grad_dtype, r.pow2), _scale(amaxes[1], E4M3, r.pow2)
        else:  # tensorwise: the weight's scale is forward's (torchao casts the same weight again, to the same)
            if ctx.group is not None:
                (amax_g,) = _reduced([amax_g], ctx.group, "all_reduce max (fp8 amax of fp8_linear_tp, backward)",
                                     ctx.site)
            sg, sw = _scale(amax_g, r.grad_dtype, r.pow2), ctx.scales[1]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt8 = _cast(wt, sw, E4M3)
            dx = _mm(_cast(grad, sg, r.grad_dtype), sg, wt8.t(), sw.t(), grad.dtype, fast_accum=False)
        if ctx.needs_input_grad[1]:
            if r.rowwise:  # per output feature and per input feature, over the tokens (all ranks' under "rows")
                amax_gt, amax_xt = over_tokens if over_tokens is not None else (_amax(grad, 0), _amax(x, 0))
                sg = _scale(amax_gt, r.grad_dtype, r.pow2)
                sx = _scale(amax_xt, E4M3, r.pow2)
            else:
                sx = ctx.scales[0]
            g8t = _cast(grad, sg, r.grad_dtype).t()
            dw = _mm(g8t, sg.t(), _cast(x, sx, E4M3), sx, grad.dtype, fast_accum=False)
        return dx, dw, None, None, None, None


_FORWARD = "all_reduce max (fp8 amaxes of fp8_linears_regathered)"
_BACKWARD = "all_reduce max (fp8 amaxes of fp8_linears_regathered, backward)"
_REGATHER = ("all_gather (backward of fp8_linears_regathered: their input again, overlapped with the input "
             "gradient)")


class _Fp8LinearsRegathered(torch.autograd.Function):
    """The column-parallel fp8 linears reading ``gathered``, the sp all-gather of ``shard`` over ``group`` along
    ``dim``: :class:`_Fp8Matmul` at ``split="out"`` for each weight, kept as
    :class:`fxshard.runtime.collectives._LinearsRegathered` keeps its linears.  Forward: the input's amax and the
    weights' (tensorwise) in one all-reduce, the input cast once, each product.  Saved: ``shard`` (1/tp of the input)
    and the weights.  Backward: the gradients' amaxes (rowwise: and the weights' per input feature) in one
    all-reduce; the all-gather of ``shard`` started; the input gradient computed while it runs; then each weight's
    gradient from the input gathered again, cast with forward's scale (tensorwise) or its own per feature
    (rowwise), as torchao casts the saved input.  The same operations on the same values as the unfused
    ``fp8_linear_tp`` calls: equal bit for bit.  ``group`` None: forward only, no amax reduced (the cost model's
    trace of what it saves)."""

    @staticmethod
    def forward(ctx, gathered, shard, recipe: Recipe, groups, dim, site, n, *weights):
        group, amax_group = groups  # the gather's (tp) and the amaxes' (tp; cp_tp under --cp)
        flat = gathered.reshape(-1, gathered.shape[-1])
        wts = [w.t() for w in weights]
        amax_x = _amax(flat, -1 if recipe.rowwise else None)
        amax_ws = [_amax(wt, 0 if recipe.rowwise else None) for wt in wts]
        if amax_group is not None and recipe.rowwise:  # the weights' per output feature: each rank's own ("out")
            (amax_x,) = _reduced([amax_x], amax_group, _FORWARD, site)
        elif amax_group is not None:
            amax_x, *amax_ws = _reduced([amax_x, *amax_ws], amax_group, _FORWARD, site)
        sx = _scale(amax_x, E4M3, recipe.pow2)
        sws = [_scale(a, E4M3, recipe.pow2) for a in amax_ws]
        ctx.recipe, ctx.group, ctx.amax_group, ctx.dim, ctx.site = recipe, group, amax_group, dim, site
        ctx.scales = (sx, sws)
        ctx.save_for_backward(shard, *weights)
        x8 = _cast(flat, sx, E4M3)
        return tuple(_mm(x8, sx, _cast(wt, sw, E4M3), sw, flat.dtype, fast_accum=True)
                     .reshape(*gathered.shape[:-1], wt.shape[1]) for wt, sw in zip(wts, sws, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        shard, *weights = ctx.saved_tensors
        r, n = ctx.recipe, len(weights)
        flat = [g.reshape(-1, g.shape[-1]) for g in grads]
        wts = [w.t() for w in weights]
        amaxes = [_amax(g, -1 if r.rowwise else None) for g in flat]
        if r.rowwise:  # the weights again, per input feature: the output features they span are split
            amaxes += [_amax(wt, -1) for wt in wts]
        amaxes = _reduced(amaxes, ctx.amax_group, _BACKWARD, ctx.site)
        sgs = [_scale(a, r.grad_dtype, r.pow2) for a in amaxes[:n]]
        sws = [_scale(a, E4M3, r.pow2) for a in amaxes[n:]] if r.rowwise else ctx.scales[1]
        parts = [torch.empty_like(shard, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(ctx.group))]
        with guarded(_REGATHER, ctx.group, shard, ctx.site):
            work = dist.all_gather(parts, shard.contiguous(), group=ctx.group, async_op=True)  # start
            # the input gradient, summed as autograd sums what the linears send it: the last linear's first
            dx = None
            for g, sg, wt, sw in reversed(list(zip(flat, sgs, wts, sws, strict=True))):
                part = _mm(_cast(g, sg, r.grad_dtype), sg, _cast(wt, sw, E4M3).t(), sw.t(), g.dtype, fast_accum=False)
                dx = part if dx is None else dx + part
            work.wait()
        x = torch.cat(parts, dim=ctx.dim)
        xf = x.reshape(-1, x.shape[-1])
        sx = _scale(_amax(xf, 0), E4M3, r.pow2) if r.rowwise else ctx.scales[0]  # per input feature, over tokens
        x8 = _cast(xf, sx, E4M3)  # once for every weight gradient (the same scale)
        dws = []
        for i, (g, sg) in enumerate(zip(flat, sgs, strict=True)):
            if not ctx.needs_input_grad[7 + i]:
                dws.append(None)
                continue
            if r.rowwise:  # per output feature, over the tokens (never split by tp)
                sg = _scale(_amax(g, 0), r.grad_dtype, r.pow2)
            dws.append(_mm(_cast(g, sg, r.grad_dtype).t(), sg.t(), x8, sx, g.dtype, fast_accum=False))
        return dx.reshape(x.shape), None, None, None, None, None, None, *dws


def _linear(x: torch.Tensor, group, weight: torch.Tensor, bias, recipe: str, split) -> torch.Tensor:
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    if split not in SPLITS:
        raise ValueError(f"fp8_linear_tp split {split!r}: expected 'in', 'out' or 'rows'")
    flat = x.reshape(-1, x.shape[-1])
    out = _Fp8Matmul.apply(flat, weight, RECIPES[recipe], group, split,
                           None if group is None or torch.compiler.is_compiling() else _site())
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out + bias.to(out.dtype) if bias is not None else out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: str = "tensorwise") -> torch.Tensor:
    """``linear(x, weight, bias)`` with its products in float8 (torchao's ``recipe``), no communication."""
    return _linear(x, None, weight, bias, recipe, None)


def fp8_linear_tp(x: torch.Tensor, group, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  recipe: str = "tensorwise", split: str = "out") -> torch.Tensor:
    """:func:`fp8_linear` on a linear whose weight ``group`` splits (``split``: its ``"out"`` or ``"in"``
    dimension), or whose input's tokens it splits (``"rows"``, the weight whole): the amaxes all-reduced with MAX over
    ``group`` forward and backward, so every scale is the one the whole tensor has on one device."""
    return _linear(x, group, weight, bias, recipe, split)


def fp8_linears_regathered(x: torch.Tensor, group, shard: torch.Tensor, dim: int, weights: tuple, biases: tuple,
                           recipe: str = "tensorwise", amax_group=None) -> tuple[torch.Tensor, ...]:
    """``fp8_linear_tp(x, amax_group, weights[i], biases[i], recipe, "out")`` for each i, where ``x`` is
    ``gather_to(shard, group, dim)`` (sequence parallelism's column-parallel input): saving ``shard`` for backward
    rather than ``x`` and all-gathering it again there, as :func:`fxshard.runtime.collectives.linears_regathered` does
    for the linears it fuses (1/tp of the bytes); the amaxes of all the products in one all-reduce each way, over
    ``amax_group`` (default ``group``; under ``--cp`` the cp and tp ranks, tensorwise).  Under torch.compile, the
    ``fp8_linear_tp`` calls, for the compiler to choose what it saves."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    amax_group = group if amax_group is None else amax_group
    if amax_group is not group and RECIPES[recipe].rowwise:
        raise ValueError("fp8_linears_regathered: rowwise scales per token are each tp group's own; an amax_group "
                         "beyond the gather's group is tensorwise's")
    if torch.compiler.is_compiling():
        return tuple(_linear(x, amax_group, w, b, recipe, "out") for w, b in zip(weights, biases, strict=True))
    site = None if group is None else _site()
    outs = _Fp8LinearsRegathered.apply(x, shard, RECIPES[recipe], (group, amax_group), dim, site, len(weights),
                                       *weights)
    return tuple(out + b.to(out.dtype) if b is not None else out for out, b in zip(outs, biases, strict=True))


def fp8_amax_elements(recipe: str, rows, weights: list[tuple[int, int]], direction: str) -> int:
    """The float32 values one :func:`fp8_linears_regathered` call all-reduces (MAX) in ``direction``, its ``weights``
    (local ``[out, in]`` shapes) reading ``rows`` tokens: tensorwise, the input's amax and each weight's forward, each
    gradient's backward; rowwise, each token's forward (the weights' per output feature are each rank's own), each
    gradient's per token and each weight's per input feature backward::

        >>> qkv = [(16, 32)] * 3
        >>> fp8_amax_elements("tensorwise", 64, qkv, "forward"), fp8_amax_elements("rowwise", 64, qkv, "backward")
        (4, 288)
    """
    if not RECIPES[recipe].rowwise:
        return 1 + len(weights) if direction == "forward" else len(weights)
    if direction == "forward":
        return rows
    return len(weights) * rows + sum(w[1] for w in weights)


def fp8_reference(model: torch.nn.Module, recipe: str) -> list[str]:
    """Make every :func:`fp8_module` of ``model`` compute as :func:`fp8_linear` (the single-device reference of
    ``fxshard verify`` and the tests), keeping its parameters; returns their FQNs."""
    done = []
    for fqn, module in model.named_modules():
        if fp8_module(fqn, module):
            module.forward = _bound(module, recipe)
            done.append(fqn)
    return done


def _bound(module: torch.nn.Linear, recipe: str):
    def forward(x):
        return fp8_linear(x, module.weight, module.bias, recipe)

    return forward
