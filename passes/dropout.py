"""Give every dropout the mask it has in single-device training, under any layout.

Torch's dropout draws from a per-device generator, so its mask would change with the tensor-parallel
slice, the pipeline stage, the dp rank and the microbatch.  This pass numbers the training-mode
``aten.dropout`` calls in graph order (= call order in the forward: their ``site``) and rewrites each
into ``rt.dropout(x, p, site=k, shard=...)``, whose mask is a hash of the seed, the batch number, the
site, the sample's row in the whole batch and the element's index in the *unsharded* tensor
(``fxshard/runtime/random.py``).  ``shard`` tells a tp rank which slice of the global tensor it holds,
so every rank computes exactly the decisions of its own elements::

    dropout_2 = rt.dropout(view_7, 0.1, site=2, shard=(1, 0, 2))  # S(1)  mask as on one device

Every other random op of :data:`fxshard.runtime.draws.DRAWS` (``rand``, ``randn``, ``randint``, ``randperm``,
``rand_like``, ``bernoulli_``, ``exponential_``, ``normal_``, ``uniform_``, ``multinomial``, ...) becomes
``rt.draw(op, ..., site=k, rows=..., shard=...)``, numbered in graph order among themselves: each element is drawn by
its place in one device's tensor (``fxshard/runtime/draws.py``), ``rows`` saying which dimension holds this rank's
part of the batch (the batch-row analysis, :mod:`fxshard.ir.rows`: dp ranks x microbatches, in order) and ``shard``
its tp slice::

    rand = rt.draw(torch.ops.aten.rand.default, [2, 16], device=..., site=0, rows=(0, 2, 4))  # [2, 16] f32

Runs after the collectives pass (placements are final) and before the pipeline cut.  Refused, with
the module named: dropout inside ``scaled_dot_product_attention`` (the fused kernel draws its own
mask), the channel-wise and alpha variants, and — when the batch is split over dp ranks or
microbatches — a dropout input whose dim 0 is not the batch, since rows are mapped to samples; a draw whose
value has no part of the batch fxshard can map to rows, or split along the sequence under ``--cp``; and a random
op outside ``DRAWS`` (``poisson``, ``rrelu``, a draw from the model's own generator) under pipeline or data
parallelism or split over tp ranks, where its values would differ from one device.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.errors import RandomnessError
from fxshard.graph import node_fqn
from fxshard.ir.context import TP, CompileContext, RankValue, spec
from fxshard.ir.placement import Replicate, Shard, slice_spec
from fxshard.ir.sharding import argument
from fxshard.runtime import draws as rt_draws
from fxshard.runtime import random as rt_random

aten = torch.ops.aten

_DROPOUT = {aten.dropout.default: False, aten.dropout_.default: True}  # op -> in place
_VARIANTS = {  # op -> what the user wrote
    aten.feature_dropout.default: "F.dropout1d/2d/3d (channel-wise dropout)",
    aten.feature_dropout_.default: "F.dropout1d/2d/3d (channel-wise dropout)",
    aten.alpha_dropout.default: "F.alpha_dropout / nn.AlphaDropout",
    aten.alpha_dropout_.default: "F.alpha_dropout / nn.AlphaDropout",
    aten.feature_alpha_dropout.default: "F.feature_alpha_dropout / nn.FeatureAlphaDropout",
    aten.feature_alpha_dropout_.default: "F.feature_alpha_dropout / nn.FeatureAlphaDropout",
    aten.native_dropout.default: "aten.native_dropout",
}


def dropout_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    layout = ctx.layout
    rows = ctx.batch // layout.dp // ctx.microbatches if ctx.batch and layout.dp * ctx.microbatches > 1 else None
    site = drawn = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        _refuse_unreproducible(node)
        if node.target in rt_draws.DRAWS and node.kwargs.get("generator") is None:
            _as_draw(node, drawn, ctx)
            drawn += 1
            continue
        if node.target not in _DROPOUT:
            _refuse_other_randomness(node, ctx)
            continue
        # F.dropout(inplace=True) is aten.dropout_, whose tensor argument is named self
        x = argument(node, "input") if _DROPOUT[node.target] is False else argument(node, "self")
        p, train = argument(node, "p"), argument(node, "train")
        if not train:
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
            continue
        here, site = site, site + 1  # p = 0 counts too: the sites are the training-mode calls, in order
        if p == 0:
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
            continue
        kwargs = {"site": here}
        if ctx.rows is not None and node.name in set(ctx.rows.whole):  # on the whole batch: its rows from 0
            kwargs["whole"] = True
        elif rows is not None:
            _check_rows(node, x, rows, ctx)
        placement = spec(node).placement
        if isinstance(placement, Shard) and layout.tp > 1:
            if placement.general:  # unequal blocks, or parts several ranks hold alike
                raise RandomnessError(f"{node_fqn(node) or 'model'}: dropout on a value split in unequal or "
                                      f"replicated packed blocks ({placement}) has no layout-invariant mask yet; "
                                      "use the dropout after the packed value is split into its parts")
            slices = [slice_spec(placement, r, layout.tp) for r in range(layout.tp)]
            kwargs["shard"] = RankValue(TP, tuple((sl.dim, sl.index, sl.parts, *((sl.blocks,) if sl.blocks > 1 else ()))
                                                    if sl.parts > 1 else None for sl in slices))
        if _DROPOUT[node.target]:
            kwargs["inplace"] = True
        node.target = rt_random.dropout
        node.args = (x, p)
        node.kwargs = kwargs
    gm.recompile()
    return gm


def _shard(node: fx.Node, placement: Shard, tp: int, what: str) -> RankValue:
    """Which slice of the global tensor each tp rank holds: ``(dim, index, parts[, blocks])``, None for all of it."""
    if placement.general:  # unequal blocks, or parts several ranks hold alike
        raise RandomnessError(f"{node_fqn(node) or 'model'}: {what} on a value split in unequal or replicated packed "
                              f"blocks ({placement}) has no layout-invariant values yet; use it after the packed value "
                              "is split into its parts")
    slices = [slice_spec(placement, r, tp) for r in range(tp)]
    return RankValue(TP, tuple((sl.dim, sl.index, sl.parts, *((sl.blocks,) if sl.blocks > 1 else ()))
                               if sl.parts > 1 else None for sl in slices))


def _as_draw(node: fx.Node, site: int, ctx: CompileContext) -> None:
    """``op(...)`` as ``rt.draw(op, ..., site=site, rows=..., shard=...)``: this rank's elements of one device's
    draw."""
    op, layout, fqn = node.target, ctx.layout, node_fqn(node) or "model"
    kwargs = dict(node.kwargs, site=site)
    rows = ctx.rows
    if rows is not None and node.name not in set(rows.whole):  # computed on the whole batch: one device's tensor
        p = rows.of(node)
        if isinstance(p, Shard):
            kwargs["rows"] = (p.dim, rows.rows, layout.dp * ctx.microbatches, *((p.blocks,) if p.blocks > 1 else ()))
        elif p != Replicate():
            raise RandomnessError(
                f"{fqn}: {node.name} = {op} draws random numbers in training, and fxshard cannot map the value it "
                f"draws to the batch's rows ({p}), which are split over {layout.dp} dp rank(s) x {ctx.microbatches} "
                "microbatch(es); draw it for a value of the batch (torch.rand_like(x), x.new_empty(...).uniform_()) "
                "or with a size that keeps the batch in one dimension, or train at --dp 1 without microbatches")
    placement = spec(node).placement
    if isinstance(placement, Shard) and layout.tp > 1:
        if "rows" in kwargs and kwargs["rows"][0] == placement.dim:
            raise RandomnessError(f"{fqn}: {node.name} = {op} draws a value split along its batch rows over tp too "
                                  f"({placement}); fxshard maps one split of a dimension; train at --tp 1 or --dp 1")
        kwargs["shard"] = _shard(node, placement, layout.tp, str(op))
    elif not isinstance(placement, (Shard, Replicate)):
        raise RandomnessError(f"{fqn}: {node.name} = {op} draws for a value placed {placement} over tp; expected it "
                              "whole or split; train at --tp 1")
    if isinstance(spec(node).seq, Shard):
        raise RandomnessError(f"{fqn}: {node.name} = {op} draws random numbers split along the sequence under --cp "
                              f"{layout.cp}; its layout-invariant values number the tokens of the whole sequence, "
                              "which a cp rank's permuted part does not yet give them; draw it without a sequence "
                              "dimension or drop --cp")
    node.target = rt_draws.draw
    node.args = (op, *node.args)
    node.kwargs = kwargs


def _refuse_unreproducible(node: fx.Node) -> None:
    fqn = node_fqn(node) or "model"
    if node.target in _VARIANTS and _training_p(node) > 0:
        raise RandomnessError(
            f"{fqn}: {node.name} is {_VARIANTS[node.target]}, whose mask fxshard cannot make match single-device "
            "training under a parallel layout; use nn.Dropout / F.dropout (element-wise), or p=0"
        )
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
        if p:
            raise RandomnessError(
                f"{fqn}: {node.name} = {node.target} applies dropout_p={p} inside the fused attention kernel, whose "
                "mask fxshard cannot reproduce across tensor/pipeline/data-parallel ranks; for Hugging Face models "
                "load with attn_implementation=\"eager\" (attention dropout becomes an ordinary dropout), or set the "
                "attention dropout to 0"
            )


def _training_p(node: fx.Node) -> float:
    """``p`` of a dropout-like op in training mode, 0 when it is off."""
    p, train = argument(node, "p"), argument(node, "train")
    return float(p) if train is not False else 0.0  # native_dropout's train=None means training


def _check_rows(node: fx.Node, x: fx.Node, rows: int, ctx: CompileContext) -> None:
    shape = list(x.meta["val"].shape)
    if shape and shape[0] == rows:
        return
    layout = ctx.layout
    raise RandomnessError(
        f"{node_fqn(node) or 'model'}: dropout {node.name} gets a tensor of shape {shape}; the batch is split "
        f"over {layout.dp} dp rank(s) x {ctx.microbatches} microbatch(es) of {rows} samples, and fxshard gives "
        f"row r of a dropout input the mask of sample r of its microbatch, so dim 0 must be the batch "
        f"(size {rows}), found {shape[0] if shape else 'a scalar'}; make the dropout's input batch-first "
        "(e.g. transpose around it) or run with dp = 1 and one microbatch"
    )


def _draws(node: fx.Node) -> bool:
    """Whether a call of an op tagged as random actually draws: torch tags the op, not the call, and
    attention with ``dropout_p=0`` (every SDPA model in eval, or without attention dropout) or an op
    called with ``training=False`` never touches the generator."""
    if not argument(node, "dropout_p", 1.0):
        return False
    return argument(node, "training", argument(node, "train", True)) is not False


def _refuse_other_randomness(node: fx.Node, ctx: CompileContext) -> None:
    """Refuse a random op fxshard does not draw by position (outside dropout and ``DRAWS``: ``poisson``, ``rrelu``, a
    draw from the model's own generator) where its draws would differ from single-device training: split over tp ranks
    (each would draw its own slice), per pipeline microbatch or per dp rank.  Replicated at pp = dp = 1 it is exact:
    every tp rank draws the whole tensor from the same seeded generator in the model's order.  An op that only takes a
    ``dropout_p`` (attention) draws nothing at p = 0; p > 0 is refused by ``_refuse_unreproducible``."""
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags or node.target in _VARIANTS or ctx.layout.world_size == 1 \
            or not _draws(node):
        return
    # the inputs count too: rand_like of a split tensor draws a local-shaped tensor on each rank
    values = [node, *node.all_input_nodes]
    if ctx.layout.pp == ctx.layout.dp == 1 and all(spec(v).placement == Replicate() for v in values):
        return
    schema = getattr(node.target, "_schema", None)
    if schema is not None and any(a.name == "dropout_p" for a in schema.arguments):
        return
    raise RandomnessError(
        f"{node_fqn(node) or 'model'}: {node.name} = {node.target} draws random numbers in training from torch's "
        "generator; fxshard draws the single-device values under any layout for dropout and the ops of "
        "fxshard.runtime.draws.DRAWS (rand, randn, randint, randperm, bernoulli, exponential_, normal, uniform_, "
        "multinomial, ...), not this one, which would draw other values per tp slice, pipeline microbatch or dp "
        f"rank ({ctx.layout.describe()}), so training would differ from one device (replicated at pp = dp = 1 it is "
        "exact). Draw it with one of those ops, draw the values outside the model and pass them in as an input, or "
        "use a layout without pipeline and data parallelism"
    )
