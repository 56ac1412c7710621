"""What a pipeline stage's class says of its boundary: what it receives and sends (comments and the
``INPUTS`` / ``OUTPUTS`` the schedule allocates by), the user inputs a later stage takes from its microbatch
(``BATCH``), the names of the values that cross stages, and
``sync_tied_grads`` for the weights several stages hold::

    comments, inputs, outputs = io_comments(st, requires_grad(gm, ctx.trainable), ctx, coords)
"""

from __future__ import annotations

import torch.fx as fx

from fxshard.codegen.lines import assigned_name
from fxshard.ir.context import CompileContext, spec
from fxshard.ir.layout import PP, TP
from fxshard.ir.placement import Replicate, local_shape
from fxshard.ir.stages import StageSpec


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
        var = assigned_name(v)
        v._rename(f"{base}_{var}" if var else f"{base}_{v.name}")


def _local(node: fx.Node, tp: int) -> tuple[tuple[int, ...], str]:
    val = node.meta["val"]
    return tuple(local_shape(tuple(val.shape), spec(node).placement, tp)), str(val.dtype).removeprefix("torch.")


def io_comments(st: StageSpec, grad: set[fx.Node], ctx: CompileContext, coords):
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
            return "user input"
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
    if st.batch:
        comments.append("# takes from its own microbatch of the batch, by keyword (never sent between stages):")
        comments += [row(v, False)[0] for v in st.batch]
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
        read = {a for n in st.recomputed for a in n.all_input_nodes}
        sources = "buffers, constants and user inputs" if read & set(st.batch) else "buffers and constants"
        comments.append(f"# recomputes {len(st.recomputed)} op(s) from {sources} instead of receiving their results "
                        "(marked below)")
    return comments, in_meta, out_meta


def meta_tuple(metas: list[dict]) -> str:
    items = [f"({m['name']!r}, {tuple(m['shape'])!r}, torch.{m['dtype']}, {m['requires_grad']})" for m in metas]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def tied_lines(tied: list[tuple[fx.Node, list[int]]], ctx: CompileContext, coords, state, stage_attrs) -> list[str]:
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
