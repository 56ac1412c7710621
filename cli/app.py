"""``fxshard`` commands.  Arguments are parsed here; all logic lives in the library."""

from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fxshard.errors import FxshardError, FxshardWarning
from fxshard.train.options import RunOptions

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Compile unmodified PyTorch models into readable per-rank distributed training code.")
# not a terminal (a pipe, CI log): tables at 120 columns rather than rich's default of 80
console = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning):
    """fxshard's warnings as one line, like its errors: a source line of the caller would mean nothing here."""
    if not issubclass(category, FxshardWarning):
        return _default(message, category, filename, lineno, file, line)
    from rich.markup import escape

    err.print(f"[bold yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)


warnings.showwarning = _show_warning


def _fail(e: Exception) -> None:
    from rich.markup import escape

    # escape: messages quote tracebacks and log lines whose [brackets] are not rich markup
    err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


# ---------------------------------------------------------------- options shared by compile, plan and verify

ModelArg = Annotated[Path, typer.Argument(help="model file defining make_model() and make_inputs()")]
TP = Annotated[int, typer.Option("--tp", help="tensor-parallel degree")]
PP = Annotated[int, typer.Option("--pp", help="pipeline-parallel degree")]
DP = Annotated[int, typer.Option("--dp", help="data-parallel degree")]
Zero = Annotated[int, typer.Option("--zero", help="ZeRO stage (0-3)")]
EP = Annotated[int, typer.Option("--ep", help="expert-parallel degree: each MoE layer's experts split over ep of the "
                                              "dp ranks (ep divides dp)")]
DType = Annotated[str, typer.Option("--dtype", help="fp32, or bf16: mixed precision (bf16 compute, fp32 master "
                                                      "weights and Adam state)")]
Schedule = Annotated[str, typer.Option("--schedule", help="pipeline schedule: gpipe, 1f1b, interleaved-1f1b, "
                                                            "zero-bubble")]
Microbatches = Annotated[int | None, typer.Option("--microbatches",
                                                  help="pipeline microbatches per step (default: the fewest the "
                                                       "schedule runs well with that divide the batch)")]
VirtualStages = Annotated[int | None, typer.Option("--virtual-stages",
                                                   help="stages per pp rank for interleaved-1f1b (default 2) and "
                                                        "zero-bubble (default 1)")]
Recompute = Annotated[str, typer.Option("--recompute", help="activation recompute of each repeated block: none; "
                                                             "selective (keep matmul outputs, recompute the rest in "
                                                             "backward); full (keep only the block's inputs); auto (the "
                                                             "least of these that fits --device-memory by the plan)")]
DeviceMemory = Annotated[str | None, typer.Option("--device-memory",
                                                  help="memory of one device (80GiB, 80GB, 16GiB): say per rank "
                                                       "whether its predicted peak fits; --recompute auto chooses "
                                                       "by it")]
SequenceParallel = Annotated[bool, typer.Option("--sp", help="sequence parallelism (with --tp 2 or more): norms, "
                                                        "dropout and residual adds run on S/tp tokens; the "
                                                        "all-reduces become reduce-scatters and all-gathers")]
Overlap = Annotated[bool, typer.Option("--overlap/--no-overlap",
                                       help="write copy_to and the column-parallel linears reading it as one "
                                            "rt.copy_to_linears, whose backward overlaps the input gradient's "
                                            "all-reduce with the weight gradients (same values, same bytes)")]
PlanFile = Annotated[Path | None, typer.Option("--plan", help="plan file defining PLAN = {fqn_glob: style}")]
Seed = Annotated[int, typer.Option("--seed", help="seed for make_model() and make_inputs()")]


def _layout(tp: int, pp: int, dp: int, zero: int, schedule: str, microbatches: int | None,
            virtual_stages: int | None, dtype: str, recompute: str = "none", sp: bool = False,
            ep: int = 1, overlap: bool = True):
    from fxshard.ir.context import Layout

    return Layout(tp=tp, pp=pp, dp=dp, zero=zero, schedule=schedule, microbatches=microbatches,
                  virtual_stages=virtual_stages, dtype=dtype, recompute=recompute, sp=sp, ep=ep, overlap=overlap)


@app.command()
def compile(
    model: ModelArg,
    tp: TP = 1,
    pp: PP = 1,
    dp: DP = 1,
    ep: EP = 1,
    zero: Zero = 0,
    dtype: DType = "fp32",
    recompute: Recompute = "none",
    sp: SequenceParallel = False,
    overlap: Overlap = True,
    schedule: Schedule = "1f1b",
    microbatches: Microbatches = None,
    virtual_stages: VirtualStages = None,
    split_before: list[str] = typer.Option(None, "--split-before",
                                           help="cut the pipeline before this module (repeat, or comma-separate)"),
    plan: PlanFile = None,
    out: Path = typer.Option(Path("out"), "--out", "-o", help="output folder"),
    seed: Seed = 0,
    weights: Path = typer.Option(None, "--weights",
                                 help="Hugging Face model folder (config.json + safetensors): capture on meta "
                                      "tensors, validate the folder, each rank reads only its slices at run time"),
    meta: bool = typer.Option(False, "--meta", help="capture on meta tensors and write no weights (code and "
                                                    "manifest only; implied by --weights)"),
    device_memory: DeviceMemory = None,
):
    """Compile MODEL for a layout into per-rank Python files, a manifest and weight shards."""
    from fxshard.cli.report import compile_report

    from fxshard.compiler import load_plan_file
    from fxshard.driver import compile as compile_
    from fxshard.tools.costs import parse_size

    try:
        device = parse_size(device_memory) if device_memory is not None else None  # before the compile
        layout = _layout(tp, pp, dp, zero, schedule, microbatches, virtual_stages, dtype, recompute, sp, ep, overlap)
        user_plan = load_plan_file(plan) if plan else None
        if split_before:
            cuts = [c.strip() for arg in split_before for c in arg.split(",") if c.strip()]
            user_plan = dict(user_plan or {}, split_before=cuts)
        with console.status(f"compiling {model} ({layout.describe()})"):
            result = compile_(model, layout, out=out, plan=user_plan, seed=seed, weights=weights, meta=meta,
                              device_memory=device)
    except FxshardError as e:
        _fail(e)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM while writing (fxshard.codegen.folder)
        _fail(f"compile interrupted by {e.args[0] if e.args else 'SIGINT'}: {out} was left as it was")
    compile_report(console, result)


@app.command()
def plan(
    model: ModelArg,
    tp: TP = 1,
    pp: PP = 1,
    dp: DP = 1,
    ep: EP = 1,
    zero: Zero = 0,
    schedule: Schedule = "1f1b",
    microbatches: Microbatches = None,
    virtual_stages: VirtualStages = None,
    dtype: DType = "fp32",
    recompute: Recompute = "none",
    sp: SequenceParallel = False,
    plan_file: PlanFile = None,
    batch: int = typer.Option(None, "--batch", help="evaluate at this many examples per step (default: the example's)"),
    seq: int = typer.Option(None, "--seq", help="evaluate at this sequence length (default: the example's)"),
    device_memory: DeviceMemory = None,
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    seed: Seed = 0,
):
    """Cost a layout without writing code: per rank memory (model state, bytes saved for backward, microbatches
    alive, predicted peak), communication per mesh axis (sympy expressions in B and S) and the pipeline bubble."""
    import json

    from fxshard.cli.report import plan_report

    from fxshard.compiler import load_plan_file
    from fxshard.tools.costs import parse_size, plan_costs

    try:
        device = parse_size(device_memory) if device_memory is not None else None  # before the compile
        layout = _layout(tp, pp, dp, zero, schedule, microbatches, virtual_stages, dtype, recompute, sp, ep)
        report = plan_costs(model, layout, load_plan_file(plan_file) if plan_file else None, seed, batch, seq,
                            device)
    except FxshardError as e:
        _fail(e)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        plan_report(console, report)


@app.command()
def show(
    out: Path = typer.Argument(..., help="compiled output folder"),
    rank: int = typer.Option(None, "--rank", help="global rank whose code to print"),
):
    """Print the layout summary, or one rank's generated code (highlighted)."""
    from fxshard.cli.report import show_layout, show_rank

    try:
        if rank is None:
            show_layout(console, out)
        else:
            show_rank(console, out, rank)
    except FxshardError as e:
        _fail(e)


def _option(flag) -> typer.models.OptionInfo:
    """The typer option of one of ``fxshard run``'s flags (:class:`fxshard.train.options.Flag`)."""
    return typer.Option(flag.default, flag.declaration, help=flag.help or None, hidden=flag.hidden)


def _run_options(command):
    """Give ``command`` (``out`` alone) an option per flag of RunOptions, in order: typer reads the signature."""
    out = next(iter(inspect.signature(command).parameters.values())).replace(annotation=Path)
    flags = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_option(f), annotation=f.type)
             for f in RunOptions.flags()]
    command.__signature__ = inspect.Signature([out, *flags])
    command.__annotations__ = {p.name: p.annotation for p in [out, *flags]}
    return command


