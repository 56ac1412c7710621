"""Rich terminal output for the commands (tables, highlighted code).  Presentation only."""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from fxshard.codegen.header import collective_counts
from fxshard.codegen.manifest import Manifest, RankEntry, read_manifest
from fxshard.ir.layout import DP, EP, PP, TP
from fxshard.units import human_bytes


def _collective_counts(entry: RankEntry) -> str:
    f, b = collective_counts(entry.collectives)
    return f"fwd: {f}\nbwd: {b}"


def _rank_table(manifest: Manifest, title: str) -> Table:
    table = Table(title=title, show_lines=True)
    table.add_column("global ranks")
    table.add_column("coords", no_wrap=True)
    table.add_column("file", no_wrap=True, min_width=16)
    table.add_column("local params", justify="right")
    table.add_column("collectives per microbatch" if manifest.pipeline else "collectives per step")
    total = _unsharded_params(manifest)
    for entry in manifest.ranks:
        n = sum(_numel(t.shape) for t in entry.tensors.values() if t.kind == "parameter")
        coords = " ".join(f"{k}={v}" for k, v in entry.coords.to_json().items() if k != DP)
        held = f"{n:,}\nof {total:,} ({100 * n / total:.0f}%)" if total else f"{n:,}"
        table.add_row(", ".join(map(str, entry.global_ranks)), coords, entry.file, held, _collective_counts(entry))
    return table


def _unsharded_params(manifest: Manifest) -> int:
    """The model's parameters, unsharded: each source tensor once, at its global shape."""
    sources = {t.source: t.global_shape for e in manifest.ranks for t in e.tensors.values() if t.kind == "parameter"}
    return sum(_numel(shape) for shape in sources.values())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _plan_lines(console: Console, manifest: Manifest) -> None:
    console.print(f"[bold]plan[/] ({manifest.plan_source}):")
    from fxshard.ir.context import compress_plan

    for line in compress_plan(list(manifest.plan)) or ["(nothing split: every module replicated)"]:
        console.print(f"  {line}", highlight=False)
    for note in manifest.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)


def _stage_table(manifest: Manifest) -> Table | None:
    pipe = manifest.pipeline
    if not pipe:
        return None
    table = Table(title=f"pipeline: {manifest.layout.schedule}, {pipe.stages} stages, "
                        f"{pipe.microbatches} microbatches of {pipe.batch // pipe.microbatches} "
                        f"(cut: {pipe.cut})")
    table.add_column("stage", justify="right")
    table.add_column(PP, justify="right")
    table.add_column("holds", no_wrap=True)
    table.add_column("blocks", justify="right")
    table.add_column("GFLOP/mb", justify="right")
    table.add_column("share", justify="right")
    table.add_column("param MB", justify="right")
    table.add_column("MB/tp rank", justify="right")
    total = sum(r.flops for r in pipe.table) or 1
    for r in pipe.table:
        table.add_row(str(r.stage), str(r.pp_rank), r.holds, str(r.blocks), f"{r.flops / 1e9:.4f}",
                      f"{100 * r.flops / total:.0f}%", f"{r.param_bytes / 2**20:.2f}",
                      f"{r.local_param_bytes / 2**20:.2f}")
    return table


def compile_report(console: Console, result) -> None:
    manifest = result.manifest
    _plan_lines(console, manifest)
    stages = _stage_table(manifest)
    if stages is not None:
        console.print(stages)
        for tie in manifest.pipeline.tied:
            console.print(f"tied: {tie.fqn} is held by stages {list(tie.stages)}; its gradient is summed between "
                          "them after backward", highlight=False)
    console.print(_rank_table(manifest, f"{manifest.model_class} from {manifest.model_name} — "
                                        f"{manifest.layout.describe()}"))
    if result.checks is not None:
        console.print(f"static checks: {check_summary(result.checks)}", highlight=False)
    if result.memory_plan is not None:
        microbatch_line(console, result.memory_plan)
        recompute_lines(console, result.memory_plan)
    console.print(f"wrote {result.out}: {len(result.files)} rank file(s), manifest.json, weights/, model.py",
                  highlight=False, markup=False)
    out = shlex.quote(str(result.out))  # pasted into a shell as printed: a path with spaces or quotes stays one word
    console.print(f"read a rank's code with `fxshard show {out} --rank 0`; train with `fxshard run {out} --steps 3`",
                  highlight=False, markup=False, soft_wrap=True)


