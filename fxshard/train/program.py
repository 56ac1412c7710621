"""This rank's compiled program: what ``fxshard.load(OUT)`` returns under torchrun, and what ``fxshard run`` drives.

A user's own loop (``samples/own_loop.py``), with its own DataLoader and any torch LR scheduler::

    program = fxshard.load("out/llama-tp2-dp2", lr=3e-4, weight_decay=0.1, clip_grad_norm=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(program.optimizer, lambda s: min(1.0, (s + 1) / 100))
    for batch in loader:                                        # global batches: each rank keeps its share
        loss = program.train_step(program.local_batch(batch))   # forward + backward, the same loss on every rank
        program.optimizer.step()                                # finish the gradients, clip, AdamW
        scheduler.step()
        program.optimizer.zero_grad()

What happens between ``train_step`` and the update is fixed, in this order, as torchtitan's ``train_step`` and
Accelerate's ``backward`` / ``clip_grad_norm_`` / ``optimizer.step`` do it:

1. ``train_step(*batches)`` runs forward and backward of this rank's share of each batch (under pipelining, the
   schedule over all microbatches); gradients *accumulate* until ``optimizer.zero_grad()``, as ``loss.backward()``
   does.  It returns the batches' mean loss, averaged over dp: the loss one device computes on the global batches.
   Several batches in one call are one accumulated step whose token-mean loss counts every token of all of them.
2. :meth:`Program.finish_gradients` (called by ``optimizer.step()`` and ``clip_grad_norm_`` if not called before):
   divide by the batches and microbatches accumulated (Accelerate's and torchtitan's mean over accumulation), sum
   the tied weights' gradients between stages and the split-backward gradients over dp, the experts' over edp, and
   under ZeRO 1 reduce-scatter the gradient buckets.  After it the gradients are what the update applies.
3. ``clip_grad_norm_(max_norm)``: the global norm over every tp, pp, dp (and ep) shard; ``optimizer.step()`` clips to
   the program's ``clip_grad_norm`` itself unless the loop clipped this step.
4. ``optimizer.step()``: AdamW on this rank's share (ZeRO 1: then the parameter all-gathers), unless the step's
   loss or its global gradient norm (read at 3 on every rank, clipping or not) is not finite: then the update is
   never applied.  ``--on-nonfinite stop`` (the default) raises :class:`NonFiniteError` on every rank, so no
   parameter and no checkpoint ever holds a non-finite step; ``skip`` leaves the parameters and the optimizer's
   state as they were and sets ``last_step_skipped``, as Megatron's and DeepSpeed's loss scalers skip a step.

``program.optimizer`` is a ``torch.optim.Optimizer`` whose ``param_groups`` are the layout's optimizers' own groups,
so a scheduler that sets ``group["lr"]`` reaches every shard.  ``save``/``load`` write and read the checkpoints of
``fxshard run --checkpoint`` (any layout resumes any other's).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist

from fxshard.capture.inputs import flatten_batch
from fxshard.capture.rows import check_entries
from fxshard.codegen.manifest import import_rank_file, read_manifest
from fxshard.errors import FxshardError, LayoutError
from fxshard.ir.layout import DP, EDP
from fxshard.runtime import trace
from fxshard.runtime.data_parallel import local
from fxshard.runtime.distributed_optimizer import finish_param_sync
from fxshard.runtime.guard import named_phase, set_context
from fxshard.runtime.loss import step_tokens
from fxshard.runtime.matmul import agreed_kernel
from fxshard.runtime.random import begin_batch
from fxshard.train.modules import (
    build_groups,
    build_optimizer,
    build_rank,
    check_accumulated_loss,
    local_parameter_count,
    norm_weights,
)
from fxshard.train.optim import clip_grad_norm_
from fxshard.train.options import RunOptions, options_with


class NoTargetsError(FxshardError):
    """A step none of whose positions has a label: its token-mean loss is 0/0, whatever the model."""


class NonFiniteError(FxshardError):
    """A step's loss or gradient norm is not finite (``--on-nonfinite stop``): raised on every rank before the
    update."""


def load(out: str | Path, options: RunOptions | None = None, *, device: torch.device | None = None,
         **flags) -> Program:
    """This rank's compiled program of ``out``, in a process started by torchrun (the default process group is
    started here if it is not yet).  ``flags``: any of ``fxshard run``'s options by field name (``lr``,
    ``weight_decay``, ``clip_grad_norm``, ``compile``, ...), over ``options``.  As ``fxshard run``, it refuses rank
    files or a model.py edited since the compile before importing any of them (``allow_edited=True`` runs them).

    >>> program = fxshard.load("out/llama-tp2-dp2", lr=3e-4)   # doctest: +SKIP
    """
    from fxshard.codegen.manifest import refuse_edited
    from fxshard.train.options import under_torchrun

    options = options_with(options or RunOptions(), flags)
    if not options.allow_edited:
        refuse_edited(Path(out), read_manifest(out), "allow_edited=True to fxshard.load")
    if device is None and not dist.is_initialized() and not under_torchrun():
        raise FxshardError(f"fxshard.load({str(out)!r}): runs as one rank of a distributed job, and this process is "
                           "none (RANK and WORLD_SIZE are not set): start the script with torchrun "
                           f"--nproc-per-node {read_manifest(out).layout.world_size} SCRIPT.py (one process per rank "
                           f"of {out}), or train it with `fxshard run {out}`")
    if device is None:
        from fxshard.train.process import start_rank

        device = start_rank(options.timeout)
    return Program(Path(out), options, device)


class Program:
    """One rank's generated modules, data parallelism, pipeline schedule and optimizer (see the module docstring).

    ``step_count``: optimizer steps taken, skipped ones included (a loaded checkpoint's step after :meth:`load`);
    ``last_step_skipped``: whether the last ``optimizer.step()`` skipped its update (``--on-nonfinite skip``: then a
    loop leaves its LR scheduler where it is, as Megatron does)."""

    def __init__(self, out: Path, options: RunOptions, device: torch.device):
        self.out, self.options, self.device = Path(out), options, device
        self.manifest = manifest = read_manifest(out)
        self.layout = layout = manifest.layout
        if dist.get_world_size() != layout.world_size:
            raise LayoutError(f"{out} was compiled for {layout.world_size} processes ({layout.describe()}) but "
                              f"{dist.get_world_size()} were started; launch with --nproc-per-node {layout.world_size}")
        check_accumulated_loss(out, manifest, options.optim.grad_accum)
        self.groups, dp_mesh = build_groups(layout, manifest, device)
        self.coords = layout.coords(dist.get_rank())
        self.entry = manifest.rank(self.coords)
        code = import_rank_file(out / self.entry.file)
        self._compiled = agreed_kernel(options.cpu_matmul) if options.compile else None  # auto: one kernel for all
        self._rank = build_rank(code, out, manifest, self.entry, self.groups, dp_mesh, device, self._compiled)
        self._opt = build_optimizer(self._rank, self.entry, layout, self.groups, options.optim)
        if self._sharded and options.optim.overlap_param_gather:
            # each bucket's all-gather waited for just before its first use in the next forward; a compiled forward
            # is one graph, so its module waits for all of its buckets before it runs
            self._opt.gather_before_use(list(self.held.values()), per_submodule=not self._compiled)
        self.optimizer = ProgramOptimizer(self)
        self._weighted = norm_weights(self.held, self.entry, manifest, layout)
        self._count = getattr(code, "count_tokens", None)
        # this dp rank's rows of each batch (inputs a pipeline rank does not read may be None)
        self._rows = next((i.shape[0] // layout.dp for i in manifest.inputs
                           if i.is_tensor and i.shape and not i.counted_by and not i.whole), None)
        self.step_count = 0
        self.probe = None  # fxshard run --memory-report's MemoryProbe, sampled by the step
        self._batches = 0  # batches trained since the start of training: they number the dropout masks
        self._accumulated = 0  # batches whose gradients wait for the optimizer step
        self._finished = self._clipped = False
        self._loss = self._norm = 0.0  # this step's loss (train_step's, summed) and gradient norm
        self.grad_norm: float | None = None  # the last optimizer step's global gradient norm, before clipping
        self.skipped = 0  # steps whose update a non-finite loss or gradient norm skipped (--on-nonfinite skip)
        self.last_step_skipped = False
        self.skipped_what = ""  # why the last skipped step was skipped

    # ------------------------------------------------------------ what the rank holds

    @property
    def held(self) -> dict[str, torch.nn.Module]:
        """The generated modules by weight-key prefix: ``""``, or ``"StageN."`` per pipeline stage."""
        return self._rank.held

    @property
    def _sharded(self) -> bool:
        return self.layout.zero == 1 and self.layout.replicas > 1  # fxshard's distributed optimizer

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters (tp and pp slices; FSDP2 DTensors under ZeRO 2/3), holding the last step's values:
        ZeRO 1's parameter all-gathers still in flight are waited for first."""
        finish_param_sync(self._opt)
        return list(self._rank.params)

    def wait_for_parameters(self) -> None:
        """Wait for ZeRO 1's parameter all-gathers still in flight after the last step (the next forward waits for
        them itself): before reading the parameters anywhere else, or stopping."""
        finish_param_sync(self._opt)

    def close(self) -> None:
        """Wait for every collective this program left in flight (ZeRO 1's parameter all-gathers after the last
        step), so that the process group can be destroyed: a gloo or NCCL group shut down under a collective still
        running aborts the process ("terminate called without an active exception").  ``with fxshard.load(OUT) as
        program:`` calls it at the end of the block; the program stays usable."""
        self.wait_for_parameters()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(key, parameter)`` pairs, keyed as this rank's weights file (``StageN.`` prefixed under pipelining)."""
        finish_param_sync(self._opt)
        return [(prefix + name, p) for prefix, m in self.held.items() for name, p in m.named_parameters()]

    def local_batch(self, batch):
        """This rank's share of a global batch (one batch as ``make_inputs()`` returns it): every tensor's rows of this
        dp rank, in dp order, as one device's batch splits into the dp ranks'.  Tensors stay on the CPU."""

        from fxshard.capture.rows import Rows
        from fxshard.train.data.spec import local_slice

        return local_slice(batch, self.coords[DP], self.layout.dp, Rows.of_inputs(self.manifest.inputs))

    # ------------------------------------------------------------ steps

    def train_step(self, *batches) -> float:
        """Forward and backward of this rank's share of each of ``batches``; their mean loss over the global batches,
        the same on every rank.  Gradients accumulate until ``optimizer.zero_grad()``."""
        if self._finished:
            raise FxshardError("train_step: the gradients of this step were already finished (by optimizer.step() or "
                               "clip_grad_norm_); call program.optimizer.zero_grad() before the next train_step")
        leaves = [self._leaves(b, "train_step") for b in _batches(batches, "train_step")]
        step = self.step_count + 1
        set_context(step, f"training step {step}")
        # compiled: the rank files' collectives run in the graph, unguarded; the whole mesh's heartbeats say who stopped
        phase_group = dist.group.WORLD if self._compiled else self.groups[self.layout.grad_axis]
        value = 0.0
        with self._token_mean(leaves), named_phase(_torch_issued(self.layout, step, bool(self._compiled)), phase_group):
            for batch in leaves:
                begin_batch(self.manifest.seed, self._batches, self.coords[DP] * (self._rows or 0))
                self._batches += 1
                value += self._rank.train_fn(batch) / len(leaves)
        self._accumulated += len(leaves)
        loss = self._dp_mean(value)
        self._loss += loss
        return loss

    def eval_step(self, *batches) -> float:
        """The mean loss of ``batches`` (this rank's shares) without gradients or dropout; under pipelining the schedule
        runs forward only.  The loss one device computes on the global batches in ``model.eval()`` mode."""
        leaves = [self._leaves(b, "eval_step") for b in _batches(batches, "eval_step")]
        value = 0.0
        with self._token_mean(leaves), named_phase("an evaluation forward", self.groups[DP]):
            for batch in leaves:
                begin_batch(self.manifest.seed, 0, self.coords[DP] * (self._rows or 0), training=False)
                value += self._rank.eval_fn(batch) / len(leaves)
        return self._dp_mean(value)

    def step(self, *batches) -> float:
        """One whole optimizer step: ``train_step(*batches)``, ``optimizer.step()``, ``optimizer.zero_grad()``; the
        loss.  (A loop with an LR scheduler steps it after this.)"""
        loss = self.train_step(*batches)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def finish_gradients(self) -> None:
        """Make the accumulated gradients the ones the update applies (step 2 of the module docstring); once per
        step, again a no-op until ``optimizer.zero_grad()``."""
        if self._finished:
            return
        if not self._accumulated:
            raise FxshardError("the optimizer step has no gradients: no train_step since the last "
                               "optimizer.zero_grad(); call program.train_step(batch) first")
        divisor = self._accumulated * self._rank.microbatches
        if divisor > 1:  # gradients summed over batches and microbatches: average them
            for p in self._rank.params:
                if p.grad is not None:
                    p.grad.div_(divisor)
        if self._rank.finish is not None:
            with trace.span("tied and split-backward gradient sums", "step"):
                self._rank.finish()
        if self.probe is not None:
            self.probe.after_backward(self._rank.params)
        if self._sharded:
            with trace.span("ZeRO-1 gradient reduce-scatter", "step"):
                self._opt.reduce_gradients()  # each rank's shard of the averaged gradients
        self._finished = True

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so their global norm (every shard of every parameter counted once) is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` on one device; return the norm before clipping."""
        self.finish_gradients()
        if self._sharded:
            pairs = self._opt.grad_pieces({id(p): w for p, w in self._weighted})
        else:
            pairs = [(local(p.grad), w) for p, w in self._weighted if p.grad is not None]
        self._clipped = True
        self._norm = clip_grad_norm_(pairs, max_norm, device=self.device)
        return self._norm

    def _optimizer_step(self) -> None:
        self.finish_gradients()
        clip = self.options.optim.clip_grad_norm
        if not self._clipped:  # the global norm, the same on every rank: clipped with --clip-grad-norm, else only read
            self.clip_grad_norm_(clip if clip is not None else math.inf)
        step = self.step_count + 1
        self.grad_norm = float(self._norm)
        self.last_step_skipped = not (math.isfinite(self._loss) and math.isfinite(self._norm))
        if self.last_step_skipped:
            self._nonfinite(step)
            return
        with named_phase(f"the optimizer step's parameter exchange over dp in training step {step}",
                         self.groups[self.layout.grad_axis]):
            with trace.span("optimizer step", "step"):
                self._opt.step()  # ZeRO 1 all-gathers the updated parameters
        if self.probe is not None:
            self.probe.after_step(self._opt)
        self.step_count = step

    def _nonfinite(self, step: int) -> None:
        """A step whose loss or global gradient norm is not finite (every rank sees the same two numbers, so every
        rank takes the same way): the update is never applied.  ``--on-nonfinite stop`` raises; ``skip`` counts the
        step without changing a parameter or the optimizer's state."""
        finish_param_sync(self._opt)  # nothing in flight behind an error or a skipped step
        what = f"the loss is {self._loss}" if not math.isfinite(self._loss) else \
            f"the gradient norm is {self._norm} (the loss, {self._loss:.6g}, is finite)"
        if self.options.on_nonfinite != "skip":
            raise NonFiniteError(f"step {step}: {what}; training stops before the update, so no parameter or "
                                 "checkpoint holds it (check the weights and inputs for inf/nan, or lower --lr; "
                                 "--on-nonfinite skip skips such steps instead)")
        self.skipped += 1
        self.step_count = step
        self.skipped_what = what

    def _zero_grad(self) -> None:
        self._opt.zero_grad(set_to_none=True)
        self._accumulated = 0
        self._finished = self._clipped = False
        self._loss = self._norm = 0.0

    # ------------------------------------------------------------ checkpoints

    def save(self, folder: str | Path, *, scheduler=None, data=None, keep_last: int = 0,
             replace: bool = False) -> Path | None:
        """Save a checkpoint of this step into ``folder`` (``folder/step-<N>``, ``folder/latest``), collectively;
        rank 0 returns its path.  ``scheduler`` and ``data`` (anything with a JSON-able ``state_dict()``: an LR
        scheduler, the data position) are saved with it.  Once it is complete, ``keep_last`` (N > 0) deletes all but
        the newest N complete steps, and ``replace`` every other step of ``folder`` (an earlier run's)."""
        from fxshard.train.checkpoint import save_checkpoint

        trainer = {"batches": self._batches,
                   "scheduler": scheduler.state_dict() if scheduler is not None else None,
                   "data": _state_of(data, digest=dist.get_rank() == 0)}  # rank 0's is saved
        with named_phase(f"the checkpoint save of step {self.step_count}", dist.group.WORLD):
            finish_param_sync(self._opt)  # the parameters of this step, not the gathers still in flight
            return save_checkpoint(folder, self.step_count, self.out, self.held, self.entry, self._opt, self.manifest,
                                   self.coords, self.groups[self.layout.grad_axis], self.options.optim,
                                   self.groups.get(EDP),
                                   trainer=_json_checked(trainer), keep_last=keep_last, replace=replace)

    def load(self, folder: str | Path, *, scheduler=None, data=None, say=print) -> dict | None:
        """Continue from the checkpoint ``folder`` leads to (saved under any layout): the trained values and Adam
        state in place, ``step_count``, and the ``scheduler``'s and ``data``'s states.  Returns the saved data state,
        or None for a checkpoint without one (saved before fxshard recorded it): ``say`` is told the position is
        unknown, and the data is left where it is."""
        from fxshard.train.checkpoint import CheckpointReader
        from fxshard.train.restore import load_trained

        reader = CheckpointReader(folder)
        reader.check_model(self.manifest, self.out, self.options.allow_changed_model)
        trainer = reader.index.get("trainer") or {}
        from fxshard.train.data.loader import Batches

        if isinstance(data, Batches):  # the examples saved, cheaply (the token file's size; the launcher compared
            from fxshard.train.data.resume import check_data_state, identity_of  # its digest)

            check_data_state(trainer, identity_of(data, digest=False), self.options.allow_data_change, str(reader.path))
        finish_param_sync(self._opt)
        self._zero_grad()
        load_trained(reader, self._opt, self.held, self.entry, self.groups[self.layout.grad_axis], self.groups.get(EDP))
        self.step_count = reader.step
        accum = reader.index.get("optimizer", {}).get("grad_accum", 1)
        self._batches = trainer.get("batches", reader.step * accum)
        if scheduler is not None:
            _restore_scheduler(scheduler, trainer.get("scheduler"), reader.step)
        state = trainer.get("data")
        if state is not None and data is not None:
            data.load_state_dict(state)
        elif data is not None and dist.get_rank() == 0:
            say(f"note: {reader.path} records no data position (saved before fxshard recorded it); the data "
                "continues from where it is now, not necessarily after the examples the run had trained on")
        return state

    def trained_state(self) -> dict[str, torch.Tensor]:
        """This rank's trained tensors on the CPU, keyed as in its weights file; ZeRO 2/3 shards gathered over dp."""
        finish_param_sync(self._opt)
        state = {}
        for prefix, module in self.held.items():
            for name, t in list(module.named_parameters()) + list(module.named_buffers()):
                if hasattr(t, "full_tensor"):
                    t = t.full_tensor()
                state[prefix + name] = t.detach().cpu().clone()
        return state

    def parameter_count(self) -> int:
        """Ψ of this rank: elements of its (tp- and pp-local) parameters, before any dp sharding."""
        return local_parameter_count(self.held, self.entry)

    def frozen_count(self) -> int:
        """Of :meth:`parameter_count`, the elements of the parameters that do not train (``requires_grad=False``)."""
        return sum(math.prod(self.entry.tensors[prefix + name].shape) for prefix, module in self.held.items()
                   for name, p in module.named_parameters() if not p.requires_grad)

    # ------------------------------------------------------------ batches

    def _leaves(self, batch, what: str) -> list:
        """The compiled forward's inputs from this rank's share of ``batch``, on the device, floating inputs in the
        compute dtype; a batch of another shape is refused, the global batch with a pointer to local_batch."""
        from fxshard.errors import ModelFileError

        try:
            leaves = flatten_batch(batch, self.manifest.inputs, self._rows)
        except ModelFileError as e:
            with contextlib.suppress(ModelFileError):
                if self.layout.dp > 1:
                    flatten_batch(batch, self.manifest.inputs)
                    raise FxshardError(f"{what}: got a global batch; it takes this dp rank's share (1/{self.layout.dp} "
                                       "of the rows): pass program.local_batch(batch)") from None
            raise FxshardError(f"{what}: {e}" + (f" (this dp rank's share: global rows / dp {self.layout.dp})"
                                                  if self.layout.dp > 1 else "")) from None
        check_entries(self.manifest.inputs, leaves)  # an input counted by a mask: as many entries per microbatch
        mixed = self.layout.mixed
        return [v if not isinstance(v, torch.Tensor) else
                v.to(self.device, self.layout.compute_dtype if mixed and v.is_floating_point() else v.dtype,
                     non_blocking=True) for v in leaves]

    def _token_mean(self, leaves: list[list]):
        """For a token-mean loss (the rank file's ``count_tokens``): the count of the whole step's targets, summed
        over dp, for ``rt.token_mean`` to divide by; else nothing."""
        if self._count is None:
            return contextlib.nullcontext()
        counted = torch.tensor(_add(_count_tokens(self._count, batch, self.manifest) for batch in leaves),
                               dtype=torch.int64, device=self.device)  # one count per counted mean of the loss
        if self.layout.dp > 1:
            from fxshard.runtime.guard import guarded

            with guarded("all_reduce of the step's counted tokens over dp", self.groups[DP]):
                dist.all_reduce(counted, group=self.groups[DP])
        if not bool(counted.any()):  # every rank has the same counts: every rank stops here alike
            raise NoTargetsError(f"step {self.step_count + 1}: no position of its batches has a label (every target is "
                                 "-100, the ignored label), so its token-mean loss would be 0/0 and no update could "
                                 "be made; the data holds sequences with nothing to predict (with --pack: documents "
                                 "of one token, only their EOS). Give data with text to predict")
        # cp ranks count parts of each row: the divisor counts dp x cp parts
        return step_tokens(counted.tolist(), len(leaves) * self._rank.microbatches * self.layout.replicas)

    def _dp_mean(self, value: float) -> float:
        """The loss averaged over the dp ranks (each saw 1/dp of the batch); under --cp over dp x cp (each rank's loss
        is its share of its rows' tokens)."""
        if self.layout.replicas == 1:
            return value
        from fxshard.runtime.guard import guarded

        t = torch.tensor(value, dtype=torch.float64, device=self.device)
        with guarded("all_reduce of the step loss over dp", self.groups[self.layout.grad_axis]):
            dist.all_reduce(t, group=self.groups[self.layout.grad_axis])
        return float(t) / self.layout.replicas


class ProgramOptimizer(torch.optim.Optimizer):
    """``program.optimizer``: a torch Optimizer over the layout's optimizers (AdamW, ZeRO 1's distributed optimizer,
    fp32 masters, the experts' own), whose ``param_groups`` are theirs, so LR schedulers drive them all.
    ``step()`` finishes and clips the gradients first (the module docstring); its state lives in checkpoints
    (``program.save``), not in ``state_dict()``."""

    def __init__(self, program: Program):
        super().__init__([torch.zeros(1, requires_grad=True)], program.options.optim.kwargs())
        self._program = program
        self.param_groups = program._opt.param_groups  # the same dicts

    def step(self, closure=None):
        if closure is not None:
            raise FxshardError("program.optimizer.step(closure): a closure would rerun forward outside the pipeline "
                               "schedule; call program.train_step, then optimizer.step()")
        self._program._optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._program._zero_grad()

    def state_dict(self):
        raise FxshardError("program.optimizer.state_dict(): the optimizer's state is sharded over the layout; save it "
                           "with program.save(folder) (fxshard run's checkpoints, which any layout loads)")

    def load_state_dict(self, state_dict) -> None:
        raise FxshardError("program.optimizer.load_state_dict(): load a checkpoint with program.load(folder)")


def _batches(batches: tuple, what: str) -> tuple:
    if not batches:
        raise FxshardError(f"{what}() needs a batch: {what}(batch), or {what}(b1, b2, ...) for one accumulated step")
    for i, b in enumerate(batches):
        if not isinstance(b, (dict, tuple, list)):
            raise FxshardError(f"{what}: argument {i} is a {type(b).__name__}; each argument is one batch, a dict or "
                               f"tuple as make_inputs() returns (pass a tuple batch as one argument: {what}((x, y)))")
    return batches


def _count_tokens(count, leaves: list, manifest) -> tuple[int, ...]:
    """The targets a token-mean loss counts in one batch's leaves, one count per counted mean the loss adds
    (``count`` returns a scalar, or a vector for several): ``count`` runs on each microbatch-sized run of rows (the
    shapes it was compiled for), whichever microbatch those rows go to."""
    leading = [(i, v) for i, v in zip(manifest.inputs, leaves, strict=True)
               if isinstance(v, torch.Tensor) and v.dim() and i.microbatch_shape and not i.counted_by and not i.whole]
    if not leading or leading[0][0].microbatch_shape[0] == leading[0][1].shape[0]:
        return _ints(count(*leaves))
    runs = leading[0][1].shape[0] // leading[0][0].microbatch_shape[0]

    def run(i, v, k: int):  # microbatch k's part of input i: its rows, a counted input's entries of them
        if not isinstance(v, torch.Tensor) or not v.dim() or i.whole or not i.microbatch_shape:
            return v
        size = i.microbatch_shape[0]
        return v[k * size:(k + 1) * size]

    return _add(_ints(count(*[run(i, v, k) for i, v in zip(manifest.inputs, leaves, strict=True)]))
                for k in range(runs))


def _ints(counted) -> tuple[int, ...]:
    return tuple(int(c) for c in torch.as_tensor(counted).reshape(-1))


def _add(counts) -> tuple[int, ...]:
    """Counts of several parts, summed term by term."""
    return tuple(map(sum, zip(*counts, strict=True)))


def _torch_issued(layout, step: int, compiled: bool = False) -> str:
    """What torch itself communicates in a training step (fxshard's own collectives name their lines, except
    inside torch.compile's graphs, where no Python runs around them)."""
    what = {0: "DDP's bucketed gradient all-reduce over dp",
            1: "ZeRO 1's bucket reduce-scatters and all-gathers over dp",
            2: "FSDP2's parameter all-gathers and gradient reduce-scatters over dp (ZeRO 2)",
            3: "FSDP2's parameter all-gathers and gradient reduce-scatters over dp (ZeRO 3)"}[layout.zero]
    what = what if layout.replicas > 1 else ""
    if compiled:
        # tp's collectives run inside the graphs; pp's schedule and ep's exchanges run eagerly, guarded
        inside = ("the rank files' collectives over tp inside the torch.compile graphs (--compile: run without it "
                  "to have the failing one named with its line)")
        what = f"{inside}{', or ' + what if what else ''}" if layout.tp > 1 else what
    return (what or "the step's communication") + f" in training step {step}"


def _state_of(data, digest: bool = False):
    from fxshard.train.data.loader import Batches

    if isinstance(data, Batches):
        return data.state_dict(digest)
    return None if data is None else data.state_dict() if hasattr(data, "state_dict") else data


def _json_checked(trainer: dict) -> dict:
    import json

    for key, value in trainer.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise FxshardError(f"program.save: the {key} state is not JSON ({e}); a checkpoint keeps it in its "
                               "index.json: give plain numbers, strings, lists and dicts") from None
    return trainer


def _restore_scheduler(scheduler, state: dict | None, step: int) -> None:
    """The scheduler's saved state; a checkpoint without one (saved before schedules were recorded, at a constant
    learning rate) moves it to ``step`` as if it had stepped with the run."""
    import warnings

    if state is None:
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                scheduler.step()
        return
    # per-group lists are rank 0's of the saving layout, whose groups may be more or fewer than this rank's: every
    # group starts from the same --lr, so its first entry stands for all
    groups = scheduler.optimizer.param_groups
    state = {k: [v[0]] * len(groups) if isinstance(v, list) and v and len(v) != len(groups) else v
             for k, v in state.items()}
    scheduler.load_state_dict(state)
    for group, lr in zip(groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr  # as the saving run's optimizer had it after its last scheduler step

