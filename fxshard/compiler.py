"""The compiler: capture, plan, passes in a fixed order, code generation, the output folder.

The static checks of what it generated, the layout's ``auto`` policies and verify run around it, one layer up, in
the driver (:func:`fxshard.driver.compile` is ``fxshard compile``)::

    >>> from fxshard.compiler import compile_program
    >>> from fxshard.ir.layout import Layout
    >>> result = compile_program("samples/gpt.py", Layout(tp=2))   # the per-rank graph, in memory
    >>> result.ctx.passes_run[:5]
    ['capture', 'token_mean', 'tensor_parallel', 'collectives', 'dropout']
    >>> result.ctx.passes_run[5:]
    ['saved_activations', 'pipeline', 'blocks', 'overlap', 'checks']

(``tests/test_docs.py`` runs this example.)
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from safetensors.torch import save_file
from torch.utils import _pytree as pytree

from fxshard.capture.lora import lora_modules
from fxshard.capture.modelfile import (
    ModelFile,
    load_model_file,
)
from fxshard.capture.precision import capture_at
from fxshard.capture.program import Program
from fxshard.capture.rows import Rows, first_part, record_pairs
from fxshard.codegen import emit_rank, rank_file_name
from fxshard.codegen.collective_list import collective_entries
from fxshard.codegen.emit import RankCode
from fxshard.codegen.folder import PROGRAM, STAGE, staged_output
from fxshard.codegen.manifest import (
    MANIFEST,
    CollectiveEntry,
    InputEntry,
    Manifest,
    Mesh,
    PipelineInfo,
    RankEntry,
    StageEntry,
    StageRow,
    TensorEntry,
    TiedWeight,
)
from fxshard.codegen.stage_io import name_stage_values
from fxshard.codegen.weights import checkpoint_source, external_weights, shard_metadata, weight_shards
from fxshard.errors import LayoutError, PlanError, warn
from fxshard.files import make_folder, path_for_library, write_bytes, write_text
from fxshard.ir.autograd import requires_grad
from fxshard.ir.batch import cross_batch_products, has_router_loss, is_mean_of_sums, whole_batch_region
from fxshard.ir.context import CompileContext, spec
from fxshard.ir.contracts import (
    BLOCKED,
    COMMUNICATED,
    MASKS_INVARIANT,
    PLACED,
    STAGED,
    Fact,
    check_facts,
    check_order,
)
from fxshard.ir.cut import choose_microbatches, find_blocks, label_markers
from fxshard.ir.layout import EP, MESH_AXES, TP, Coords, Layout
from fxshard.ir.placement import Replicate, Shard, local_shape, slice_spec
from fxshard.ir.rows import BatchRows, batch_rows
from fxshard.ir.sequence import SequenceDims, sequence_dims
from fxshard.ir.stages import gradless_sends, pipeline_stages, tied_weights
from fxshard.passes import PASSES
from fxshard.plan.styles import resolve
from fxshard.version import __version__

# what code generation reads of the passes' result: placements, the collectives, dropout sites, the stages, the blocks
CODEGEN_REQUIRES = (PLACED, COMMUNICATED, MASKS_INVARIANT, STAGED, BLOCKED)


@dataclass
class CompiledProgram:
    out: Path | None
    ctx: CompileContext
    gm: fx.GraphModule
    sources: dict[str, str] = field(default_factory=dict)  # file name -> code
    manifest: Manifest | None = None
    checks: object | None = None  # the static checks of the generated files (fxshard.check.check's CheckReport)
    memory_plan: object | None = None  # with device_memory: fxshard plan's CostReport, which --recompute auto chose by

    @property
    def files(self) -> list[str]:
        return sorted(self.sources)


def load_plan_file(path: str | Path) -> dict:
    """Read ``PLAN = {...}`` from a Python plan file."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"{path}: no such plan file; expected a Python file defining PLAN = {{...}}")
    scope: dict = {}
    # a plan file may also say where to cut the pipeline: SPLIT_BEFORE = ["model.layers.8", ...]
    try:
        exec(builtins.compile(path.read_text(), str(path), "exec"), scope)
    except Exception as e:
        raise PlanError(f"{path}: the plan file failed to run: {type(e).__name__}: {e}") from e
    plan = scope.get("PLAN")
    split = scope.get("SPLIT_BEFORE")
    if plan is None and split is not None:
        plan = {}
    if not isinstance(plan, dict):
        raise PlanError(f"{path}: defines no PLAN dict; write PLAN = {{'layers.*.mlp.fc_in': fxshard.colwise(), ...}}")
    if split is not None:
        plan = dict(plan, split_before=split)
    return plan


