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
shape (:func:`fxshard.cost.costs.plan_costs` fits every node's dimensions in ``b`` and ``S``); a tensor an
op makes only for its backward (LayerNorm's mean and rstd, attention's logsumexp) takes, per dimension,
the fitted expression of a same-sized dimension of the op's inputs or output.  Exact at the captured size
by construction; exact at other sizes where the fit is (every dimension of the sample models is).

Fake tensors report the CPU device, so ``scaled_dot_product_attention`` takes the CPU flash kernel, which
saves q, k, v, the output and the logsumexp, not the S x S weights of the math path: the same tensors as
the CUDA flash kernel, and the measured CPU run (``fxshard run --memory-report``) picks it too.

Under ``--recompute`` each repeated block (``units``, :func:`fxshard.ir.blocks.block_units`, the spans the
generated code calls as submodules) runs through the runtime's own :func:`fxshard.runtime.recompute.recompute`,
that is ``torch.utils.checkpoint`` with the same policy: checkpoint saves the block's inputs through the hooks,
and the outputs selective recompute keeps (cached by torch where the hooks do not see them) are noted through
:func:`fxshard.runtime.recompute.watching_kept`.  Per block, ``blocks`` holds the bytes it keeps; the plan
takes the difference to the run without recompute as the block's forward alive again in backward.

``flops`` counts the forward's FLOPs as :mod:`torch.utils.flop_counter` does (matrix multiplies and
attention; elementwise ops count 0), at the traced (captured) size: per block and what recompute repeats::

    stage = trace_saved(nodes, ctx, coords, local, dims, held=stage_inputs + stage_outputs)
    stage.saved            # 10*B*S + ... bytes per microbatch
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fxshard.graph import largest_shape
from fxshard.ir.autograd import requires_grad
from fxshard.ir.comm import kind_of
from fxshard.ir.fake import argument_values, fake_mode, fake_value
from fxshard.ir.layout import Coords
from fxshard.runtime import collectives as rtc
from fxshard.runtime import fp8 as rt_fp8
from fxshard.runtime.recompute import KEEP_OF_MODE, SAVED_OPS, recompute, watching_kept


@dataclass(frozen=True)
class StageMemory:
    """One microbatch on one stage: ``saved`` bytes held for backward (``storages`` distinct storages), and
    the largest value its forward makes (``largest`` bytes, made by node ``largest_node``)."""

    saved: sympy.Expr
    storages: int
    largest: sympy.Expr
    largest_node: str
    blocks: dict = field(default_factory=dict)  # block fqn -> bytes of the storages first kept inside it
    flops: dict = field(default_factory=dict)  # "forward", "blocks", "selective": forward FLOPs (captured size)
    # who kept each storage first: the block it was kept in (its fqn), else the name of the node that saved it
    # ("" for the values held without being used); the search's pieces add these up (fxshard.cost.profile)
    saved_by: dict = field(default_factory=dict)


