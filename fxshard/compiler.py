"""The compiler driver: capture, plan, passes in a fixed order, code generation.

::

    result = fxshard.compile("samples/gpt.py", Layout(tp=2), out="out/gpt-tp2")
    print(result.files)
"""

from __future__ import annotations

import builtins
import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch.fx as fx
from safetensors.torch import save_file

from fxshard import __version__
from fxshard.capture import Program, capture
from fxshard.codegen import emit_rank, rank_file_name
from fxshard.context import CompileContext, Layout, spec
from fxshard.errors import LayoutError, OutputFolderError, PlanError
from fxshard.modelfile import ModelFile, load_model_file
from fxshard.passes.checks import checks_pass
from fxshard.passes.collectives import collectives_pass
from fxshard.passes.tensor_parallel import tensor_parallel_pass
from fxshard.placement import SliceSpec, local_shape, take
from fxshard.plan import resolve

PASSES = [tensor_parallel_pass, collectives_pass, checks_pass]
from fxshard.output import FORMAT, MANIFEST  # noqa: E402


@dataclass
class CompiledProgram:
    out: Path | None
    ctx: CompileContext
    gm: fx.GraphModule
    sources: dict[str, str] = field(default_factory=dict)  # file name -> code
    manifest: dict = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return sorted(self.sources)


def check_layout(layout: Layout) -> None:
    """Reject layouts this version does not implement yet, before any work."""
    if layout.pp > 1:
        raise LayoutError(f"--pp {layout.pp}: pipeline parallelism is not implemented yet in fxshard {__version__}; use --pp 1")
    if layout.dp > 1:
        raise LayoutError(f"--dp {layout.dp}: data parallelism is not implemented yet in fxshard {__version__}; use --dp 1")
    if layout.zero:
        raise LayoutError(f"--zero {layout.zero}: ZeRO is not implemented yet in fxshard {__version__}; use --zero 0")
    if layout.microbatches not in (None, 1):
        raise LayoutError(f"--microbatches {layout.microbatches} applies to pipeline parallelism (--pp > 1), "
                          "which is not implemented yet; leave it unset")
    if layout.schedule != "1f1b":
        raise LayoutError(f"--schedule {layout.schedule} applies to pipeline parallelism (--pp > 1), "
                          "which is not implemented yet; leave it unset")


