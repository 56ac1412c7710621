"""``fxshard run``'s options, each declared once: a field here (the optimizer's in :class:`OptimConfig`), made a
command-line option by :mod:`fxshard.flags`.

The command line is made from these fields (option ``--field-name``, the field's default and help), and
the launcher hands the same options to every rank it starts as that command line again::

    options = RunOptions(steps=5, optim=OptimConfig(lr=3e-4), metrics=Path("m.jsonl"))
    options.argv("out/gpt")   # ['run', 'out/gpt', '--steps', '5', '--lr', '0.0003', ..., '--metrics', 'm.jsonl']

Options that could only fail later are refused before any process starts (:func:`check_run_options`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from fxshard.flags import Flag, build, flags, option, values
from fxshard.train.data.options import DataOptions
from fxshard.train.optim import OptimConfig


@dataclass(frozen=True)
class RunOptions:
    steps: int = option(3, "training steps")
    optim: OptimConfig = OptimConfig()  # --lr, --beta1, --beta2, --eps, --weight-decay, --clip-grad-norm, ...
    data: DataOptions = DataOptions()  # --data, --eval-data, --pack, --data-workers, --shuffle, --data-seed
    metrics: Path | None = option(None, "write one JSON line per step")
    tensorboard: Path | None = option(None, "write what --metrics records (loss, eval loss, learning rate, tokens/s, "
                                            "gradient norm) as TensorBoard scalars into DIR, from rank 0 (needs the "
                                            "tensorboard extra)")
    timeout: float = option(300.0, "seconds before a collective that did not complete fails")
    compile: bool = option(False, "run each rank's generated forward (and so its backward) through torch.compile "
                                  "(inductor), collectives as functional collectives; the first step compiles")
    cpu_matmul: str = option("auto", "with --compile on CPU: the kernel of the static fp32 matrix products of 4M "
                                     "multiply-adds and more: onednn (twice MKL's speed on AMD CPUs with AVX-512, "
                                     "where MKL takes its AVX2 path; slower than MKL on AVX2-only CPUs), torch "
                                     "(torch's MKL, as eager runs), or auto: onednn on AMD with AVX-512, else torch")
    trace: Path | None = option(None, "write per-rank Chrome trace JSON of every pipeline action and collective to "
                                      "DIR (rank<R>.json, joined in trace.json: open it in ui.perfetto.dev, or read it "
                                      "with `fxshard report`)")
    memory_report: bool = option(False, "after training, print each rank's bytes of parameters, gradients and "
                                        "optimizer state next to the ZeRO formula")
    final_state: Path | None = option(None, "write each rank's trained tensors to DIR/rank<R>.safetensors",
                                      hidden=True)
    checkpoint: Path | None = option(None, "checkpoint folder: saves go to DIR/step-<N>, DIR/latest names the "
                                           "newest")
    save_every: int = option(0, "save a checkpoint every K steps (with --checkpoint)")
    resume: bool = option(False, "continue from DIR/latest (saved under any layout); --steps counts from step 0")
    overwrite: bool = option(False, "start a new run in a --checkpoint folder that holds an earlier run's "
                                    "checkpoints: its steps are deleted when this run saves its first one")
    keep_last: int = option(0, "keep only the newest N complete checkpoints (never the one DIR/latest names); "
                               "0: keep all")
    allow_changed_model: bool = option(False, "--resume a checkpoint saved from another model file (its digest "
                                              "differs from the compiled one's) whose parameters fit this model")
    allow_data_change: bool = option(False, "--resume with other data than the checkpoint trained on (another or a "
                                            "changed token file, --data-seed, --shuffle, --pack): continue at its "
                                            "saved position with the data given")
    on_nonfinite: str = option("stop", "a non-finite loss or gradient norm (checked on every rank before the "
                                       "optimizer step): stop the run, or skip the step (no update, the schedule "
                                       "waits)")
    check: bool = option(True, "before launching locally, run `fxshard check`'s static checks: rank files from "
                               "different compiles, or whose collectives or sends do not match, are refused "
                               "instead of hanging", launcher=True)
    allow_edited: bool = option(False, "accept rank files and model.py whose sha256 differs from the one "
                                       "manifest.json recorded at compile (files edited by hand)")
    eval_every: int = option(0, "every N steps, evaluate the model on --eval-batches batches of the validation split "
                                "(no gradients; printed and recorded as eval_loss in --metrics); 0: never")
    eval_batches: int = option(4, "validation batches per evaluation (the same first batches each time)")

    @classmethod
    def flags(cls) -> list[Flag]:
        """Every option, in order, the optimizer's fields where ``optim`` is."""
        return flags(cls)

    @classmethod
    def from_flags(cls, values: dict) -> RunOptions:
        """The options of parsed flags, by field name as :meth:`flags` lists them."""
        return build(cls, values)

    def argv(self, out: str | Path) -> list[str]:
        """The ``fxshard run`` arguments of every rank the launcher starts: these options, but the launcher's own."""
        given = values(self)
        return ["run", str(out)] + [a for f in self.flags() if not f.launcher for a in f.argv(given[f.name])]

    def checkpoint_config(self):
        """``--checkpoint DIR [--save-every K] [--resume]`` as a CheckpointConfig, or None without a folder."""
        from fxshard.train.checkpoint import CheckpointConfig, CheckpointError

        if self.checkpoint is None:
            given = [flag for flag, value in (("--save-every", self.save_every), ("--resume", self.resume),
                                              ("--overwrite", self.overwrite), ("--keep-last", self.keep_last))
                     if value]
            if given:
                raise CheckpointError(f"{' and '.join(given)} need{'s' * (len(given) == 1)} --checkpoint DIR")
            return None
        if self.save_every < 0:
            raise CheckpointError(f"--save-every {self.save_every}: expected a positive number of steps")
        if self.keep_last < 0:
            raise CheckpointError(f"--keep-last {self.keep_last}: expected a number of checkpoints >= 1 (0: keep all)")
        if self.resume and self.overwrite:
            raise CheckpointError("--resume and --overwrite: --resume continues the checkpoints in the folder, "
                                  "--overwrite replaces them; pass one")
        return CheckpointConfig(self.checkpoint, self.save_every, self.resume, self.overwrite, self.keep_last,
                                self.allow_changed_model)


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (or fxshard run's launcher): RANK and WORLD_SIZE are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def options_with(options: RunOptions, changes: dict) -> RunOptions:
    """``options`` with ``changes`` (field names of :meth:`RunOptions.flags`, the optimizer's among them) replaced.

    >>> options_with(RunOptions(), {"lr": 3e-4, "steps": 10}).optim.lr
    0.0003
    """
    from fxshard.errors import OptionError

    given = values(options)
    unknown = sorted(set(changes) - set(given))
    if unknown:
        raise OptionError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the options are "
                          f"fxshard run's, by field name: {', '.join(given)}")
    return RunOptions.from_flags(given | changes) if changes else options