def trace_saved(nodes: list[fx.Node], ctx, coords: Coords, local: dict, dims, at: dict,
                held: list[fx.Node] = (), recompute_mode: str = "none", units: dict | None = None) -> StageMemory:
    """Run ``nodes`` forward on fake tensors and cost what autograd saves (plus the values in ``held``).

    ``local``: each node's local shape; ``dims(node)``: its local dimensions as expressions in B and S;
    ``at``: where to evaluate to pick the largest value; ``units``: the repeated blocks among ``nodes`` (first
    node -> :class:`~fxshard.ir.blocks.BlockUnit`), run as ``recompute_mode`` has the generated code run them."""
    state = set(ctx.program.state_by_name())
    grad_inputs = requires_grad(nodes[0].graph.owning_module, ctx.trainable) if nodes else set()
    env, producer, saved, running = {}, {}, [], [None, None]  # running: the node and the block being run
    units = units or {}

    def pack(t):
        saved.append((t, *running))
        return t

    arg = argument_values(env, coords)

    def ensure(a):  # a stage input, parameter or buffer: made when first read
        if a not in env:
            env[a] = _leaf(a, local, a in ctx.trainable or a in grad_inputs)
            _own(producer, env[a], a)

    def run(node):
        for a in node.all_input_nodes:
            ensure(a)
        running[0] = node
        env[node] = _run_node(node, arg, coords, ctx)
        _own(producer, env[node], node)

    flops = _Flops()
    # a shape environment: a value read (item()) or a size the data decides (nonzero) is a symbol, as in capture
    with fake_mode(), torch.enable_grad(), flops, watching_kept(pack), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        i = 0
        while i < len(nodes):
            unit = units.get(nodes[i])
            if unit is None:
                run(nodes[i])
                i += 1
                continue
            running[1] = flops.block = unit.fqn
            for a in unit.inputs:
                ensure(a)
            _run_block(unit, run, env, recompute_mode)
            running[1] = flops.block = None
            i += len(unit.nodes)
        for n in held:  # a value passed through (targets to the loss) is held without being used here
            if n not in env:
                env[n] = _leaf(n, local, False)
                _own(producer, env[n], n)
            saved.append((env[n], None, None))

    def is_state(node: fx.Node | None) -> bool:
        return node is not None and node.op == "placeholder" and (node in ctx.params or node.name in state)

    total, seen, blocks = sympy.Integer(0), set(), {u.fqn: sympy.Integer(0) for u in units.values()}
    by: dict[str, sympy.Expr] = {}
    for t, op, block in saved:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage._cdata
        owner = producer.get(key)
        if key in seen or is_state(owner):
            continue
        seen.add(key)
        expr = _storage_expr(t, _count(storage.nbytes()), owner, op, env, dims)
        total += expr
        key = block if block is not None else (op.name if op is not None else "")
        by[key] = by.get(key, sympy.Integer(0)) + expr
        if block is not None:
            blocks[block] += expr
    largest = max(((_bytes(dims(n), env[n]), n.name) for n in nodes if _is_float(env.get(n)) and n.name),
                  key=lambda e: float(e[0].subs(at)), default=(sympy.Integer(0), ""))
    return StageMemory(sympy.expand(total), len(seen), *largest, blocks={k: sympy.expand(v) for k, v in blocks.items()},
                       flops=flops.totals(), saved_by={k: sympy.expand(v) for k, v in by.items()})


def _run_block(unit, run, env: dict, mode: str) -> None:
    """One repeated block's span, as the generated code calls it: plainly, or through ``rt.recompute``."""

    def body(*args):
        for a, v in zip(unit.inputs, args, strict=True):
            env[a] = v
        for n in unit.nodes:
            run(n)
        return tuple(env[o] for o in unit.outputs)

    args = [env[a] for a in unit.inputs]
    outs = body(*args) if mode == "none" else recompute(body, *args, keep=KEEP_OF_MODE[mode])
    for o, v in zip(unit.outputs, outs, strict=True):
        env[o] = v


# the CPU flash kernel the plan's fake tensors take has no formula of its own; it does the CUDA flash kernel's work
_FLOPS_AS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
             torch.ops.aten._scaled_dot_product_flash_attention}


