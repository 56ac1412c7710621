"""Make a token-mean loss a mean over the whole step's counted tokens, under any layout.

``F.cross_entropy(logits, target, ignore_index=-100)`` (and ``nll_loss``; Hugging Face's ForCausalLMLoss and
ForMaskedLMLoss without ``num_items_in_batch`` call it) divides the summed token losses by the number of
targets that are not ``ignore_index``.  A microbatch, a dp rank's rows or one of several accumulated batches
counts its own tokens, so a mean of their means weights a token by how crowded its part of the batch was:
a right-padded batch trained at dp=2 or pp=2 differed from one device by 5e-4 at step 1.

This pass makes the loss a *sum* over counted tokens and divides it by ``rt.token_mean``'s divisor, which the
runtime sets before every step from the count of the whole step (every microbatch, dp rank and accumulated
batch: the batch is on every rank, so no communication is needed).  The count comes from the program itself:
the graph that computes the loss's targets from the inputs is emitted as ``count_tokens`` in each rank file.
With the divisor N / D (N counted tokens, D = microbatches · dp · accumulated batches, the factor by which
training averages gradients and losses), every layout trains exactly as one device on the whole step.

A loss this pass cannot prove a token mean (class weights, a loss computed further from the cross entropy)
keeps the averaging, with a note when the layout splits the batch.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.graph import node_fqn
from fxshard.ir.context import CompileContext, NodeSpec
from fxshard.ir.contracts import contract
from fxshard.runtime import loss as rt_loss

aten = torch.ops.aten
_LOSSES = {aten.cross_entropy_loss.default: (2, 3, 4), aten.nll_loss.default: (2, 3, 4),
           aten.nll_loss_nd.default: (2, 3, 4)}  # op -> positions of weight, reduction, ignore_index
_MEAN, _SUM = 1, 2


@contract()  # inserts the token-mean node before the placements are decided, so it runs first
def token_mean_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0][0]
    recognized = _token_mean_loss(loss, ctx.user_inputs)
    if recognized is None:
        if ctx.layout.dp > 1 or ctx.layout.pp > 1:
            ctx.notes.append(f"the loss ({getattr(loss, 'target', loss)}) is not a token mean fxshard can prove: it "
                             "is averaged over microbatches and dp ranks, which equals single-device training only "
                             "when each part weighs its rows the same")
        return gm
    target, ignore_index = recognized
    args = list(loss.args) + [None, _MEAN, ignore_index][len(loss.args) - 2:] if len(loss.args) < 5 else list(loss.args)
    args[2] = loss.kwargs.get("weight", args[2])
    args[3] = _SUM
    args[4] = ignore_index
    loss.args = tuple(args)
    loss.kwargs = {k: v for k, v in loss.kwargs.items() if k not in ("weight", "reduction", "ignore_index")}
    with gm.graph.inserting_after(loss):
        mean = gm.graph.call_function(rt_loss.token_mean, (loss, target), {"ignore_index": ignore_index})
    mean.meta = {"val": loss.meta["val"], "nn_module_stack": loss.meta.get("nn_module_stack", {}),
                 "fxshard": NodeSpec(fqn=node_fqn(loss), role="token mean")}
    loss.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)  # the returned .loss too
    ctx.token_count = _count_graph(gm, ctx.user_inputs, target, ignore_index)
    ctx.notes.append(f"{node_fqn(loss) or 'the loss'}: a token mean (targets other than {ignore_index} counted), "
                     "generated as a sum divided by the step's count (count_tokens in each rank file): every layout "
                     "and --grad-accum trains as one device on the whole step")
    gm.recompile()
    return gm


def _token_mean_loss(loss, user_inputs: set[fx.Node]) -> tuple[fx.Node, int] | None:
    """``(target, ignore_index)`` when ``loss`` is a mean over counted integer targets of the inputs alone."""
    if not isinstance(loss, fx.Node) or loss.target not in _LOSSES:
        return None
    weight_at, reduction_at, ignore_at = _LOSSES[loss.target]
    names = ("weight", "reduction", "ignore_index")
    values = [loss.args[i] if len(loss.args) > i else loss.kwargs.get(name, default)
              for i, name, default in zip((weight_at, reduction_at, ignore_at), names, (None, _MEAN, -100), strict=True)]
    weight, reduction, ignore_index = values
    target = loss.args[1]
    val = target.meta.get("val") if isinstance(target, fx.Node) else None
    if weight is not None or reduction != _MEAN or not isinstance(val, torch.Tensor) or val.is_floating_point():
        return None
    if any(n.op == "placeholder" and n not in user_inputs for n in _ancestors(target)):
        return None  # targets computed from weights or buffers: not a count of the batch alone
    return target, int(ignore_index)


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack = {}, [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen[n] = None
            stack.extend(n.all_input_nodes)
    return list(seen)


def _count_graph(gm: fx.GraphModule, user_inputs: set[fx.Node], target: fx.Node, ignore_index: int) -> fx.GraphModule:
    """A graph of the user inputs (all of them, in order) returning one microbatch's number of counted targets."""
    keep = set(_ancestors(target))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n in user_inputs:
            env[n] = graph.placeholder(n.name)
        elif n in keep and n.op == "call_function":
            env[n] = copy = graph.node_copy(n, lambda a: env[a])
            # the count runs where the batch is (captured on meta under --weights): conversions keep the device
            copy.kwargs = {k: v for k, v in copy.kwargs.items() if k != "device"}
    counted = graph.call_function(aten.ne.Scalar, (env[target], ignore_index))
    graph.output(graph.call_function(aten.sum.default, (counted,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def token_counter(program) -> fx.GraphModule | None:
    """For a captured :class:`~fxshard.capture.program.Program` whose loss is a token mean: a graph of its user
    inputs returning the number of counted targets (the single-device reference weighs accumulated batches by
    it); None for any other loss."""
    gm = program.gm
    state = program.state_by_name()
    user_inputs = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in state}
    loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    recognized = _token_mean_loss(loss, user_inputs)
    return None if recognized is None else _count_graph(gm, user_inputs, *recognized)
