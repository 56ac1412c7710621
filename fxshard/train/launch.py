"""``fxshard run`` as one rank (of torchrun, or of the local launcher in :mod:`fxshard.train.local`): a thin loop
over the same :class:`fxshard.train.program.Program` that ``fxshard.load`` gives a user's own loop.

Each step takes ``--grad-accum`` batches of this dp rank's stream, runs ``train_step``, stops at a non-finite loss
before the parameters change, steps the optimizer and the LR schedule (torch's ``LambdaLR``), and every
``--eval-every`` steps evaluates ``--eval-batches`` validation batches.  Rank 0 prints a line per step and, with
``--metrics``, appends ``{"step", "loss", "lr", "grad_norm", "seconds", "tokens"[, "eval_loss"]}`` JSON lines to a
file; with ``--tensorboard``, the same figures go to TensorBoard (:mod:`fxshard.train.board`).
Checkpoints hold the weights, the optimizer, the schedule and the data position; ``--resume`` continues with the
next batch of the stream.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fxshard.runtime import trace
from fxshard.runtime.dp_trace import traced_fsdp
from fxshard.train.memory import MemoryProbe
from fxshard.train.options import RunOptions
from fxshard.train.program import Program
from fxshard.train.schedule import make_scheduler


def run_rank(out: Path, options: RunOptions, log=print, memory_report=None) -> list[float]:
    """Train as this process's rank (RANK/WORLD_SIZE from the environment); return the losses.

    With ``memory_report`` (a callable, given when ``options.memory_report`` asks for the report), rank 0 calls
    it with :func:`fxshard.train.memory.report_rows` of every rank's measured model-state bytes after training."""
    from fxshard.codegen.manifest import read_manifest
    from fxshard.train.process import start_rank
    from fxshard.train.supervise import become_worker

    become_worker()  # a killed launcher takes its workers with it
    device = start_rank(options.timeout)
    rank = dist.get_rank()
    from fxshard.runtime import liveness
    from fxshard.runtime.guard import doing

    liveness.start(rank, doing)  # so that a rank whose collective fails can tell a stopped peer from a busy one
    try:
        if options.trace is not None:
            trace.start(rank, options.trace)
        memory = {} if memory_report is not None else None
        state = {} if options.final_state is not None else None
        losses = train(out, options, device=device, log=log, memory=memory, final_state=state)
        if state is not None:  # every rank's trained tensors, for fxshard verify
            write_final_state(Path(options.final_state), rank, state)
        rows = None
        if memory_report is not None:
            from fxshard.train.memory import report_rows

            samples = [None] * dist.get_world_size()
            dist.all_gather_object(samples, memory)
            if rank == 0:
                from fxshard.cost.costs import planned_memory

                rows = report_rows(samples, read_manifest(out).layout, planned_memory(out))
                memory_report(rows)
        if trace.save() is not None:
            dist.barrier()  # every rank's file written: rank 0 joins them
            if rank == 0:
                trace.merge(options.trace, dist.get_world_size())
        if rank == 0:
            from fxshard.train.record import write_run_record

            write_run_record(out, options, losses, rows)
        return losses
    finally:
        trace.stop()
        liveness.stop()
        dist.destroy_process_group()


def train(out: Path, options: RunOptions, *, device: torch.device | None = None, log=print,
          final_state: dict | None = None, memory: dict | None = None) -> list[float]:
    """Train the compiled program in ``out`` as this rank of the initialized default process group, as ``options``
    say (``fxshard run``'s); return the losses of the steps run (after a resumed checkpoint's step, only those).

    With ``final_state`` (a dict), it is filled with this rank's trained tensors, keyed as in its weights file
    (``attr``, or ``StageN.attr`` under pipeline parallelism).  With ``memory`` (a dict), it is filled with the bytes
    of model state this rank held (see :mod:`fxshard.train.memory`) and ``psi``, its parameter count before dp
    sharding.  ``options.checkpoint`` saves every ``save_every`` steps and, with ``resume``, continues from the
    latest checkpoint (of any layout).  With ``options.compile``, rank 0 says how long the first step spent
    compiling::

        train(Path("out/gpt"), RunOptions(steps=5, optim=OptimConfig(lr=3e-4, lr_schedule="cosine")))
    """
    checkpoint = options.checkpoint_config()
    locked = contextlib.nullcontext()
    if checkpoint is not None:
        from fxshard.train.resume_checks import check_new_run

        check_new_run(checkpoint)  # on every rank, before any saves: an earlier run's steps are not overwritten
    if checkpoint is not None and dist.get_rank() == 0:
        from fxshard.train.supervise import checkpoint_lock

        locked = checkpoint_lock(Path(checkpoint.folder))  # one run writes a checkpoint folder at a time
    with locked:
        program = Program(Path(out), options, device or torch.device("cpu"))
        data = open_stream(program, "train")
        try:
            return _Loop(program, options, data, log).run(final_state, memory)
        finally:
            data.close()