def batch_size(inputs, where: str, rows: Rows | None = None) -> int | None:
    """The leading size shared by the tensor inputs (the batch), or None without tensor inputs; ``rows``: inputs
    that do not lead with the batch (:class:`~fxshard.capture.rows.Rows`), checked apart."""
    rows = rows or Rows(None)
    skip = {f"[{k!r}]" for k in (*rows.counted, *rows.whole)}
    leaves = [(pytree.keystr(p), v) for p, v in pytree.tree_flatten_with_path(inputs)[0]
              if isinstance(v, torch.Tensor) and pytree.keystr(p) not in skip]
    if not leaves:
        return None
    path, first = leaves[0]
    if first.dim() == 0:
        raise LayoutError(f"{where}: input {path} is a scalar tensor; pipeline microbatches split every tensor "
                          "input along its first (batch) dimension")
    b = first.shape[0]
    for p, v in leaves[1:]:
        if v.dim() == 0 or v.shape[0] != b:
            raise LayoutError(f"{where}: input {p} has shape {list(v.shape)} but {path} has batch size {b}; "
                              "pipeline microbatches split every tensor input along dim 0, so all must share it")
    return b


def _split_plan(plan: dict | None) -> tuple[dict | None, list[str]]:
    if not plan or "split_before" not in plan:
        return plan, []
    plan = dict(plan)
    split = plan.pop("split_before")
    if isinstance(split, str):
        split = [split]
    if not isinstance(split, (list, tuple)) or not all(isinstance(x, str) for x in split):
        raise PlanError(f"split_before must be a list of module paths, e.g. ['model.layers.8'], got {split!r}")
    return plan, list(split)


def compile_program(model_file: str | Path | ModelFile, layout: Layout, plan: dict | None = None,
                    seed: int = 0, program: Program | None = None, meta: bool = False) -> CompiledProgram:
    """Capture and transform; returns the per-rank graph and context without writing files.

    ``meta=True`` builds and captures the model with its parameters on the meta device."""
    if layout.recompute == "auto":
        raise LayoutError("--recompute auto: expected it resolved to none, selective or full before the compile; "
                          "found auto; compile through fxshard.driver.compile or `fxshard compile` with "
                          "--device-memory, which choose the mode by the plan")
    plan, split_before = _split_plan(plan)
    mf = (model_file if isinstance(model_file, ModelFile) else load_model_file(model_file)).for_layout(layout)
    microbatches, batch, inputs, split, peers = 1, None, None, None, []
    if program is None:
        inputs = mf.build_inputs(seed)
        where = f"{mf.path.name}: make_inputs()"
        rows = Rows.of(inputs)
        if layout.pp > 1 or layout.dp > 1:
            batch = batch_size(inputs, where, rows)
            if batch is None:
                raise LayoutError(f"{where} has no tensor input to split over data-parallel ranks or microbatches")
            if batch % layout.dp:
                ok = [d for d in range(1, batch + 1) if batch % d == 0]
                raise LayoutError(f"--dp {layout.dp}: the batch of {batch} ({where}) does not split evenly over "
                                  f"{layout.dp} data-parallel ranks; use --dp in {ok} or change the batch size")
            per_rank = batch // layout.dp
            microbatches = choose_microbatches(layout, per_rank, where) if layout.pp > 1 else 1
            size = per_rank // microbatches
            split = " and ".join(([f"--dp {layout.dp}"] if layout.dp > 1 else [])
                                 + ([f"{microbatches} microbatches"] if microbatches > 1 else [])) or None
            inputs, whole = first_part(inputs, rows, size, where, split or "the layout"), inputs
            # every rank's rows and every microbatch: the program specialized on the first must hold on the rest
            peers = [pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                                     rows.take(whole, k, k + size)) for k in range(size, batch, size)]
        program = capture_at(mf, seed, inputs, layout.compute_dtype if layout.mixed else None, meta, peers)
        program = record_pairs(program, rows, where, split)
    sequence = _sequence(mf, seed, inputs, program, layout) if layout.cp > 1 else None
    # under --dp: passes/router_loss.py makes its means whole-batch
    _check_router_loss(program, microbatches, mf, layout.cp)
    _check_scalar_parameters(program, layout)
    if layout.pp > 1:
        layout = dataclasses.replace(layout, microbatches=microbatches,
                                     virtual_stages=layout.stages_per_rank)
    markers = label_markers(program.gm)
    gm = program.gm
    resolved = resolve(program.model, plan)
    for message in resolved.warnings:
        warn(message)
    ctx = CompileContext(layout, program, resolved, model_file_name=mf.path.name, model_digest=mf.digest(),
                         split_before=split_before, microbatches=microbatches, batch=batch, sequence=sequence)
    if layout.recompute != "none" and find_blocks(program.module_types) is None:
        raise LayoutError(f"--recompute {layout.recompute}: {type(program.model).__name__} has no repeated blocks "
                          "(a ModuleList of layers, such as a transformer's), which are what "
                          "fxshard recomputes; drop --recompute")
    ctx.notes.extend(program.notes)  # capture's: data-dependent code specialized on the example batch
    if layout.tp > 1:  # at tp=1 no plan applies, so there is nothing to say about one
        ctx.notes.extend(resolved.notes)
    if markers and layout.pp == 1:
        ctx.notes.append(f"{markers} fxshard.pipeline_split() marker(s) ignored at --pp 1")
    if layout.zero and layout.dp == 1:  # a note, not an error: the layout trains correctly, it just shards nothing
        ctx.notes.append(f"--zero {layout.zero} has no effect at --dp 1: ZeRO shards optimizer state, gradients and "
                         "parameters over the data-parallel ranks; add --dp N (N > 1) or leave --zero 0")
    state = program.state_by_name()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in state and state[node.name].kind == "parameter":
                ctx.params.add(node)
            elif node.name not in state:
                ctx.user_inputs.add(node)
    if batch is not None and layout.dp * microbatches > 1:
        ctx.rows = _rows(mf, seed, program, ctx)
    gm = run_passes(gm, ctx)
    ctx.passes_run.insert(0, "capture")
    return CompiledProgram(None, ctx, gm)


