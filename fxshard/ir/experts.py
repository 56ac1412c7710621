"""The grouped-matmul pattern of a mixture-of-experts experts module, as the captured graph shows it.

A transformers 5 MoE layer stores its experts stacked (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``) and runs them as two grouped matmuls over the routed rows sorted by
expert, with the model's cumulative rows per expert as offsets::

    offs = cumsum(histc(sorted expert ids))                     # the router's choice, every rank
    h = grouped_mm(rows, transpose(gate_up_proj), offs)         # row-wise from here ...
    h = act(chunk(h)[0]) * chunk(h)[1]
    out = grouped_mm(h, transpose(down_proj), offs)             # ... to here
    out = (out * weights.unsqueeze(-1))[inv_perm].view(T, k, H).sum(1).to(dtype)   # the combine

Two transformations read this pattern: expert parallelism (``passes/expert_parallel.py``, the rows moved to
the rank of their expert) and tensor parallelism inside the experts (``fxshard/plan/experts.py``, each
expert's intermediate size split over tp).  Both need the same facts, found here once: which nodes are an
experts module's grouped matmuls, which parameter each one's weight is, and that every op between the two
acts on each row alone, which ops before the first bring its rows from the module's input (the dispatch), and
which ops after the second are linear in its rows (the combine).
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from fxshard.graph import ancestors, walk

aten = torch.ops.aten
# the model's weight on its way to the grouped matmul: ops that keep the expert dimension (dim 0) as it is
WEIGHT_OPS = {aten.transpose.int, aten.to.dtype, aten.contiguous.default, aten._to_copy.default}
# ops between the two grouped matmuls that act on each row alone (so the rows may be any rows)
ROW_OPS = {aten.chunk.default, aten.split.Tensor, aten.silu.default, aten.gelu.default, aten.relu.default,
           aten.sigmoid.default, aten.tanh.default, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor,
           aten.to.dtype, aten._to_copy.default, aten.clamp.default, aten.neg.default}


# transformers' dispatch before the first grouped matmul (grouped_mm_experts_forward): the tokens' rows gathered
# in expert order (``hidden_states[perm // top_k]``), cast to their own dtype
_DISPATCH_OPS = {aten.index.Tensor, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.to.dtype}
# transformers' combine after the second grouped matmul (grouped_mm_experts_forward): weigh each row by its
# routing weight, gather the rows back into token order, view them [T, k, H], sum each token's k rows, cast
_COMBINE_OPS = {aten.mul.Tensor, aten.index.Tensor, aten.view.default, aten.reshape.default,
                aten._unsafe_view.default, aten.sum.dim_IntList, aten.to.dtype}


def grouped_mm_ops() -> set:
    """``aten._grouped_mm`` and transformers' CPU fallback of it (a custom op, once transformers registered it)."""
    ops = {aten._grouped_mm.default}
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        ops.add(fallback.default)
    return ops


def weight_param(node: fx.Node, params: set[fx.Node]) -> tuple[fx.Node | None, list[fx.Node]]:
    """The parameter a grouped matmul's weight argument comes from, and the nodes on the way (the matmul's
    argument first)."""
    chain = []
    while node not in params:
        if node.op != "call_function" or node.target not in WEIGHT_OPS:
            return None, chain
        if node.target is aten.transpose.int and 0 in [d % node.args[0].meta["val"].dim() for d in node.args[1:]]:
            return None, chain
        chain.append(node)
        node = node.args[0]
    return node, chain


def param_dim(chain: list[fx.Node], dim: int) -> int:
    """The parameter's dimension that becomes dimension ``dim`` of the matmul's weight argument through
    ``chain`` (as :func:`weight_param` returns it): transposes swap dimensions, casts keep them."""
    for node in chain:
        if node.target is aten.transpose.int:
            n = node.meta["val"].dim()
            a, b = node.args[1] % n, node.args[2] % n
            dim = b if dim == a else a if dim == b else dim
    return dim


def offsets(mm: fx.Node) -> fx.Node:
    return mm.args[2] if len(mm.args) > 2 else mm.kwargs["offs"]


def grouped_mms(gm: fx.GraphModule, fqn_of) -> dict[str, list[fx.Node]]:
    """The grouped matmuls of each experts module, by module FQN (``fqn_of(node)``), in graph order."""
    ops = grouped_mm_ops()
    found: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ops:
            found.setdefault(fqn_of(node), []).append(node)
    return found


