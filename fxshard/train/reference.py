"""Single-device training of the unmodified model: what distributed runs must match."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from fxshard.capture.modelfile import ModelFile
from fxshard.capture.precision import cast_inputs
from fxshard.capture.program import _WithLoss
from fxshard.errors import FxshardError
from fxshard.ir.context import DTYPES
from fxshard.runtime.draws import ReferenceDraws
from fxshard.runtime.fp8 import fp8_reference
from fxshard.runtime.mixed_precision import MasterWeightAdamW, split_masters
from fxshard.runtime.random import ReferenceDropout, begin_batch, local_rows
from fxshard.train.data import DataOptions, global_batches
from fxshard.train.optim import OptimConfig, clip_grad_norm_


def reference_losses(mf: ModelFile, steps: int, optim: OptimConfig = OptimConfig(), seed: int = 0,
                     dtype: str = "fp32", final_state: dict | None = None, data: DataOptions = DataOptions(),
                     eval_every: int = 0, eval_batches: int = 4, evals: dict | None = None,
                     final_buffers: dict | None = None, grad_sq: dict | None = None, fp8: str | None = None,
                     chunks: int = 1) -> list[float]:
    """Losses of ``steps`` AdamW steps on one device, from the same initial weights and the same global batches
    (:func:`fxshard.train.data.global_batches` of ``data``), with the same weight-decay groups and learning-rate
    schedule (torch's LambdaLR of :func:`fxshard.train.schedule.lr_schedule`).

    ``dtype="bf16"``: the same mixed-precision recipe as ``--dtype bf16`` (bf16 parameters and
    gradients, AdamW on fp32 master weights).  ``eval_every``: every that many steps, ``evals[step]`` gets the loss
    of the first ``eval_batches`` validation batches in ``model.eval()`` mode, as ``fxshard run --eval-every``.
    ``grad_sq``: every parameter's squared gradient norm at each step (before clipping), by FQN, as verify judges
    a parameter whose gradient is zero up to rounding (:func:`fxshard.check.verify.quiet_parameters`).

    ``fp8``: the linears :func:`fxshard.runtime.fp8.fp8_module` admits compute with that float8 recipe, and each
    batch runs as ``chunks`` consecutive parts of its rows (dp x pipeline microbatches: the batches the distributed
    run's forwards see), their gradients accumulated: an fp8 scale is an amax over the tokens one forward sees."""
    from torch.optim.lr_scheduler import LambdaLR

    from fxshard.train.schedule import lr_schedule

    model = mf.build_model(seed)
    model.train()
    if fp8 is not None:
        fp8_reference(model, fp8)
    stream = global_batches(mf, "train", data, seed)
    batches = [next(stream) for _ in range(steps * optim.grad_accum)]
    positional = not isinstance(batches[0], dict)
    step_fn = _WithLoss(model, mf.loss_fn, positional)
    params = list(model.parameters())
    decayed = [optim.decayed(p.shape) for p in params]
    if dtype == "fp32":
        opt = optim.make(params, decayed)
    else:
        masters = split_masters(params, getattr(torch, DTYPES[dtype]))
        opt = MasterWeightAdamW(params, masters, optim, decayed)
    scheduler = LambdaLR(getattr(opt, "optim", opt), lr_schedule(optim, steps))
    if dtype != "fp32":
        batches = [cast_inputs(b, getattr(torch, DTYPES[dtype])) for b in batches]
    counter = _token_counter(mf, seed) if optim.grad_accum > 1 or chunks > 1 or (eval_every and eval_batches > 1) \
        else None
    losses = []
    for i in range(steps):
        total = 0.0
        step_batches = [part for b in batches[i * optim.grad_accum:(i + 1) * optim.grad_accum]
                        for part in _rows_split(b, chunks)]
        # --grad-accum k is one step over the k batches: a token-mean loss weighs each batch by its counted tokens
        counts = [counter(b) for b in step_batches] if counter is not None else [(1,)] * len(step_batches)
        if len(counts[0]) > 1 and chunks > 1:  # fp8's parts would each need their own share of every mean
            raise FxshardError("fp8 linears under dp or microbatches, on a model whose loss holds several token "
                               "means (a load-balancing loss): the single-device reference cannot weigh its parts "
                               "as the ranks do; verify it at dp=1 without microbatches, or without --fp8")
        if len(counts[0]) > 1:  # several counted means: one forward on the step's batches as one batch weighs each
            step_batches, counts = [_concatenated(step_batches)], [(1,)]  # by its own count
        counts = [c[0] for c in counts]
        for k, batch in enumerate(step_batches):
            if counts[k] == 0:
                continue  # no counted token: no share of the step's loss or gradient
            # dropout masks and draws keyed as in Program.train_step: the batch number, the part's first row in it
            first = (k % chunks) * local_rows(pytree.tree_leaves(batch))
            begin_batch(seed, i * optim.grad_accum + k // chunks, first)
            with ReferenceDropout(), ReferenceDraws():
                loss, _ = step_fn(*batch) if positional else step_fn(**batch)
            share = counts[k] / sum(counts)
            (loss * share).backward()
            total += float(loss.detach()) * share
        if grad_sq is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                if p.requires_grad:
                    grad_sq.setdefault(name, []).append(None if p.grad is None
                                                        else p.grad.detach().float().pow(2).sum().item())
        if optim.clip_grad_norm is not None and dtype != "fp32":
            clip_grad_norm_([(p.grad, 1.0) for p in params if p.grad is not None], optim.clip_grad_norm)
        elif optim.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad_norm, foreach=False)
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if eval_every and (i + 1) % eval_every == 0 and evals is not None:
            evals[i + 1] = _evaluate(model, step_fn, _validation(mf, seed, data, eval_batches, dtype), counter,
                                     positional)
    if final_state is not None:  # the trained parameters by FQN (tied ones under every name)
        for name, p in model.named_parameters(remove_duplicate=False):
            final_state[name] = p.detach().clone()
    if final_buffers is not None:  # the buffers by FQN (a batch norm's running statistics)
        for name, b in model.named_buffers():
            final_buffers[name] = b.detach().clone()
    return losses


def _validation(mf: ModelFile, seed: int, data: DataOptions, batches: int, dtype: str) -> list:
    """The first ``batches`` global batches of the validation split."""
    stream = global_batches(mf, "validation", data, seed)
    try:
        taken = [next(stream) for _ in range(batches)]
    finally:
        stream.close()
    return taken if dtype == "fp32" else [cast_inputs(b, getattr(torch, DTYPES[dtype])) for b in taken]


def _evaluate(model, step_fn, batches: list, counter, positional: bool) -> float:
    """The loss of ``batches`` without gradients in ``model.eval()`` mode, a token mean over all of them."""
    if counter is not None and len(counter(batches[0])) > 1:  # several counted means: the batches as one batch
        batches = [_concatenated(batches)]
    counts = [counter(b)[0] for b in batches] if counter is not None else [1] * len(batches)
    model.eval()
    try:
        with torch.no_grad():
            found = [float((step_fn(*b) if positional else step_fn(**b))[0]) for b in batches]
    finally:
        model.train()
    return sum(loss * n / sum(counts) for loss, n in zip(found, counts, strict=True) if n)


def _token_counter(mf: ModelFile, seed: int):
    """``batch -> counted targets`` when the model's loss is a token mean (from its captured graph), else None."""
    from fxshard.capture.program import capture
    from fxshard.ir.token_means import token_counter

    rng = torch.random.get_rng_state()
    program = capture(mf, seed)  # seeds torch: the training that follows draws as if it had not run
    torch.random.set_rng_state(rng)
    graph = token_counter(program)
    if graph is None:
        return None

    def count(batch) -> tuple[int, ...]:  # one count per counted mean of the loss
        # by path, in the captured inputs' order: a batch of the data path may order its dict's keys otherwise
        # (use_cache first), and the count then read the input ids as labels (no -100 ever counted out)
        leaves = {pytree.keystr(path): leaf for path, leaf in pytree.tree_flatten_with_path(
            (tuple(batch), {}) if not isinstance(batch, dict) else ((), dict(batch)))[0]}
        return tuple(int(c) for c in torch.as_tensor(graph(*(leaves[i.path] for i in program.inputs))).reshape(-1))

    return count


def _rows_split(batch, chunks: int) -> list:
    """``batch`` as ``chunks`` batches of consecutive rows (each tensor split along its first dimension)."""
    if chunks == 1:
        return [batch]
    leaves, tree = pytree.tree_flatten(batch)
    parts = [v.tensor_split(chunks) if isinstance(v, torch.Tensor) and v.dim() else [v] * chunks for v in leaves]
    return [pytree.tree_unflatten([p[c] for p in parts], tree) for c in range(chunks)]


def _concatenated(batches: list):
    """The batches of one step as one batch (their tensors concatenated along the batch dimension)."""
    flat = [pytree.tree_flatten(b) for b in batches]
    leaves = [torch.cat(parts) if isinstance(parts[0], torch.Tensor) and parts[0].dim() else parts[0]
              for parts in zip(*(f[0] for f in flat), strict=True)]
    return pytree.tree_unflatten(leaves, flat[0][1])