ALLOW_EDITED = next(f for f in RunOptions.flags() if f.name == "allow_edited")


@app.command()
def check(out: Path = typer.Argument(..., help="compiled output folder"),
          allow_edited: bool = _option(ALLOW_EDITED)):
    """Re-run the static checks on OUT's files: layout, headers, weights, and that every rank of each process
    group issues the same collectives (run on meta tensors) and every pipeline send has its receive; refuse
    files edited after compile. The checks import and run the rank files: check only folders you trust."""
    from fxshard.cli.report import check_report

    from fxshard.tools.check import check_output

    try:
        with console.status(f"checking {out}"):
            report = check_output(out, allow_edited)
    except FxshardError as e:
        _fail(e)
    check_report(console, out, report)


@app.command()
@_run_options
def run(out: Path = typer.Argument(..., help="compiled output folder"), **flags):
    """Train: launch every rank locally, or run as one rank when started by torchrun.

    Refused before launch (with or without --check): a rank file or model.py edited after compile (its
    sha256 differs from manifest.json's; --allow-edited overrides) and manifest paths outside OUT. A compiled
    folder is Python code that runs on every rank: run only folders you trust."""
    from fxshard.codegen.manifest import read_manifest, refuse_edited
    from fxshard.train.launch import run_rank, under_torchrun
    from fxshard.train.local import launch_local
    from fxshard.train.options import check_run_options

    try:
        options = RunOptions.from_flags(flags)
        check_run_options(out, options)
        if under_torchrun():
            if not options.allow_edited:
                refuse_edited(out, read_manifest(out))
            from fxshard.cli.report import memory_table

            from fxshard.runtime.guard import recorded

            with recorded():  # the launcher's summary then names this rank's error
                run_rank(out, options,
                         memory_report=(lambda rows: memory_table(console, rows)) if options.memory_report else None)
            from fxshard.train.supervise import exit_finished

            exit_finished()  # trained, written and torn down: no interpreter teardown to abort in
        manifest = read_manifest(out)
        world = manifest.layout.world_size
        if options.check:
            from fxshard.tools.check import check_output

            with console.status(f"checking {out}"):
                report = check_output(out, options.allow_edited)
            console.print(f"static checks: OK ({report.ranks} rank files agree on every collective and send)")
        elif not options.allow_edited:
            refuse_edited(out, manifest)
        console.print(f"launching {world} processes for {out} ({manifest.layout.describe()})")
        launch_local(out, options.argv(out), world)
    except FxshardError as e:
        _fail(e)


