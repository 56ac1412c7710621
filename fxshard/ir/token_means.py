"""Which terms of a loss are means over counted targets, and the graph that counts those targets.

``F.cross_entropy(logits, target, ignore_index=-100)`` (and ``nll_loss``) divides the summed token losses by the
number of targets that are not ``ignore_index``: a part of the batch counts its own.  :func:`counted_terms` finds
such means in a loss (itself, or an affine combination of them and of means over fixed counts);
:func:`count_graph` is a graph of the user inputs returning how many targets each counts.  The token-mean pass
(``passes/token_mean.py``) rewrites the terms to divide by the count of the whole step; the single-device reference
(:mod:`fxshard.train.reference`) weighs accumulated batches by the same count (:func:`token_counter`)::

    terms = counted_terms(loss, ctx.user_inputs)     # [(node, target, ignore_index), ...]
    counter = token_counter(program)                 # None unless the loss is a token mean
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.graph import ancestors, walk
from fxshard.ir.batch import cross_batch_products, whole_batch_region

aten = torch.ops.aten
LOSSES = {aten.cross_entropy_loss.default: (2, 3, 4), aten.nll_loss.default: (2, 3, 4),
          aten.nll_loss_nd.default: (2, 3, 4)}  # op -> positions of weight, reduction, ignore_index
MEAN, SUM = 1, 2  # the losses' reduction argument
# the loss's terms combine through these: sums and differences of terms, a term times or over a constant
_DIV = {aten.div.Tensor, aten.div.Scalar}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar} | _DIV
_COMBINE = {aten.add.Tensor, aten.sub.Tensor} | _SCALE
_PLAIN_MEANS = {aten.mean.default, aten.mean.dim}
_ELEMENT_LOSSES = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default}  # reduction: arg 2


def counted_terms(loss, user_inputs: set[fx.Node], whole: set[fx.Node] = frozenset()
                  ) -> list[tuple[fx.Node, fx.Node, int]]:
    """The means over counted targets the loss adds up, ``(node, target, ignore_index)`` each: ``loss`` itself, or
    an affine combination (sums, differences, constant factors) of such means and of means over fixed counts
    (a sentence-order loss beside a masked LM's; extractive QA's start and end losses, whose ignore index is the
    sequence length).  ``whole``: values computed on the whole batch (passes/batch_gather.py: a contrastive loss),
    terms as they are.  [] when the loss is anything else: it keeps the layout's averaging."""
    terms: list[tuple[fx.Node, fx.Node, int]] = []
    operands: dict[fx.Node, list[fx.Node]] = {}  # what the walk goes on to: the terms a combination combines
    for node in walk([loss], lambda n: operands.pop(n, ())):
        if not isinstance(node, fx.Node) or node in whole:
            continue
        counted = _token_mean_loss(node, user_inputs)
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
            operands[node] = args
        elif not _fixed_mean(node, user_inputs):
            return []
    return sorted(terms, key=lambda t: list(t[0].graph.nodes).index(t[0])) if terms else []


def _token_mean_loss(loss, user_inputs: set[fx.Node]) -> tuple[fx.Node, int] | None:
    """``(target, ignore_index)`` when ``loss`` is a mean over counted integer targets of the inputs alone."""
    if not isinstance(loss, fx.Node) or loss.target not in LOSSES:
        return None
    weight_at, reduction_at, ignore_at = LOSSES[loss.target]
    names = ("weight", "reduction", "ignore_index")
    values = [loss.args[i] if len(loss.args) > i else loss.kwargs.get(name, default)
              for i, name, default in zip((weight_at, reduction_at, ignore_at), names, (None, MEAN, -100), strict=True)]
    weight, reduction, ignore_index = values
    target = loss.args[1]
    val = target.meta.get("val") if isinstance(target, fx.Node) else None
    if weight is not None or reduction != MEAN or not isinstance(val, torch.Tensor) or val.is_floating_point():
        return None
    if any(n.op == "placeholder" and n not in user_inputs for n in ancestors([target])):
        return None  # targets computed from weights or buffers: not a count of the batch alone
    return target, int(ignore_index)


def _fixed_mean(node: fx.Node, user_inputs: set[fx.Node]) -> bool:
    """A term that averaging equal parts of the batch keeps exact as it is: a value the batch does not enter, or a
    scalar mean over all it reduces (every part holds the same number of values: ``x.mean()``, ``F.mse_loss``)."""
    if not _reads_inputs(node, user_inputs):
        return True
    if node.op != "call_function" or node.target in LOSSES or node.meta["val"].dim() != 0:
        return False
    if node.target in _PLAIN_MEANS:
        return True
    return (node.target in _ELEMENT_LOSSES and node.args[2:3] in ((), (MEAN,))
            and node.kwargs.get("reduction", MEAN) == MEAN)


def _reads_inputs(node: fx.Node, user_inputs: set[fx.Node]) -> bool:
    return any(n in user_inputs for n in ancestors([node]))


def count_graph(gm: fx.GraphModule, user_inputs: set[fx.Node], targets: list[tuple[fx.Node, int]]) -> fx.GraphModule:
    """A graph of the user inputs (all of them, in order) returning one microbatch's number of counted targets: a
    scalar for one counted mean, the counts of each (a vector, in term order) for several."""
    keep = set(ancestors([t for t, _ in targets]))
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
    return count_graph(gm, user_inputs, [(t, i) for _, t, i in terms]) if terms else None