class _Flops(TorchDispatchMode):
    """Forward FLOPs by :mod:`torch.utils.flop_counter`'s formulas: all, inside blocks, and inside blocks by ops
    selective recompute does not keep (what it runs again)."""

    def __init__(self):
        super().__init__()
        self.block, self.counts = None, {"forward": 0, "blocks": 0, "selective": 0}
        self._kept = {op._overloadpacket for op in SAVED_OPS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(_FLOPS_AS.get(func._overloadpacket, func._overloadpacket))
        if formula is not None:
            n = _count(formula(*args, **kwargs, out_val=out))
            self.counts["forward"] += n
            if self.block is not None:
                self.counts["blocks"] += n
                self.counts["selective"] += 0 if func._overloadpacket in self._kept else n
        return out

    def totals(self) -> dict:
        return dict(self.counts)


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
    if kind is not None and kind.name == "linears_regathered":  # the runtime's Function: it saves the shard
        weights, biases = (tuple(arg(a) for a in node.kwargs[k]) for k in ("weights", "biases"))
        return rtc._LinearsRegathered.apply(arg(node.args[0]), arg(node.kwargs["shard"]), None, node.kwargs["dim"],
                                            None, len(weights), *weights, *biases)
    if kind is not None and kind.name == "fp8_linears_regathered":  # the runtime's call, with no group: forward only
        weights, biases = (tuple(arg(a) for a in node.kwargs[k]) for k in ("weights", "biases"))
        return rt_fp8.fp8_linears_regathered(arg(node.args[0]), None, arg(node.kwargs["shard"]), node.kwargs["dim"],
                                             weights, biases, node.kwargs["recipe"])
    return fake_value(node, arg, coords, ctx)


def _own(producer: dict, value, node: fx.Node) -> None:
    """The first node whose value has a storage made it (later ones are views of it)."""
    if isinstance(value, torch.Tensor) and not isinstance(node.meta.get("val"), (tuple, list)):
        producer.setdefault(value.untyped_storage()._cdata, node)


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _count(n) -> int:
    """A size or count as an int; one the data decides (an unbacked symbol) at its largest (graph.largest_shape)."""
    return largest_shape((n,))[0]


def _bytes(dims: tuple, t: torch.Tensor) -> sympy.Expr:
    return sympy.expand(math.prod(dims, start=sympy.Integer(1)) * t.element_size())


def _storage_expr(t: torch.Tensor, nbytes: int, owner: fx.Node | None, op: fx.Node | None, env: dict,
                  dims) -> sympy.Expr:
    """Bytes of ``t``'s storage as an expression: its maker's fitted bytes, scaled by how much larger the storage
    is than the maker's value (1 but for ops whose value views a larger buffer)."""
    if owner is not None and isinstance(env.get(owner), torch.Tensor):
        made = env[owner]
        size = _count(made.numel()) * made.element_size()
        return _bytes(dims(owner), made) * (sympy.Rational(nbytes, size) if size else 1)
    shape = largest_shape(t)
    shape_dims = _matched(shape, op, env, dims) if op is not None else [sympy.Integer(d) for d in shape]
    size = _count(t.numel()) * t.element_size()
    return _bytes(tuple(shape_dims), t) * (sympy.Rational(nbytes, size) if size else 1)


def _matched(shape: tuple, op: fx.Node, env: dict, dims) -> list:
    """Each dimension of a tensor ``op`` made for its backward, as the expression of a same-sized dimension of
    ``op``'s inputs or output: at the same position if one has it, else anywhere, else the number.  From elsewhere,
    never a 1 (as likely a kept or broadcast dimension as a microbatch of one row) nor an expression an earlier
    dimension of the tensor took (a value holds its tokens once): at a microbatch of one row, sizes coincide, and
    the embedding's ``[b, S, 1]`` mask read as b x S x b, the vocab-parallel loss's ``[tokens, tp, 2]`` (8 tokens
    per rank at tp=8) as tokens x tokens (25 GiB of the 70B cp plan's 62 GiB on pp rank 1)."""
    known = [(largest_shape(env[n]), dims(n)) for n in (*op.all_input_nodes, op)
             if isinstance(env.get(n), torch.Tensor) and not isinstance(n.meta.get("val"), (tuple, list))]
    out = []
    for i, size in enumerate(shape):
        same_place = [e[i] for shp, e in known if i < len(shp) and shp[i] == size]
        anywhere = [e[j] for shp, e in known for j, d in enumerate(shp)
                    if d == size and size != 1 and e[j] not in out]
        out.append((same_place or anywhere or [sympy.Integer(size)])[0])
    return out
