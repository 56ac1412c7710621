"""``fxshard`` commands.  Arguments are parsed here; all logic lives in the library."""

from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fxshard.capture.folder_options import FolderOptions
from fxshard.cost.auto_options import AutoOptions
from fxshard.errors import FxshardError, FxshardWarning, OptionError
from fxshard.flags import build as _build_flags
from fxshard.flags import flags
from fxshard.ir.layout import Layout
from fxshard.step_shape import StepShape
from fxshard.train.optim import OptimConfig
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


def build(cls, values: dict):
    """The ``cls`` of parsed flags; a value its checks refuse (``--zero 4``) is an error line, not a traceback."""
    try:
        return _build_flags(cls, values)
    except FxshardError as e:
        _fail(e)


def _fail(e: Exception) -> None:
    from rich.markup import escape

    # escape: messages quote tracebacks and log lines whose [brackets] are not rich markup
    err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


# ---------------------------------------------------------------- options shared by compile, plan and verify
# The layout's flags are Layout's fields (fxshard/ir/layout.py), run's RunOptions' (fxshard/train/options.py): each
# command's options are generated from those declarations (_with_flags), never restated here.

ModelArg = Annotated[Path, typer.Argument(help="model file defining make_model() and make_inputs(), or a Hugging "
                                                "Face folder (config.json, *.safetensors) with --seq and --batch")]
DeviceMemory = Annotated[str | None, typer.Option("--device-memory",
                                                  help="memory of one device (80GiB, 80GB, 16GiB): say per rank "
                                                       "whether its predicted peak fits; --recompute auto chooses "
                                                       "by it")]
PlanFile = Annotated[Path | None, typer.Option("--plan", help="plan file defining PLAN = {fqn_glob: style}")]
SplitBefore = Annotated[list[str] | None, typer.Option("--split-before", help="cut the pipeline before this module "
                                                                              "(repeat, or comma-separate)")]
Seed = Annotated[int, typer.Option("--seed", help="seed for make_model() and make_inputs()")]
LAYOUT_FLAGS = flags(Layout)
AUTO_FLAGS = flags(AutoOptions)  # plan --auto, compile --auto, plan --hardware (fxshard/cost/auto_options.py)
FOLDER_FLAGS = flags(FolderOptions)  # MODEL a Hugging Face folder (fxshard/capture/folder_options.py)
# --seq and --batch, one declaration each (fxshard/step_shape.py): a folder's example batch, what --auto searches
# at, what plan evaluates at; verify takes them for a folder only, without --auto's old --global-batch
STEP_FLAGS = flags(StepShape)
VERIFY_STEP_FLAGS = [f for f in STEP_FLAGS if f.name != "global_batch"]
# what verify trains with: run's own flags for the steps, the optimizer, the timeout and --compile
VERIFY_RUN_FLAGS = [f for f in RunOptions.flags()
                    if f.name in ("steps", "timeout", "compile", "cpu_matmul", *(g.name for g in flags(OptimConfig)))]


def _option(flag) -> typer.models.OptionInfo:
    """The typer option of a declared flag (:class:`fxshard.flags.Flag`)."""
    return typer.Option(flag.default, flag.declaration, help=flag.help or None, hidden=flag.hidden)


def _with_flags(*declared: list):
    """Give ``command`` an option per flag of each list in ``declared``, after its first parameter (the model or the
    folder) and before its own options: typer reads the signature; the command receives them in ``**flags``."""

    def wrap(command):
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
        made = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_option(f), annotation=f.type)
                for group in declared for f in group]
        params = [own[0], *made, *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[1:])]
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def _user_plan(plan: Path | None, split_before: list[str] | None) -> dict | None:
    """The plan file's PLAN, with ``--split-before``'s cuts (repeated or comma-separated) as its split_before."""
    from fxshard.compiler import load_plan_file

    user_plan = load_plan_file(plan) if plan else None
    if split_before:
        cuts = [c.strip() for arg in split_before for c in arg.split(",") if c.strip()]
        user_plan = dict(user_plan or {}, split_before=cuts)
    return user_plan