def _sequence(mf: ModelFile, seed: int, inputs, program: Program, layout: Layout) -> SequenceDims:
    """Under ``--cp``: each captured value's sequence dimensions, from a second capture (on meta tensors) at another
    length (:mod:`fxshard.ir.sequence`)."""
    if inputs is None:  # a program captured by the caller: its rows of the example batch
        rows = next((i.shape[0] for i in program.inputs if i.is_tensor and i.shape), None)
        inputs = pytree.tree_map(lambda v: v[:rows] if isinstance(v, torch.Tensor) and v.dim() else v,
                                 mf.build_inputs(seed))
    dtype = layout.compute_dtype if layout.mixed else None
    return sequence_dims(lambda other: capture_at(mf, seed, other, dtype, meta=True).gm, inputs, program.gm,
                         f"{mf.path.name}: make_inputs()")


def _rows(mf: ModelFile, seed: int, program: Program, ctx: CompileContext) -> BatchRows:
    """Where the batch is split over dp ranks or microbatches: each captured value's placement over the batch's rows
    and the ops that mix them, from a second capture (on meta tensors) at twice the rows (:mod:`fxshard.ir.rows`)."""
    rows = next(i.shape[0] for i in program.inputs if i.is_tensor and i.shape)
    layout = ctx.layout
    second = _captured_twice(mf, seed, 2 * rows, layout.compute_dtype if layout.mixed else None, program.record)
    gm = program.gm
    exempt = {n.name: Replicate() for n in gm.graph.nodes if is_mean_of_sums(n)} if layout.dp > 1 and has_router_loss(
        program.model) else {}  # passes/router_loss.py makes them whole-batch means
    products = cross_batch_products(gm, ctx.user_inputs)  # passes/batch_gather.py computes them whole

    def analyse(products):
        return batch_rows(gm, second, {n.name for n in ctx.user_inputs}, f"{mf.path.name}: make_inputs()",
                          {n.name for n in whole_batch_region(products)}, exempt)
    rows = analyse(products)
    paired = [p for p in products if rows.pairs_rows(*p.args[:2])]
    return rows if paired == products else analyse(paired)  # a product of sizes equal to the rows by chance


