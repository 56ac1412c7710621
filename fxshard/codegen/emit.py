"""Emit one rank's graph as a Python module (see ``templates/rank.py.j2``).

Lines are grouped under a comment naming the source module, its type and its parallel role;
values that are not replicated carry their placement; every collective is one ``rt.*`` call with a
comment saying what it does forward and backward.  Output is deterministic: the same input gives
byte-identical files.
"""

from __future__ import annotations

import keyword
import math
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import torch
import torch.fx as fx

from fxshard.capture.custom_ops import import_lines
from fxshard.graph import loss_cone
from fxshard.ir.autograd import requires_grad
from fxshard.ir.blocks import BlockUnit, block_units
from fxshard.ir.comm import KINDS, WIRE, buffer_is_input
from fxshard.ir.context import CompileContext, Group, RankValue, spec
from fxshard.ir.cut import find_blocks, under
from fxshard.ir.layout import DP, EP, PP, TP, Coords
from fxshard.ir.placement import Partial, Replicate, Shard, local_shape
from fxshard.ir.stages import StageSpec, pipeline_stages, tied_weights
from fxshard.runtime import collectives as rt_collectives
from fxshard.runtime import random as rt_random
from fxshard.runtime.recompute import KEEP_OF_MODE
from fxshard.units import human_bytes

aten = torch.ops.aten

def one_line(value):
    """Every value the template writes into a rank file, as text on one line: a character that is not printable
    (a newline in a class or file name) is written as its escape, so that no text a model or its file names carry
    becomes a line of code.  Names that would need more (quotes inside a string) are refused at capture
    (:func:`fxshard.capture.program.check_names`)."""
    if not isinstance(value, str) or value.isprintable():
        return value
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value)


_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
    keep_trailing_newline=True,
    autoescape=False,
    finalize=one_line,
)

# what a block keeps for backward under --recompute, said on its call
_RECOMPUTE_NOTE = {"full": "keeps its inputs, recomputes its forward in backward",
                   "selective": "keeps its matmul outputs, recomputes the rest in backward"}
# dtypes as the per-line comments write them
SHORT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "bool", torch.complex64: "c64"}
# frames of these packages are not the model's: a group header names the innermost frame outside them
_NOT_MODEL = ("/torch/", "/fxshard/", "/passes/", "<")

def rank_file_name(coords: Coords) -> str:
    return f"rank_pp{coords[PP]}_tp{coords[TP]}.py"


def attr_name(fqn: str, taken: set[str]) -> str:
    base = "".join(c if c.isalnum() else "_" for c in fqn) or "tensor"
    if base[0].isdigit():
        base = "t_" + base
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


@dataclass
class RankCode:
    source: str
    attrs: dict[str, str]  # weight key in the rank's safetensors file -> placeholder name
    collectives: list[dict] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # per stage held: index, class, inputs, outputs


@dataclass
class _Class:
    name: str
    doc: str
    comments: list[str]
    attributes: list[str]
    init_lines: list[str]
    forward_args: str
    forward_lines: list[str]
    axes: list[str] | None = None  # process groups it takes (None: the file's)
    blocks: list[str] = field(default_factory=list)  # its block submodules, in the order they run


_RESERVED_CLASSES = {"RankModule", "torch", "rt", "aten"}
_RESERVED = {"device", TP, PP, DP, "forward", "training", "return_outputs", "INPUTS", "OUTPUTS"}