def folder_line(console: Console, source, out: Path) -> None:
    """What ``compile FOLDER`` wrote for the folder: its model file, and where the weights come from."""
    f = source.folder
    console.print(f"{Path(out) / 'model.py'}: the model file written for {f.folder} ({f.architecture}, "
                  f"{f.task.name}; example batch {f.batch} x {f.seq} tokens), readable and editable; "
                  + ("each rank reads its slices of the folder's safetensors at run time" if source.weights else
                     "compiled --meta: no weights (recompile without --meta to read the folder's)"),
                  highlight=False, markup=False, soft_wrap=True)


def show_layout(console: Console, out: Path) -> None:
    manifest = read_manifest(out)
    _plan_lines(console, manifest)
    stages = _stage_table(manifest)
    if stages is not None:
        console.print(stages)
    console.print(_rank_table(manifest, f"{out}: {manifest.model_class} — {manifest.layout.describe()}"))


def show_rank(console: Console, out: Path, rank: int) -> None:
    manifest = read_manifest(out)
    layout = manifest.layout
    if not 0 <= rank < layout.world_size:
        from fxshard.errors import OutputFolderError

        raise OutputFolderError(f"--rank {rank}: {out} has ranks 0..{layout.world_size - 1}")
    code = (Path(out) / manifest.rank(layout.coords(rank)).file).read_text()
    if console.is_terminal:
        console.print(Syntax(code, "python", line_numbers=True, word_wrap=False))
    else:
        console.print(code, highlight=False, markup=False, soft_wrap=True)


def memory_table(console: Console, rows: list[dict]) -> None:
    """``fxshard run --memory-report``: bytes of model state per rank next to the ZeRO formula."""
    mib = 2**20
    table = Table(title=f"model state per rank, MiB (ZeRO formula {rows[0]['formula_text']}; Ψ = parameters on the "
                        "rank before dp sharding)")
    for col in ("rank", "coords", "Ψ", "params", "grads", "optim", "total", "formula", "ratio", "in fwd"):
        table.add_column(col, justify="left" if col == "coords" else "right", no_wrap=True)
    for r in rows:
        f = r["formula"]
        table.add_row(str(r["rank"]), " ".join(f"{k}={v}" for k, v in r["coords"].items()), f"{r['psi']:,}",
                      *(f"{r[k] / mib:.2f}" for k in ("params", "grads", "optimizer", "total")),
                      f"{f['total'] / mib:.2f} = {f['params'] / mib:.2f}+{f['grads'] / mib:.2f}+"
                      f"{f['optimizer'] / mib:.2f}", f"{r['ratio']:.3f}", f"{r['gathered'] / mib:.2f}")
    console.print(table)
    console.print("formula = params + grads + optim; 'in fwd' = most parameter bytes held at once during a forward "
                  "(ZeRO 3 gathers them before use)", highlight=False)
    for note in sorted({r["note"] for r in rows if r["note"]}):
        console.print(note, highlight=False)
    _activation_table(console, rows)