def not_row_wise(first: fx.Node, second: fx.Node) -> str | None:
    """Why the ops from the first grouped matmul to the second do not act on each row alone (None: they do).

    Expert parallelism computes another set of rows in another order; tensor parallelism splits each row's
    columns, which a row-wise op keeps apart as long as the placements say so."""
    inside = functools.cache(lambda n: n is not first and reaches(first, n))  # not the weights and what else
    for n in walk(second.all_input_nodes, lambda n: n.all_input_nodes if inside(n) else ()):  # feeds it from outside
        if not inside(n):
            continue
        if n.op != "call_function" or (n.target not in ROW_OPS and n.target.__name__ != "getitem"):
            return f"{n.name} ({n.target}) between the experts' grouped matmuls is not an op known to act row by row"
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
        if n.target in (aten.chunk.default, aten.split.Tensor) and dim % n.args[0].meta["val"].dim() == 0:
            return f"{n.name} splits the rows between the grouped matmuls"
    return None


def reaches(src: fx.Node, dst: fx.Node) -> bool:
    """Whether ``dst`` is computed from ``src``."""
    return any(n is src for n in ancestors([dst]))


def combine_chain(second: fx.Node, fqn_of) -> list[fx.Node]:
    """The nodes after an experts module's second grouped matmul, in order, that are linear in its rows (the
    combine: ``(out * w.unsqueeze(-1))[inv_perm].view(T, k, H).sum(1).to(dtype)``), so that partial sums of
    the rows may pass through them and be reduced once, on the ``[T, H]`` result, not on the ``[T*k, H]`` rows.

    Each node is the only user of the one before, in the same module (``fqn_of``), keeps its dtype (a cast
    rounds each partial sum: not linear), and is one of: a product with another value (which must then be the
    same on every rank: the propagation rule checks placements), a gather of rows by an index, a view, a sum
    over some dimensions, a cast to its own dtype.  The chain ends before the first node that is none of these."""
    chain, node, fqn = [], second, fqn_of(second)
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.op != "call_function" or user.target not in _COMBINE_OPS or fqn_of(user) != fqn \
                or not _linear_in(user, node):
            break
        chain.append(user)
        node = user
    return chain


def dispatch_chain(first: fx.Node, fqn_of) -> list[fx.Node]:
    """The nodes before an experts module's first grouped matmul, in order, that bring its rows from the module's
    input and are linear in it (the dispatch: ``hidden_states[perm // top_k].to(dtype)``), so that tensor
    parallelism may begin before them: the ``copy_to`` that sums the rows' gradient over tp then sits on the
    ``[T, H]`` tokens, after the gather's backward has added each token's k row gradients, not on the
    ``[T*k, H]`` rows.

    Walking back from the matmul's rows, each node is the only user of its result (nothing outside the chain
    reads a value whose gradient is still partial), in the same module (``fqn_of``), keeps its dtype, and is a
    gather of rows by an index, a view or a cast to its own dtype.  The chain begins after the first node that
    is none of these (the module's input: the tokens ``[T, H]``)."""
    chain, node, fqn = [], first.args[0], fqn_of(first)
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _DISPATCH_OPS \
            and len(node.users) == 1 and fqn_of(node) == fqn and isinstance(node.args[0], fx.Node) \
            and _linear_in(node, node.args[0]):
        chain.insert(0, node)
        node = node.args[0]
    return chain


def _linear_in(node: fx.Node, x: fx.Node) -> bool:
    """Whether ``node`` (one of ``_COMBINE_OPS`` or ``_DISPATCH_OPS``) is linear in its argument ``x``, without a
    cast."""
    val, src = node.meta.get("val"), x.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor) or val.dtype != src.dtype:
        return False
    if node.target is aten.mul.Tensor:
        return (node.args[0] is x) != (node.args[1] is x)  # x * x is not linear
    if node.args[0] is not x:
        return False
    if node.target is aten.index.Tensor:  # rows gathered: one index, on dimension 0
        (index, *rest) = node.args[1]
        return not rest and isinstance(index, fx.Node) and index is not x
    if node.target is aten.sum.dim_IntList:  # sum(x) with no dimensions named sums every one
        return len(node.args) > 1 and bool(node.args[1])
    return True  # view, reshape, a cast to the same dtype (checked above)