def emit_rank(gm: fx.GraphModule, ctx: CompileContext, coords: Coords, version: str,
              global_ranks: list[int]) -> RankCode:
    """The Python module of one rank: one class (``RankModule``), or one per pipeline stage it holds."""
    program = ctx.program
    layout = ctx.layout
    state = program.state_by_name()
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    classes: list[_Class] = []
    attrs: dict[str, str] = {}
    collectives: list[dict] = []
    stages: list[dict] = []
    tied_fn: list[str] = []
    stage_attrs: dict[int, dict[str, str]] = {}  # stage -> attribute -> placeholder name
    block_classes: dict = {}  # the classes of the block submodules, shared by the file's classes
    pipe = ctx.pipeline
    if pipe is None:
        state_nodes = [n for n in placeholders if n.name in state and n.users]
        inputs = [n for n in placeholders if n.name not in state]
        outputs_only = _outputs_only(gm, compute)
        cls, names, a = _class_code("RankModule", f"{_coords_text(coords, layout)} of {program.module_types['']}: "
                                    "parameters at their per-rank shapes, straight-line forward.",
                                    [], compute, state_nodes, inputs, set(), ctx, coords, collectives, None,
                                    set(out_node.all_input_nodes), _outputs_guard(out_node, outputs_only),
                                    block_classes)
        if outputs_only:
            cls.attributes = ["return_outputs = True  # False: forward returns (loss,) and skips what only the "
                              "model's other outputs need (fxshard run trains so)"]
        cls.forward_lines += ["", f"return {_arg(out_node.args[0], names, coords)}"]
        classes.append(cls)
        attrs.update(a)
        axes = _axes(ctx)
    else:
        axes = [*_axes(ctx), PP]
        S = layout.num_stages
        all_stages = pipeline_stages(gm, ctx)
        grad = requires_grad(gm, ctx.params)
        for s in layout.stages_of(coords[PP]):
            st = all_stages[s]
            name = f"Stage{s}"
            comments, in_meta, out_meta = _io_comments(st, grad, ctx, coords)
            doc = (f"Pipeline stage {s} of {S} ({st.label}) on pp rank {coords[PP]}, tp rank {coords[TP]}: "
                   f"one microbatch per call.")
            start = len(collectives)
            cls, names, a = _class_code(name, doc, comments, st.nodes, st.state, st.inputs, st.recomputed, ctx,
                                        coords, collectives, s, set(st.outputs), block_classes=block_classes)
            cls.attributes = [f"INPUTS = {_meta_tuple(in_meta)}", f"OUTPUTS = {_meta_tuple(out_meta)}"]
            outs = [names[n] for n in st.outputs]
            if s == S - 1:
                ret = outs[0]
            else:
                ret = f"({', '.join(outs)},)" if len(outs) == 1 else f"({', '.join(outs)})"
            dest = "the schedule (loss)" if s == S - 1 else f"stage {s + 1}"
            cls.forward_lines += ["", f"return {ret}  # to {dest}"]
            classes.append(cls)
            stage_attrs[s] = a
            for key, ph in a.items():
                attrs[f"{name}.{key}"] = ph
            for c in collectives[start:]:
                c["stage"] = s
            stages.append({"index": s, "class": name, "inputs": in_meta, "outputs": out_meta})
        tied_fn = _tied_lines(tied_weights(gm, all_stages, ctx.params), ctx, coords, state, stage_attrs)

    if layout.zero == 3 and layout.dp > 1:  # the FSDP2 units of attach_data_parallel
        for cls in classes:
            cls.attributes.append(f"BLOCKS = {tuple(cls.blocks)!r}  # block submodules: one FSDP2 unit each")
    classes = [_finish_block(b) for b in block_classes.values()] + classes
    summary = _summary(collectives)
    if pipe is None:
        held, skipped, unit, per_step = compute, set(outputs_only), "step", 1
    else:
        held = [n for s in layout.stages_of(coords[PP]) for n in all_stages[s].nodes]
        skipped, unit, per_step = set(), "microbatch", ctx.microbatches
    dp_doc, dp_lines = _data_parallel_lines(ctx, global_ranks, attrs)
    text = _ENV.get_template("rank.py.j2").render(
        dp_doc=dp_doc,
        dp_lines=dp_lines,
        version=version,
        model_file=ctx.model_file_name,
        digest=ctx.model_digest,
        model_class=program.module_types[""],
        custom_op_imports=import_lines(program.custom_ops),
        function_lines=[f.define_line(name) for name, f in program.functions.items()],
        layout=layout.describe(),
        mesh=layout.mesh_shape,
        coords_text=_coords_text(coords, layout),
        global_ranks=", ".join(map(str, global_ranks)),
        plan_source=ctx.plan.source,
        plan_lines=ctx.plan_summary,
        passes=", ".join(ctx.passes_run + ["codegen"]),
        collective_summary=summary,
        collective_unit=unit,
        collective_lines=collective_header(held, ctx, skipped, unit, per_step),
        recompute_line=_recompute_line(layout.recompute, [u for b in block_classes.values() for u in b.users],
                                       f"{TP} and {EP}" if layout.ep > 1 else TP),
        legend_lines=legend_lines(held),
        pipeline_lines=_pipeline_header(ctx, coords) if pipe is not None else [],
        axes=axes,
        classes=classes,
        tied_lines=tied_fn,
    )
    if ctx.token_count is not None:
        text += _count_tokens_function(ctx.token_count)
    text = "\n".join(ln.rstrip() for ln in text.splitlines()) + "\n"
    return RankCode(text, attrs, collectives, stages)


def _recompute_line(mode: str, blocks: list[str], axes: str = TP) -> str:
    """What ``--recompute`` does in this file, for its header (``axes``: whose collectives run again)."""
    if mode == "none":
        return ""
    held = ", ".join(blocks) if len(blocks) <= 3 else f"{blocks[0]}, ..., {blocks[-1]} ({len(blocks)} blocks)"
    what = (f"keep only their inputs for backward; backward runs each one's forward again, its {axes} collectives "
            "included" if mode == "full" else
            "keep their matmul and fused-attention outputs for backward; backward recomputes the rest (norms, "
            f"activations, softmax, elementwise ops, {axes} collectives)")
    return f"recompute: {mode}: {held} {what}" if blocks else f"recompute: {mode}: no block of this rank to recompute"


def _count_tokens_function(count: fx.GraphModule) -> str:
    """``count_tokens(*inputs)``: how many targets of one microbatch the token-mean loss counts.  The runtime
    calls it on every microbatch of a step before the step, and divides the summed loss by the total."""
    body = count.code.strip().splitlines()
    args = body[0][len("def forward(self, "):-len("):")]
    lines = [f"def count_tokens({args}):",
             '    """The targets of one microbatch that the loss counts (passes/token_mean.py); the runtime sums',
             '    them over the whole step and divides the summed loss by that count (rt.token_mean)."""']
    lines += [ln.replace("torch.ops.aten.", "aten.") for ln in body[1:]]
    return "\n\n" + "\n".join(lines) + "\n"


_ZERO_TEXT = {
    0: ["gradients: DDP all-reduce (average) over dp in {mb} MB buckets, overlapping backward",
        "parameters and optimizer state: replicated on every dp rank"],
    1: ["fxshard's distributed optimizer (fxshard.runtime.distributed_optimizer, as Megatron-Core's; no DDP):",
        "the parameters are views of flat buckets (fxshard run --zero-bucket-mb, default {zmb:g} MB) and their",
        "gradients accumulate into flat gradient buckets; once per step, after the last backward, each bucket's",
        "gradients are reduce-scattered (average) over dp into this rank's 1/{dp} shard, AdamW steps that shard",
        "alone (its Adam state is the only copy), and the updated parameters are all-gathered, each bucket's",
        "gather waited for just before the next forward first uses it (fxshard run --no-overlap-param-gather:",
        "in the step): 2 collectives per bucket and step"],
    2: ["FSDP2 fully_shard on the dp mesh, reshard_after_forward=False: gradients reduce-scattered (average)",
        "as backward produces them; each dp rank keeps 1/{dp} of the gradients and optimizer state;",
        "parameters are all-gathered for forward and kept for backward"],
    3: ["FSDP2 fully_shard on the dp mesh, reshard_after_forward=True: each dp rank keeps 1/{dp} of the",
        "parameters, gradients and optimizer state; each repeated block (the module's BLOCKS) is a unit of",
        "its own: its parameters are all-gathered just before it runs, forward and again backward, and freed",
        "after it, the next block's gather issued while it computes; the rest of the module is one more",
        "unit; gradients are reduce-scattered (average) block by block as backward produces them"],
}