def _captured_twice(mf: ModelFile, seed: int, rows: int, dtype, reads=None) -> fx.GraphModule:
    """The model captured at ``rows`` rows on meta tensors; its Python reads of tensor values (data-dependent code)
    answered as the program's capture answered them (``reads``: :mod:`fxshard.capture.specialize`), which meta
    tensors cannot: the analysis judges the program as specialized.  The compiles of one model at several layouts
    (fxshard plan's search, verify) capture it once (capture_at's cache)."""
    full = mf.build_inputs(seed)  # the first rows, a counted input's entries of them (capture/rows.py)
    inputs = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                             Rows.of(full).take(full, 0, rows))
    return capture_at(mf, seed, inputs, dtype, meta=True, reads=reads).gm


def _check_scalar_parameters(program: Program, layout: Layout) -> None:
    """FSDP2 (ZeRO 2 and 3) shards every parameter along its first dimension and refuses a 0-dim one (CLIP's
    ``logit_scale``) when the run starts; say so at compile, naming it."""
    if layout.zero < 2 or layout.dp == 1:
        return
    state = program.state_by_name()
    scalars = [state[n.name].fqn for n in program.gm.graph.nodes if n.op == "placeholder" and n.name in state
               and state[n.name].kind == "parameter" and getattr(n.meta.get("val"), "dim", lambda: 1)() == 0]
    if scalars:
        raise LayoutError(f"--zero {layout.zero}: {', '.join(scalars)} is a 0-dim parameter, which FSDP2 (ZeRO 2 and "
                          "3) cannot shard; use --zero 1 (the optimizer state sharded) or --zero 0, or make it a "
                          "1-element tensor in the model")


def _check_router_loss(program: Program, split: int, mf: ModelFile, cp: int) -> None:
    """A mixture-of-experts load-balancing loss (transformers' ``load_balancing_loss_func``) is E times the sum
    over experts of (fraction of the batch's tokens routed to e) x (mean router probability of e): a product of
    two means over the whole batch.  Computed per pipeline microbatch and averaged, it is another number (7.6e-4
    relative on a tiny Mixtral split in 2), so it is refused rather than trained inexactly; under --dp the means are
    made whole-batch means (passes/router_loss.py), not yet under --cp (each cp rank holds part of every sequence)."""
    check_router_loss(program.model, split, mf.path.name, "pipeline microbatches would compute per microbatch "
                      "and average", "or train without --pp (--dp makes both means whole-batch means)")
    check_router_loss(program.model, cp, f"{mf.path.name} at --cp {cp}", "each cp rank would compute over its own "
                      "tokens only (the means are made whole over dp, not yet over cp)", "or train without --cp")


def check_router_loss(model: torch.nn.Module, parts: int, where: str, how: str, fix: str) -> None:
    """Refuse a model whose loss adds transformers' load-balancing loss when the step's batch is cut into
    ``parts`` that each compute the loss (``how``: by which flag; ``fix``: the other way out than turning the loss
    off).  Also ``fxshard run --grad-accum K`` (:func:`fxshard.train.launch.train`): each accumulated batch would
    compute the two means on its own batch."""
    config = getattr(model, "config", None)
    if parts > 1 and has_router_loss(model):
        raise LayoutError(f"{where}: {type(model).__name__} adds its load-balancing loss "
                          f"(router_aux_loss_coef={config.router_aux_loss_coef}) to the loss; expected a loss that "
                          f"sums over parts of the batch, found a product of two whole-batch means, which {how}: "
                          f"training would not equal one device; set output_router_logits=False in the model file, "
                          f"{fix}")


