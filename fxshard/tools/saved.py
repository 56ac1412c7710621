"""What one microbatch leaves alive for backward on a pipeline stage: the bytes autograd saves, symbolic in B and S.

The rank's graph (the nodes of a stage, or of the whole rank without a pipeline) runs forward on fake
tensors of its local shapes, with autograd on and ``torch.autograd.graph.saved_tensors_hooks`` noting
every tensor an op saves for its backward.  Nothing is guessed per op: an op saves what its derivative
formula in torch saves, as the generated rank file runs the same ATen calls (each line of a rank file is
one node of this graph).  Saved tensors are counted once per storage (a view saves its base; ``linear``
saves ``weight.t()``, which is the weight), and storages of parameters and buffers are model state, not
activations.  Under a pipeline, ``PipelineStage`` also keeps each microbatch's inputs and outputs until its
backward: they join the set (most are saved anyway).

Each storage is then written as an expression: the storage a graph node made has that node's fitted
shape (:func:`fxshard.tools.costs.plan_costs` fits every node's dimensions in ``b`` and ``S``); a tensor an
op makes only for its backward (LayerNorm's mean and rstd, attention's logsumexp) takes, per dimension,
the fitted expression of a same-sized dimension of the op's inputs or output.  Exact at the captured size
by construction; exact at other sizes where the fit is (every dimension of the sample models is).

Fake tensors report the CPU device, so ``scaled_dot_product_attention`` takes the CPU flash kernel, which
saves q, k, v, the output and the logsumexp, not the S x S weights of the math path: the same tensors as
the CUDA flash kernel, and the measured CPU run (``fxshard run --memory-report``) picks it too::

    stage = trace_saved(nodes, ctx, coords, local, dims, held=stage_inputs + stage_outputs)
    stage.saved            # 10*B*S + ... bytes per microbatch
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxshard.ir.autograd import requires_grad
from fxshard.ir.comm import kind_of
from fxshard.ir.context import RankValue
from fxshard.passes.checks import fake_value


@dataclass(frozen=True)
class StageMemory:
    """One microbatch on one stage: ``saved`` bytes held for backward (``storages`` distinct storages), and
    the largest value its forward makes (``largest`` bytes, made by node ``largest_node``)."""

    saved: sympy.Expr
    storages: int
    largest: sympy.Expr
    largest_node: str


def trace_saved(nodes: list[fx.Node], ctx, coords: dict[str, int], local: dict, dims, at: dict,
                held: list[fx.Node] = ()) -> StageMemory:
    """Run ``nodes`` forward on fake tensors and cost what autograd saves (plus the values in ``held``).

    ``local``: each node's local shape; ``dims(node)``: its local dimensions as expressions in B and S;
    ``at``: where to evaluate to pick the largest value."""
    state = set(ctx.program.state_by_name())
    grad_inputs = requires_grad(nodes[0].graph.owning_module, ctx.params) if nodes else set()
    env, producer, saved, running = {}, {}, [], [None]

    def pack(t):
        saved.append((t, running[0]))
        return t

    def arg(a):
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, RankValue):
            return a.at(coords)
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    with FakeTensorMode(allow_non_fake_inputs=True), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for node in nodes:
            for a in node.all_input_nodes:
                if a not in env:
                    env[a] = _leaf(a, local, a in ctx.params or a in grad_inputs)
                    _own(producer, env[a], a)
            running[0] = node
            env[node] = _run_node(node, arg, coords, ctx)
            _own(producer, env[node], node)
        for n in held:  # a value passed through (targets to the loss) is held without being used here
            if n not in env:
                env[n] = _leaf(n, local, False)
                _own(producer, env[n], n)
            saved.append((env[n], None))

    def is_state(node: fx.Node | None) -> bool:
        return node is not None and node.op == "placeholder" and (node in ctx.params or node.name in state)

    total, seen = sympy.Integer(0), set()
    for t, op in saved:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage._cdata
        owner = producer.get(key)
        if key in seen or is_state(owner):
            continue
        seen.add(key)
        total += _storage_expr(t, storage.nbytes(), owner, op, env, dims)
    largest = max(((_bytes(dims(n), env[n]), n.name) for n in nodes if _is_float(env.get(n)) and n.name),
                  key=lambda e: float(e[0].subs(at)), default=(sympy.Integer(0), ""))
    return StageMemory(sympy.expand(total), len(seen), *largest)


def _leaf(node: fx.Node, local: dict, grad: bool):
    """A stage input, parameter or buffer as a fake tensor of its local shape."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty(local.get(node, tuple(val.shape)), dtype=val.dtype)
    return t.requires_grad_(grad and t.is_floating_point())


def _run_node(node: fx.Node, arg, coords, ctx):
    kind = kind_of(node.target)
    if kind is not None and kind.name == "copy_to":  # identity forward: the runtime returns a view, not a copy
        x = arg(node.args[0])
        return x.view_as(x)
    return fake_value(node, arg, coords, ctx)


def _own(producer: dict, value, node: fx.Node) -> None:
    """The first node whose value has a storage made it (later ones are views of it)."""
    if isinstance(value, torch.Tensor) and not isinstance(node.meta.get("val"), (tuple, list)):
        producer.setdefault(value.untyped_storage()._cdata, node)


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _bytes(dims: tuple, t: torch.Tensor) -> sympy.Expr:
    return sympy.expand(math.prod(dims, start=sympy.Integer(1)) * t.element_size())


def _storage_expr(t: torch.Tensor, nbytes: int, owner: fx.Node | None, op: fx.Node | None, env: dict,
                  dims) -> sympy.Expr:
    """Bytes of ``t``'s storage as an expression: its maker's fitted bytes, scaled by how much larger the storage
    is than the maker's value (1 but for ops whose value views a larger buffer)."""
    if owner is not None and isinstance(env.get(owner), torch.Tensor):
        made = env[owner]
        size = made.numel() * made.element_size()
        return _bytes(dims(owner), made) * (sympy.Rational(nbytes, size) if size else 1)
    shape_dims = _matched(tuple(t.shape), op, env, dims) if op is not None else [sympy.Integer(d) for d in t.shape]
    size = t.numel() * t.element_size()
    return _bytes(tuple(shape_dims), t) * (sympy.Rational(nbytes, size) if size else 1)


def _matched(shape: tuple, op: fx.Node, env: dict, dims) -> list:
    """Each dimension of a tensor ``op`` made for its backward, as the expression of a same-sized dimension of
    ``op``'s inputs or output: at the same position if one has it, else anywhere, else the number."""
    known = [(tuple(env[n].shape), dims(n)) for n in (*op.all_input_nodes, op)
             if isinstance(env.get(n), torch.Tensor) and not isinstance(n.meta.get("val"), (tuple, list))]
    out = []
    for i, size in enumerate(shape):
        same_place = [e[i] for shp, e in known if i < len(shp) and shp[i] == size]
        anywhere = [e[j] for shp, e in known for j, d in enumerate(shp) if d == size]
        out.append((same_place or anywhere or [sympy.Integer(size)])[0])
    return out