def _expert_attrs(ctx: CompileContext, attrs: dict[str, str]) -> list[str]:
    """Parameter names, as each module's ``named_parameters`` gives them (a stage's without its ``StageN.``
    prefix: ``attach_data_parallel`` gets one stage module at a time), of the experts passes/expert_parallel.py
    split."""
    state = ctx.program.state_by_name()
    return sorted({re.sub(r"^Stage\d+\.", "", k) for k, p in attrs.items() if state[p].fqn in ctx.expert_params})


def _data_parallel_lines(ctx: CompileContext, global_ranks, attrs: dict[str, str]) -> tuple[list[str], list[str]]:
    """Docstring and body of the generated ``attach_data_parallel`` (only when dp > 1)."""
    from fxshard.defaults import ZERO_BUCKET_MB
    from fxshard.runtime.data_parallel import DDP_BUCKET_MB

    layout = ctx.layout
    if layout.dp == 1:
        return [], []
    zero = layout.zero
    doc = [f"Data parallelism over dp = {layout.dp} (global ranks {', '.join(map(str, global_ranks))} run this "
           f"file, each on 1/{layout.dp} of the batch), ZeRO stage {zero}:"]
    zmb = ZERO_BUCKET_MB
    doc += ["    " + line.format(mb=DDP_BUCKET_MB, dp=layout.dp, zmb=zmb) for line in _ZERO_TEXT[zero]]
    if zero == 1:
        if ctx.expert_params:
            doc.append(f"    expert parallelism ep = {layout.ep}: the experts (E/{layout.ep} per rank) have a distributed "
                       f"optimizer of their own over the {layout.dp // layout.ep} ranks holding the same experts "
                       f"(gradients summed over those and divided by {layout.dp})")
        if layout.mixed:
            doc.append(f"    mixed precision: {layout.dtype} parameters, gradients and buckets; the optimizer keeps "
                       "fp32 master weights of its shard")
        body = ["return module  # the optimizer, built after this, takes the parameters into its buckets"]
    elif zero == 0 and ctx.expert_params:
        doc.append(f"    expert parallelism ep = {layout.ep}: the experts (E/{layout.ep} per rank) are not DDP's; their "
                   f"gradients are summed over the {layout.dp // layout.ep} ranks holding the same experts and "
                   f"divided by {layout.dp} after backward (fxshard.runtime.experts.sync_expert_grads)")
        body = [f"return rt.ddp(module, dp_mesh, ignore={_expert_attrs(ctx, attrs)!r})"]
    elif zero == 0:
        body = ["return rt.ddp(module, dp_mesh)"]
        if layout.mixed:
            doc.append(f"    mixed precision: {layout.dtype} parameters and gradients; the optimizer keeps fp32 master "
                       "weights")
    else:
        dtype = f", param_dtype=torch.{str(layout.compute_dtype).removeprefix('torch.')}" if layout.mixed else ""
        blocks = ", blocks=[getattr(module, b) for b in module.BLOCKS]" if zero == 3 else ""
        ignore = ""
        if ctx.expert_params:
            doc.append(f"    expert parallelism ep = {layout.ep}: the experts (E/{layout.ep} per rank) are not FSDP2's: "
                       f"held whole on the {layout.dp // layout.ep} ranks holding the same experts, their gradients "
                       f"summed over those and divided by {layout.dp} after backward "
                       "(fxshard.runtime.experts.sync_expert_grads)")
            ignore = f", ignore={_expert_attrs(ctx, attrs)!r}"
        body = [f"return rt.fully_shard(module, dp_mesh, reshard_after_forward={zero == 3}{dtype}{blocks}{ignore})"]
        if layout.mixed:
            doc.append(f"    mixed precision: the fp32 shards are the master weights; gathered as {layout.dtype} "
                       "for compute, gradients reduce-scattered in fp32")
    return doc, body


def _coords_text(coords: Coords, layout) -> str:
    text = f"tp rank {coords[TP]} of {layout.tp}"
    if layout.pp > 1:
        text = f"pp rank {coords[PP]} of {layout.pp}, " + text
    return text


def _dead_after(steps: list[tuple[list[fx.Node], list[fx.Node]]], inputs: list[fx.Node],
                keep: set[fx.Node]) -> dict[int, list[fx.Node]]:
    """For each step (the values it reads, the values it makes), the local values whose last use it is: the
    forward drops them right there, as torch.fx's own code does, so autograd alone decides what lives on."""
    local = set(inputs) | {v for _, made in steps for v in made}
    last: dict[fx.Node, int] = {v: i for i, (_, made) in enumerate(steps) for v in made}  # unread: dies at once
    for i, (reads, _) in enumerate(steps):
        for a in reads:
            if a in local:
                last[a] = i
    dead: dict[int, list[fx.Node]] = {}
    for v in list(inputs) + [v for _, made in steps for v in made]:
        if v in last and v not in keep:
            dead.setdefault(last[v], []).append(v)
    return dead


def _outputs_only(gm: fx.GraphModule, compute: list[fx.Node]) -> list[fx.Node]:
    """The trailing nodes that compute only the model's other outputs, which training can skip by returning
    early; none when such a node comes before something training runs (the order stays as captured)."""
    cone = loss_cone(gm)
    first_rest = next((i for i, n in enumerate(compute) if n not in cone), len(compute))
    rest = compute[first_rest:]
    return rest if not any(n in cone for n in rest) else []


def _outputs_guard(out_node: fx.Node, outputs_only: list[fx.Node]) -> tuple[set[fx.Node], list[str]] | None:
    """The early return before the nodes that compute only the model's other outputs (training skips them)."""
    if not outputs_only:
        return None
    loss = out_node.args[0][0]
    return set(outputs_only), ["if not self.return_outputs:  # training: the loss alone",
                               f"    return ({loss.name},)"]


