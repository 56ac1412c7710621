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

A loss adding several such means (masked LM plus sentence order; extractive QA's start and end losses, whose
ignore index is the sequence length) is rewritten term by term: ``rt.token_mean(..., term=k)`` divides each by its
own count over the step, and ``count_tokens`` returns the counts of all terms (a vector).  Plain means with the
same number of values in every part of the batch, and terms the batch does not enter, stay as they are.

A loss this pass cannot prove a token mean (class weights, a loss computed further from the cross entropy)
keeps the averaging, with a note when the layout splits the batch.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.graph import node_fqn
from fxshard.ir.batch import cross_batch_products, whole_batch_region
from fxshard.ir.context import CompileContext, NodeSpec
from fxshard.runtime import loss as rt_loss

aten = torch.ops.aten
_LOSSES = {aten.cross_entropy_loss.default: (2, 3, 4), aten.nll_loss.default: (2, 3, 4),
           aten.nll_loss_nd.default: (2, 3, 4)}  # op -> positions of weight, reduction, ignore_index
_MEAN, _SUM = 1, 2
# the loss's terms combine through these: sums and differences of terms, a term times or over a constant
_DIV = {aten.div.Tensor, aten.div.Scalar}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar} | _DIV
_COMBINE = {aten.add.Tensor, aten.sub.Tensor} | _SCALE
_PLAIN_MEANS = {aten.mean.default, aten.mean.dim}
# elementwise losses -> the position of their reduction argument
_ELEMENT_LOSSES = {aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
                   aten.huber_loss.default: 2, aten.binary_cross_entropy_with_logits.default: 4,
                   aten.binary_cross_entropy.default: 3}


def token_mean_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0][0]
    whole = whole_batch_region(cross_batch_products(gm, ctx.user_inputs, ctx.rows))
    if ctx.rows is not None:  # values passes/batch_rows.py computes on the whole batch: a loss there is as it is
        names = set(ctx.rows.whole)
        whole |= {n for n in gm.graph.nodes if n.name in names}
    terms = counted_terms(loss, ctx.user_inputs, whole)
    if not terms:
        if (ctx.layout.dp > 1 or ctx.layout.pp > 1) and loss not in whole:
            ctx.notes.append(f"the loss ({getattr(loss, 'target', loss)}) is not a token mean fxshard can prove: it "
                             "is averaged over microbatches and dp ranks, which equals single-device training only "
                             "when each part weighs its rows the same")
        return gm
    several = len(terms) > 1
    for k, (node, target, ignore_index) in enumerate(terms):
        if node.target in _LOSSES:
            _as_token_mean(gm, node, target, ignore_index, k if several else None)
        else:
            _as_masked_mean(gm, node, target, k if several else None)
    ctx.token_count = _count_graph(gm, ctx.user_inputs, [(t, i) for _, t, i in terms])
    if several:
        ctx.notes.append(f"the loss: {len(terms)} means over counted targets ("
                         + ", ".join(f"{node_fqn(n) or n.name} counting {_counted(n, i)}" for n, _, i in terms)
                         + "), each generated as a sum divided by its own count over the step (count_tokens in each "
                         "rank file): every layout and --grad-accum weighs each by its own global count, as one device")
    else:
        node, _, ignore_index = terms[0]
        ctx.notes.append(f"{node_fqn(node) or 'the loss'}: a token mean ({_counted(node, ignore_index)} counted), "
                         "generated as a sum divided by the step's count (count_tokens in each rank file): every "
                         "layout and --grad-accum trains as one device on the whole step")
    gm.recompile()
    return gm


def _counted(loss: fx.Node, ignore_index: int) -> str:
    return f"targets other than {ignore_index}" if loss.target in _LOSSES else "the values a mask of the batch selects"