def run_passes(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Run the registry's passes (:data:`fxshard.passes.PASSES`) in order, holding each to its contract
    (:mod:`fxshard.ir.contracts`): the order is checked before any runs; a pass whose gate says no is skipped (nor
    named in the rank files' headers); after each, the graph is linted and its ``ensures`` and every fact an
    earlier pass ensured are checked."""
    check_order(PASSES, CODEGEN_REQUIRES)
    ensured: dict[Fact, str] = {}
    for p in PASSES:
        if not p.applies(ctx):
            continue
        gm = p.run(gm, ctx)
        gm.graph.lint()
        check_facts(gm, ctx, p.run.__name__, p.ensures, ensured)
        ensured.update((fact, p.run.__name__) for fact in p.ensures)
        ctx.passes_run.append(p.name)
    return gm


def generate(result: CompiledProgram, mf: ModelFile, seed: int, weights: str | Path | None = None,
             meta: bool = False) -> dict[str, dict]:
    """Fill ``result.sources`` and ``result.manifest``; return each weights file's tensors.

    ``weights``: a Hugging Face folder (validated here) each rank reads its slices from at run time; with it or with
    ``meta``, the manifest records where each tensor the shards do not hold comes from."""
    source = checkpoint_source(weights, result.ctx.program) if weights is not None else None
    result.sources, result.manifest, shards = _generate(result, mf, seed)
    if meta or weights is not None:
        result.manifest = external_weights(result.manifest, shards, source)
    return shards


def shard_shapes(manifest: Manifest, shards: dict[str, dict]) -> dict[str, dict[str, tuple]]:
    """Weights file -> tensor key -> shape: what the shards hold and what the ranks read at run time."""
    shapes = {name: {k: tuple(t.shape) for k, t in tensors.items()} for name, tensors in shards.items()}
    for entry in manifest.ranks:
        shapes[entry.weights] |= entry.read_at_run_time
    return shapes


def _generate(result: CompiledProgram, mf: ModelFile, seed: int):
    """Rank files and manifest, then each rank's weight shard: the slices its manifest entry records."""
    ctx, layout = result.ctx, result.ctx.layout
    sources, ranks = {}, []
    if ctx.pipeline is not None:
        stages = pipeline_stages(result.gm, ctx)
        name_stage_values(result.gm, stages)
        sends = gradless_sends(stages, requires_grad(result.gm, ctx.trainable))
        ctx.notes.extend(n for n in sends if n not in ctx.notes)
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            coords = Coords(pp=pp_rank, tp=tp_rank)
            global_ranks = [r for r in range(layout.world_size)
                            if (layout.coords(r).pp, layout.coords(r).tp) == (pp_rank, tp_rank)]
            code = emit_rank(result.gm, ctx, coords, __version__, global_ranks)
            collectives = collective_entries(result.gm, ctx, pp_rank)
            fname = rank_file_name(coords)
            sources[fname] = code.source
            for e in range(layout.ep):  # every ep rank runs the same file on its own experts' weights
                here = coords.replace(ep=e) if layout.ep > 1 else coords
                holders = [r for r in global_ranks if layout.ep_rank(layout.coords(r).dp) == e]
                ranks.append(_rank_entry(result.gm, ctx, here, holders, fname, code, collectives))
    manifest = _manifest(result.gm, ctx, mf, seed, ranks)
    return sources, manifest, weight_shards(manifest, ctx.program.tensors)


def _rank_entry(gm: fx.GraphModule, ctx: CompileContext, coords: Coords, global_ranks: list[int],
                fname: str, code: RankCode, collectives: tuple[CollectiveEntry, ...]) -> RankEntry:
    """What the manifest records of one rank file: every tensor it holds, its placements and the slice of its source."""
    layout, program = ctx.layout, ctx.program
    state = program.state_by_name()
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    tied_by_kept: dict[str, list[str]] = {}
    for alias, kept in program.tied.items():
        tied_by_kept.setdefault(kept, []).append(alias)
    tensors = {}
    for key, pname in code.attrs.items():
        s = state[pname]
        placements = {TP: spec(placeholders[pname]).placement}
        if s.fqn in ctx.expert_params:  # passes/expert_parallel.py: this ep rank's experts (dim 0), whole over tp
            assert placements[TP] == Replicate(), (s.fqn, placements)
            placements[EP] = Shard(0)
        full = program.tensors[s.fqn]
        axis = next((a for a, p in placements.items() if isinstance(p, Shard)), TP)  # the one it is split over
        shape = local_shape(tuple(full.shape), placements[axis], layout.size(axis))
        tensors[key] = TensorEntry(
            source=s.fqn, kind=s.kind, persistent=s.persistent, placements=placements, global_shape=tuple(full.shape),
            shape=shape, dtype=str(full.dtype).removeprefix("torch."),
            slice=slice_spec(placements[axis], coords[axis], layout.size(axis)),
            aliases=tuple(sorted(tied_by_kept.get(s.fqn, []))))
    # emit describes the stages as dicts: they become typed here, at the manifest's boundary
    stages = tuple(map(StageEntry.from_json, code.stages)) if ctx.pipeline is not None else None
    ep = f"_ep{coords.ep}" if coords.ep is not None else ""
    return RankEntry(coords=coords, global_ranks=tuple(global_ranks), file=fname,
                     weights=f"weights/{fname.removesuffix('.py')}{ep}.safetensors", tensors=tensors,
                     collectives=collectives, stages=stages)


def _manifest(gm: fx.GraphModule, ctx: CompileContext, mf: ModelFile, seed: int, ranks: list[RankEntry]) -> Manifest:
    """The whole compile's record: model, layout, plan, inputs, the rank files and the pipeline."""
    layout, program = ctx.layout, ctx.program
    inputs = tuple(InputEntry(name=i.name, path=i.path, is_tensor=i.is_tensor, dtype=i.dtype,
                              shape=_batch_shape(i.shape, ctx) if i.is_tensor and not i.whole else tuple(i.shape),
                              microbatch_shape=tuple(i.shape), counted_by=i.counted_by, whole=i.whole)
                   for i in program.inputs)
    return Manifest(
        fxshard_version=__version__, model_file="model.py", model_name=mf.path.name, model_digest=ctx.model_digest,
        model_class=type(program.model).__name__, seed=seed, layout=layout, mesh=Mesh(MESH_AXES, layout.mesh_shape),
        plan_source=ctx.plan.source, plan=tuple(ctx.plan.describe()), notes=tuple(ctx.notes), inputs=inputs,
        outputs=tuple(program.output_paths), tied=dict(sorted(program.tied.items())),
        custom_ops={**program.custom_ops, **{f"fxshard_fn::{name}": f.module for name, f in program.functions.items()}},
        ranks=tuple(ranks), pipeline=_pipeline_info(gm, ctx), batch_couplings=tuple(ctx.batch_couplings),
        lora=tuple(lora_modules(program.model)))


def _pipeline_info(gm: fx.GraphModule, ctx: CompileContext) -> PipelineInfo | None:
    cut = ctx.pipeline
    if cut is None:
        return None
    state = ctx.program.state_by_name()
    tied = tuple(TiedWeight(f"tied:{state[p.name].fqn}", state[p.name].fqn, tuple(holders))
                 for p, holders in tied_weights(gm, pipeline_stages(gm, ctx), ctx.trainable))
    # the cut's table rows are dicts (passes/pipeline.py): typed here, at the manifest's boundary
    return PipelineInfo(stages=ctx.layout.num_stages, stages_per_rank=ctx.layout.stages_per_rank,
                        microbatches=ctx.microbatches, batch=ctx.batch, cut=cut.source,
                        table=tuple(map(StageRow.from_json, cut.table)), tied=tied)


def _batch_shape(shape, ctx: CompileContext) -> tuple[int, ...]:
    """The shape of an input for a whole step (the graph was captured on one microbatch of one dp rank)."""
    if ctx.batch is None or not shape:
        return tuple(shape)
    return (shape[0] * ctx.microbatches * ctx.layout.dp, *shape[1:])


def write_output(out: Path, result: CompiledProgram, mf: ModelFile, shards: dict) -> None:
    """Write the program into a staging folder beside ``out`` and swap it in (:mod:`fxshard.files.staged`):
    a failed compile leaves ``out`` as it was, and files fxshard did not write are never deleted.  The manifest
    records the sha256 of every generated file, so ``check`` and ``run`` can refuse one edited afterwards."""
    model_bytes = mf.path.read_bytes()  # read once: it may be out/model.py itself
    digests = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in result.sources.items()}
    digests["model.py"] = hashlib.sha256(model_bytes).hexdigest()
    result.manifest = dataclasses.replace(result.manifest, digests=digests)
    names = {*result.sources, *shards, "model.py", MANIFEST}
    with staged_output(out, names, PROGRAM) as stage:
        make_folder(stage / "weights", "the weight shards' folder")
        for name, text in result.sources.items():
            write_text(stage / name, text, "a rank file", owner=STAGE)
        for name, tensors in shards.items():
            with path_for_library(stage / name, "a weight shard", owner=STAGE) as tmp:
                save_file(tensors, str(tmp), metadata=shard_metadata(result.manifest, name))
        write_bytes(stage / "model.py", model_bytes, "the model file's copy", owner=STAGE)
        result.manifest.write(stage)
    result.out = out