def check_run_options(out: Path, options: RunOptions, say=print):
    """Refuse run options that could only fail later, before any process starts (the optimizer's own are
    checked by :class:`~fxshard.train.optim.OptimConfig`); return the checkpoint configuration.  The launcher
    also tries the files it will write: a --metrics file and a --checkpoint folder that cannot be written are
    named here, not by rank 0's traceback after launch."""
    from fxshard.errors import OptionError

    checkpoint = options.checkpoint_config()
    from fxshard.codegen.manifest import read_manifest
    from fxshard.train.modules import check_accumulated_loss
    from fxshard.train.schedule import check_schedule

    if options.optim.grad_accum > 1:  # also refused on each rank (torchrun); here before any process starts
        check_accumulated_loss(out, read_manifest(out), options.optim.grad_accum)
    if options.steps < 1:
        raise OptionError(f"--steps {options.steps}: expected at least 1 step (steps count from the start, resumed "
                          "or not)")
    check_schedule(options.optim, options.steps)
    if options.eval_every < 0 or options.eval_batches < 1:
        flag, value = ("--eval-every", options.eval_every) if options.eval_every < 0 else \
            ("--eval-batches", options.eval_batches)
        raise OptionError(f"{flag} {value}: expected " + ("a number of steps >= 0 (0: no evaluation)"
                                                           if flag == "--eval-every" else "at least 1 batch"))
    timeout, metrics, final_state = options.timeout, options.metrics, options.final_state
    check_timeout(timeout)
    from fxshard.codegen.folder import OUT_OWNER
    from fxshard.files import check_replaceable
    from fxshard.train.record import RUN_RECORD, RUN_RECORD_WHAT

    check_replaceable(Path(out) / RUN_RECORD, RUN_RECORD_WHAT, owner=OUT_OWNER)  # rank 0 writes it at the end
    if metrics is not None:
        _check_metrics(out, metrics)
    if options.tensorboard is not None:
        from fxshard.train.board import check_tensorboard

        check_tensorboard(options.tensorboard)
    check_cpu_matmul(options.cpu_matmul)
    if options.on_nonfinite not in NONFINITE:
        raise OptionError(f"--on-nonfinite {options.on_nonfinite}: expected one of {', '.join(NONFINITE)}")
    if options.compile:
        check_compile(out)
        if options.memory_report:
            _check_compiled_memory_report(out)
    if options.trace is not None:
        _check_trace(options.trace, read_manifest(out).layout.world_size)
    if final_state is not None and final_state.exists() and not final_state.is_dir():
        raise OptionError(f"--final-state {final_state}: is a file; --final-state names a folder")
    if final_state is not None:
        from fxshard.files import make_folder

        make_folder(final_state, "the --final-state folder")
        for rank in range(read_manifest(out).layout.world_size):  # each rank writes its own: never through a link
            check_replaceable(final_state / f"rank{rank}.safetensors", "a rank's trained tensors")
    _check_data(out, options, say)
    if checkpoint is not None:
        try:
            _check_checkpoint_option(out, options, checkpoint, say)
        except OSError as e:
            raise OptionError(f"--checkpoint {checkpoint.folder}: cannot be written ({e.strerror}); choose a "
                              "folder you can write to") from None
    return checkpoint


