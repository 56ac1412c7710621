"""Emit one rank's graph as a Python module (see ``templates/rank.py.j2``).

Lines are grouped under a comment naming the source module, its type and its parallel role;
values that are not replicated carry their placement; every collective is one ``rt.*`` call with a
comment saying what it does forward and backward.  Output is deterministic: the same input gives
byte-identical files.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import torch
import torch.fx as fx

from fxshard.context import CompileContext, Group, RankValue, spec
from fxshard.placement import Partial, Replicate, Shard, local_shape

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
    keep_trailing_newline=True,
    autoescape=False,
)

_COLLECTIVE_NOTES = {
    "copy_to": "R: identity forward; all-reduce of the gradient over {g} backward",
    "all_reduce": "P(sum) -> R: all-reduce over {g}; backward: identity",
    "all_gather": "{p} -> R: all-gather over {g}; backward: keep this rank's part",
    "scatter": "R -> {q}: keep this rank's part; backward: all-gather over {g}",
    "shard": "R -> {q}: keep this rank's part (no gradient, no communication)",
}


def rank_file_name(coords: dict[str, int]) -> str:
    return f"rank_pp{coords['pp']}_tp{coords['tp']}.py"


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
    attrs: dict[str, str]  # placeholder name -> attribute name
    collectives: list[dict] = field(default_factory=list)


def emit_rank(gm: fx.GraphModule, ctx: CompileContext, coords: dict[str, int], version: str,
              global_ranks: list[int]) -> RankCode:
    program = ctx.program
    state = program.state_by_name()
    taken: set[str] = {"device", "tp", "pp", "dp", "forward", "training"}
    attrs: dict[str, str] = {}
    init_lines: list[str] = []
    names: dict[fx.Node, str] = {}
    inputs: list[str] = []
    tp = ctx.layout.tp
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in state:
            s = state[node.name]
            if not node.users:
                continue
            a = attr_name(s.fqn, taken)
            attrs[node.name] = a
            names[node] = f"self.{a}"
            init_lines.append(_state_line(a, s, node, tp))
        else:
            names[node] = node.name
            inputs.append(node.name)

    lines: list[str] = []
    collectives: list[dict] = []
    group_key = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            lines.append("")
            lines.append(f"return {_arg(node.args[0], names, coords)}")
            continue
        key = (spec(node).fqn, spec(node).role)
        if key != group_key:
            group_key = key
            if lines:
                lines.append("")
            lines.append(_group_comment(node, ctx))
        names[node] = node.name
        line = f"{node.name} = {_call(node, names, coords)}"
        note = _note(node, tp)
        lines.append(f"{line}  # {note}" if note else line)
        name = getattr(node.target, "__name__", "")
        if spec(node).collective and name != "shard":
            val = node.meta.get("val")
            collectives.append({
                "op": name,
                "group": "tp",
                "value": node.name,
                "shape": list(local_shape(tuple(val.shape), spec(node.args[0]).placement, tp)),
                "dtype": str(val.dtype).removeprefix("torch."),
                "backward": {"copy_to": "all_reduce", "all_reduce": None, "all_gather": None,
                             "scatter": "all_gather"}[name],
            })

    summary = _summary(collectives)
    text = _ENV.get_template("rank.py.j2").render(
        version=version,
        model_file=ctx.model_file_name,
        digest=ctx.model_digest,
        model_class=type(program.model).__name__,
        layout=ctx.layout.describe(),
        mesh=ctx.layout.mesh_shape,
        coords_text=f"pp rank {coords['pp']}, tp rank {coords['tp']} of {tp}",
        global_ranks=", ".join(map(str, global_ranks)),
        plan_source=ctx.plan.source,
        plan_lines=ctx.plan_summary,
        passes=", ".join(ctx.passes_run + ["codegen"]),
        collective_summary=summary,
        class_name="RankModule",
        axes=["tp"],
        init_lines=init_lines,
        forward_args=", ".join(inputs),
        forward_lines=[ln for ln in lines],
    )
    text = "\n".join(ln.rstrip() for ln in text.splitlines()) + "\n"
    return RankCode(text, attrs, collectives)


def collective_counts(collectives: list[dict]) -> tuple[str, str]:
    """``("1 all_gather, 5 all_reduce", "5 all_reduce")``: one rank's collectives per step, forward and backward."""
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    for c in collectives:
        if c["op"] != "copy_to":
            fwd[c["op"]] = fwd.get(c["op"], 0) + 1
        if c["backward"]:
            bwd[c["backward"]] = bwd.get(c["backward"], 0) + 1
    return (", ".join(f"{n} {k}" for k, n in sorted(fwd.items())) or "none",
            ", ".join(f"{n} {k}" for k, n in sorted(bwd.items())) or "none")


def _summary(collectives: list[dict]) -> str:
    f, b = collective_counts(collectives)
    return f"forward {f}; backward {b}"


def _state_line(attr: str, s, node: fx.Node, tp: int) -> str:
    val = node.meta["val"]
    placement = spec(node).placement
    shp = local_shape(tuple(val.shape), placement, tp)
    dtype = f"torch.{str(val.dtype).removeprefix('torch.')}"
    empty = f"torch.empty({shp}, dtype={dtype}, device=self.device)"
    where = f"# {s.fqn}  {placement}" + ("" if placement == Replicate() else " on tp") + f"  global {list(val.shape)}"
    if s.kind == "parameter":
        return f"self.{attr} = torch.nn.Parameter({empty})  {where}"
    persistent = "" if s.persistent else ", persistent=False"
    return f'self.register_buffer("{attr}", {empty}{persistent})  {where}'


def _group_comment(node: fx.Node, ctx: CompileContext) -> str:
    s = spec(node)
    fqn = s.fqn
    type_name = ctx.program.module_types.get(fqn, "")
    label = fqn or "(model)"
    parts = [label, type_name] + ([s.role] if s.role else [])
    return "# " + "  ".join(p for p in parts if p)


def _note(node: fx.Node, tp: int) -> str:
    s = spec(node)
    name = getattr(node.target, "__name__", "")
    if s.collective:
        src = spec(node.args[0]).placement
        return _COLLECTIVE_NOTES[name].format(g="tp", p=src, q=s.placement)
    p = s.placement
    if isinstance(p, tuple):
        return " ".join(str(x) for x in p) if any(not isinstance(x, Replicate) for x in p) else ""
    if isinstance(p, (Shard, Partial)):
        return str(p)
    return ""


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