def _class_code(name, doc, comments, nodes, state_nodes, inputs, recomputed, ctx, coords, collectives, stage,
                keep: set[fx.Node], guard: tuple[set[fx.Node], list[str]] | None = None,
                block_classes: dict | None = None):
    """One generated class; ``guard`` = (nodes, lines): the lines go before the first of those nodes, whose
    collectives the manifest marks ``outputs_only``.  Each repeated block it runs becomes a submodule
    (recorded by passes/blocks.py, :mod:`fxshard.ir.blocks`), of a class kept in ``block_classes`` (body -> class) for the whole file."""
    program = ctx.program
    state = program.state_by_name()
    tp = ctx.layout.tp
    guarded_nodes, guard_lines = guard or (set(), [])
    units = block_units(nodes, state_nodes, keep, set(recomputed) | guarded_nodes)
    in_units = {n for u in units.values() for n in u.state}
    taken = set(_RESERVED)
    attrs: dict[str, str] = {}
    init_lines: list[str] = []
    names: dict[fx.Node, str] = {}
    for node in state_nodes:
        if node in in_units:
            continue
        s = state[node.name]
        a = attr_name(s.fqn, taken)
        attrs[a] = node.name
        names[node] = f"self.{a}"
        init_lines.append(_state_line(a, s, node, tp, ep=_ep_of(s.fqn, ctx)))
    for node in inputs:
        names[node] = node.name
    steps: list[fx.Node | BlockUnit] = []
    for node in nodes:
        if node in units:
            steps.append(units[node])
        elif not any(node in u.nodes for u in units.values()):
            steps.append(node)
    calls = {}
    for unit in units.values():
        block = _block_class(unit, ctx, coords, block_classes if block_classes is not None else {})
        sub = attr_name(unit.fqn, taken)
        calls[unit] = (sub, block)
        init_lines.append(f"self.{sub} = {block.cls.name}(groups, self.device)  # {unit.fqn}")
        for key, ph in block.attrs.items():
            attrs[f"{sub}.{key}"] = ph
    lines = _body(steps, names, inputs, keep, recomputed, guard, ctx, coords, collectives, calls)
    cls = _Class(name, doc, comments, [], init_lines, ", ".join(names[n] for n in inputs), lines,
                 blocks=[calls[u][0] for u in units.values()])
    return cls, names, attrs


def _body(steps, names, inputs, keep, recomputed, guard, ctx, coords, collectives, calls=None,
          relative_to: str = "") -> list[str]:
    """The forward's lines: one per node, one call per block submodule, grouped under module comments."""
    tp = ctx.layout.tp
    guarded_nodes, guard_lines = guard or (set(), [])
    nodes = [n for st in steps for n in ([st] if isinstance(st, fx.Node) else st.nodes)]
    where = _group_lines(nodes, recomputed, guarded_nodes)
    dead = _dead_after([(st.all_input_nodes, [st]) if isinstance(st, fx.Node) else (st.inputs, st.outputs)
                        for st in steps], inputs, keep)
    lines: list[str] = []
    group_key = None
    for i, st in enumerate(steps):
        if isinstance(st, BlockUnit):
            sub, block = calls[st]
            for v in st.outputs:
                var = _assigned_name(v)
                names[v] = v.name if v.name.startswith(sub + "_") else f"{sub}_{var if var else _base_name(v)}"
        else:
            names.setdefault(st, st.name)
        drop = ";  " + " = ".join(names[v] for v in dead[i]) + " = None" if i in dead else ""
        if isinstance(st, BlockUnit):
            outs = ", ".join(names[v] for v in st.outputs)
            args = ", ".join(_arg(a, names, coords) for a in st.inputs)
            note = _value_text(st.outputs[0], tp) if len(st.outputs) == 1 else ""
            mode = ctx.layout.recompute
            if mode == "none":
                line = f"{outs} = self.{sub}({args}){drop}"
            else:
                kept = KEEP_OF_MODE[mode]  # rt.recompute's default keeps the inputs only
                keep = "" if kept == "inputs" else f', keep="{kept}"'
                line = f"{outs} = rt.recompute(self.{sub}, {args}{keep}){drop}"
                note = (note + "; " if note else "") + _RECOMPUTE_NOTE[mode]
            lines += [*([""] if lines else []), _group_comment(st.nodes[0], ctx, "", st.fqn, block=True),
                      f"{line}  # {note}" if note else line]
            group_key = None
            for c in block.collectives:
                collectives.append(dict(c))
            continue
        node = st
        again = node in recomputed
        key = (spec(node).fqn, spec(node).role, again)
        if node in guarded_nodes and guard_lines:
            lines += ["", *guard_lines]
            guard_lines, group_key = [], None
        if key != group_key:
            group_key = key
            if lines:
                lines.append("")
            lines.append(_group_comment(node, ctx, where.get(node, ""), relative_to=relative_to)
                         + ("  (recomputed here, not received)" if again else ""))
        target = getattr(node.target, "__name__", "")
        line = f"{names[node]} = {_call(node, names, coords)}{drop}"
        note = _note(node, tp)
        lines.append(f"{line}  # {note}" if note else line)
        if spec(node).collective and KINDS[target].communicates:
            val = node.meta.get("val")
            if isinstance(val, tuple):  # rt.copy_to_linears: its input, as its copy_to's
                val = node.args[0].meta["val"]
            collectives.append({
                "op": target,
                "group": next(a.axis for a in node.args if isinstance(a, Group)),
                "value": names[node],
                "shape": list(local_shape(tuple(val.shape), spec(node.args[0]).placement, tp)),
                "dtype": str(val.dtype).removeprefix("torch."),
                "backward": KINDS[target].backward,
            })
            if node in guarded_nodes:
                collectives[-1]["outputs_only"] = True
    return lines


@dataclass
class _Block:
    cls: _Class
    attrs: dict[str, str]  # attribute in the submodule -> placeholder name
    collectives: list[dict]  # what one call issues, in order (values by their names in the class)
    local: set[str] = field(default_factory=set)  # the names the class's forward gives its values
    users: list[str] = field(default_factory=list)  # the blocks (FQN) of this class
    candidates: list[list[str]] = field(default_factory=list)  # per block, the names of its arguments

    @property
    def type_name(self) -> str:
        return re.sub(r"\d+$", "", self.cls.name)