def write_final_state(folder: Path, rank: int, state: dict) -> Path:
    """``--final-state DIR``: this rank's trained tensors as ``DIR/rank<R>.safetensors``, written through
    :mod:`fxshard.files` (a new file renamed onto the name: a link planted there during the run is refused, never
    written through)."""
    from safetensors.torch import save_file

    from fxshard.files import make_folder, path_for_library

    make_folder(folder, "the --final-state folder")
    path = folder / f"rank{rank}.safetensors"
    with path_for_library(path, "a rank's trained tensors") as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    return path


def open_metrics(path: Path, append: bool):
    """``--metrics FILE`` for rank 0's lines: opened without following a link (one planted during the run is
    refused by name; a hard link too) and only if fxshard made it, emptied unless ``append`` (a resumed run continues
    its run's file)."""
    from fxshard.files import open_log
    from fxshard.train.options import METRICS

    return open_log(path, METRICS, append)


def open_stream(program: Program, split: str, state: dict | None = None):
    """This dp rank's batches of ``split`` (:func:`fxshard.train.data.open_batches`), as the rank's pipeline
    coordinate reads them."""
    from fxshard.capture.modelfile import load_model_file
    from fxshard.ir.layout import DP, PP
    from fxshard.train.data import inputs_read, open_batches

    manifest, coords = program.manifest, program.coords
    return open_batches(load_model_file(program.out / manifest.model_file), manifest, split, coords[DP],
                        program.layout.dp, program.options.data, state,
                        reads=inputs_read(program.out, manifest, coords[PP]))