def _activation_table(console: Console, rows: list[dict]) -> None:
    """Measured bytes saved for backward per microbatch and the last step's peak, next to ``fxshard plan``."""
    mib = 2**20
    table = Table(title="activations and peak per rank, MiB (measured in the last step; plan: fxshard plan's "
                        "prediction)")
    for col in ("rank", "saved/microbatch", "plan", "ratio", "alive (plan)", "peak", "plan", "ratio"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        plan = r["plan"]
        cells = [f"{plan['saved'] / mib:.2f}", f"{r['saved'] / plan['saved']:.3f}", str(plan["alive"]),
                 f"{r['peak'] / mib:.2f}", f"{plan['peak'] / mib:.2f}", f"{r['peak'] / plan['peak']:.3f}"] \
            if plan else ["—", "—", "—", f"{r['peak'] / mib:.2f}", "—", "—"]
        table.add_row(str(r["rank"]), f"{r['saved'] / mib:.2f}", *cells)
    console.print(table)
    console.print("saved: distinct storages autograd saved in one microbatch's forward (parameters left out; under a "
                  "pipeline also the stage's inputs and outputs); peak: most bytes allocated at once in the step",
                  highlight=False)
    if rows[0]["plan_note"]:
        console.print(rows[0]["plan_note"], highlight=False)


def check_summary(report) -> str:
    kinds = [k for k in (TP, PP, EP, "tied-weight") if any(g.label.startswith(k + " group") for g in report.groups)]
    text = (f"{report.ranks} rank file(s) agree on the collectives of every {', '.join(kinds)} group"
            if kinds else f"{report.ranks} rank file(s), no process group to compare")
    return text + (f"; {len(report.links)} pipeline send/recv pair(s) match" if report.links else "")


def check_report(console: Console, out: Path, report) -> None:
    """``fxshard check``: per process group, the collectives every member issues; then OK."""
    how = "run on meta tensors" if report.traced else "scanned"
    table = Table(title=f"{out}: collectives per process group ({report.ranks} rank files {how}, "
                        f"world size {report.world})")
    for col in ("process group", "where", "rank files", "forward", "backward", ""):
        table.add_column(col, justify="right" if col in ("forward", "backward") else "left",
                         no_wrap=col != "where")
    for g in report.groups:
        table.add_row(g.label, g.scope, ", ".join(g.files), str(g.forward), str(g.backward), "[green]OK[/]")
    console.print(table)
    for link in report.links:
        console.print(f"pipeline {link}: sends match receives [green]OK[/]", highlight=False)
    console.print(f"[bold green]OK[/]: {check_summary(report)}; no rank would wait for a collective "
                  "another rank never issues", highlight=False)


def verify_report(console: Console, result) -> None:
    """``fxshard verify``: losses side by side, then the parameters that differ most."""
    table = Table(title=f"single device vs {result.layout.describe()}")
    for col in ("step", "single device", "distributed", "abs diff", "rel diff"):
        table.add_column(col, justify="right")
    for step, (ref, got) in enumerate(zip(result.reference, result.distributed, strict=True), start=1):
        table.add_row(str(step), f"{ref:.7f}", f"{got:.7f}", f"{abs(got - ref):.2e}",
                      f"{abs(got - ref) / max(abs(ref), 1e-30):.2e}")
    console.print(table)
    worst = sorted(result.params, key=lambda p: -p["diff_sq"])[:5]
    params = Table(title=f"trained parameters: {len(result.params)} compared; the 5 that differ most "
                         "(rel = ‖diff‖ / ‖update‖ of the tensor, update = single device trained − initial)")
    for col in ("parameter", "shape", "max abs diff", "rel"):
        params.add_column(col, justify="left" if col == "parameter" else "right")
    apart = result.apart  # quiet ones the update share cannot hold: judged by max abs alone (fxshard.check.verify)
    for p in worst:
        mark = " (quiet, apart)" if p["fqn"] in apart else " (quiet)" if p.get("quiet") else ""
        params.add_row(p["fqn"], str(p["shape"]), f"{p['max_abs']:.2e}", f"{p['rel']:.2e}{mark}")
    console.print(params)
    style = "green" if result.ok else "bold red"
    console.print(f"[{style}]{result.summary()}[/]", highlight=False)


_PLAN_ROWS = [  # key, label, unit
    ("psi", "parameters Ψ (this rank, before dp sharding)", "count"),
    ("frozen_psi", "frozen parameters (requires_grad=False; in Ψ: no gradient, no optimizer state)", "count"),
    ("params", "parameter bytes", "bytes"),
    ("grads", "gradient bytes", "bytes"),
    ("optimizer", "optimizer state bytes (Adam moments; + fp32 masters under bf16)", "bytes"),
    ("params_peak", "parameter bytes held during forward (ZeRO 2/3: a stage gathered whole + its shard)", "bytes"),
    ("saved", "bytes saved for backward per microbatch (what autograd keeps; + stage inputs and outputs under a "
              "pipeline)", "bytes"),
    ("alive", "microbatches alive at the peak (forwards whose backward is not done)", "count"),
    ("activations", "activation bytes at the peak (saved x alive)", "bytes"),
    ("transient", "largest transient (2 x the largest forward value; + the recomputed block's forward)", "bytes"),
    ("model_state", "model state bytes (held during forward + gradients + optimizer state)", "bytes"),
    ("peak", "predicted peak bytes (model state + activations + transient)", "bytes"),
    ("tp_allreduce", "tp all-reduce elements per step (fwd + bwd)", "count"),
    ("tp_allgather", "tp all-gather elements per step", "count"),
    ("tp_reducescatter", "tp reduce-scatter elements per step (--sp)", "count"),
    ("tp_sent", "tp elements each rank sends per step (ring: all-reduce 2(t-1)/t of its buffer, gather and "
                "reduce-scatter (t-1)/t)", "count"),
    ("pp_send", "pp elements sent per step (activations fwd, grads bwd)", "count"),
    ("dp_bytes", "dp bytes sent per step (ring collectives; --ep: the experts' over dp/ep)", "bytes"),
    # --cp only
    ("cp_sent", "cp bytes sent per step (attention's K/V exchange fwd + bwd; ring: (c-1)/c of a gather or "
                "reduce-scatter, the ring's c-1 K/V steps, the all-to-alls)", "bytes"),
    # --ep only
    ("ep_psi", "expert parameters (this rank's E/ep of each MoE layer; in Ψ)", "count"),
    ("ep_state", "expert model state bytes (parameters, gradients, Adam; ZeRO 1: Adam over dp/ep; ZeRO 2/3: "
                 "whole)", "bytes"),
    ("ep_alltoall", "ep all-to-all bytes sent per step (dispatch + combine, fwd + bwd, + counts; balanced "
                    "routing: (N-1)/N of tokens x top-k)", "bytes"),
]


def _human(value: float, unit: str) -> str:
    if unit == "bytes":
        return human_bytes(value)
    for scale, name in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f}{name}"
    return f"{value:.0f}"


