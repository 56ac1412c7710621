"""What fxshard reads of a captured graph's provenance: the module each node came from, and what the loss needs.

A leaf (torch.fx alone), so that capture, ir, plan, the passes, the checks and the cost model read one definition::

    node_fqn(node)     # 'model.layers.3.mlp.down_proj': from the node's nn_module_stack, as capture keeps it
    loss_cone(gm)      # the nodes training runs: the loss, side effects, and what they are computed from
    ancestors([node])  # the node and what it is computed from (walk: the one graph walk)
    static_shape(val)  # a value's shape as ints, a size the data decides standing as a number of its own
    largest_shape(val) # the same, a size the data decides at its largest: what estimates count
    model_line(node)   # 'modeling_llama.py:244': the line of the model's code that made it
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator

import torch.fx as fx

NOT_MODEL = ("/torch/", "/fxshard/", "/passes/", "<")  # frames of a stack trace that are not the model's code


def loss_cone(gm: fx.GraphModule) -> set[fx.Node]:
    """What training runs: the loss (output 0 of a captured graph), every op with a side effect (an
    in-place update, e.g. of a buffer or through a view), and every node these are computed from.  The
    rest computes only the model's other outputs (e.g. logits gathered whole to be returned)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    start = [a for a in out.args[0][:1] if isinstance(a, fx.Node)]
    return set(ancestors(start + [n for n in gm.graph.nodes if n.op == "call_function" and n.is_impure()]))


def module_call(node: fx.Node, fqn: str) -> int | None:
    """Which call of module ``fqn`` computed ``node`` (0 for the first; export numbers the later calls of a
    module its forward calls again, ALBERT's shared layer's, ``@1``, ``@2``, ...), or None outside ``fqn``."""
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        if value[0] == fqn:
            _, at, k = key.rpartition("@")
            return int(k) if at and k.isdigit() else 0
    return None


def node_fqn(node: fx.Node) -> str:
    """FQN of the innermost module a node came from ('' for the model itself)."""
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""


def walk(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> Iterator[fx.Node]:
    """Each node reachable from ``start`` by ``step`` (a node's next nodes), once, depth first, ``start`` included:
    the one graph walk the passes and analyses share (a caller stops it by leaving the loop, prunes it by a ``step``
    that gives no next nodes past a node)::

        any(n in user_inputs for n in ancestors([node]))    # computed from the batch?
        set(walk(products, lambda n: [u for u in n.users if u.op == "call_function"]))
    """
    seen: set[fx.Node] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(step(node))


def ancestors(start: Iterable[fx.Node]) -> Iterator[fx.Node]:
    """``start`` and every node it is computed from (:func:`walk` by ``all_input_nodes``)."""
    return walk(start, lambda n: n.all_input_nodes)


def descendants(start: Iterable[fx.Node]) -> Iterator[fx.Node]:
    """``start`` and every node computed from it (:func:`walk` by ``users``)."""
    return walk(start, lambda n: n.users)


def static_shape(value) -> tuple[int, ...]:
    """``value``'s shape (a tensor's, as ``node.meta["val"]`` holds it) as ints.  A size only the data decides
    (``nonzero``, ``masked_select``, a boolean index: an unbacked symbol ``u3`` of torch.export, or an expression
    of such, ``4*u3``) stands as a number of its own: each symbol a distinct prime above 10**7, so a size equals
    another only where both are the same expression, and no size of the model, and products stay consistent
    (a view of ``[u3, 64]`` as ``[u3, 4, 16]`` keeps its first dimension).  For the analyses that compare sizes;
    a size the generated code must hold is the graph's own (a node), never this number::

        static_shape(torch.empty(4, 16))   # (4, 16)
    """
    return tuple(d if isinstance(d, int) else _stand_in(d) for d in value.shape)


def largest_shape(value) -> tuple[int, ...]:
    """``value``'s shape (a tensor's, or a shape itself) with each size the data decides at the largest its shape
    environment allows (a boolean index of ``[4, 16]`` selects at most 64 rows): what a memory or traffic estimate
    counts, never less than the program can hold.  A size without a finite bound counts 0 (unlike
    :func:`static_shape`'s stand-in, no size an estimate could scale)::

        largest_shape(torch.empty(4, 16))   # (4, 16)
    """
    shape = value.shape if hasattr(value, "shape") else value
    return tuple(d if isinstance(d, int) else _largest(d) for d in shape)


def _largest(size) -> int:
    node = size.node
    try:
        upper = node.shape_env.bound_sympy(node.expr).upper
        return int(upper) if upper.is_finite else 0
    except (TypeError, AttributeError, ValueError):
        return 0


def data_sized(node: fx.Node) -> bool:
    """Whether a size of ``node``'s value is one only the data decides (see :func:`static_shape`)."""
    val = node.meta.get("val")
    return hasattr(val, "shape") and any(not isinstance(d, int) for d in val.shape)


def _stand_in(size) -> int:
    expr = size.node.expr
    return int(expr.xreplace({s: _prime(s.name) for s in expr.free_symbols}))


@functools.cache
def _prime(name: str) -> int:
    import sympy

    index = int("".join(c for c in name if c.isdigit()) or 0)
    return int(sympy.nextprime(10**7 * (index + 1)))


def model_line(node: fx.Node) -> str:
    """``modeling_llama.py:244``: the innermost line of the model's own code (or its library's) that made
    ``node``, from the stack trace torch.export keeps; "" when the node has none (nodes fxshard inserted)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for path, line in reversed(frames):
        if not any(part in path for part in NOT_MODEL):
            return f"{path.rsplit('/', 1)[-1]}:{line}"
    return ""
