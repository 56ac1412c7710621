"""Rich terminal output for the commands (tables, highlighted code).  Presentation only."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from fxshard.codegen.emit import collective_counts
from fxshard.output import layout_of, rank_entry, read_manifest


def _collective_counts(entry: dict) -> str:
    f, b = collective_counts(entry["collectives"])
    return f"fwd: {f}\nbwd: {b}"


def _rank_table(manifest: dict, title: str) -> Table:
    table = Table(title=title, show_lines=True)
    table.add_column("global ranks")
    table.add_column("coords", no_wrap=True)
    table.add_column("file", no_wrap=True, min_width=16)
    table.add_column("local params", justify="right")
    table.add_column("collectives per microbatch" if manifest.get("pipeline") else "collectives per step")
    for entry in manifest["ranks"]:
        n = sum(_numel(t["shape"]) for t in entry["tensors"].values() if t["kind"] == "parameter")
        coords = " ".join(f"{k}={v}" for k, v in entry["coords"].items() if k != "dp")
        table.add_row(", ".join(map(str, entry["global_ranks"])), coords, entry["file"], f"{n:,}",
                      _collective_counts(entry))
    return table


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _plan_lines(console: Console, manifest: dict) -> None:
    console.print(f"[bold]plan[/] ({manifest['plan_source']}):")
    from fxshard.context import compress_plan

    for line in compress_plan(manifest["plan"]) or ["(nothing split: every module replicated)"]:
        console.print(f"  {line}", highlight=False)
    for note in manifest.get("notes", []):
        console.print(f"[yellow]note:[/] {note}", highlight=False)


def _stage_table(manifest: dict) -> Table | None:
    pipe = manifest.get("pipeline")
    if not pipe:
        return None
    table = Table(title=f"pipeline: {manifest['layout']['schedule']}, {pipe['stages']} stages, "
                        f"{pipe['microbatches']} microbatches of {pipe['batch'] // pipe['microbatches']} "
                        f"(cut: {pipe['cut']})")
    table.add_column("stage", justify="right")
    table.add_column("pp", justify="right")
    table.add_column("holds", no_wrap=True)
    table.add_column("blocks", justify="right")
    table.add_column("GFLOP/mb", justify="right")
    table.add_column("share", justify="right")
    table.add_column("param MB", justify="right")
    table.add_column("MB/tp rank", justify="right")
    total = sum(r["flops"] for r in pipe["table"]) or 1
    for r in pipe["table"]:
        table.add_row(str(r["stage"]), str(r["pp_rank"]), r["holds"], str(r["blocks"]), f"{r['flops'] / 1e9:.4f}",
                      f"{100 * r['flops'] / total:.0f}%", f"{r['param_bytes'] / 2**20:.2f}",
                      f"{r['local_param_bytes'] / 2**20:.2f}")
    return table


def compile_report(console: Console, result) -> None:
    manifest = result.manifest
    _plan_lines(console, manifest)
    stages = _stage_table(manifest)
    if stages is not None:
        console.print(stages)
        for tie in manifest["pipeline"]["tied"]:
            console.print(f"tied: {tie['fqn']} is held by stages {tie['stages']}; its gradient is summed between "
                          "them after backward", highlight=False)
    console.print(_rank_table(manifest, f"{manifest['model_class']} from {manifest['model_name']} — "
                                        f"{layout_of(manifest).describe()}"))
    console.print(f"wrote {result.out}: {len(result.files)} rank file(s), manifest.json, weights/, model.py")
    console.print(f"read a rank's code with `fxshard show {result.out} --rank 0`; "
                  f"train with `fxshard run {result.out} --steps 3`")


def show_layout(console: Console, out: Path) -> None:
    manifest = read_manifest(out)
    _plan_lines(console, manifest)
    stages = _stage_table(manifest)
    if stages is not None:
        console.print(stages)
    console.print(_rank_table(manifest, f"{out}: {manifest['model_class']} — {layout_of(manifest).describe()}"))


def show_rank(console: Console, out: Path, rank: int) -> None:
    manifest = read_manifest(out)
    layout = layout_of(manifest)
    if not 0 <= rank < layout.world_size:
        from fxshard.errors import OutputFolderError

        raise OutputFolderError(f"--rank {rank}: {out} has ranks 0..{layout.world_size - 1}")
    entry = rank_entry(manifest, layout.coords(rank))
    code = (Path(out) / entry["file"]).read_text()
    if console.is_terminal:
        console.print(Syntax(code, "python", line_numbers=True, word_wrap=False))
    else:
        console.print(code, highlight=False, markup=False, soft_wrap=True)