def load_plan_file(path: str | Path) -> dict:
    """Read ``PLAN = {...}`` from a Python plan file."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"{path}: no such plan file; expected a Python file defining PLAN = {{...}}")
    scope: dict = {}
    try:
        exec(builtins.compile(path.read_text(), str(path), "exec"), scope)
    except Exception as e:
        raise PlanError(f"{path}: the plan file failed to run: {type(e).__name__}: {e}") from e
    plan = scope.get("PLAN")
    if not isinstance(plan, dict):
        raise PlanError(f"{path}: defines no PLAN dict; write PLAN = {{'layers.*.mlp.fc_in': fxshard.colwise(), ...}}")
    return plan


def compile_program(model_file: str | Path | ModelFile, layout: Layout, plan: dict | None = None,
                    seed: int = 0, program: Program | None = None) -> CompiledProgram:
    """Capture and transform; returns the per-rank graph and context without writing files."""
    check_layout(layout)
    mf = model_file if isinstance(model_file, ModelFile) else load_model_file(model_file)
    program = program or capture(mf, seed)
    gm = program.gm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = resolve(program.model, plan)
    for w in caught:
        warnings.warn(str(w.message), stacklevel=2)
    ctx = CompileContext(layout, program, resolved, model_file_name=mf.path.name, model_digest=mf.digest())
    state = program.state_by_name()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in state and state[node.name].kind == "parameter":
                ctx.params.add(node)
            elif node.name not in state:
                ctx.user_inputs.add(node)
    for p in PASSES:
        gm = p(gm, ctx)
        gm.graph.lint()
        ctx.passes_run.append(p.__name__.removesuffix("_pass"))
    ctx.passes_run.insert(0, "capture")
    return CompiledProgram(None, ctx, gm)


def compile(model_file: str | Path, layout: Layout, out: str | Path | None = None, plan: dict | None = None,
            seed: int = 0) -> CompiledProgram:
    """Compile ``model_file`` for ``layout``; write rank files, manifest and weights to ``out`` if given."""
    mf = load_model_file(model_file)
    result = compile_program(mf, layout, plan, seed)
    result.sources, result.manifest, shards = _generate(result, mf, seed)
    if out is not None:
        write_output(Path(out), result, mf, shards)
    return result


def _generate(result: CompiledProgram, mf: ModelFile, seed: int):
    ctx, gm = result.ctx, result.gm
    layout = ctx.layout
    program = ctx.program
    state = program.state_by_name()
    sources, ranks, shards = {}, [], {}
    tied_by_kept: dict[str, list[str]] = {}
    for alias, kept in program.tied.items():
        tied_by_kept.setdefault(kept, []).append(alias)
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for tp_rank in range(layout.tp):
        coords = {"dp": 0, "pp": 0, "tp": tp_rank}
        global_ranks = [r for r in range(layout.world_size) if layout.coords(r)["tp"] == tp_rank]
        code = emit_rank(gm, ctx, coords, __version__, global_ranks)
        fname = rank_file_name(coords)
        sources[fname] = code.source
        wname = f"weights/{fname.removesuffix('.py')}.safetensors"
        tensors, entries = {}, {}
        for pname, attr in code.attrs.items():
            s = state[pname]
            placement = spec(placeholders[pname]).placement
            full = program.tensors[s.fqn]
            sl = SliceSpec.of(placement, tp_rank, layout.tp)
            local = take(full.detach(), sl)
            tensors[attr] = local.contiguous().clone()
            entries[attr] = {
                "source": s.fqn,
                "kind": s.kind,
                "persistent": s.persistent,
                "placement": repr(placement),
                "global_shape": list(full.shape),
                "shape": list(local_shape(tuple(full.shape), placement, layout.tp)),
                "dtype": str(full.dtype).removeprefix("torch."),
                "slice": sl.to_json(),
                "aliases": sorted(tied_by_kept.get(s.fqn, [])),
            }
        shards[wname] = tensors
        ranks.append({"coords": coords, "global_ranks": global_ranks, "file": fname, "weights": wname,
                      "tensors": entries, "collectives": code.collectives})
    manifest = {
        "format": FORMAT,
        "fxshard_version": __version__,
        "model_file": "model.py",
        "model_name": mf.path.name,
        "model_digest": ctx.model_digest,
        "model_class": type(program.model).__name__,
        "seed": seed,
        "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "zero": layout.zero,
                   "schedule": layout.schedule, "microbatches": layout.microbatches},
        "mesh": {"axes": ["dp", "pp", "tp"], "shape": list(layout.mesh_shape)},
        "plan_source": ctx.plan.source,
        "plan": ctx.plan.describe(),
        "notes": ctx.notes,
        "inputs": [{"name": i.name, "path": i.path, "is_tensor": i.is_tensor, "shape": list(i.shape), "dtype": i.dtype}
                   for i in program.inputs],
        "outputs": program.output_paths,
        "tied": dict(sorted(program.tied.items())),
        "ranks": ranks,
    }
    return sources, manifest, shards


def write_output(out: Path, result: CompiledProgram, mf: ModelFile, shards: dict) -> None:
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise OutputFolderError(f"{out}: exists and is not an fxshard output folder (no {MANIFEST}); "
                                "choose an empty or new folder")
    if out.exists() and (out / MANIFEST).is_file():
        for old in list(out.glob("rank_*.py")) + [out / "weights"]:
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
    (out / "weights").mkdir(parents=True, exist_ok=True)
    for name, text in result.sources.items():
        (out / name).write_text(text)
    for name, tensors in shards.items():
        save_file(tensors, str(out / name))
    shutil.copyfile(mf.path, out / "model.py")
    (out / MANIFEST).write_text(json.dumps(result.manifest, indent=2, sort_keys=False) + "\n")
    result.out = out
