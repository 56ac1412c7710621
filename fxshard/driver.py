"""The driver: what runs around the compiler, above it, the checks, the cost model and the trainer.

``compile`` is the whole of ``fxshard compile``: the layout's ``auto`` policies decided by the plan (``--recompute
auto`` by ``--device-memory``), the compiler, the static checks of the files it generated (refused before anything is
written), and the output folder; ``verify`` compiles, trains on local processes and on one device, and compares
(``verify("samples/gpt.py", Layout(tp=2, pp=2), steps=3).ok``).  ``fxshard plan`` is
:func:`fxshard.cost.costs.plan_costs`: a compile in memory, then the cost model.

    >>> from fxshard.driver import compile
    >>> from fxshard.ir.layout import Layout
    >>> result = compile("samples/gpt.py", Layout(tp=2), out="out/gpt-tp2")
    >>> result.files, result.checks.ranks
    (['rank_pp0_tp0.py', 'rank_pp0_tp1.py'], 2)

(``tests/test_docs.py`` runs this example.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fxshard.capture.folder_options import FolderOptions
from fxshard.capture.hf_folder import ModelSource
from fxshard.capture.hf_folder import model_source as _model_source
from fxshard.capture.modelfile import load_model_file
from fxshard.check.check import COMPILER_BUG, check_program
from fxshard.check.fp64 import check_fp64, float64_model_file, rounding_floor
from fxshard.check.verify import (
    DEFAULT_PARAM_RTOL,
    DEFAULT_RTOL,
    Verification,
    adamw_reach,
    compare_parameters,
    compare_running_stats,
    default_tolerances,
    gather_parameters,
    quiet_parameters,
    with_weights,
)
from fxshard.codegen.folder import check_target, recover_interrupted
from fxshard.compiler import CompiledProgram, compile_program, generate, shard_shapes, write_output
from fxshard.cost.costs import plan_costs
from fxshard.errors import FxshardError
from fxshard.files import make_folder
from fxshard.ir.layout import Layout
from fxshard.train.optim import OptimConfig


@contextlib.contextmanager
def model_source(path: str | Path, options: FolderOptions = FolderOptions(), seq: int | None = None,
                 batch: int | None = None, weights: bool = True) -> Iterator[ModelSource]:
    """MODEL as the compiler takes it: a model file as it is, or a Hugging Face folder as the model file fxshard
    writes for it (:mod:`fxshard.capture.hf_folder`) with the folder as its weights; a folder without safetensors is
    refused here, before anything is captured (unless ``weights`` is False: ``plan``, ``compile --meta``)::

        with model_source("qwen", seq=2048, batch=8) as source:
            compile(source.model_file, Layout(tp=2), out="out/qwen", weights=source.weights)
    """
    with _model_source(path, options, seq, batch, weights) as source:
        if source.weights is not None:
            from fxshard.codegen.weights import tensor_files

            tensor_files(source.weights)
        yield source


def compile(model_file: str | Path, layout: Layout, out: str | Path | None = None, plan: dict | None = None,
            seed: int = 0, weights: str | Path | None = None, meta: bool = False,
            device_memory: int | None = None) -> CompiledProgram:
    """Compile ``model_file`` for ``layout``, check the generated files, and write them to ``out`` if given.

    ``weights``: a Hugging Face folder; the model is captured on meta tensors, the folder validated,
    and each rank reads its slices from it at run time (no parameter shards are written).
    ``meta=True`` without ``weights``: code and manifest only, for a model too large to initialize.
    ``device_memory`` (bytes): the plan's per-rank peaks and verdicts (``result.memory_plan``); with
    ``layout.recompute == "auto"`` the least recompute that fits every rank is chosen by them first, and a pipeline
    without ``layout.microbatches`` gets the fewest microbatches that fit (:mod:`fxshard.cost.microbatches`)::

        compile("samples/gpt.py", Layout(tp=2, recompute="auto"), device_memory=8 * 2**20).ctx.layout.recompute
    """
    if out is not None:
        recover_interrupted(Path(out))  # a swap killed (kill -9) in an earlier compile: finished or undone, and said
        check_target(Path(out), set())  # a file, or a folder that is not fxshard's: refused before any work
    memory_plan = None
    if device_memory is not None or layout.recompute == "auto":
        memory_plan = plan_costs(model_file, layout, plan, seed, device_memory=device_memory)
        if layout.recompute == "auto":
            layout = dataclasses.replace(layout, recompute=memory_plan.recompute)
        if memory_plan.microbatch_choice is not None:  # --microbatches not given: the count the plan chose
            layout = dataclasses.replace(layout, microbatches=memory_plan.microbatch_choice["chosen"])
    mf = load_model_file(model_file).for_layout(layout)
    result = compile_program(mf, layout, plan, seed, meta=meta or weights is not None)
    result.memory_plan = memory_plan
    shards = generate(result, mf, seed, weights, meta)
    result.checks = check_program(result.sources, result.manifest, shard_shapes(result.manifest, shards), run=False,
                                  fix=COMPILER_BUG)
    if out is not None:
        write_output(Path(out), result, mf, shards)
    return result


_compile = compile  # for verify, whose ``compile`` is the run's --compile


def verify(model_file: str | Path, layout: Layout, steps: int = 3, optim: OptimConfig = OptimConfig(),
           plan: dict | None = None, seed: int = 0, rtol: float | None = None, param_rtol: float | None = None,
           out: str | Path | None = None, timeout_s: float = 300.0, compile: bool = False,
           cpu_matmul: str = "auto", weights: str | Path | None = None, fp64: bool = False) -> Verification:
    """Compile, train ``steps`` steps on ``layout.world_size`` local processes and on one device; compare.

    The distributed run is the real thing: the compiled rank files launched as local gloo processes, exactly as
    ``fxshard run`` does, every rank writing its trained tensors.  Losses must agree within ``rtol`` (relative); the
    trained parameters within ``param_rtol``: the norm of their difference over the norm of the single-device update,
    all parameters together (:data:`fxshard.check.verify.DEFAULT_PARAM_RTOL`) but those whose single-device gradient is
    zero up to rounding (:data:`~fxshard.check.verify.QUIET_GRAD`), which AdamW moves by noise: each of those within
    twice the farthest AdamW moves an element (:func:`~fxshard.check.verify.adamw_reach`); batch norms' running
    statistics within ``param_rtol`` of their own change.  ``compile``: the distributed run is
    ``fxshard run --compile --cpu-matmul cpu_matmul`` (the single-device reference stays eager).  ``weights``: a Hugging
    Face folder, compiled as ``fxshard compile --weights`` (each rank reads its slices from it at run time); the
    single-device model is ``make_model()`` with the folder's tensors loaded.  ``fp64``: both sides in float64
    (:mod:`fxshard.check.fp64`), for a model whose training amplifies fp32 rounding past the tolerance; an fp32
    verification that fails measures that (``Verification.floor``)::

        result = verify("samples/gpt.py", Layout(tp=2, pp=2), steps=3)
        assert result.ok, result.summary()
    """
    from fxshard.check.verify import check_verify_options
    from fxshard.train.local import launch_local
    from fxshard.train.modules import check_accumulated_loss
    from fxshard.train.options import RunOptions, check_compile, check_cpu_matmul, check_timeout
    from fxshard.train.reference import reference_losses

    check_verify_options(steps, rtol, param_rtol)  # before anything is compiled or launched
    check_timeout(timeout_s)
    check_cpu_matmul(cpu_matmul)
    if fp64:
        check_fp64(layout, weights)
    precision = "fp64" if fp64 else layout.dtype
    with tempfile.TemporaryDirectory(prefix="fxshard-verify-") as tmp:
        source = float64_model_file(model_file, Path(tmp)) if fp64 else model_file
        out = Path(out) if out is not None else Path(tmp) / "out"
        result = _compile(source, layout, out=out, plan=plan, seed=seed, weights=weights)
        metrics, final = out / "verify" / "metrics.jsonl", out / "verify" / "final"
        make_folder(metrics.parent, "verify's folder")
        options = RunOptions(steps=steps, optim=optim, metrics=metrics, timeout=timeout_s, compile=compile,
                             cpu_matmul=cpu_matmul, final_state=final)
        check_accumulated_loss(out, result.manifest, optim.grad_accum)  # as fxshard run, before it launches
        if compile:
            check_compile(out)
        launch_local(out, options.argv(out), layout.world_size)
        distributed = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
        trained = gather_parameters(result.manifest, final)
        ref_state: dict = {}
        mf = load_model_file(source).for_layout(layout)
        if weights is not None:
            mf = with_weights(mf, Path(weights))
        built = mf.build_model(seed)
        initial = dict(built.named_parameters(remove_duplicate=False))
        grad_sq, ref_buffers = {}, {}
        fp8 = result.ctx.layout.fp8_recipe  # its scales are per forward: one device runs the same parts of a batch
        chunks = result.ctx.layout.dp * result.ctx.microbatches if fp8 else 1
        reference = reference_losses(mf, steps, optim, seed, layout.dtype, final_state=ref_state, grad_sq=grad_sq,
                                     final_buffers=ref_buffers, fp8=fp8, chunks=chunks)
        quiet = quiet_parameters(grad_sq, {n: p.numel() for n, p in initial.items()}, precision)
        rows = compare_parameters(trained, ref_state, initial, quiet)
        stats = compare_running_stats(gather_parameters(result.manifest, final, kind="buffer"), ref_buffers, built)
        if len(distributed) != steps:
            raise FxshardError(f"the distributed run reported {len(distributed)} of {steps} steps; see its output "
                               "above")
        tolerances = (DEFAULT_RTOL[precision], DEFAULT_PARAM_RTOL[precision]) if fp64 else default_tolerances(layout)
        verification = Verification(result.ctx.layout, reference, distributed, rows,
                                    rtol if rtol is not None else tolerances[0],
                                    param_rtol if param_rtol is not None else tolerances[1],
                                    2 * adamw_reach(optim, steps), precision, stats=stats)
        if not verification.ok and precision == "fp32":  # one device's own rounding: can fp32 judge this model?
            verification.floor = rounding_floor(model_file, Path(tmp), layout, steps, optim, seed, reference,
                                                ref_state, distributed, trained, verification.apart, weights,
                                                train=reference_losses)
    return verification