@app.command()
@_with_flags(LAYOUT_FLAGS, AUTO_FLAGS, STEP_FLAGS, FOLDER_FLAGS)
def compile(
    model: ModelArg,
    split_before: SplitBefore = None,
    plan_file: PlanFile = None,
    out: Path = typer.Option(Path("out"), "--out", "-o", help="output folder"),
    seed: Seed = 0,
    weights: Path = typer.Option(None, "--weights",
                                 help="Hugging Face model folder (config.json + safetensors): capture on meta "
                                      "tensors, validate the folder, each rank reads only its slices at run time"),
    meta: bool = typer.Option(False, "--meta", help="capture on meta tensors and write no weights (code and "
                                                    "manifest only; implied by --weights)"),
    device_memory: DeviceMemory = None,
    ctx: typer.Context = None,
    **flags,
):
    """Compile MODEL for a layout into per-rank Python files, a manifest and weight shards.

    MODEL is a model file, or a Hugging Face folder: fxshard writes its model file (OUT/model.py: the config's
    AutoModelFor... and an example batch of --batch rows of --seq tokens) and each rank reads its slices of the
    folder's safetensors at run time, as `compile OUT/model.py --weights FOLDER` does."""
    from fxshard.cli.report import compile_report, folder_line

    from fxshard.capture.hf_folder import check_model_flags
    from fxshard.cost.costs import parse_size
    from fxshard.driver import compile as compile_
    from fxshard.driver import model_source

    auto, layout, folder = build(AutoOptions, flags), build(Layout, flags), build(FolderOptions, flags)
    try:
        shape = build(StepShape, flags)
        seq, batch = shape.seq, shape.batch
        check_model_flags(model, seq, batch, auto.auto, weights=weights)
        auto.check_compile()
        with model_source(model, folder, seq, batch, weights=not meta) as source:
            if auto.auto:  # search, print the ranking, then compile the first
                layout = _plan_auto(source, auto, layout, shape, _user_plan(plan_file, split_before), seed, False,
                                    str(out), _given(ctx, "dtype")).result.ranked[0].layout
            device = parse_size(device_memory) if device_memory is not None else None  # before the compile
            user_plan = _user_plan(plan_file, split_before)
            with console.status(f"compiling {model} ({layout.describe()})"):
                result = compile_(source.model_file, layout, out=out, plan=user_plan, seed=seed,
                                  weights=source.weights or weights, meta=meta, device_memory=device)
    except FxshardError as e:
        _fail(e)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM while writing (fxshard.codegen.folder.Interrupted)
        signal_name = e.args[0] if e.args else "SIGINT"
        if getattr(e, "swapped", False):  # it came during the swap, which was completed first
            _fail(f"compile interrupted by {signal_name} while the new program was being swapped in: {out} holds "
                  "the new program, complete (your files in it kept)")
        _fail(f"compile interrupted by {signal_name}: {out} was left as it was")
    compile_report(console, result)
    if source.folder is not None:
        folder_line(console, source, out)


@app.command()
@_with_flags(LAYOUT_FLAGS, AUTO_FLAGS, STEP_FLAGS, FOLDER_FLAGS)
def plan(
    model: ModelArg,
    split_before: SplitBefore = None,
    plan_file: PlanFile = None,
    device_memory: DeviceMemory = None,
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    seed: Seed = 0,
    data: Path = typer.Option(None, "--data",
                              help="a token file to check against the model (as `fxshard run --data`): its sequences, "
                                   "and with --pack the padding packing saves"),
    pack: bool = typer.Option(False, "--pack", help="with --data: pack whole documents (as `fxshard run --pack`)"),
    ctx: typer.Context = None,
    **flags,
):
    """Cost a layout without writing code: per rank memory (model state, bytes saved for backward, microbatches
    alive, predicted peak), communication per mesh axis (sympy expressions in B and S) and the pipeline bubble;
    with --hardware, the predicted step time. With --auto: search the layouts of --gpus devices and rank them.
    MODEL may be a Hugging Face folder (with --seq and --batch; its config.json alone is enough)."""
    from fxshard.driver import model_source

    auto, shape = build(AutoOptions, flags), build(StepShape, flags)
    seq, batch = shape.seq, shape.batch
    try:
        with model_source(model, build(FolderOptions, flags), seq, batch, weights=False) as source:
            if auto.auto:
                return _plan_auto(source, auto, build(Layout, flags), shape, _user_plan(plan_file, split_before),
                                  seed, as_json, dtype_given=_given(ctx, "dtype"))
            _plan(source.model_file, auto, flags, split_before, plan_file, batch, seq, device_memory, as_json, seed,
                  data, pack)
    except FxshardError as e:
        _fail(e)