def _plan_expression(row: dict, key: str) -> str:
    if key == "alive":  # per stage of the rank, as the schedule order has them at the peak
        return " + ".join(f"{n} (stage {s})" for s, n in row["alive_by_stage"].items())
    text = str(row[key].expr)
    return f"{text}  ({row['transient_node']})" if key == "transient" and row["transient_node"] else text


def _verdict_cells(v: dict) -> tuple[str, str, str]:
    size = _human(v["device_memory"], "bytes")
    if v["fits"]:
        return (f"[green]fits a {size} device[/]", "[green]headroom[/]", f"[green]{_human(v['headroom'], 'bytes')}[/]")
    return (f"[bold red]does not fit a {size} device[/]", "[bold red]over by[/]",
            f"[bold red]{_human(-v['headroom'], 'bytes')}[/]")


def plan_report(console: Console, report) -> None:
    """``fxshard plan``: per pipeline rank, every cost as an expression and its value."""
    at = ", ".join(f"{k}={v}" for k, v in report.at.items())
    for row in report.ranks:
        table = Table(title=f"{report.layout.describe()} — pp rank {row['pp_rank']} (global ranks "
                            f"{', '.join(map(str, row['global_ranks']))}; tp ranks hold equal shares)")
        table.add_column("per rank")
        table.add_column("expression (B: examples per step, S: sequence length)")
        table.add_column(f"at {at}", justify="right")
        for key, label, unit in _PLAN_ROWS:
            if key not in row:  # a row of a flag not given (--ep)
                continue
            cost = row[key]
            table.add_row(label, _plan_expression(row, key), _human(cost.value, unit))
        if "verdict" in row:
            table.add_row(*_verdict_cells(row["verdict"]))
        console.print(table)
    microbatch_line(console, report)
    recompute_lines(console, report)
    console.print(f"pipeline bubble {report.bubble_formula} = {report.bubble.expr} "
                  f"({report.bubble.value:.1%} of each pp rank's step idle)", highlight=False)
    for note in report.notes:
        console.print(f"note: {note}", highlight=False)


def microbatch_line(console: Console, report) -> None:
    """The pipeline's microbatch count when ``--device-memory`` chose it (``--microbatches`` not given): what, why,
    and the worst rank's peak at each count tried (:mod:`fxshard.cost.microbatches`)."""
    if report.microbatch_choice is not None:
        from fxshard.cost.microbatches import describe

        console.print(describe(report.microbatch_choice), highlight=False, soft_wrap=True)


def recompute_lines(console: Console, report) -> None:
    """The recompute mode (and whether ``auto`` chose it), and per mode the worst rank's predicted peak and the
    FLOPs the mode adds: the trade-off, for ``fxshard plan`` and ``fxshard compile --device-memory``."""
    summary = report.recompute_summary()
    device = report.ranks[0].get("verdict", {}).get("device_memory")
    how = "chosen by --recompute auto: the least that fits every rank" if summary["auto"] else "as asked"
    console.print(f"recompute: {summary['mode']} ({how})", highlight=False)
    for mode, peak in summary["peaks"].items():
        fits = "" if device is None else ("  fits" if peak <= device else "  does not fit")
        added = f"{summary['flops'][mode]:.1%} more FLOPs per step" if mode != "none" else "no FLOPs added"
        mark = "*" if mode == summary["mode"] else " "
        console.print(f" {mark} {mode:<9} worst rank peak {_human(peak, 'bytes'):>12} (pp rank "
                      f"{summary['worst_rank'][mode]}){fits};  {added}", highlight=False)
    if len(summary["peaks"]) > 1:
        console.print("   FLOPs: what torch.utils.flop_counter counts (matrix multiplies, attention) of the forward "
                      "run again, as a share of forward + backward (3 x forward), at the captured size",
                      highlight=False)