def _as_token_mean(gm: fx.GraphModule, loss: fx.Node, target: fx.Node, ignore_index: int, term: int | None) -> None:
    """``loss`` (a mean over counted targets) as a sum over them, divided by ``rt.token_mean``'s divisor."""
    args = list(loss.args) + [None, _MEAN, ignore_index][len(loss.args) - 2:] if len(loss.args) < 5 else list(loss.args)
    args[2] = loss.kwargs.get("weight", args[2])
    args[3] = _SUM
    args[4] = ignore_index
    loss.args = tuple(args)
    loss.kwargs = {k: v for k, v in loss.kwargs.items() if k not in ("weight", "reduction", "ignore_index")}
    kwargs = {"ignore_index": ignore_index} | ({"term": term} if term is not None else {})
    with gm.graph.inserting_after(loss):
        mean = gm.graph.call_function(rt_loss.token_mean, (loss, target), kwargs)
    mean.meta = {"val": loss.meta["val"], "nn_module_stack": loss.meta.get("nn_module_stack", {}),
                 "fxshard": NodeSpec(fqn=node_fqn(loss), role="token mean")}
    loss.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)  # the returned .loss too


def _as_masked_mean(gm: fx.GraphModule, loss: fx.Node, mask: fx.Node, term: int | None) -> None:
    """``loss`` (a mean over the values a boolean ``mask`` selects) as their sum over ``rt.token_mean``'s divisor,
    which counts the mask's true elements (ignore index 0: ``mask != 0``)."""
    if loss.target in _PLAIN_MEANS:
        loss.target, loss.args, loss.kwargs = aten.sum.default, loss.args[:1], {}
    else:
        at = _ELEMENT_LOSSES[loss.target]
        args = list(loss.args) + [None] * (at + 1 - len(loss.args))
        args[at] = _SUM
        loss.args = tuple(args)
        loss.kwargs = {k: v for k, v in loss.kwargs.items() if k != "reduction"}
    kwargs = {"ignore_index": 0} | ({"term": term} if term is not None else {})
    with gm.graph.inserting_after(loss):
        mean = gm.graph.call_function(rt_loss.token_mean, (loss, mask), kwargs)
    mean.meta = {"val": loss.meta["val"], "nn_module_stack": loss.meta.get("nn_module_stack", {}),
                 "fxshard": NodeSpec(fqn=node_fqn(loss), role="token mean")}
    loss.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)


def counted_terms(loss, user_inputs: set[fx.Node], whole: set[fx.Node] = frozenset()
                  ) -> list[tuple[fx.Node, fx.Node, int]]:
    """The means over counted targets the loss adds up, ``(node, target, ignore_index)`` each: ``loss`` itself, or
    an affine combination (sums, differences, constant factors) of such means and of means over fixed counts
    (a sentence-order loss beside a masked LM's; extractive QA's start and end losses, whose ignore index is the
    sequence length).  ``whole``: values computed on the whole batch (passes/batch_gather.py: a contrastive loss),
    terms as they are.  [] when the loss is anything else: it keeps the layout's averaging."""
    terms: list[tuple[fx.Node, fx.Node, int]] = []
    stack, seen = [loss], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if node in whole:
            continue
        counted = _token_mean_loss(node, user_inputs) or _masked_mean_loss(node, user_inputs)
        if counted is not None:
            terms.append((node, *counted))
        elif node.op == "call_function" and node.target in _COMBINE:
            args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
            if node.target in _DIV:  # a term over a constant; over a value of the batch (a count of its own), or
                num, den = node.args[:2]  # a constant over a term: no mean
                if isinstance(den, fx.Node) and _reads_inputs(den, user_inputs):
                    return []
                args = [num] if isinstance(num, fx.Node) else []
            elif node.target in _SCALE:  # a term times a constant; a product of two terms is no mean
                args = [a for a in args if _reads_inputs(a, user_inputs)]
                if len(args) > 1:
                    return []
            stack.extend(args)
        elif not _fixed_mean(node, user_inputs):
            return []
    return sorted(terms, key=lambda t: list(t[0].graph.nodes).index(t[0])) if terms else []


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