def _plan(model, auto, flags, split_before, plan_file, batch, seq, device_memory, as_json, seed, data, pack):
    """``fxshard plan`` of a model file, without --auto."""
    import json

    from fxshard.cli.report import plan_report

    from fxshard.cost.costs import parse_size, plan_costs

    try:
        device = parse_size(device_memory) if device_memory is not None else None  # before the compile
        layout = build(Layout, flags)
        if auto.hardware is not None:
            from fxshard.cost.hardware import load_hardware

            load_hardware(auto.hardware)  # a bad profile refused before the compile
        report = plan_costs(model, layout, _user_plan(plan_file, split_before), seed, batch, seq, device)
        found = None
        if data is not None or pack:
            from fxshard.capture.modelfile import load_model_file
            from fxshard.train.data import DataOptions
            from fxshard.train.data.checks import check_model_data

            found = check_model_data(load_model_file(model), seed, DataOptions(data=data, pack=pack),
                                     say=err.print)
    except FxshardError as e:
        _fail(e)
    predicted = None
    if auto.hardware is not None:
        from fxshard.cost.auto import predict_layout
        from fxshard.cost.costs import B, S

        try:
            predicted = predict_layout(model, report.layout, auto.hardware, int(report.at[B]), int(report.at[S]),
                                       auto.gpus_per_node, _user_plan(plan_file, split_before), seed)
        except FxshardError as e:
            _fail(e)
    if as_json:
        extra = {"time": _prediction_json(predicted[0])} if predicted else {}
        print(json.dumps(report.to_json() | ({"data": found} if found else {}) | extra, indent=2, default=str))
    else:
        plan_report(console, report)
        if found:
            from fxshard.train.data.checks import describe

            console.print(describe(found), highlight=False)
        if predicted:
            from fxshard.cli.auto import time_lines

            time_lines(console, *predicted)


