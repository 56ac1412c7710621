"""Which terms of a loss are means over counted targets, and the graph that counts those targets.

``F.cross_entropy(logits, target, ignore_index=-100)`` (and ``nll_loss``) divides the summed token losses by the
number of targets that are not ``ignore_index``: a part of the batch counts its own.  So does a mean over the
values a boolean mask of the batch selects (``loss[mask].mean()``, ``F.mse_loss(x[mask], y[mask])``), which counts
the mask's true elements (ignore index 0).  :func:`counted_terms` finds such means in a loss (itself, or an affine
combination of them and of means over fixed counts); :func:`count_graph` is a graph of the user inputs returning
how many targets each counts.  The token-mean pass
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
PLAIN_MEANS = {aten.mean.default, aten.mean.dim}
# elementwise losses -> the position of their reduction argument
ELEMENT_LOSSES = {aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
                  aten.huber_loss.default: 2, aten.binary_cross_entropy_with_logits.default: 4,
                  aten.binary_cross_entropy.default: 3}


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
        counted = _token_mean_loss(node, user_inputs) or _masked_mean_loss(node, user_inputs)
        if counted is not None:
            terms.append((node, *counted))
        elif node.op == "call_function" and node.target in _COMBINE:
            args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
            if node.target in _DIV:  # a term over a constant; over a value of the batch (a count of its own), or
                num, den = node.args[:2]  # a constant over a term: no mean
                if isinstance(den, fx.Node) and _reads_inputs(den, user_inputs):
                    return []
                args = [num] if isinstance(num, fx.Node) and not _sum_over_its_count(num, den) else []
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
    if any(n.op == "placeholder" and n not in user_inputs for n in ancestors([mask])) or \
            not _reads_inputs(mask, user_inputs):
        return None
    return mask, 0


def _reduces_to_mean(node: fx.Node) -> bool:
    """A scalar mean over every value of its input: ``x.mean()`` or an elementwise loss with reduction mean."""
    if node.meta["val"].dim() != 0:
        return False
    if node.target in PLAIN_MEANS:
        return len(node.args) == 1 or node.args[1] in (None, [], list(range(node.args[0].meta["val"].dim())))
    at = ELEMENT_LOSSES.get(node.target)
    if at is None:
        return False
    reduction = node.args[at] if len(node.args) > at else node.kwargs.get("reduction", MEAN)
    return reduction == MEAN


def _fixed_mean(node: fx.Node, user_inputs: set[fx.Node]) -> bool:
    """A term that averaging equal parts of the batch keeps exact as it is: a value the batch does not enter, or a
    scalar mean over all it reduces (every part holds the same number of values: ``x.mean()``, ``F.mse_loss``)."""
    if not _reads_inputs(node, user_inputs):
        return True
    if node.op != "call_function" or node.target in LOSSES or node.meta["val"].dim() != 0:
        return False
    if any(not isinstance(d, int) for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
           for d in a.meta["val"].shape):
        return False  # over a number of values the data decides (masked_select, a boolean index): no fixed mean
    if node.target in PLAIN_MEANS:
        return True
    return node.target in ELEMENT_LOSSES and _reduces_to_mean(node)


def _sum_over_its_count(num, den) -> bool:
    """``x.sum() / n`` with ``n`` the number of values summed (Switch Transformers' router z-loss,
    ``torch.sum(z) / (num_groups * tokens_per_group)``): a mean over a fixed count, as ``x.mean()`` is."""
    if not isinstance(num, fx.Node) or num.target is not aten.sum.default or not isinstance(den, (int, float)):
        return False
    shape = num.args[0].meta["val"].shape
    if any(not isinstance(d, int) for d in shape):
        return False
    count = 1
    for d in shape:
        count *= d
    return den == count


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
