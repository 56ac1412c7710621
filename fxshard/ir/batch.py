"""Products that pair the examples of a batch with each other, and the values computed from them.

Data parallelism, pipeline microbatches and ``--grad-accum`` run the forward on a part of the step's batch and
average the parts' losses and gradients.  A contrastive loss scores every image against every text of the batch,
``logits = image_features @ text_features.T`` with labels ``arange(B)``: on a part it scores the part's examples
against each other only, and the average of the parts' losses is another loss (0.59 relative at --dp 2 on a CLIP
model).  :func:`cross_batch_products` finds such products; :func:`whole_batch_region` is what follows from them up
to the loss, which ``passes/batch_gather.py`` runs on the whole batch (its operands gathered over dp) and the
token-mean pass leaves as it is (a mean over the whole batch, the same value on every rank).

The batch is followed by size: the user inputs' leading dimension is the part's batch ``b``; a value computed from
the inputs carries the examples in each dimension of size ``b``.  A product of two such values whose left operand
has its rows and whose right operand has its columns over the batch (``[b, d] @ [d, b]``) pairs examples::

    >>> import torch, torch.nn.functional as F
    >>> from torch.export import export
    >>> class Clip(torch.nn.Module):
    ...     def forward(self, x, y):
    ...         logits = F.normalize(x, dim=-1) @ F.normalize(y, dim=-1).t()
    ...         return F.cross_entropy(logits, torch.arange(x.shape[0]))
    >>> gm = export(Clip(), (torch.randn(4, 8), torch.randn(4, 8)), strict=False).module()
    >>> inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    >>> [n.target for n in cross_batch_products(gm, inputs)]
    [<OpOverload(op='aten.matmul', overload='default')>]
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.errors import LayoutError
from fxshard.graph import node_fqn, static_shape, walk

aten = torch.ops.aten
PRODUCTS = {aten.matmul.default, aten.mm.default}


def local_batch(user_inputs: set[fx.Node]) -> int | None:
    """The leading size of the tensor inputs (one part's batch), or None without tensor inputs."""
    sizes = [n.meta["val"].shape[0] for n in user_inputs
             if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()]
    return sizes[0] if sizes else None


def examples(gm: fx.GraphModule, user_inputs: set[fx.Node]) -> set[fx.Node]:
    """The nodes whose value is computed from the user inputs (the examples flow through them)."""
    found = set(user_inputs)
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def cross_batch_products(gm: fx.GraphModule, user_inputs: set[fx.Node], rows=None) -> list[fx.Node]:
    """The 2-D products ``[b, d] @ [d, b]`` of two values computed from the inputs: each example's row against
    every example's column.  ``rows``: where the batch is split, the batch-row analysis (:mod:`fxshard.ir.rows`),
    which keeps the products whose operands do carry the examples there (a size equal to ``b`` by chance, as any
    size at one row per part, is not the batch)."""
    b = local_batch(user_inputs)
    if b is None:
        return []
    flowing = examples(gm, user_inputs)
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in PRODUCTS:
            continue
        left, right = node.args[:2]
        if not (isinstance(left, fx.Node) and isinstance(right, fx.Node) and left in flowing and right in flowing):
            continue
        lv, rv = left.meta.get("val"), right.meta.get("val")
        if isinstance(lv, torch.Tensor) and isinstance(rv, torch.Tensor) and lv.dim() == rv.dim() == 2 \
                and static_shape(lv)[0] == b and static_shape(rv)[1] == b \
                and (rows is None or rows.pairs_rows(left, right)):
            found.append(node)
    return found


def whole_batch_region(products: list[fx.Node]) -> set[fx.Node]:
    """``products`` and every node computed from them: what runs on the whole batch once they do."""
    return set(walk(products, lambda node: [u for u in node.users if u.op == "call_function"]))


def describe(node: fx.Node, model: str) -> str:
    """``fqn: op (what it mixes)``, as the refusals and the manifest's batch couplings name it."""
    return f"{node_fqn(node) or model}: {node.target} (a product of every example with every other)"


def refuse_microbatches(ctx, listed: str, what: str, over_dp: str = "") -> None:
    """Refuse a layout whose pipeline splits the batch into microbatches when ``listed`` (the ops, named) needs the
    whole batch at once (``what`` it does with it); ``over_dp``: what --dp does for it instead."""
    if ctx.microbatches > 1:
        raise LayoutError(f"--pp {ctx.layout.pp} with {ctx.microbatches} microbatches: {listed} {what}, which a "
                          "pipeline schedule sees one microbatch at a time (it runs microbatch 0 before the rest of "
                          f"the batch exists); train the batch over --dp instead{over_dp}, or at --microbatches 1")


def has_router_loss(model: torch.nn.Module) -> bool:
    """Whether ``model`` adds transformers' load-balancing loss to its loss: a product of two means over the whole
    batch (``passes/router_loss.py`` makes them whole-batch means under --dp; the compiler refuses pipeline
    microbatches and --cp for it, ``fxshard run`` --grad-accum)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0))


# a layer's term of the load-balancing loss: its top-k ids counted (histc; scatter_add of the attention mask's
# weights), its probabilities summed (passes/router_loss.py makes their means whole-batch means)
COUNTS = {aten.histc.default, aten.scatter_add.default, aten.scatter_add_.default}
SUMS = COUNTS | {aten.sum.dim_IntList}


def is_mean_of_sums(node: fx.Node) -> bool:
    """``sums / rows``, the sums an add chain of per-layer histc counts or row sums (from ``zeros``)."""
    return (node.op == "call_function" and node.target is aten.div.Tensor and isinstance(node.args[0], fx.Node)
            and bool(mean_terms(node.args[0])))


def mean_terms(node: fx.Node) -> list[fx.Node]:
    """The per-layer terms of an add chain ``zeros + t_0 + t_1 + ...`` (each a count or a sum over dim 0), or []."""
    terms = []
    while node.op == "call_function" and node.target is aten.add.Tensor:
        a, b = node.args
        if not (isinstance(b, fx.Node) and b.target in SUMS):
            return []
        if b.target is aten.sum.dim_IntList and list(b.args[1]) != [0]:
            return []
        terms.append(b)
        node = a
    return terms[::-1] if node.op == "call_function" and node.target is aten.zeros.default and terms else []
