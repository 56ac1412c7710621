"""A product of every example with every other (a contrastive loss) under ``--dp``: computed on the whole batch.

CLIP-style losses score each image against each text of the batch, ``logits = image @ text.T`` (``[B, B]``) with
labels ``arange(B)``.  A dp rank holds its own rows: its logits are ``[B/dp, B/dp]``, its loss is another loss, and
averaging the ranks' losses is not one device's (0.59 relative at --dp 2, ZeRO 1).  This pass does what open_clip's
gathered features do: the product's operands are all-gathered over dp (``rt.gather_to``), and the product and
everything computed from it (:func:`fxshard.ir.batch.whole_batch_region`) run on the whole batch on every rank::

    gather_to = rt.gather_to(mul, self.dp, dim=0)          # [B, d]: every rank's image features
    gather_to_1 = rt.gather_to(t, self.dp, dim=1)          # [d, B]: every rank's text features
    matmul = torch.ops.aten.matmul.default(gather_to, gather_to_1)
    arange = torch.ops.aten.arange.default(B, ...)         # the labels of the whole batch

Every rank then holds the single-device loss.  Backward, ``gather_to``'s reduce-scatter sums every rank's gradient
of its examples' features, dp times one device's (each rank differentiates the same loss); the data-parallel
average of the weights' gradients divides by dp again, so they are one device's.  A parameter used on the whole
batch (a logit scale applied to the logits) gets one device's gradient on every rank, which the average keeps.

Pipeline microbatches cannot be made exact: a schedule runs microbatch 0's forward, and under 1F1B its backward,
before the next microbatch exists; such a compile is refused naming the op and its module.  ``--grad-accum`` is
refused at launch for the same reason (the manifest's ``batch_couplings``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxshard.errors import LayoutError
from fxshard.graph import node_fqn
from fxshard.ir.batch import (
    cross_batch_products,
    describe,
    examples,
    local_batch,
    refuse_microbatches,
    whole_batch_region,
)
from fxshard.ir.context import DP, CompileContext, Group, spec
from fxshard.ir.placement import Shard
from fxshard.runtime import collectives as rtc

aten = torch.ops.aten


def batch_gather_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    products = cross_batch_products(gm, ctx.user_inputs, ctx.rows)
    model = type(ctx.program.model).__name__
    found = [describe(n, model) for n in products]
    ctx.batch_couplings = [*ctx.batch_couplings, *found]
    listed = "; ".join(found)
    refuse_microbatches(ctx, listed, "pairs the examples of the whole batch", " (its features are gathered)")
    if ctx.layout.dp == 1:
        return gm
    b = local_batch(ctx.user_inputs)
    region = whole_batch_region(products)
    flowing = examples(gm, ctx.user_inputs)
    whole: dict[fx.Node, fx.Node] = {}  # a value entering the region -> its whole-batch form
    for node in [n for n in gm.graph.nodes if n in region]:
        def enter(a, node=node):
            if not isinstance(a, fx.Node) or a in region:
                return a
            if a not in whole:
                whole[a] = _whole(gm, node, a, b, ctx.layout.dp, a in flowing)
            return whole[a]
        node.args = fx.node.map_arg(node.args, enter)
        node.kwargs = fx.node.map_arg(node.kwargs, enter)
    for a in whole:  # a part's labels only the region read: their whole-batch copy replaced them
        _erase_unused(gm, a)
    if ctx.rows is not None:  # values the rows analysis wants whole that this pass made whole (eye(b)) are gone
        alive = {n.name for n in gm.graph.nodes}
        ctx.rows = dataclasses.replace(ctx.rows, whole=tuple(n for n in ctx.rows.whole if n in alive),
                                       ratios=tuple(n for n in ctx.rows.ratios if n in alive),
                                       mixing={n: why for n, why in ctx.rows.mixing.items() if n in alive})
    _revalue(gm, region)
    ctx.notes.append(f"--dp {ctx.layout.dp}: {listed}: its operands gathered over dp (rt.gather_to, the gradient "
                     "reduce-scattered back), it and what follows from it computed on the whole batch on every rank: "
                     "the loss and gradients of one device")
    gm.recompile()
    return gm


def _whole(gm: fx.GraphModule, user: fx.Node, a: fx.Node, b: int, dp: int, carries: bool) -> fx.Node:
    """``a``, read by ``user`` in the whole-batch region, made whole: gathered over dp along its batch dimension
    when it carries examples, ``arange(b)`` (the labels of a part) made ``arange(b * dp)``, else as it is."""
    val = a.meta.get("val")
    where = f"{node_fqn(user) or 'the model'}: {user.name} ({user.target})"
    if not isinstance(val, torch.Tensor):
        return a
    if not carries:
        return _whole_made(gm, a, b, dp)
    dims = [1] if user.target in (aten.matmul.default, aten.mm.default) and a is user.args[1] else \
        [0] if user.target in (aten.matmul.default, aten.mm.default) else \
        [d for d, size in enumerate(val.shape) if size == b]
    placement = spec(a).placement
    if len(dims) != 1 or placement == Shard(dims[0]):
        raise LayoutError(f"{where} reads {a.name} {list(val.shape)} (placement {placement}) on the whole batch; "
                          f"expected its examples along one dimension of size {b}, whole on each tp rank; found "
                          f"{len(dims)}: train at --dp 1 or compute the pairing from [batch, features] values")
    with gm.graph.inserting_after(a):
        gathered = gm.graph.call_function(rtc.gather_to, (a, Group(DP)), {"dim": dims[0]})
    shape = list(val.shape)
    shape[dims[0]] *= dp
    gathered.meta = {"val": val.new_empty(shape),
                     "nn_module_stack": a.meta.get("nn_module_stack", {}), "stack_trace": a.meta.get("stack_trace", ""),
                     "fxshard": dataclasses.replace(spec(a), collective="gather_to", inputs=None,
                                                    role="examples of every dp rank")}
    return gathered


# ops that make a tensor of the sizes they are given: ``arange(b)`` (a part's labels), ``eye(b)`` (SigLIP's
# ``2 * eye(B) - 1`` targets), ``ones``/``zeros``/``full``/``empty`` of ``[b, b]``; the sizes they take, by position
_SIZED = {aten.arange.default: (0,), aten.eye.default: (0,), aten.eye.m: (0, 1), aten.ones.default: (0,),
          aten.zeros.default: (0,), aten.full.default: (0,), aten.empty.memory_format: (0,)}


def _whole_made(gm: fx.GraphModule, a: fx.Node, b: int, dp: int) -> fx.Node:
    """``a``, a value the whole-batch region reads that no example flows into, at the whole batch: where it is
    computed from tensors made at the part's batch size ``b`` (``arange(b)``, ``eye(b)``, ``ones(b, b)``) and from
    constants alone, that computation again with each such size ``b * dp`` (``2 * eye(B)``); else ``a`` as it is.
    A made size that is not the batch (a width equal to ``b``) gives shapes the region's revaluation refuses."""
    made, stack = [], [a]
    while stack:  # a's ancestry: made tensors and ops on them; a parameter, buffer or input keeps ``a`` as it is
        n = stack.pop()
        if n.op != "call_function" or n in made:
            if n.op != "call_function":
                return a
            continue
        made.append(n)
        stack.extend(n.all_input_nodes)
    resized = [n for n in made if n.target in _SIZED and _sizes(n, b)]
    if not resized:
        return a
    copies: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(a.next):
        for n in [n for n in gm.graph.nodes if n in made]:  # graph order: an op after its arguments
            args = fx.node.map_arg(n.args, lambda x: copies[x])
            if n in resized:
                args = tuple(_grown(v, b, dp) if i in _SIZED[n.target] else v for i, v in enumerate(args))
            copies[n] = gm.graph.call_function(n.target, args, fx.node.map_arg(n.kwargs, lambda x: copies[x]))
            copies[n].meta = {k: v for k, v in n.meta.items() if k != "val"}
    _revalue(gm, set(copies.values()))
    return copies[a]