def _block_class(unit: BlockUnit, ctx: CompileContext, coords, classes: dict) -> _Block:
    """The class of one block's submodule: its own parameters, its inputs as arguments, its nodes under names
    of its own (``linear``, ``linear_1``, ...), so identical blocks have identical code and share the class."""
    state = ctx.program.state_by_name()
    tp = ctx.layout.tp
    taken = set(_RESERVED)
    names: dict[fx.Node, str] = {}
    attrs: dict[str, str] = {}
    init_lines = []
    for node in unit.state:
        s = state[node.name]
        a = attr_name(s.fqn.removeprefix(unit.fqn + "."), taken)
        attrs[a] = node.name
        names[node] = f"self.{a}"
        init_lines.append(_state_line(a, s, node, tp, relative_to=unit.fqn, ep=_ep_of(s.fqn, ctx)))
    # the arguments' names are chosen when every block of the class is known (the names most of its blocks
    # would give): the class's identity cannot depend on them (block 0 reads the embeddings, the others the
    # previous block's output)
    args = [f"__arg{i}__" for i in range(len(unit.inputs))]
    names.update(zip(unit.inputs, args, strict=True))
    for node in unit.nodes:
        names[node] = local_name(node, taken)
    collectives: list[dict] = []
    local = dict(names)
    lines = _body(unit.nodes, local, unit.inputs, set(unit.outputs), set(), None, ctx, coords, collectives,
                  relative_to=unit.fqn)
    outs = [local[v] for v in unit.outputs]
    lines += ["", f"return {outs[0]}" if len(outs) == 1 else f"return {', '.join(outs)}"]
    key = (tuple(init_lines), len(args), tuple(lines))
    if key not in classes:
        type_name = ctx.program.module_types.get(unit.fqn, "Block")
        if not type_name.isidentifier() or keyword.iskeyword(type_name):  # a class made with type("...")
            type_name = "Block"
        taken_names = {c.cls.name for c in classes.values()}
        name, i = type_name, 2
        while name in taken_names or name in _RESERVED_CLASSES or re.fullmatch(r"Stage\d+", name):
            name, i = f"{type_name}{i}", i + 1
        cls = _Class(name, "", [], [], init_lines, ", ".join(args), lines, axes=_axes(ctx))
        classes[key] = _Block(cls, {}, collectives, set(local.values()))
    shared = classes[key]
    shared.users.append(unit.fqn)
    shared.candidates.append([attr_name(state[a.name].fqn, set()) if a.name in state else _value_name(a)
                              for a in unit.inputs])
    return _Block(shared.cls, attrs, shared.collectives)


def _finish_block(block: _Block) -> _Class:
    """The block class with its arguments named (per position, the name most of its blocks give the value)
    and a docstring naming the blocks it runs."""
    cls = block.cls
    chosen: list[str] = []
    for i in range(len(block.candidates[0]) if block.candidates else 0):
        votes = [c[i] for c in block.candidates]
        base = max(dict.fromkeys(votes), key=votes.count)
        while base in block.local or base in _RESERVED:
            base += "_in"
        name, k = base, 1
        while name in chosen:
            name, k = f"{base}_{k}", k + 1
        chosen.append(name)

    def named(text: str) -> str:
        return re.sub(r"__arg(\d+)__", lambda m: chosen[int(m[1])], text)

    users = block.users
    held = ", ".join(users) if len(users) <= 3 else f"{users[0]}, ..., {users[-1]}: {len(users)} blocks"
    doc = (f"{block.type_name}, a repeated block as this rank runs it ({held}): its own parameters at their "
           "per-rank shapes; what it reads from outside, as arguments.")
    return _Class(cls.name, doc, [], [], cls.init_lines, named(cls.forward_args),
                  [named(line) for line in cls.forward_lines], axes=cls.axes)


def _value_name(node: fx.Node) -> str:
    """What a value is, as a name: the variable the model's code assigns it to, ``<module>_out`` for a value a
    module returns (``blocks_out`` for ``blocks.3``'s), else its op."""
    var = _assigned_name(node)
    if var == "out" and spec(node).fqn:
        parts = [p for p in spec(node).fqn.split(".") if not p.isdigit()]
        return f"{parts[-1]}_out" if parts else "out"
    return var if var and var != "out" else _base_name(node)


def local_name(node: fx.Node, taken: set[str]) -> str:
    """The name of ``node`` in a block's class: its op, numbered (``linear``, ``linear_1``, ...); a fused
    ``copy_to_linears`` is numbered among the ``copy_to`` (passes/overlap.py), so its class reads as without
    the fusion but for the fused lines."""
    name = attr_name(_base_name(node), taken)
    return name.replace("copy_to", "copy_to_linears", 1) if node.target is rt_collectives.copy_to_linears else name


def _base_name(node: fx.Node) -> str:
    """The name torch.fx gives a node before numbering it: its op (``linear``, ``all_reduce``, ``getitem``); the
    fused ``copy_to_linears`` and its outputs the ``copy_to`` and ``linear`` they replace (passes/overlap.py)."""
    target = node.target
    if target is rt_collectives.copy_to_linears:
        return "copy_to"
    if target is operator.getitem and getattr(node.args[0], "target", None) is rt_collectives.copy_to_linears:
        return "linear"
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__.split(".")[-1]
    return getattr(target, "__name__", "value").strip("_") or "value"


def _group_lines(nodes, recomputed, guarded) -> dict[fx.Node, str]:
    """The model file:line of each group of lines, keyed by the group's first node: the first line of the
    model's code that one of the group's nodes comes from (a group: consecutive nodes of one module and role)."""
    where: dict[fx.Node, str] = {}
    first, key = None, None
    for node in nodes:
        k = (spec(node).fqn, spec(node).role, node in recomputed, node in guarded)
        if k != key:
            first, key = node, k
        if first not in where:
            line = model_line(node)
            if line:
                where[first] = line
    return where


def _local(node: fx.Node, tp: int) -> tuple[tuple[int, ...], str]:
    val = node.meta["val"]
    return tuple(local_shape(tuple(val.shape), spec(node).placement, tp)), str(val.dtype).removeprefix("torch.")