def _prediction_json(pred) -> dict:
    return {"layout": pred.layout.describe(), "step_s": pred.step, "compute_s": pred.compute,
            "exposed_communication_s": pred.exposed, "bubble_s": pred.bubble,
            "imbalance_s": pred.imbalance, "tokens_per_s_per_device":
            pred.tokens_per_s, "mfu": pred.mfu, "peak_bytes": pred.peaks, "device_memory": pred.memory,
            "fits": pred.fits, "terms_s": pred.terms, "microbatches": pred.microbatches, "rows": pred.rows,
            "accumulate": pred.accumulate}


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the command line set option ``name`` (rather than leaving its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def _plan_auto(source, auto: AutoOptions, layout: Layout, shape: StepShape, user_plan, seed, as_json: bool,
               out: str = "out/auto", dtype_given: bool = True):
    """``fxshard plan --auto`` of ``source`` (:class:`fxshard.capture.hf_folder.ModelSource`): search, print the best
    layouts and the command that compiles the first; without ``--dtype`` (``dtype_given`` False) in the dtype the
    hardware profile trains in."""
    import json

    from fxshard.cli.auto import auto_report

    from fxshard.cost.auto import compile_command, plan_auto

    model = source.argv()[0]
    try:
        with console.status(f"searching the layouts of {auto.gpus} devices for {model}"):
            found = plan_auto(source.model_file, layout.dtype if dtype_given else None, auto, shape.seq, layout,
                              user_plan, seed, batch=shape.batch)
    except FxshardError as e:
        _fail(e)
    found.model = model  # a folder by its own name, not the model file written for it
    command = compile_command(source.argv(), found.result.ranked[0], out)
    if as_json:
        r = found.result
        print(json.dumps({"gpus": r.gpus, "hardware": found.hardware.name, "dtype": found.dtype, "seq": r.setting.seq,
                          "global_batch": r.setting.global_batch, "gpus_per_node": r.setting.gpus_per_node,
                          "considered": r.considered, "fitting": r.fitting, "search_s": r.seconds,
                          "capture_s": found.capture_seconds, "command": command,
                          "ranked": [_prediction_json(p) for p in r.ranked]}, indent=2, default=str))
    else:
        auto_report(console, found, command)
    return found


@app.command()
def show(
    out: Path = typer.Argument(..., help="compiled output folder"),
    rank: int = typer.Option(None, "--rank", help="global rank whose code to print"),
):
    """Print the layout summary, or one rank's generated code (highlighted). Runs no code of OUT."""
    from fxshard.cli.report import show_layout, show_rank

    try:
        if rank is None:
            show_layout(console, out)
        else:
            show_rank(console, out, rank)
    except FxshardError as e:
        _fail(e)


@app.command()
def calibrate(
    out: Path = typer.Option(..., "--out", "-o", help="the hardware profile to write (JSON; pass it to --hardware)"),
    procs: int = typer.Option(4, "--procs", help="local processes to measure with (ignored under torchrun)"),
    quick: bool = typer.Option(False, "--quick", help="fewer and smaller measurements (seconds, noisier)"),
    model: Path = typer.Option(None, "--model", help="a model file: time its forward and backward on every rank "
                                                     "to set compute_scale (the step's op mix over the roofline)"),
):
    """Measure this machine (matmul FLOP/s per dtype, memory bandwidth, collective bandwidth and latency per group
    size, within a node and, under torchrun, across nodes) and write a hardware profile."""
    from fxshard.cost.calibrate import calibrate as calibrate_

    try:
        with console.status(f"measuring with {procs} processes"):
            profile = calibrate_(out, procs, quick, model)
    except FxshardError as e:
        _fail(e)
    if profile:
        console.print(f"wrote {out}: {profile['name']}", highlight=False)


ALLOW_EDITED = next(f for f in RunOptions.flags() if f.name == "allow_edited")


@app.command()
def check(out: Path = typer.Argument(..., help="compiled output folder"),
          allow_edited: bool = _option(ALLOW_EDITED)):
    """Re-run the static checks on OUT's files: layout, headers, weights, and that every rank of each process
    group issues the same collectives (run on meta tensors) and every pipeline send has its receive; refuse
    files edited after compile. The checks import and run the rank files: check only folders you trust."""
    from fxshard.cli.report import check_report

    from fxshard.check.check import check_output

    try:
        with console.status(f"checking {out}"):
            report = check_output(out, allow_edited)
    except FxshardError as e:
        _fail(e)
    check_report(console, out, report)


@app.command()
@_with_flags(RunOptions.flags())
def run(out: Path = typer.Argument(..., help="compiled output folder"), **flags):
    """Train: launch every rank locally, or run as one rank when started by torchrun.

    Refused before launch (with or without --check): a rank file or model.py edited after compile (its
    sha256 differs from manifest.json's; --allow-edited overrides) and manifest paths outside OUT. A compiled
    folder is Python code that runs on every rank: run only folders you trust."""
    from fxshard.codegen.manifest import read_manifest, refuse_edited
    from fxshard.train.launch import run_rank
    from fxshard.train.local import launch_local
    from fxshard.train.options import check_run_options, under_torchrun

    def checked() -> RunOptions:
        options = RunOptions.from_flags(flags)
        options.checkpoint_config()  # flags that need each other: said before anything reads OUT
        if not options.allow_edited:  # first: the option checks import model.py (make_dataset, make_batches)
            refuse_edited(out, read_manifest(out))
        check_run_options(out, options)
        return options

    try:
        if under_torchrun():
            from fxshard.cli.report import memory_table

            from fxshard.runtime.guard import recorded

            with recorded():  # the launcher's summary then names this rank's error, its checks' refusals too
                options = checked()
                run_rank(out, options,
                         memory_report=(lambda rows: memory_table(console, rows)) if options.memory_report else None)
            from fxshard.train.supervise import exit_finished

            exit_finished()  # trained, written and torn down: no interpreter teardown to abort in
        options = checked()
        manifest = read_manifest(out)
        world = manifest.layout.world_size
        if options.check:
            from fxshard.check.check import check_output

            with console.status(f"checking {out}"):
                report = check_output(out, options.allow_edited)
            console.print(f"static checks: OK ({report.ranks} rank files agree on every collective and send)")
        console.print(f"launching {world} processes for {out} ({manifest.layout.describe()})")
        launch_local(out, options.argv(out), world)
    except FxshardError as e:
        _fail(e)


data_app = typer.Typer(no_args_is_help=True, help="Training data: token files for `fxshard run --data`, and a "
                                                  "generated corpus to try them on (text from a trained model is "
                                                  "`fxshard generate`, not `data generate`).")
app.add_typer(data_app, name="data")


@data_app.command("tokenize")
def data_tokenize(
    corpus: Path = typer.Argument(..., help="a .txt (documents between blank lines), .jsonl or .parquet file, or a "
                                            "folder of them"),
    tokenizer: Path = typer.Option(..., "--tokenizer", help="a local Hugging Face tokenizer folder "
                                                            "(tokenizer.json)"),
    out: Path = typer.Option(..., "--out", help="the token file to write, PATH.bin (PATH.idx and PATH.json beside "
                                                "it)"),
    validation: float = typer.Option(0.005, "--validation", help="the fraction of the documents (the last ones) "
                                                                 "held out as the validation split"),
    text_field: str = typer.Option("text", "--text-field", help="the field (.jsonl) or column (.parquet) of the "
                                                                "text"),
    eos: str = typer.Option(None, "--eos", help="the end-of-document token (default: tokenizer_config.json's "
                                                "eos_token)"),
    format: str = typer.Option(
        "text", "--format", help="text (documents), chat (rows of messages, rendered with the tokenizer's "
                                 "chat template, with a loss mask) or prompt-completion (rows of prompt and "
                                 "completion)"),
    train_on: str = typer.Option(
        "assistant", "--train-on", help="chat and prompt-completion: the tokens trained: assistant (every "
                                        "assistant turn; the completion), last-assistant, or all"),
    seq: int = typer.Option(
        None, "--seq", help="chat and prompt-completion: the longest conversation, in tokens (the sequence "
                            "you compile); longer ones as --truncate says"),
    truncate: str = typer.Option(
        "refuse", "--truncate", help="a conversation longer than --seq: refuse (name its row), right (keep "
                                     "its first tokens) or drop it"),
    chat_template: Path = typer.Option(
        None, "--chat-template", help="chat: a Jinja chat template file to render with instead of the "
                                      "tokenizer's own"),
):
    """Tokenize a corpus into a token file for `fxshard run --data`: text (ids back to back, EOS after each
    document, Megatron's .idx and a .json sidecar), or chat and prompt-completion rows (.jsonl, .parquet or a
    datasets folder) with a loss mask beside the ids (PATH.mask: which tokens are trained)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from fxshard.train.data.tokenize import tokenize as tokenize_

    try:
        if not 0 <= validation < 1:
            from fxshard.errors import OptionError

            raise OptionError(f"--validation {validation}: expected a fraction in [0, 1), e.g. 0.005")
        if format != "text":
            return _tokenize_chat(corpus, tokenizer, out, validation, format, train_on, seq, truncate,
                                  chat_template)
        if seq is not None or chat_template is not None or train_on != "assistant" or truncate != "refuse":
            from fxshard.errors import OptionError

            raise OptionError("--seq, --truncate, --train-on and --chat-template go with --format chat or "
                              "prompt-completion; a text corpus is one stream of documents")
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TimeRemainingColumn(), console=err, transient=True) as bar:
            task = bar.add_task(f"tokenizing {corpus}", total=None)
            done = tokenize_(corpus, tokenizer, out, validation, text_field, eos,
                             progress=lambda n, total: bar.update(task, completed=n, total=total))
    except FxshardError as e:
        _fail(e)
    console.print(f"wrote {done.path}: {done.tokens:,} tokens ({done.dtype}) in {done.documents:,} documents, "
                  f"the last {done.validation_documents:,} the validation split; eos id {done.eos}, vocabulary "
                  f"{done.vocab_size:,}")


def _tokenize_chat(corpus, tokenizer, out, validation, fmt, train_on, seq, truncate, chat_template):
    from fxshard.train.data.chat_tokenize import tokenize_chat

    what = f"rendering and tokenizing {corpus}"
    with console.status(what) as status:
        done = tokenize_chat(corpus, tokenizer, out, fmt=fmt, train_on=train_on, seq=seq, truncate=truncate,
                             validation=validation, chat_template=chat_template,
                             progress=lambda rows: status.update(f"{what}: {rows:,} rows"))
    cut = f"; {done.truncated:,} truncated and {done.dropped:,} dropped at --seq {seq}" if seq else ""
    console.print(f"wrote {done.path} and its loss mask {done.path.with_suffix('.mask').name}: "
                  f"{done.tokens:,} tokens ({done.dtype}) in {done.conversations:,} conversations (the "
                  f"longest {done.longest:,}), "
                  f"{done.trained_tokens:,} trained ({done.trained_tokens / done.tokens:.1%}; masked by "
                  f"{done.method}){cut}; the last {done.validation_documents:,} the validation split")


@data_app.command("generate")
def data_generate(
    out: Path = typer.Argument(..., help="folder to write: OUT/corpus/*.jsonl and the tokenizer OUT/tokenizer"),
    documents: int = typer.Option(20_000, "--documents", help="documents to generate"),
    files: int = typer.Option(1, "--files", help=".jsonl files to spread them over"),
    vocab: int = typer.Option(None, "--vocab", help="ids of the BPE tokenizer trained on the corpus (EOS "
                                                    "among them; default 256, with --chat 512)"),
    chat: bool = typer.Option(False, "--chat", help="conversations ({\"messages\": [...]} rows) and a "
                                                    "byte-level tokenizer whose tokenizer_config.json holds "
                                                    "a chat template: for `data tokenize --format chat`"),
    seed: Seed = 0,
):
    """Write a generated corpus (a Markov chain over made-up words, documents of 1 to 40 sentences) and a BPE
    tokenizer trained on it: data to try `fxshard data tokenize` and `fxshard run --data` with, no download.
    With --chat, conversations (a user asks for a phrase backwards) and a tokenizer with Qwen2's chat
    template. (Text from a trained model is `fxshard generate CKPT`.)"""
    from fxshard.train.data.synthetic import generate

    vocab = vocab if vocab is not None else 512 if chat else 256
    try:
        if documents < 1 or files < 1 or vocab < 2:
            from fxshard.errors import OptionError

            raise OptionError(f"--documents {documents} --files {files} --vocab {vocab}: expected at least 1 document "
                              "and 1 file, and a vocabulary of 2 ids or more")
        if chat:
            from fxshard.train.data.synthetic_chat import train_chat_tokenizer, write_chat_corpus

            with console.status(f"generating {documents:,} conversations"):
                write_chat_corpus(out / "corpus", documents, seed)
                train_chat_tokenizer(out / "corpus", out / "tokenizer", vocab)
            console.print(f"wrote {out / 'corpus'} ({documents:,} conversations) and the tokenizer "
                          f"{out / 'tokenizer'} (with a chat template)")
            return
        with console.status(f"generating {documents:,} documents"):
            generate(out, documents, files, vocab, seed)
    except FxshardError as e:
        _fail(e)
    console.print(f"wrote {out / 'corpus'} ({documents:,} documents) and the tokenizer {out / 'tokenizer'}")


@app.command()
def report(
    out: Path = typer.Argument(..., help="compiled output folder"),
    device_memory: DeviceMemory = None,
    metrics: Path = typer.Option(None, "--metrics", help="the run's --metrics file (default: the one the last "
                                                          "`fxshard run` of OUT wrote, from OUT/run.json)"),
    trace: Path = typer.Option(None, "--trace", help="the run's --trace folder (default: from OUT/run.json)"),
    to: Path = typer.Option(None, "--to", help="write the page here (default OUT/report.html)"),
    model: Path = typer.Option(None, "--model", help="your copy of the model file OUT was compiled from (same "
                                                      "sha256): draw each rank's memory by the plan, which imports it"),
):
    """Write OUT/report.html: one self-contained page of the mesh (what each rank holds; with --model, its memory
    by the plan), the model as compiled (placements, collectives, the rank files), the pipeline schedule (planned,
    and measured when the run was traced) and the last run (loss, step time, tokens/s, memory).

    The report runs no code of OUT (its model.py and rank files are read as text): a folder from someone else can
    be looked at safely. It imports only the --model file you name."""
    from fxshard.cost.costs import parse_size
    from fxshard.report.render import write_report

    try:
        device = parse_size(device_memory) if device_memory is not None else None
        from fxshard.errors import OptionError

        for flag, path in (("--metrics", metrics), ("--trace", trace)):
            if path is not None and not path.exists():
                raise OptionError(f"{flag} {path}: no such file or folder")
        if to is not None and (to.is_dir() or not to.parent.is_dir()):
            found = "a folder" if to.is_dir() else f"no folder {to.parent}"
            raise OptionError(f"--to {to}: expected a file path in an existing folder; found {found}; give e.g. "
                              "--to report.html")
        with console.status(f"reporting {out}"):
            path, warnings = write_report(out, device, metrics, trace, to, model)
    except FxshardError as e:
        _fail(e)
    for w in warnings:
        err.print(f"warning: {w}")
    console.print(f"wrote {path}: open it in a browser (one file, nothing fetched)")


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="checkpoint folder (DIR, following DIR/latest, or DIR/step-<N>)"),
    hf: Path = typer.Option(None, "--hf", help="write a Hugging Face model folder here"),
    merge: bool = typer.Option(False, "--merge", help="with --hf, of a LoRA checkpoint: the merged model (each "
                                                      "adapted weight W + scaling * B @ A)"),
    peft: Path = typer.Option(None, "--peft", help="of a LoRA checkpoint: write its adapters here as peft saves "
                                                   "them (adapter_model.safetensors, adapter_config.json)"),
    model: Path = typer.Option(None, "--model", help="model file (default: the copy saved in the checkpoint)"),
):
    """Export a checkpoint's trained weights (of any layout) as a Hugging Face folder that
    transformers' from_pretrained loads (--hf), or a LoRA checkpoint's adapters as a peft adapter folder (--peft).
    DIR is new, empty, or an earlier export (its fxshard-export.json lists what it wrote): written beside it and
    swapped in, a file of yours in it kept."""
    from fxshard.train.export import export_hf, export_peft

    if (hf is None) == (peft is None) or (merge and hf is None):
        _fail(OptionError("fxshard export: expected one of --hf DIR (a whole model; --merge for a LoRA checkpoint) "
                          "or --peft DIR (a LoRA checkpoint's adapters); found "
                          + ("both" if hf is not None and peft is not None else "--merge without --hf"
                             if merge and peft is None and hf is None else "--merge with --peft" if merge
                             else "neither")))
    target = hf if hf is not None else peft
    try:
        path = export_hf(checkpoint, hf, model, merge) if hf is not None else export_peft(checkpoint, peft, model)
    except FxshardError as e:
        _fail(e)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM while writing (fxshard.codegen.folder.Interrupted)
        signal_name = e.args[0] if e.args else "SIGINT"
        _fail(f"export interrupted by {signal_name}: " + (f"{target} holds the new export, complete" if getattr(
            e, "swapped", False) else f"{target} was left as it was"))
    console.print(f"exported {path} to {target}")


@app.command()
def generate(
    checkpoint: Path = typer.Argument(..., help="checkpoint folder (DIR, following DIR/latest, or DIR/step-<N>)"),
    prompt: str = typer.Option(..., "--prompt", help="the text to continue (with --chat: the user's message)"),
    chat: bool = typer.Option(False, "--chat", help="render the prompt as a user turn with the tokenizer's chat "
                                                    "template, and decode the assistant's answer"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy (the most likely token); above 0: sample "
                                                                 "at this temperature"),
    top_p: float = typer.Option(1.0, "--top-p", help="with --temperature: sample from the most likely tokens whose "
                                                     "probability adds up to P"),
    seed: Seed = 0,
    tokenizer: Path = typer.Option(None, "--tokenizer", help="tokenizer folder (default: the one the model file "
                                                             "names, TOKENIZER; compile FOLDER names the folder's)"),
    model: Path = typer.Option(None, "--model", help="model file (default: the copy saved in the checkpoint)"),
):
    """Decode text from a trained checkpoint (any layout), on one process, with transformers' generate: a quick
    look at what training taught, not a serving engine (export for that). Not `fxshard data generate`, which writes
    a corpus to train on. Runs the checkpoint's model file: generate only from checkpoints you trust."""

    from fxshard.train.generate import Sampling
    from fxshard.train.generate import generate as generate_

    try:
        sampling = Sampling(max_new_tokens, temperature, top_p, seed)
        sampling.check()  # before the model is built
        with console.status(f"generating from {checkpoint}"):
            done = generate_(checkpoint, prompt, chat=chat, sampling=sampling, tokenizer=tokenizer, model_file=model)
    except FxshardError as e:
        _fail(e)
    console.print(done.text, highlight=False, markup=False, soft_wrap=True)


@app.command()
@_with_flags(LAYOUT_FLAGS, VERIFY_RUN_FLAGS, VERIFY_STEP_FLAGS, FOLDER_FLAGS)
def verify(
    model: ModelArg,
    split_before: SplitBefore = None,
    plan_file: PlanFile = None,
    rtol: float = typer.Option(None, "--rtol", help="losses: relative tolerance (default 1e-5; 2e-2 under bf16)"),
    param_rtol: float = typer.Option(None, "--param-rtol",
                                     help="parameters: tolerance of ‖distributed − single device‖ / ‖single device "
                                          "update‖ over all parameters (default 1e-3; 0.25 under bf16)"),
    seed: Seed = 0,
    out: Path = typer.Option(None, "--out", help="keep the compiled program and the trained tensors here"),
    fp64: bool = typer.Option(False, "--fp64", help="both sides in float64 (the model and its floating inputs "
                              "converted): for a model whose training amplifies fp32 rounding past the tolerance "
                              "(default tolerances 1e-9 and 1e-6)"),
    **flags,
):
    """Train MODEL distributed (local gloo processes, as `fxshard run`) and on one device; print the largest
    differences of the losses and of the trained parameters; exit 1 above the tolerance. MODEL may be a Hugging
    Face folder (with --seq and --batch): both sides start from its weights."""
    from fxshard.cli.report import verify_report

    from fxshard.capture.hf_folder import check_model_flags
    from fxshard.check.verify import check_verify_options
    from fxshard.driver import model_source
    from fxshard.driver import verify as verify_

    try:
        layout = build(Layout, flags)
        run = RunOptions.from_flags({f.name: f.default for f in RunOptions.flags()} | flags)
        check_verify_options(run.steps, rtol, param_rtol)  # before the line that says it starts
        shape = build(StepShape, flags | {"global_batch": None})  # verify takes no --global-batch
        seq, batch = shape.seq, shape.batch
        check_model_flags(model, seq, batch, auto=False)
        with model_source(model, build(FolderOptions, flags), seq, batch) as source:
            console.print(f"verifying {model} at {layout.describe()}{' in float64' if fp64 else ''}: {run.steps} "
                          "steps distributed and on one device")
            result = verify_(source.model_file, layout, run.steps, run.optim, _user_plan(plan_file, split_before), seed,
                             rtol, param_rtol, out, timeout_s=run.timeout, compile=run.compile,
                             cpu_matmul=run.cpu_matmul, weights=source.weights, fp64=fp64)
    except FxshardError as e:
        _fail(e)
    verify_report(console, result)
    if not result.ok:
        raise typer.Exit(1)


def _version(value: bool) -> None:
    if value:
        from fxshard.environment import describe

        console.print(describe(), highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="print fxshard's and torch's versions and torch's backend, and exit")):
    """Compile unmodified PyTorch models into readable per-rank distributed training code."""
    from fxshard.environment import untested_torch

    if note := untested_torch():
        err.print(f"note: {note}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