@app.command()
def report(
    out: Path = typer.Argument(..., help="compiled output folder"),
    device_memory: DeviceMemory = None,
    metrics: Path = typer.Option(None, "--metrics", help="the run's --metrics file (default: the one the last "
                                                          "`fxshard run` of OUT wrote, from OUT/run.json)"),
    trace: Path = typer.Option(None, "--trace", help="the run's --trace folder (default: from OUT/run.json)"),
    to: Path = typer.Option(None, "--to", help="write the page here (default OUT/report.html)"),
):
    """Write OUT/report.html: one self-contained page of the mesh (what each rank holds, its memory by the plan),
    the model as compiled (placements, collectives, the rank files), the pipeline schedule (planned, and measured
    when the run was traced) and the last run (loss, step time, tokens/s, memory)."""
    from fxshard.report.render import write_report
    from fxshard.tools.costs import parse_size

    try:
        device = parse_size(device_memory) if device_memory is not None else None
        from fxshard.errors import OptionError

        for flag, path in (("--metrics", metrics), ("--trace", trace)):
            if path is not None and not path.exists():
                raise OptionError(f"{flag} {path}: no such file or folder")
        if to is not None and (to.is_dir() or not to.parent.is_dir()):
            raise OptionError(f"--to {to}: expected a file path in an existing folder; found "
                              + ("a folder" if to.is_dir() else f"no folder {to.parent}") + "; give e.g. --to report.html")
        with console.status(f"reporting {out}"):
            path, warnings = write_report(out, device, metrics, trace, to)
    except FxshardError as e:
        _fail(e)
    for w in warnings:
        err.print(f"warning: {w}")
    console.print(f"wrote {path}: open it in a browser (one file, nothing fetched)")


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="checkpoint folder (DIR, following DIR/latest, or DIR/step-<N>)"),
    hf: Path = typer.Option(..., "--hf", help="write a Hugging Face model folder here"),
    model: Path = typer.Option(None, "--model", help="model file (default: the copy saved in the checkpoint)"),
):
    """Export a checkpoint's trained weights (of any layout) as a Hugging Face folder that
    transformers' from_pretrained loads."""
    from fxshard.train.export import export_hf

    try:
        path = export_hf(checkpoint, hf, model)
    except FxshardError as e:
        _fail(e)
    console.print(f"exported {path} to {hf}")