def _io_comments(st: StageSpec, grad: set[fx.Node], ctx: CompileContext, coords):
    """Comment lines on what a stage receives and sends, and the static metadata of both; ``grad``: the values
    a gradient flows back to."""
    layout = ctx.layout
    tp = layout.tp
    S = layout.num_stages
    s = st.index
    comments: list[str] = []
    in_meta: list[dict] = []
    out_meta: list[dict] = []

    def origin(v) -> str:
        if v.op == "placeholder":
            return "user input, taken from the batch by stage 0"
        return f"computed by {spec(v).fqn or 'the model'} in stage {spec(v).stage}"

    width = max([24] + [len(v.name) + 1 for v in (*st.inputs, *st.outputs)])

    def row(v, passed: bool) -> tuple[str, dict]:
        shp, dt = _local(v, tp)
        rg = v in grad
        what = origin(v) + (", passed on" if passed else "")
        flows = "gradient flows back" if rg else "no gradient"
        place = spec(v).placement
        ptxt = "" if place == Replicate() else f" {place}"
        return (f"#   {v.name:<{width}} {dt} {list(shp)}{ptxt}  {what}; {flows}",
                {"name": v.name, "shape": list(shp), "dtype": dt, "requires_grad": rg})

    def peers(stage: int) -> str:
        p = layout.stage_rank(stage)
        ranks = [layout.rank_of(dp=d, pp=p, tp=coords[TP]) for d in range(layout.dp)]
        return f"stage {stage} on pp rank {p} (global rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"

    if s == 0:
        comments.append("# takes the microbatch of the user inputs from the schedule:")
    else:
        comments.append(f"# receives from {peers(s - 1)}, per microbatch:")
    for v in st.inputs:
        line, meta = row(v, v in st.outputs)
        comments.append(line)
        in_meta.append(meta)
    if s == S - 1:
        comments.append("# returns the microbatch loss to the schedule, which runs backward from it")
        v = st.outputs[0]
        shp, dt = _local(v, tp)
        out_meta.append({"name": v.name, "shape": list(shp), "dtype": dt, "requires_grad": True})
    else:
        comments.append(f"# sends to {peers(s + 1)}, per microbatch:")
        for v in st.outputs:
            line, meta = row(v, v in st.inputs)
            comments.append(line)
            out_meta.append(meta)
    if st.recomputed:
        comments.append(f"# recomputes {len(st.recomputed)} op(s) from buffers and constants instead of receiving "
                        "their results (marked below)")
    return comments, in_meta, out_meta


def _meta_tuple(metas: list[dict]) -> str:
    items = [f"({m['name']!r}, {tuple(m['shape'])!r}, torch.{m['dtype']}, {m['requires_grad']})" for m in metas]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _pipeline_header(ctx: CompileContext, coords) -> list[str]:
    layout = ctx.layout
    m = ctx.microbatches
    lines = [f"schedule {layout.schedule}, {layout.num_stages} stages ({layout.stages_per_rank} per pp rank), "
             f"{m} microbatches of {ctx.batch // layout.dp // m} per dp rank; cut: {ctx.pipeline.source}"]
    for row in ctx.pipeline.table:
        mine = "  <- this rank" if row["pp_rank"] == coords[PP] else ""
        lines.append(f"  stage {row['stage']} (pp rank {row['pp_rank']}): {row['holds']}{mine}")
    return lines


def _tied_lines(tied: list[tuple[fx.Node, list[int]]], ctx: CompileContext, coords, state, stage_attrs) -> list[str]:
    """Body of ``sync_tied_grads``: one call per weight held by several stages that this rank holds."""
    layout = ctx.layout
    mine = set(layout.stages_of(coords[PP]))
    lines = []
    for p, holders in tied:
        local = [s for s in holders if s in mine]
        if not local:
            continue
        fqn = state[p.name].fqn
        aliases = [a for a, k in ctx.program.tied.items() if k == fqn]
        copies = ", ".join(f"stages[{s}].{_attr_of(stage_attrs[s], p)}" for s in local)
        ranks = sorted({layout.stage_rank(s) for s in holders})
        label = fqn + (f" (= {', '.join(aliases)})" if aliases else "")
        lines.append(f"# {label}: held by stages {', '.join(map(str, holders))} on pp ranks "
                     f"{', '.join(map(str, ranks))}")
        group = f'groups["tied:{fqn}"]' if len(ranks) > 1 else "None"
        lines.append(f"rt.sum_tied_grads([{copies}], {group})")
    return lines


def _attr_of(attrs: dict[str, str], placeholder: fx.Node) -> str:
    return next(a for a, name in attrs.items() if name == placeholder.name)


def collective_counts(collectives: list[dict]) -> tuple[str, str]:
    """``("1 all_gather, 5 all_reduce", "5 all_reduce")``: one rank's collectives per step, forward and backward
    (without those only returning the model's other outputs needs, which training skips)."""
    return _counts([c for c in collectives if not c.get("outputs_only")])


def _counts(collectives: list[dict]) -> tuple[str, str]:
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    for c in collectives:
        forward = KINDS[c["op"]].forward
        if forward:
            fwd[forward] = fwd.get(forward, 0) + 1
        if c["backward"]:
            bwd[c["backward"]] = bwd.get(c["backward"], 0) + 1
    return (", ".join(f"{n} {k}" for k, n in sorted(fwd.items())) or "none",
            ", ".join(f"{n} {k}" for k, n in sorted(bwd.items())) or "none")


def _summary(collectives: list[dict]) -> str:
    f, b = collective_counts(collectives)
    text = f"forward {f}; backward {b}"
    extra = [c for c in collectives if c.get("outputs_only")]
    if extra:
        more, _ = _counts(extra)
        text += f" (returning the model's other outputs adds {more})"
    return text


