"""Split the sequence over the ``cp`` ranks (context parallelism, ``--cp N``): each rank computes 1/N of the tokens.

What depends on the inputs alone (position ids, attention masks built by the model, rotary tables, ALiBi biases,
the causal-LM labels shifted by one) keeps its whole-sequence computation, on every cp rank, exactly as the model
wrote it; where such a value meets the model's weights it is entered into the split program by ``rt.cp_enter``:
its sequence dimensions permuted into the cp order (a causal model's 2N chunks, rank i holding chunks i and 2N-1-i,
so every rank does the same attention work) and this rank's part kept.  Everything after runs on this rank's tokens:
every op is decided by the placement rules over the cp axis (the tensor-parallel table, :mod:`fxshard.ir.cp_rules`
for losses and the rest), sizes baked into views become this rank's, and an op with no rule for a split sequence (a
cumulative scan, a convolution or pooling along it) is refused, naming its module.

Attention is where tokens meet.  ``--cp-mode`` writes it as explicit lines:

* ``allgather`` (the default, Llama 3's): ``rt.gather_to`` of K and V over cp, hoisted above ``repeat_kv`` and the
  reshapes so the key/value heads travel, not their repeats; backward reduce-scatters dK and dV.  Matmul-softmax
  attention (Bloom's ALiBi scores) is gathered the same way, at its second operand.
* ``ring``: N ``rt.ring_attention_step`` lines pass K/V blocks around the ring while each block is computed, and
  ``rt.merge_attention`` merges the blocks by their log-sum-exp (``torch.nn.functional.scaled_dot_product_attention``
  only).
* ``a2a`` (DeepSpeed-Ulysses): ``rt.seq_to_heads`` / ``rt.heads_to_seq`` all-to-alls around the attention, which
  sees the whole sequence in its natural order for 1/N of the heads (refused when cp·tp does not divide the heads).

A token-mean loss (``passes/token_mean.py``) becomes this rank's share of the step's mean, which training averages
over dp x cp with the gradients; the model's other outputs are gathered whole by ``rt.cp_leave``.  After this pass
the graph is one cp rank's program: the other passes see a model with a shorter sequence.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from fxshard.errors import ShardingError
from fxshard.graph import node_fqn
from fxshard.ir import cp_attention
from fxshard.ir.context import CP, CompileContext, Group, NodeSpec
from fxshard.ir.cp_experts import TokenBlock, token_local_blocks
from fxshard.ir.cp_rules import MATMULS, cp_rule
from fxshard.ir.localize import localize_sizes
from fxshard.ir.placement import Partial, Placement, Replicate, Shard, local_shape
from fxshard.ir.sharding import Decision, argument, rule_decision, shape, tensor_args
from fxshard.runtime import collectives as rtc
from fxshard.runtime import context_parallel as rcp
from fxshard.runtime import loss as rt_loss

aten = torch.ops.aten
R = Replicate()
AVG = Partial("avg")
GROUP = Group(CP)
# ops that move or re-view a value without mixing its elements: a gather is hoisted above them, an input-only value
# is entered below them
MOVEMENT = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.transpose.int, aten.permute.default,
            aten.t.default, aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
            aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.flatten.using_ints, aten.unflatten.int,
            aten.select.int, aten.slice.Tensor}
SDPA = aten.scaled_dot_product_attention.default


def context_parallel_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    split = _Split(gm, ctx)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node not in split.whole and node not in split.place \
                and node not in split.erased:
            split.decide(node)
    split.outputs()
    split.localize()
    gm.recompile()
    return gm


class _Split:
    """The walk: each node's placement over cp (``place``), the values entered and gathered so far."""

    def __init__(self, gm: fx.GraphModule, ctx: CompileContext):
        self.gm, self.ctx, self.cp, self.mode = gm, ctx, ctx.layout.cp, ctx.layout.cp_mode
        self.seq = ctx.sequence
        self.length = self.seq.length
        self.whole = input_only(gm, ctx)
        self.balanced = causal(gm, ctx)
        self.place: dict[fx.Node, Placement | tuple] = {}
        self.entered: dict[tuple, fx.Node] = {}
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.erased: set[fx.Node] = set()
        self.blocks = {n: b for b in token_local_blocks(gm, node_fqn) for n in b.nodes}
        self.whole -= set(self.blocks)  # an experts module's arange of its pairs: this rank's pairs
        chunks = 2 * self.cp if self.balanced else self.cp
        if self.length % chunks:
            ok = [c for c in range(1, self.length + 1) if self.length % ((2 * c) if self.balanced else c) == 0]
            why = f"2*cp = {chunks} load-balanced chunks (a causal model)" if self.balanced else f"{chunks} parts"
            raise ShardingError(f"{ctx.model_file_name}: --cp {self.cp} cuts the sequence of {self.length} tokens into "
                                f"{why}, which do not divide it; use --cp in {ok[:8]} or a sequence length divisible "
                                f"by {chunks} (pad the batch)")
        ctx.notes.append(
            f"--cp {self.cp} --cp-mode {self.mode}: {self.length} tokens split over {self.cp} ranks, "
            + (f"load-balanced (a causal model: rank i holds chunks i and {2 * self.cp - 1}-i of {2 * self.cp})"
               if self.balanced else "in contiguous parts (no causal mask: every part does the same work)")
            + "; position ids, masks and shifted labels computed on the whole sequence first")

    # ---------------------------------------------------------------- deciding

    def decide(self, node: fx.Node) -> None:
        args = tensor_args(node)
        if node.target is operator.getitem:
            src = self.place.get(node.args[0], R)
            self.place[node] = src[node.args[1]] if isinstance(src, tuple) else src
            return
        if node.target is SDPA:
            return self.attention(node)
        if node in self.blocks:
            return self.token_block(self.blocks[node])
        _refuse_dropout(node, self.cp)
        has = [None if a in self.whole else self.place.get(a, R) for a in args]
        gathers = False
        if all(h in (None, R) for h in has):
            decision = self._seeded(node, args) or Decision(_whole_out(node), tuple(R for _ in args))
        else:
            trial = [R if h is None else h for h in has]
            decision = cp_rule(node, args, trial) or rule_decision(node, args, trial)
            if decision is None and node.target in MATMULS and isinstance(trial[MATMULS[node.target]], Shard):
                decision, gathers = self._gathered_operand(node, args, trial), True
            if decision is None:
                raise ShardingError(self._mixes(node, trial))
            if decision.rewrite is not None:  # a tensor-parallel rewrite (a mean of parts): no cp form of it
                raise ShardingError(
                    f"{node_fqn(node) or 'model'}: {_op(node)} ({node.name}) reduces over the sequence, which --cp "
                    f"{self.cp} splits (a mean or sum over the tokens: each cp rank holds 1/{self.cp} of them, and "
                    "the result would need the parts of every cp rank, which fxshard does not write under cp); "
                    "fxshard refuses rather than train wrongly: drop --cp for this model")
        self.apply(node, args, has, decision, gathers)

    def _seeded(self, node: fx.Node, args: list[fx.Node]) -> Decision | None:
        """Where tokens enter the weights (an embedding of the ids, of the positions): the input-only argument split
        along its sequence, if a rule then splits the output along one of its sequence dimensions."""
        out_dims = self.seq.of(node)
        for i, a in enumerate(args):
            if a not in self.whole or not out_dims:
                continue
            for d in self.seq.of(a):
                size = shape(a)[d]
                if size % self.length:
                    continue
                trial = [Shard(d, size // self.length) if j == i else R for j in range(len(args))]
                decision = cp_rule(node, args, trial) or rule_decision(node, args, trial)
                if decision and isinstance(decision.out, Shard) and decision.out.dim in out_dims:
                    return decision
        return None

    def _gathered_operand(self, node, args, trial) -> Decision | None:
        """Matmul-softmax attention (``q @ k^T``, ``probs @ v``, ALiBi's ``baddbmm``): the rows stay split, the
        second operand is gathered whole over cp (allgather mode only)."""
        if self.mode != "allgather":
            raise ShardingError(
                f"{node_fqn(node) or 'model'}: {_op(node)} multiplies tokens by tokens (matmul-softmax attention); "
                f"--cp-mode {self.mode} rewrites torch's scaled_dot_product_attention only; use --cp-mode allgather, "
                "or give the model SDPA attention (attn_implementation='sdpa')")
        rhs = MATMULS[node.target]
        whole = [R if i == rhs else p for i, p in enumerate(trial)]
        return cp_rule(node, args, whole) or rule_decision(node, args, whole)

    def apply(self, node: fx.Node, args: list[fx.Node], has: list, decision: Decision, gathers: bool = False) -> None:
        """Record ``decision`` for ``node``: its input-only arguments entered as it needs them, a split operand it
        needs whole gathered (``gathers``: matmul-softmax attention's second operand)."""
        assert decision.rewrite is None, (node, decision)
        replace = {}
        for a, h, need in zip(args, has, decision.inputs, strict=True):
            if h is None:
                if node.target is rt_loss.token_mean or (not self.seq.of(a) and not isinstance(need, Shard)):
                    continue  # the count of targets reads them whole, as they are
                replace[a] = self.enter(a, need)
            elif h != need and gathers and isinstance(h, Shard) and need == R:
                new = self.gather(a)
                if new is not a:
                    replace[a] = new
            elif h != need:
                raise ShardingError(self._mixes(node, [self.place.get(b, R) for b in args]))
        if replace:
            node.args = fx.node.map_arg(node.args, lambda a: replace.get(a, a))
            node.kwargs = fx.node.map_arg(node.kwargs, lambda a: replace.get(a, a))
        self.place[node] = decision.out

    # ---------------------------------------------------------------- entering and gathering

    def enter(self, value: fx.Node, need: Placement, permute: bool = True) -> fx.Node:
        """``value`` (input-only, whole) as this rank's program takes it at ``need``; a flattened value (``[B*S]``
        labels) is entered where it still has its sequence and re-viewed after."""
        key = (value, need, permute)
        if key in self.entered:
            return self.entered[key]
        dims = self.seq.of(value)
        if all(shape(value)[d] == self.length for d in dims) and (not isinstance(need, Shard) or need.blocks == 1):
            split = need.dim if isinstance(need, Shard) else None
            node = self._insert(rcp.cp_enter, (value, GROUP), {"dims": dims if permute else (), "split": split,
                                                                "balanced": self.balanced}, after=value,
                                val=value.meta["val"], placement=need, collective="cp_enter")
        else:
            node = self._enter_through(value, need, permute)
        self.entered[key] = node
        return node

    def _enter_through(self, value: fx.Node, need: Placement, permute: bool) -> fx.Node:
        chain, src = [], value
        while not all(shape(src)[d] == self.length for d in self.seq.of(src)):
            if src.op != "call_function" or src.target not in MOVEMENT or src.args[0] not in self.whole:
                raise ShardingError(
                    f"{node_fqn(value) or 'model'}: {value.name} ({_op(value)}, shape {list(shape(value))}) has a "
                    f"dimension that follows the sequence of {self.length} tokens without being it, and is computed "
                    "from the inputs alone; --cp cannot split it along the sequence")
            chain.insert(0, src)
            src = src.args[0]
        for start in [R] + [Shard(d) for d in self.seq.of(src)]:
            places = _along(chain, start)
            if places and places[-1] == need:
                break
        else:
            raise ShardingError(f"{node_fqn(value) or 'model'}: {value.name} cannot be taken split as {need} along "
                                "the sequence from where it is computed")
        prev = self.enter(src, start, permute)
        for c, p in zip(chain, places, strict=True):
            with self.gm.graph.inserting_after(prev):
                copy = self.gm.graph.node_copy(c, lambda a, c=c, prev=prev: prev if a is c.args[0] else a)
            copy.meta = dict(c.meta)
            self.place[copy] = p
            prev = copy
        return prev

    def gather(self, value: fx.Node) -> fx.Node:
        """All-gather ``value`` over cp (``rt.gather_to``: reduce-scatter of its gradient backward), hoisted above the
        re-views that only it reads, so the smallest form travels (key/value heads before ``repeat_kv``)."""
        chain, src = [], value
        while (src.op == "call_function" and src.target in MOVEMENT and len(src.users) == 1
               and isinstance(self.place.get(src.args[0]), Shard) and src.args[0] not in self.whole):
            chain.append(src)
            src = src.args[0]
        if src not in self.gathered:
            p = self.place[src]
            self.gathered[src] = self._insert(rtc.gather_to, (src, GROUP), {"dim": p.dim} | (
                {"blocks": p.blocks} if p.blocks > 1 else {}), after=src, val=src.meta["val"], placement=R,
                collective="gather_to")
        gathered = self.gathered[src]
        if not chain:
            return gathered
        chain[-1].replace_input_with(src, gathered)
        for c in chain:
            self.place[c] = R
        return value

    def _insert(self, target, args, kwargs, *, after: fx.Node | None = None, before: fx.Node | None = None, val,
                placement, collective: str = "", owner: fx.Node | None = None) -> fx.Node:
        owner = owner or after or before
        if after is not None and after.op == "placeholder":
            after, before = None, next(n for n in self.gm.graph.nodes if n.op != "placeholder")
        where = self.gm.graph.inserting_after(after) if after is not None else self.gm.graph.inserting_before(before)
        with where:
            node = self.gm.graph.call_function(target, args, kwargs)
        node.meta["val"] = val
        node.meta["nn_module_stack"] = owner.meta.get("nn_module_stack", {})
        node.meta["fxshard"] = NodeSpec(fqn=node_fqn(owner), role="context parallel", collective=collective)
        self.place[node] = placement
        return node

    # ---------------------------------------------------------------- attention

    def attention(self, node: fx.Node) -> None:
        q, k, v = node.args[:3]
        n = len(shape(node))
        if argument(node, "dropout_p"):
            raise ShardingError(f"{node_fqn(node) or 'model'}: attention dropout (dropout_p="
                                f"{argument(node, 'dropout_p')}) draws its mask inside the fused kernel, whose draws "
                                "--cp would change; set the model's attention dropout to 0 or drop --cp")
        if any(self.place.get(x) != Shard(n - 2) for x in (q, k, v)):
            raise ShardingError(f"{node_fqn(node) or 'model'}: attention whose queries, keys and values are not split "
                                f"along their sequence (dimension {n - 2}); --cp cannot split it")
        {"allgather": cp_attention.allgather, "ring": cp_attention.ring, "a2a": cp_attention.a2a}[self.mode](self, node)

    # ---------------------------------------------------------------- mixture of experts

    def token_block(self, block: TokenBlock) -> None:
        """An experts module run as written on this rank's tokens (:mod:`fxshard.ir.cp_experts`): its token rows
        split as its inputs are, what does not follow the sequence (the counts per expert, the weights) whole."""
        why = block.not_token_local(self.seq.of)
        rows = [a for a in block.inputs if self.seq.of(a)]
        placed = {self.place.get(a, R) for a in rows}
        p = next(iter(placed)) if len(placed) == 1 else None
        if why is None and (not isinstance(p, Shard) or p.dim != 0 or any(a in self.whole for a in rows)):
            why = (f"its token inputs ({', '.join(a.name for a in rows)}) are at "
                   f"{', '.join(sorted(str(q) for q in placed))}; expected them split along their rows (dimension 0)")
        tokens = {shape(a)[0] for a in rows + block.outputs}
        if why is None and len(tokens) != 1:
            why = f"its inputs and outputs hold {sorted(tokens)} rows; expected one row per token"
        if why is not None:
            raise ShardingError(f"{block.fqn}: the experts module under --cp {self.cp}: {why}; fxshard computes an "
                                "experts module on a rank's own tokens only when it recognizes it as transformers' "
                                "grouped-matmul experts (each token's result its own); drop --cp")
        outputs = set(block.outputs)
        for n in block.nodes:
            rows_dim = 0 in self.seq.of(n.args[0] if isinstance(n.meta.get("val"), (tuple, list)) else n)
            q = p if n in outputs else Shard(0) if rows_dim else R
            val = n.meta.get("val")
            self.place[n] = tuple(q for _ in val) if isinstance(val, (tuple, list)) else q
            if n.target is aten.arange.default and rows_dim:
                n.args = (n.args[0] // self.cp,)
            if n.target is operator.getitem:
                self.place[n] = self.place[n.args[0]][n.args[1]]

    # ---------------------------------------------------------------- finishing

    def outputs(self) -> None:
        """The loss as this rank's average-part (a sum over its tokens times cp: training averages over dp x cp);
        the model's other outputs split along the sequence gathered whole (``rt.cp_leave``)."""
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        values = list(out.args[0])
        done: dict[fx.Node, fx.Node] = {}
        for i, v in enumerate(values):
            if not isinstance(v, fx.Node) or v in self.whole:
                continue
            if v not in done:
                done[v] = self._output(v, first=i == 0)
            values[i] = done[v]
        out.args = (tuple(values),) + out.args[1:]

    def _output(self, v: fx.Node, first: bool) -> fx.Node:
        p = self.place.get(v, R)
        if p == Partial("sum"):  # a summed loss: its average over the ranks is the sum over cp ranks / cp
            return self._insert(aten.mul.Tensor, (v, float(self.cp)), {}, after=v, val=v.meta["val"], placement=AVG)
        if isinstance(p, Shard) and not first:  # last, with what only the other outputs need (training skips it)
            out = next(n for n in self.gm.graph.nodes if n.op == "output")
            return self._insert(rcp.cp_leave, (v, GROUP), {"dim": p.dim, "balanced": self.balanced}, before=out,
                                val=v.meta["val"], placement=R, collective="cp_leave", owner=v)
        if first and isinstance(p, Shard):
            raise ShardingError(f"{node_fqn(v) or 'model'}: the loss is split along the sequence ({p}); expected a "
                                "scalar, a sum or mean over the tokens")
        return v

    def localize(self) -> None:
        """Sizes baked into the split nodes become this rank's, then their values' shapes."""
        live = {n: p for n, p in self.place.items() if n not in self.erased}
        for node, p in live.items():
            if node.op == "call_function" and not isinstance(p, tuple):
                first = tensor_args(node)[:1]
                localize_sizes(node, p, self.place.get(first[0]) if first else None, self.cp)
        for node, p in live.items():
            node.meta["val"] = local_value(node.meta.get("val"), p, self.cp)
            node.meta["fxshard"] = dataclasses.replace(node.meta.get("fxshard", NodeSpec()), seq=p)

    def _mixes(self, node: fx.Node, placements: list) -> str:
        return (f"{node_fqn(node) or 'model'}: {_op(node)} ({node.name}) mixes tokens along the sequence, and no "
                f"rule computes it on a sequence split over cp={self.cp} (its inputs: "
                f"{', '.join(str(p) for p in placements)}): a cumulative scan, a top-k or sort, a convolution or "
                "pooling along the sequence, or a slice of it; fxshard refuses rather than train wrongly; drop --cp, "
                "or compute it "
                "from the inputs alone (position ids, masks and shifted labels are computed on the whole sequence)")


def _along(chain: list[fx.Node], start: Placement) -> list[Placement] | None:
    """The placements ``chain`` (one-input re-views) gives its values from its source at ``start``."""
    places, p = [], start
    for c in chain:
        if p == R:
            places.append(R)
            continue
        d = rule_decision(c, tensor_args(c), [p])
        if d is None:
            return None
        p = d.out
        places.append(p)
    return places


def _whole_out(node: fx.Node):
    val = node.meta.get("val")
    return tuple(R for _ in val) if isinstance(val, (tuple, list)) else R


def _op(node: fx.Node) -> str:
    return str(node.target).replace("aten::", "aten.") if hasattr(node.target, "_schema") else getattr(
        node.target, "__name__", str(node.target))


def _refuse_dropout(node: fx.Node, cp: int) -> None:
    if node.target in (aten.dropout.default, aten.dropout_.default, aten.native_dropout.default) \
            and argument(node, "p") and argument(node, "train") is not False:
        raise ShardingError(f"{node_fqn(node) or 'model'}: dropout (p={argument(node, 'p')}) under --cp {cp}: its "
                            "layout-invariant masks number the tokens of the whole sequence, which a cp rank's "
                            "permuted part does not yet give them; set the model's dropout to 0 or drop --cp")


def local_value(val, placement, parts: int):
    """A fake value at this rank's shape under ``placement`` over ``parts`` ranks (its dimensions' order kept)."""
    if isinstance(placement, tuple) and isinstance(val, (tuple, list)):
        return type(val)(local_value(v, p, parts) for v, p in zip(val, placement, strict=True))
    if not isinstance(val, torch.Tensor) or not isinstance(placement, Shard):
        return val
    size = local_shape(tuple(val.shape), placement, parts)
    order = sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))
    stride, step = [0] * val.dim(), 1
    for d in reversed(order):
        stride[d] = step
        step *= max(size[d], 1)
    return val.new_empty_strided(size, stride)


def input_only(gm: fx.GraphModule, ctx: CompileContext) -> set[fx.Node]:
    """The nodes computed from the inputs, buffers and constants alone, never from a parameter: what every cp rank
    computes on the whole sequence, as the model wrote it."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node not in ctx.params:
                found.add(node)
        elif node.op == "call_function" and all(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def causal(gm: fx.GraphModule, ctx: CompileContext) -> bool:
    """Whether the model attends causally (load-balanced chunks): an attention with ``is_causal``, a module that says
    it is causal (transformers' attention modules), or a causal language model."""
    model = ctx.program.model
    if any(n.target is SDPA and argument(n, "is_causal") for n in gm.graph.nodes):
        return True
    if any(getattr(m, "is_causal", False) is True for m in model.modules()):
        return True
    name = type(model).__name__
    return "CausalLM" in name or "LMHead" in name