def _masked_mean_loss(loss, user_inputs: set[fx.Node]) -> tuple[fx.Node, int] | None:
    """``(mask, 0)`` when ``loss`` is a mean over ``x[mask]``: a boolean index of all of ``x``'s dimensions by a
    mask computed from the inputs alone (ELECTRA's discriminator loss over the tokens its attention mask keeps).
    Each part of the batch selects its own number of values, so a mean of parts' means weighs them wrongly."""
    if not isinstance(loss, fx.Node) or loss.op != "call_function" or not _reduces_to_mean(loss):
        return None
    selected = loss.args[0]
    if not isinstance(selected, fx.Node) or selected.target is not aten.index.Tensor:
        return None
    source, indices = selected.args[:2]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    mask, val = indices[0], indices[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.shape != source.meta["val"].shape:
        return None
    if any(n.op == "placeholder" and n not in user_inputs for n in _ancestors(mask)) or \
            not _reads_inputs(mask, user_inputs):
        return None
    return mask, 0


def _reduces_to_mean(node: fx.Node) -> bool:
    """A scalar mean over every value of its input: ``x.mean()`` or an elementwise loss with reduction mean."""
    if node.meta["val"].dim() != 0:
        return False
    if node.target in _PLAIN_MEANS:
        return len(node.args) == 1 or node.args[1] in (None, [], list(range(node.args[0].meta["val"].dim())))
    at = _ELEMENT_LOSSES.get(node.target)
    if at is None:
        return False
    reduction = node.args[at] if len(node.args) > at else node.kwargs.get("reduction", _MEAN)
    return reduction == _MEAN


def _fixed_mean(node: fx.Node, user_inputs: set[fx.Node]) -> bool:
    """A term that averaging equal parts of the batch keeps exact as it is: a value the batch does not enter, or a
    scalar mean over all it reduces (every part holds the same number of values: ``x.mean()``, ``F.mse_loss``)."""
    if not _reads_inputs(node, user_inputs):
        return True
    if node.op != "call_function" or node.target in _LOSSES or node.meta["val"].dim() != 0:
        return False
    if any(not isinstance(d, int) for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
           for d in a.meta["val"].shape):
        return False  # over a number of values the data decides (masked_select, a boolean index): no fixed mean
    if node.target in _PLAIN_MEANS:
        return True
    return node.target in _ELEMENT_LOSSES and _reduces_to_mean(node)


def _reads_inputs(node: fx.Node, user_inputs: set[fx.Node]) -> bool:
    return any(n in user_inputs for n in _ancestors(node))


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack = {}, [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen[n] = None
            stack.extend(n.all_input_nodes)
    return list(seen)


def _count_graph(gm: fx.GraphModule, user_inputs: set[fx.Node], targets: list[tuple[fx.Node, int]]) -> fx.GraphModule:
    """A graph of the user inputs (all of them, in order) returning one microbatch's number of counted targets: a
    scalar for one counted mean, the counts of each (a vector, in term order) for several."""
    keep = set().union(*(_ancestors(t) for t, _ in targets))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n in user_inputs:
            env[n] = graph.placeholder(n.name)
        elif n in keep and n.op == "call_function":
            env[n] = copy = graph.node_copy(n, lambda a: env[a])
            # the count runs where the batch is (captured on meta under --weights): conversions keep the device
            copy.kwargs = {k: v for k, v in copy.kwargs.items() if k != "device"}
    counts = [graph.call_function(aten.sum.default, (graph.call_function(aten.ne.Scalar, (env[t], i)),))
              for t, i in targets]
    graph.output(counts[0] if len(counts) == 1 else graph.call_function(aten.stack.default, (counts,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def token_counter(program) -> fx.GraphModule | None:
    """For a captured :class:`~fxshard.capture.program.Program` whose loss is a token mean (or several): a graph of
    its user inputs returning the number of counted targets (a vector of them for several means; the single-device
    reference weighs accumulated batches by it); None for any other loss."""
    gm = program.gm
    state = program.state_by_name()
    user_inputs = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in state}
    loss = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    terms = counted_terms(loss, user_inputs, whole_batch_region(cross_batch_products(gm, user_inputs)))
    return _count_graph(gm, user_inputs, [(t, i) for _, t, i in terms]) if terms else None