@dataclass(frozen=True)
class _Issue:
    """One backend operation a collective call issues: direction, operation, whole buffer (local) and dtype."""

    direction: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ranks: int = 0  # the size of its process group (0: tp's); the all-to-alls of --ep go over ep

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _issues(node: fx.Node, tp: int, ep: int = 1, dp: int = 1) -> list[_Issue]:
    kind = KINDS[node.target.__name__]
    axis = next((a.axis for a in node.args if isinstance(a, Group)), TP)
    ranks = {EP: ep, DP: dp}.get(axis, 0)  # rt.batch_mean goes over dp (passes/router_loss.py)
    out = []
    for direction in ("forward", "backward"):
        op = getattr(kind, direction)
        if op:
            whole = node.args[0] if buffer_is_input(kind, direction) else node
            val = whole.meta["val"]
            out.append(_Issue(direction, op, tuple(local_shape(tuple(val.shape), spec(whole).placement, tp)),
                              val.dtype, ranks))
    return out


def _describe(issues: list[_Issue]) -> str:
    """``forward 2 all_reduce [2, 16, 64] f32; backward 2 all_reduce [2, 16, 64] f32``."""
    parts = []
    for direction in ("forward", "backward"):
        counts: dict[tuple, int] = {}
        for i in issues:
            if i.direction == direction:
                key = (i.op, i.shape, i.dtype)
                counts[key] = counts.get(key, 0) + 1
        if counts:
            parts.append(f"{direction} " + ", ".join(f"{n} {op} {list(shape)} {short_dtype(dt)}"
                                                     for (op, shape, dt), n in counts.items()))
    return "; ".join(parts)


def collective_header(nodes: list[fx.Node], ctx: CompileContext, skipped: set[fx.Node], unit: str,
                      per_step: int) -> list[str]:
    """The header lines on a rank's collectives: each repeated block's (runs of identical blocks said once),
    the rest's, and the bytes they move per ``unit`` and per step (``per_step`` units a step)."""
    tp = ctx.layout.tp
    blocks = find_blocks(ctx.program.module_types)
    runs: list[tuple[list[str], str]] = []  # (blocks, description), consecutive identical blocks merged
    per_block: dict[str, list[_Issue]] = {}
    rest: list[_Issue] = []
    for n in nodes:
        s = spec(n)
        if not s.collective or n in skipped or not KINDS[n.target.__name__].communicates:
            continue
        block = next((b for b in (blocks.names if blocks else []) if under(s.fqn, b)), None)
        (per_block.setdefault(block, []) if block else rest).extend(_issues(n, tp, ctx.layout.ep, ctx.layout.dp))
    for block, issues in per_block.items():
        text = _describe(issues)
        if runs and runs[-1][1] == text and _next_block(runs[-1][0][-1], block):
            runs[-1][0].append(block)
        else:
            runs.append(([block], text))
    if not runs and not rest:
        return []
    lines = []
    for held, text in runs:
        label = held[0] if len(held) == 1 else f"{held[0]}-{held[-1].rsplit('.', 1)[1]} (identical, each)"
        lines.append(f"  {label}: {text}")
    if rest:
        lines.append(f"  {'outside the blocks' if runs else 'all'}: {_describe(rest)}")
    everything = [i for issues in per_block.values() for i in issues] + rest
    moved = sum(i.bytes for i in everything)
    sent = sum(i.bytes * WIRE[i.op](i.ranks or tp) for i in everything)
    step = f", {_bytes_text(moved * per_step)} per step ({per_step} {unit}es)" if per_step > 1 else ""
    ep = f", ep={ctx.layout.ep}; all-to-all sizes as if routing were balanced" if ctx.layout.ep > 1 else ""
    lines.append(f"  buffers: {_bytes_text(moved)} per {unit}{step}; ring algorithms send about "
                 f"{_bytes_text(sent * per_step)} per step from each rank (tp={tp}{ep})")
    return lines


def _next_block(a: str, b: str) -> bool:
    return a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0] and int(b.rsplit(".", 1)[1]) == int(a.rsplit(".", 1)[1]) + 1


def _bytes_text(n: float) -> str:
    return human_bytes(n, digits=1)


def legend_lines(nodes: list[fx.Node]) -> list[str]:
    """What each collective the file's ``nodes`` call does, once (from :mod:`fxshard.ir.comm`), in the order of
    first use; ``copy_to_linears`` (the fused ``copy_to``, passes/overlap.py) and ``copy_to`` are said together
    where the first of them is used, the fused one first."""
    called = [n.target.__name__ for n in nodes if spec(n).collective]
    used = []
    for name in called:
        family = _COPY_TO if name in _COPY_TO else (name,)
        used += [w for w in family if w in called and w not in used]
    width = max((len(u) for u in used), default=0)
    return [f"  rt.{name:<{width}}  {KINDS[name].legend}" for name in used]


_COPY_TO = ("copy_to_linears", "copy_to")


def _axes(ctx: CompileContext) -> list[str]:
    """The process groups a class of a file without pipeline takes: tp, ep under expert parallelism, and dp for the
    whole-batch means of a load-balancing loss (passes/router_loss.py)."""
    from fxshard.passes.router_loss import router_loss_pass

    dp = [DP] if "router_loss" in ctx.passes_run or router_loss_pass.applies_to(ctx) else []
    return ([TP, EP] if ctx.layout.ep > 1 else [TP]) + dp


def _ep_of(fqn: str, ctx: CompileContext) -> int:
    """ep for the experts passes/expert_parallel.py split (their node values are this rank's part), else 1."""
    return ctx.layout.ep if fqn in ctx.expert_params else 1


def _state_line(attr: str, s, node: fx.Node, tp: int, relative_to: str = "", ep: int = 1) -> str:
    val = node.meta["val"]
    placement = spec(node).placement
    shp = local_shape(tuple(val.shape), placement, tp)
    dtype = f"torch.{str(val.dtype).removeprefix('torch.')}"
    empty = f"torch.empty({shp}, dtype={dtype}, device=self.device)"
    fqn = s.fqn.removeprefix(relative_to + ".") if relative_to else s.fqn
    where = f"# {fqn}  {placement}" + ("" if placement == Replicate() else " on tp") + f"  global {list(val.shape)}"
    if ep > 1:  # the experts of this ep rank: val holds the local shape
        where = f"# {fqn}  S(0) on ep  global {[val.shape[0] * ep, *val.shape[1:]]}"
    if s.kind == "parameter":
        return f"self.{attr} = torch.nn.Parameter({empty})  {where}"
    persistent = "" if s.persistent else ", persistent=False"
    return f'self.register_buffer("{attr}", {empty}{persistent})  {where}'