NONFINITE = ("stop", "skip")  # --on-nonfinite
METRICS = "the run's metrics"  # what fxshard.files records a --metrics file as
MAX_TIMEOUT = 365 * 24 * 3600  # a year: torch's stores and gloo take deadlines this far (1e10 s fails to connect)


def check_timeout(timeout: float) -> None:
    """``--timeout`` seconds: positive, finite, and no more than torch's process groups accept."""
    from fxshard.errors import OptionError

    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
        raise OptionError(f"--timeout {timeout}: expected a positive number of seconds up to {MAX_TIMEOUT} (a year), "
                          "e.g. --timeout 300")


def _check_data(out: Path, options: RunOptions, say) -> None:
    """The training data (and the validation split, when the run evaluates) fits the compiled program: refused here,
    before any rank starts, with the file and the fix (:mod:`fxshard.train.data.checks`)."""
    from fxshard.train.data.checks import check_data, describe
    from fxshard.train.supervise import LAUNCHER_PID

    if under_torchrun() and LAUNCHER_PID in os.environ:
        return  # a rank of the local launcher, which checked before starting it
    quiet = under_torchrun() and os.environ["RANK"] != "0"  # under torchrun every rank checks, rank 0 says so
    splits = ("train", "validation") if getattr(options, "eval_every", 0) else ("train",)
    found = check_data(out, options.data, (lambda *_: None) if quiet else say, splits)
    if not quiet and any(s["kind"] in ("tokens", "dataset", "stream") for s in found.values()):
        say(describe(found))


def _check_compiled_memory_report(out: Path) -> None:
    """``--memory-report`` counts what selective recompute keeps as torch's checkpoint keeps it, eagerly; a compiled
    backward keeps it inside the graph, where nothing is told: the report would show those bytes as none."""
    from fxshard.codegen.manifest import read_manifest
    from fxshard.errors import OptionError

    if read_manifest(out).layout.recompute == "selective":
        raise OptionError(f"--memory-report with --compile: {out} was compiled with --recompute selective, whose kept "
                          "activations the compiled backward holds where the report cannot count them; drop "
                          "--compile to measure the eager run, which keeps the same activations")


def check_cpu_matmul(cpu_matmul: str) -> None:
    """Refuse a ``--cpu-matmul`` kernel that :mod:`fxshard.runtime.matmul` does not know."""
    from fxshard.errors import OptionError
    from fxshard.runtime.matmul import CPU_MATMULS

    if cpu_matmul not in CPU_MATMULS:
        raise OptionError(f"--cpu-matmul {cpu_matmul}: expected one of {', '.join(CPU_MATMULS)}")


def check_compile(out: Path) -> None:
    """Refuse ``--compile`` where a compiled run could not be the eager one, or would recompile every step."""
    from fxshard.codegen.manifest import read_manifest
    from fxshard.errors import OptionError
    from fxshard.train.modules import compiled_regionally

    layout = read_manifest(out).layout
    why = []
    if layout.recompute == "selective" and compiled_regionally(layout):
        failing = " (with --ep torch fails 'Expected out tensor to have device meta')" if layout.ep > 1 else ""
        why.append(f"--recompute selective with {'ZeRO 3' if layout.ep == 1 else f'--ep {layout.ep}'} (each block "
                   "is compiled on its own and torch's checkpoint runs eagerly around it, where its selective policy, "
                   "a dispatch mode, sees only the kernels the compiled code calls out to, not the ops the policy "
                   f"names{failing}; use --recompute full)")
    if layout.pp > 1 and layout.schedule == "zero-bubble":
        why.append("--schedule zero-bubble (its split backward walks the autograd graph inside each stage, which a "
                   "compiled stage holds as one node: torch fails 'stage backward input'; use 1f1b or "
                   "interleaved-1f1b)")
    texts = [f.read_text() for f in Path(out).glob("rank_*.py")]
    if any("rt.dropout(" in t for t in texts):
        why.append("dropout (its masks are keyed by the batch number, which would recompile every step)")
    if any("rt.draw(" in t for t in texts):
        why.append("random draws (rt.draw: their values are keyed by the batch number, which would recompile every "
                   "step)")
    if why:
        raise OptionError(f"--compile: {out} was compiled with {'; '.join(why)}; run it without --compile, or "
                          "compile the model without that setting")