class _Loop:
    """``fxshard run``'s steps over a program: the schedule, the stream, the checkpoints, the prints."""

    def __init__(self, program: Program, options: RunOptions, data, log):
        self.program, self.options, self.data, self.log = program, options, data, log
        self.scheduler = make_scheduler(program.optimizer, options.optim, options.steps)
        self.checkpoint = options.checkpoint_config()
        self.rank = dist.get_rank()
        self.progress = self.sink = self.tokens = self.board = None
        self.saved = False  # whether this run saved a checkpoint yet (--overwrite replaces the folder's at the first)

    def run(self, final_state: dict | None, memory: dict | None) -> list[float]:
        program, options = self.program, self.options
        if self.checkpoint is not None and self.checkpoint.resume:
            self._resume()
        probe = program.probe = MemoryProbe(list(program.held.values()), program.layout.pp > 1) \
            if memory is not None else None
        first = self.first = program.step_count + 1
        if self.rank == 0:
            from fxshard.train.progress import StepProgress, tokens_per_step

            self.tokens = tokens_per_step(program.manifest, options.optim.grad_accum)
            self.progress = StepProgress(options.steps, first, self.tokens, self.log,
                                         terminal=None if self.log is print else False)
            if options.metrics is not None:  # a resumed run appends to the metrics of the run it continues
                self.sink = open_metrics(options.metrics, append=first > 1)
            if options.tensorboard is not None:
                from fxshard.train.board import Board

                self.board = Board(options.tensorboard, first)
        losses = []
        try:
            for step in range(first, options.steps + 1):
                measured = probe.measured_step(program.device) if probe is not None and step == options.steps \
                    else contextlib.nullcontext()
                start = time.perf_counter()
                # measured: the last step's saved bytes per microbatch and peak (fxshard run --memory-report)
                with measured, trace.span(f"step {step}", "step", step=step), traced_fsdp():
                    loss, lr = self._step(step)
                losses.append(loss)
                self._after(step, loss, lr, time.perf_counter() - start)
            program.wait_for_parameters()  # whoever reads the trained parameters next sees the last step's values
        finally:
            if self.progress is not None:
                self.progress.close()
            if self.sink:
                self.sink.close()
            if self.board is not None:
                self.board.close()
        if memory is not None:
            memory |= probe.sample | {"psi": program.parameter_count(), "frozen": program.frozen_count()}
        if final_state is not None:
            final_state |= program.trained_state()
        return losses

    def _step(self, step: int) -> tuple[float, float]:
        """One optimizer step over ``--grad-accum`` batches of the stream; its loss and learning rate."""
        program = self.program
        loss = program.train_step(*[next(self.data) for _ in range(self.options.optim.grad_accum)])
        lr = program.optimizer.param_groups[0]["lr"]
        program.optimizer.step()  # a non-finite loss or gradient norm: stops on every rank, or skips the update
        if not program.last_step_skipped:
            self.scheduler.step()  # a skipped step leaves the schedule where it is
        program.optimizer.zero_grad()
        return loss, lr

    def _after(self, step: int, loss: float, lr: float, seconds: float) -> None:
        """What follows a step: the compile note, evaluation, the step's line and record, a checkpoint."""
        options, progress = self.options, self.progress
        if progress is not None and options.compile and step == self.first:
            self._compile_note(step, seconds)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": self.program.grad_norm,
                  "seconds": round(seconds, 6), "tokens": self.tokens}
        if self.program.last_step_skipped:
            record["skipped"] = True
            if progress is not None:
                progress.print(f"step {step}: skipped, {self.program.skipped_what} (--on-nonfinite skip): no update; "
                               f"{self.program.skipped} step{'s' * (self.program.skipped != 1)} skipped so far")
        if options.eval_every and step % options.eval_every == 0:
            record["eval_loss"] = evaluate(self.program, options.eval_batches)
        if progress is not None:
            progress.step(step, loss, seconds)
            if "eval_loss" in record:
                progress.print(f"eval after step {step}: loss {record['eval_loss']:.6f} "
                               f"({options.eval_batches} validation batches)")
            if self.sink:
                self.sink.write(json.dumps(record) + "\n")
                self.sink.flush()
            if self.board is not None:
                self.board.write(record)
        if self.checkpoint is not None and self.checkpoint.save_every and step % self.checkpoint.save_every == 0:
            saved = self.program.save(self.checkpoint.folder, scheduler=self.scheduler, data=self.data,
                                      keep_last=self.checkpoint.keep_last,
                                      replace=self.checkpoint.overwrite and not self.saved)
            self.saved = True
            if saved is not None:
                (progress.print if progress else self.log)(f"saved checkpoint {saved}")

    def _compile_note(self, step: int, seconds: float) -> None:
        from fxshard.runtime.compiled import compile_seconds
        from fxshard.runtime.matmul import onednn_products

        products = onednn_products()
        on_onednn = f"{products} fp32 matrix products on oneDNN; " if products else ""
        self.progress.print(f"compiled in {compile_seconds():.1f} s (torch.compile, inductor; {on_onednn}rank 0, "
                            f"during step {step}, which took {seconds:.1f} s)")

    def _resume(self) -> None:
        """Continue from the checkpoint: weights, optimizer, schedule and data position; a checkpoint without a data
        position (saved before fxshard recorded one) replays the stream by its step count, as fxshard did then."""
        from fxshard.train.checkpoint import CheckpointReader
        from fxshard.train.resume_checks import check_resumable

        folder = self.checkpoint.folder
        reader = CheckpointReader(folder)
        check_resumable(reader, self.program.manifest, self.program.out, self.options.steps, self.options.optim,
                        self.checkpoint.allow_changed_model)  # as before launch: under torchrun, a rank's own check
        from fxshard.train.data.resume import check_data_state, identity_of

        check_data_state(reader.index.get("trainer") or {}, identity_of(self.data, digest=False),
                         self.options.allow_data_change, str(reader.path))  # the digest: before launch, once
        say = self.log if self.rank == 0 else (lambda *_: None)
        state = self.program.load(folder, scheduler=self.scheduler, say=say)
        if state is not None:
            self.data.load_state_dict(state)
            return
        accum = reader.index.get("optimizer", {}).get("grad_accum", 1)
        say(f"note: {reader.path} records no data position (saved before fxshard recorded it): the data is replayed "
            f"from its start past {reader.step * accum} batches ({reader.step} steps of {accum})")
        for _ in range(reader.step * accum):
            next(self.data)


def evaluate(program: Program, batches: int) -> float:
    """The loss of the first ``batches`` batches of the validation split (a fresh stream each time, so every
    evaluation sees the same batches)."""
    data = open_stream(program, "validation")
    try:
        taken = [next(data) for _ in range(batches)]
    finally:
        data.close()
    return program.eval_step(*taken)