def _erase_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then each of its arguments left so (``eye(b)`` under ``2 * eye(b)``)."""
    if node.users or node.op != "call_function":
        return
    inputs = node.all_input_nodes
    gm.graph.erase_node(node)
    for n in inputs:
        _erase_unused(gm, n)


def _sizes(node: fx.Node, b: int) -> bool:
    """Whether ``node`` (an op of ``_SIZED``) makes a dimension of size ``b``."""
    return any(v == b or isinstance(v, (list, tuple)) and b in v
               for i, v in enumerate(node.args) if i in _SIZED[node.target])


def _grown(v, b: int, dp: int):
    """A size argument with each ``b`` made ``b * dp``."""
    if isinstance(v, (list, tuple)):
        return type(v)(b * dp if x == b else x for x in v)
    return b * dp if v == b else v


def _revalue(gm: fx.GraphModule, region: set[fx.Node]) -> None:
    """The region's values at the whole batch: each op run again on fake tensors of its arguments' new shapes."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(a):
        v = a.meta.get("val") if isinstance(a, fx.Node) else a
        if isinstance(v, torch.Tensor):
            return torch.empty(v.shape, dtype=v.dtype)
        return v

    with mode:
        for node in [n for n in gm.graph.nodes if n in region]:
            if spec(node).collective:  # a tp collective keeps its input's global shape
                node.meta["val"] = node.all_input_nodes[0].meta["val"]
                continue
            args = fx.node.map_arg(node.args, fake)
            kwargs = fx.node.map_arg(node.kwargs, fake)
            args = torch.utils._pytree.tree_map(fake, args)
            try:
                with _quiet_fake_tensor_log():  # torch logs the failure's traceback; the LayoutError below says it
                    value = node.target(*args, **kwargs)
            except Exception as e:
                raise LayoutError(f"{node_fqn(node) or 'the model'}: {node.name} ({node.target}) is computed on the "
                                  f"whole batch under --dp, and fails at its size: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0]}; a size of the part's batch is fixed in it: compute it "
                                  "from the values' shapes, or train at --dp 1") from e
            node.meta["val"] = value


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