def _check_metrics(out: Path, metrics: Path) -> None:
    from fxshard.errors import OptionError

    try:
        if metrics.is_dir():
            raise OptionError(f"--metrics {metrics}: is a folder; name a file, e.g. {metrics / 'metrics.jsonl'}")
        if not metrics.parent.is_dir():
            raise OptionError(f"--metrics {metrics}: the folder {metrics.parent} does not exist; create it first")
        from fxshard.files import try_writing

        _refuse_generated(out, metrics)
        if not under_torchrun() or os.environ["RANK"] == "0":  # the launcher, and the rank that writes it
            try_writing(metrics, METRICS)  # never through a link, never a file fxshard did not write
    except OSError as e:
        raise OptionError(f"--metrics {metrics}: cannot be written ({e.strerror}); choose a file you can "
                          "write to") from None


def _check_trace(trace: Path, world: int) -> None:
    """--trace DIR: a folder that exists or can be made, and can be written (every rank writes a file into it)."""
    from fxshard.errors import OptionError

    try:
        if trace.exists() and not trace.is_dir():
            raise OptionError(f"--trace {trace}: is a file; --trace names a folder, e.g. {trace}-trace")
        if not trace.exists() and not trace.parent.is_dir():
            raise OptionError(f"--trace {trace}: the folder {trace.parent} does not exist; create it first")
        from fxshard.files import make_folder, try_writing
        from fxshard.runtime.trace import MERGED, MERGED_WHAT, RANK_WHAT

        make_folder(trace, "the --trace folder")
        for rank in range(world):  # the files the ranks and the join will write: refused now, not after training
            try_writing(trace / f"rank{rank}.json", RANK_WHAT)
        try_writing(trace / MERGED, MERGED_WHAT)
    except OSError as e:
        raise OptionError(f"--trace {trace}: cannot be written ({e.strerror}); choose a folder you can write "
                          "to") from None


def _refuse_generated(out: Path, metrics: Path) -> None:
    """--metrics naming one of the files the compile wrote (model.py, manifest.json, a rank file or shard) would
    overwrite the program being run."""
    from fxshard.codegen.manifest import MANIFEST, listed_files
    from fxshard.errors import OptionError

    for name in sorted(listed_files(Path(out) / MANIFEST) or ()):
        if (Path(out) / name).resolve() == metrics.resolve():
            raise OptionError(f"--metrics {metrics}: is {name} of the compiled folder {out}, which the metrics would "
                              f"overwrite; name another file, e.g. {Path(out) / 'metrics.jsonl'}")


def _check_checkpoint_option(out: Path, options: RunOptions, checkpoint, say) -> None:
    from fxshard.errors import OptionError
    from fxshard.train.resume_checks import check_new_run

    if checkpoint.folder.exists() and not checkpoint.folder.is_dir():
        raise OptionError(f"--checkpoint {checkpoint.folder}: is a file; --checkpoint names a folder")
    if checkpoint.save_every and checkpoint.folder.is_dir():  # first: a planted link is named as such, not taken
        from fxshard.files import check_replaceable  # for an earlier run's latest
        from fxshard.train.checkpoint import LATEST, OWNER

        check_replaceable(checkpoint.folder / LATEST, f"the checkpoint's {LATEST}", owner=OWNER)  # every save
    check_new_run(checkpoint)  # an earlier run's checkpoints: --resume, another folder, or --overwrite
    if checkpoint.resume:
        from fxshard.codegen.manifest import read_manifest
        from fxshard.train.checkpoint import CheckpointReader
        from fxshard.train.resume_checks import check_checkpoint, check_resumable

        check_checkpoint(checkpoint.folder, say)  # nothing to resume, or a damaged file: named before launch
        reader = CheckpointReader(checkpoint.folder)
        check_resumable(reader, read_manifest(out), out, options.steps, options.optim,
                        checkpoint.allow_changed_model)  # another model, nothing left to run, another schedule
        if not under_torchrun() or os.environ["RANK"] == "0":  # the token file read once (under torchrun, by rank 0)
            from fxshard.train.data.resume import check_data_state
            from fxshard.train.resume_checks import current_identity

            check_data_state(reader.index.get("trainer") or {}, current_identity(out, options.data),
                             options.allow_data_change, str(reader.path))
    if not under_torchrun():
        from fxshard.train.supervise import check_unlocked

        check_unlocked(checkpoint.folder)  # creates the folder and its lock file: both must be possible