@app.command()
def verify(
    model: ModelArg,
    tp: TP = 1,
    pp: PP = 1,
    dp: DP = 1,
    ep: EP = 1,
    zero: Zero = 0,
    schedule: Schedule = "1f1b",
    microbatches: Microbatches = None,
    virtual_stages: VirtualStages = None,
    dtype: DType = "fp32",
    recompute: Recompute = "none",
    sp: SequenceParallel = False,
    overlap: Overlap = True,
    plan: PlanFile = None,
    steps: int = typer.Option(3, "--steps", help="training steps"),
    lr: float = typer.Option(1e-3, "--lr"),
    clip_grad_norm: float = typer.Option(None, "--clip-grad-norm"),
    grad_accum: int = typer.Option(1, "--grad-accum"),
    rtol: float = typer.Option(None, "--rtol", help="losses: relative tolerance (default 1e-5; 2e-2 under bf16)"),
    param_rtol: float = typer.Option(None, "--param-rtol",
                                     help="parameters: tolerance of ‖distributed − single device‖ / ‖single device "
                                          "update‖ over all parameters (default 1e-3; 0.25 under bf16)"),
    seed: Seed = 0,
    out: Path = typer.Option(None, "--out", help="keep the compiled program and the trained tensors here"),
    compile: bool = typer.Option(False, "--compile", help="train the distributed side as `fxshard run --compile` "
                                                          "(torch.compile, inductor)"),
    cpu_matmul: str = typer.Option("onednn", "--cpu-matmul", help="with --compile on CPU: the large fp32 matrix "
                                                                 "products' kernel, onednn or torch (as fxshard run)"),
):
    """Train MODEL distributed (local gloo processes) and on one device; print the largest differences of
    the losses and of the trained parameters; exit 1 above the tolerance."""
    from fxshard.cli.report import verify_report

    from fxshard.compiler import load_plan_file
    from fxshard.driver import verify as verify_
    from fxshard.train.optim import OptimConfig

    try:
        layout = _layout(tp, pp, dp, zero, schedule, microbatches, virtual_stages, dtype, recompute, sp, ep, overlap)
        optim = OptimConfig(lr=lr, clip_grad_norm=clip_grad_norm, grad_accum=grad_accum)
        console.print(f"verifying {model} at {layout.describe()}: {steps} steps distributed and on one device")
        result = verify_(model, layout, steps, optim, load_plan_file(plan) if plan else None, seed, rtol,
                         param_rtol, out, compile=compile, cpu_matmul=cpu_matmul)
    except FxshardError as e:
        _fail(e)
    verify_report(console, result)
    if not result.ok:
        raise typer.Exit(1)


def _version(value: bool) -> None:
    if value:
        from fxshard.tools.environment import describe

        console.print(describe(), highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="print fxshard's and torch's versions and torch's backend, and exit")):
    """Compile unmodified PyTorch models into readable per-rank distributed training code."""
    from fxshard.tools.environment import untested_torch

    if note := untested_torch():
        err.print(f"note: {note}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