def _group_comment(node: fx.Node, ctx: CompileContext, where: str = "", fqn: str | None = None,
                   block: bool = False, relative_to: str = "") -> str:
    """``# model.layers.2.self_attn.q_proj  Linear  column-parallel  (modeling_llama.py:244)``: the module a
    group of lines comes from (inside a block's class, its path in the block), its type, role and model line."""
    s = spec(node)
    fqn = s.fqn if fqn is None else fqn
    type_name = ctx.program.module_types.get(fqn, "")
    if block:
        return f"# {fqn}  {type_name}  (block submodule)"
    if relative_to and fqn == relative_to:
        label = "(the block)"
    else:
        label = fqn.removeprefix(relative_to + ".") if relative_to else fqn or "(model)"
    parts = [label, type_name] + ([s.role] if s.role else []) + ([f"({where})"] if where else [])
    return "# " + "  ".join(p for p in parts if p)


def model_line(node: fx.Node) -> str:
    """``modeling_llama.py:244``: the innermost line of the model's own code (or its library's) that made
    ``node``, from the stack trace torch.export keeps; "" when the node has none (nodes fxshard inserted)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for path, line in reversed(frames):
        if not any(part in path for part in _NOT_MODEL):
            return f"{path.rsplit('/', 1)[-1]}:{line}"
    return ""


def name_stage_values(gm: fx.GraphModule, stages: list[StageSpec]) -> None:
    """Name each value one pipeline stage sends to another after what it is: its module and the variable the
    model's code assigns it to (``model_layers_1_hidden_states`` rather than ``add_14``), or its module and
    op when no assignment says.  The graph is shared by every rank's code, so every stage sees one name."""
    crossing = [v for st in stages[:-1] for v in st.outputs if v.op == "call_function"]
    for v in dict.fromkeys(crossing):
        fqn = spec(v).fqn
        base = "".join(c if c.isalnum() else "_" for c in fqn) if fqn else "model"
        if v.name.startswith(base + "_"):
            continue  # named already (a second compile of the same graph)
        var = _assigned_name(v)
        v._rename(f"{base}_{var}" if var else f"{base}_{v.name}")


def _assigned_name(node: fx.Node) -> str:
    """The variable the innermost line of the model's code that made ``node`` assigns (``hidden_states`` of
    ``hidden_states = residual + hidden_states``), ``out`` for a line that returns it, or ""."""
    trace = node.meta.get("stack_trace") or ""
    for path, code in reversed(re.findall(r'File "([^"]+)", line \d+, in \S+\n\s*(.*)', trace)):
        if not any(part in path for part in _NOT_MODEL):
            m = re.match(r"([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)", code)
            return m[1] if m else "out" if code.startswith("return ") else ""
    return ""


def short_dtype(dtype: torch.dtype) -> str:
    return SHORT_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def _value_text(node: fx.Node, tp: int) -> str:
    """``[2, 16, 32] f32``: the local shape and dtype of a tensor value on this rank; "" for other values."""
    val = node.meta.get("val")
    placement = spec(node).placement
    if not isinstance(val, torch.Tensor) or isinstance(placement, tuple):
        return ""
    return f"{list(local_shape(tuple(val.shape), placement, tp))} {short_dtype(val.dtype)}"


def _note(node: fx.Node, tp: int) -> str:
    """The comment of one line: the value's local shape and dtype, then its placement (a collective's
    placement before and after; what each collective does is said once, in the file's header)."""
    s = spec(node)
    value = _value_text(node, tp)
    p = s.placement
    if s.collective == "copy_to_linears":  # its input's value; the linears' outputs after the arrow
        return f"{_value_text(node.args[0], tp)} {spec(node.args[0]).placement} -> ({', '.join(map(str, p))})"
    if s.collective:
        src = spec(node.args[0]).placement
        return f"{value} {src} -> {p}".strip()
    if isinstance(p, tuple):
        place = " ".join(str(x) for x in p) if any(not isinstance(x, Replicate) for x in p) else ""
    else:
        place = str(p) if isinstance(p, (Shard, Partial)) else ""
    if node.target is rt_random.dropout:  # see passes/dropout.py
        place = (place + "  " if place else "") + "layout-invariant mask, as on one device"
    return f"{value} {place}".strip()


def _call(node: fx.Node, names, coords) -> str:
    if node.target is operator.getitem:
        return f"{names[node.args[0]]}[{node.args[1]}]"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        packet = target.overloadpacket.__name__.split(".")[-1]
        fn = f"aten.{packet}.{target._overloadname}" if ns == "aten" else f"torch.ops.{ns}.{packet}.{target._overloadname}"
    elif target.__module__.startswith("fxshard.runtime"):
        fn = f"rt.{target.__name__}"
    else:
        fn = f"{target.__module__}.{target.__qualname__}"
    args = [_arg(a, names, coords) for a in node.args]
    args += [f"{k}={_arg(v, names, coords)}" for k, v in node.kwargs.items()]
    return f"{fn}({', '.join(args)})"


def _arg(a, names, coords) -> str:
    if isinstance(a, fx.Node):
        return names[a]
    if isinstance(a, Group):
        return f"self.{a.axis}"
    if isinstance(a, RankValue):
        return repr(a.at(coords))
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x, names, coords) for x in a)
        if isinstance(a, tuple):
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return f"torch.{str(a).removeprefix('torch.')}"
    if isinstance(a, torch.device):
        return "self.device"
    if isinstance(a, torch.layout):
        return f"torch.{str(a).removeprefix('torch.')}"
    if isinstance(a, torch.memory_format):
        return f"torch.{str(a).removeprefix('torch.')}"
    if isinstance(a, float):
        if math.isinf(a):
            return "float('inf')" if a > 0 else "float('-inf')"
        if math.isnan(a):
            return "float('nan')"
        return repr(a)
    if isinstance(a, (int, bool, str)) or a is None:
        return repr(a)
    raise TypeError(f"fxshard codegen: cannot render argument {a!r} of type {type(a).__name__}")
