"""Static checks of a compiled program: would it start, and would its ranks agree?

Run at the end of every compile (on the files just generated) and by ``fxshard check OUT`` (on the
files in the folder, so an edited or stale file is caught before it hangs a run):

- the layout: world size = dp · pp · tp, one rank file per (pp, tp) coordinate with the right global
  ranks and stages, batches and sharded sizes that divide, headers that agree with ``manifest.json``;
- every rank of a process group issues the same collectives in the same order with the same shapes
  and dtypes (forward and backward, per pipeline stage), including the tied-weight gradient sums;
- every pipeline send has its receive: stage ``s``'s ``OUTPUTS`` are stage ``s + 1``'s ``INPUTS``;
- the parameters each rank file creates match the manifest and the weight shards.

The collectives come from the rank files themselves (``fxshard.check.rank_trace``)::

    report = check_output("out/gpt-tp2")        # raises CheckError naming file:line and collective
    [g.label for g in report.groups]            # ['tp group [0, 1]']
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from fxshard.check.collective_diff import first_difference
from fxshard.check.rank_trace import Collective, RankTrace, trace_rank
from fxshard.codegen import rank_file_name
from fxshard.codegen.manifest import Manifest, RankEntry, edited_files, read_manifest, refuse_edited
from fxshard.errors import CheckError
from fxshard.ir.comm import SUM_TIED_GRADS, communicating
from fxshard.ir.layout import CPTP, EP, MESH_AXES, PP, TP, Coords
from fxshard.ir.placement import Shard, local_shape

RECOMPILE = "Recompile with `fxshard compile` instead of editing generated files."
AS_COMPILED = ("The rank files are as fxshard compile wrote them (their sha256 matches manifest.json), so "
               "recompiling will not help: a library they import may be missing or of another version here, or "
               "this is a bug in fxshard; please report it with the model file and the command line.")
COMPILER_BUG = ("This is a bug in fxshard (it generated inconsistent rank files); please report it with the "
                "model file and the command line.")


@dataclass
class GroupCheck:
    """One kind of process group whose members were compared (a row of ``fxshard check``'s summary)."""

    label: str  # "tp group [0, 1]"
    scope: str  # "RankModule", "Stage3", "all stages", "sync_tied_grads"
    files: list[str]
    forward: int  # collectives per call of every member (microbatch or step)
    backward: int


@dataclass
class CheckReport:
    ranks: int  # rank files checked
    world: int
    traced: bool  # forward and backward ran on meta tensors (else: the source was scanned)
    groups: list[GroupCheck] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # pipeline send/recv pairs checked


def check_output(out: str | Path, allow_edited: bool = False) -> CheckReport:
    """Check a compiled output folder: manifest, rank files (run on meta tensors), weight shards, the
    ``--weights`` folder they read from, and (unless ``allow_edited``) that no generated file was edited."""
    out = Path(out)
    manifest = read_manifest(out)
    sources = {e.file: (out / e.file).read_text() for e in manifest.ranks}  # read_manifest: they exist
    problems: list[str] = []
    weights = _weight_shapes(out, manifest, problems)
    problems += _external_weights(manifest)
    if problems:
        _fail(problems, RECOMPILE)
    if not allow_edited:  # before anything of the folder runs: a file edited after compile is refused unrun
        refuse_edited(out, manifest)
    return check_program(sources, manifest, weights, run=True, fix=_fix_for(out, manifest))


def _fix_for(out: Path, manifest: Manifest) -> str:
    """Blame an edit only where a generated file differs from what the compile wrote (older manifests record
    no digest: an edit cannot be ruled out)."""
    if manifest.digests is None:
        return RECOMPILE
    edited = edited_files(out, manifest)
    if edited:
        were = "was" if len(edited) == 1 else "were"
        return f"{', '.join(edited)} {were} changed after fxshard compile wrote it (sha256). {RECOMPILE}"
    return AS_COMPILED


def _external_weights(manifest: Manifest) -> list[str]:
    """The ``--weights`` folder and files the ranks read their tensors from at run time still exist."""
    source = manifest.weights
    if source is None or source.dir is None:
        return []
    if not Path(source.dir).is_dir():
        return [f"the --weights folder {source.dir} the ranks read their weights from is missing; restore it, "
                "or recompile with --weights pointing at its new place"]
    missing = sorted({f for f in source.files.values() if not Path(f).is_file()})
    return [f"{f}: a --weights file the ranks read from is missing; restore it or recompile" for f in missing]


def check_program(sources: dict[str, str], manifest: Manifest, weights: dict[str, dict[str, tuple]] | None = None,
                  run: bool = True, fix: str = RECOMPILE) -> CheckReport:
    """Check rank file sources (file name -> text) against their manifest; raise ``CheckError`` on a problem.

    ``weights``: weights file -> tensor key -> shape, when known.  ``run=False`` scans the sources instead
    of running them (the cheap check of every compile)."""
    layout = manifest.layout
    problems = _check_layout(manifest, layout, sources)
    if problems:
        _fail(problems, fix)
    traces: dict[str, RankTrace] = {}
    failed: set[str] = set()
    for entry in manifest.ranks:
        problems += _check_header(sources[entry.file], entry, manifest)
        if entry.file in failed:
            continue
        if entry.file not in traces:  # under --ep every ep rank's entry runs one file: traced once (its first)
            try:
                traces[entry.file] = trace_rank(sources[entry.file], entry.file, manifest, entry, run)
            except CheckError as e:
                problems.append(str(e))
                failed.add(entry.file)
                continue
        problems += _check_tensors(traces[entry.file], entry, (weights or {}).get(entry.weights))
    if problems:  # the comparisons below need every rank file traced
        _fail(problems, fix)
    report = CheckReport(len(sources), layout.world_size, run)
    problems += _check_groups(manifest, layout, traces, sources, report)
    problems += _check_links(manifest, layout, traces, sources, report)
    if problems:
        _fail(problems, fix)
    return report


def _fail(problems: list[str], fix: str):
    if len(problems) == 1:
        raise CheckError(f"{problems[0]}. {fix}")
    shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
    raise CheckError(f"{len(problems)} problems:\n  {shown}\n{fix}")


def _weight_shapes(out: Path, manifest: Manifest, problems: list[str]) -> dict[str, dict[str, tuple]]:
    """Weights file -> tensor key -> shape, read from the safetensors headers; an unreadable file is a problem."""
    from safetensors import safe_open

    shapes = {}
    for entry in manifest.ranks:
        path = out / entry.weights
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes[entry.weights] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except Exception as e:  # missing, truncated (the header disagrees with the size) or not safetensors
            problems.append(f"{path}: cannot read the weights of {entry.file} ({type(e).__name__}: {e}); "
                            "the file is unreadable, truncated or damaged")
            continue
        # --weights DIR / a meta compile: the rest is read from the checkpoint folder at run time
        shapes[entry.weights] |= entry.read_at_run_time
    return shapes


def _ranks_text(ranks: list[int]) -> str:
    return f"global rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# ---------------------------------------------------------------- layout, headers, tensors


def _check_layout(manifest: Manifest, layout, sources: dict[str, str]) -> list[str]:
    problems = []
    mesh = list(manifest.mesh.shape)
    if mesh != list(layout.mesh_shape):
        problems.append(f"manifest.json: mesh shape {mesh} but the layout {layout.describe()} needs "
                        f"{list(layout.mesh_shape)} (dp, pp, tp), world size {layout.world_size}")
    by_coords = {}
    for entry in manifest.ranks:
        c = entry.coords
        key = (c.pp, c.tp, c.ep or 0)  # under --ep one entry per ep rank, all running one file
        if key in by_coords or not (0 <= c.pp < layout.pp and 0 <= c.tp < layout.tp) or c.dp or not (
                0 <= key[2] < layout.ep):
            problems.append(f"manifest.json: rank file {entry.file} has coordinates {c}, outside the "
                            f"{layout.pp} x {layout.tp} (pp x tp) grid of {layout.describe()} or listed twice")
            continue
        by_coords[key] = entry
        want_ranks = [r for r in range(layout.world_size) if (layout.coords(r).pp, layout.coords(r).tp,
                                                               layout.ep_rank(layout.coords(r).dp)) == key]
        if list(entry.global_ranks) != want_ranks:
            problems.append(f"manifest.json: {entry.file} runs on {_ranks_text(entry.global_ranks)}, but "
                            f"pp={key[0]} tp={key[1]} of a world of {layout.world_size} is {_ranks_text(want_ranks)}")
        if entry.file != rank_file_name(c):
            problems.append(f"manifest.json: the rank file of pp={key[0]} tp={key[1]} is {entry.file}, "
                            f"expected {rank_file_name(c)}")
        if entry.file not in sources:
            problems.append(f"{entry.file}: listed in the manifest but missing")
        held = [s.index for s in entry.stages or ()]
        if layout.pp > 1 and held != layout.stages_of(key[0]):
            problems.append(f"manifest.json: {entry.file} holds stages {held}"
                            f", but pp rank {key[0]} of {layout.describe()} holds {layout.stages_of(key[0])}")
    missing = [rank_file_name(Coords(pp=p, tp=t)) for p in range(layout.pp) for t in range(layout.tp)
               for e in range(layout.ep) if (p, t, e) not in by_coords]
    if missing:
        problems.append(f"manifest.json: no rank file for {', '.join(missing)}; {layout.describe()} needs "
                        f"{layout.pp * layout.tp} (one per pp x tp coordinate)")
    return problems + _check_sizes(manifest, layout)


def _check_sizes(manifest: Manifest, layout) -> list[str]:
    """Batches split over dp ranks and microbatches, tensors split over tp ranks: every split divides."""
    problems = []
    parts = layout.dp * ((layout.microbatches or 1) if layout.pp > 1 else 1)
    for i in manifest.inputs:
        if i.is_tensor and i.shape and not i.whole and parts > 1 and i.shape[0] != i.microbatch_shape[0] * parts:
            problems.append(f"manifest.json: input {i.name} has batch {i.shape[0]}, which is not "
                            f"{parts} (dp x microbatches) x its microbatch of {i.microbatch_shape[0]}")
    for entry in manifest.ranks:
        for key, t in entry.tensors.items():
            unknown = sorted(set(t.placements) - {*MESH_AXES, EP})
            if unknown or len([p for p in t.placements.values() if isinstance(p, Shard)]) > 1:
                problems.append(f"manifest.json: {entry.file} {key} has placements {t.placements}, expected one "
                                f"per mesh axis ({', '.join((*MESH_AXES, EP))}), split over one of them at most")
                continue
            placement, n = t.placement, layout.size(t.axis)
            if isinstance(placement, Shard) and not placement.divides(t.global_shape[placement.dim], n):
                problems.append(f"{entry.file}: {t.source} has size {t.global_shape[placement.dim]} in dim "
                                f"{placement.dim}, which does not split over {t.axis}={n}"
                                + (f" as {placement}" if placement.general else
                                   f" in {placement.blocks} blocks" if placement.blocks > 1 else ""))
            elif list(local_shape(t.global_shape, placement, n)) != list(t.shape):
                problems.append(f"manifest.json: {entry.file} {key} ({t.source}, {placement}) has shape "
                                f"{list(t.shape)}, expected {list(local_shape(t.global_shape, placement, n))}")
    return problems


_HEADER = {
    "layout": re.compile(r"^# layout:\s+tp=(\d+) pp=(\d+) dp=(\d+)"),
    "rank": re.compile(r"^# this rank: (?:pp rank (\d+) of \d+, )?tp rank (\d+) of \d+; "
                       r"the same code runs on global ranks ([\d, ]+)"),
    "model": re.compile(r"^# model:\s+.* \(sha256 ([0-9a-f]+)\)"),
}


def _check_header(source: str, entry: RankEntry, manifest: Manifest) -> list[str]:
    """The rank file's header names the layout, coordinates and model digest of the manifest."""
    file, lay = entry.file, manifest.layout
    found = {}
    for n, line in enumerate(source.splitlines()[:40], 1):
        for key, pattern in _HEADER.items():
            m = pattern.match(line)
            if m and key not in found:
                found[key] = (n, m.groups())
    if len(found) < len(_HEADER):
        return [f"{file}: no fxshard header (lines '# layout:', '# this rank:', '# model:'); it was not generated "
                "by fxshard compile or was edited"]
    problems = []
    (n, (tp, pp, dp)) = found["layout"]
    if (int(tp), int(pp), int(dp)) != (lay.tp, lay.pp, lay.dp):
        problems.append(f"{file}:{n}: compiled for tp={tp} pp={pp} dp={dp}, but manifest.json is for tp={lay.tp} "
                        f"pp={lay.pp} dp={lay.dp}: a rank file left from another compile")
    (n, (pp_rank, tp_rank, ranks)) = found["rank"]
    coords = (int(pp_rank or 0), int(tp_rank))
    listed = [int(r) for r in ranks.replace(",", " ").split()]
    running = sorted(r for e in manifest.ranks if e.file == file for r in e.global_ranks)  # every ep rank's
    if coords != (entry.coords.pp, entry.coords.tp) or listed != running:
        problems.append(f"{file}:{n}: the header says pp rank {coords[0]}, tp rank {coords[1]}, {_ranks_text(listed)}; "
                        f"manifest.json has it at pp={entry.coords.pp} tp={entry.coords.tp}, "
                        f"{_ranks_text(running)}")
    (n, (digest,)) = found["model"]
    if manifest.model_digest is not None and digest != manifest.model_digest:
        problems.append(f"{file}:{n}: generated from model digest {digest}, but manifest.json is for "
                        f"{manifest.model_digest}: a rank file left from another compile")
    return problems


def _check_tensors(trace: RankTrace, entry: RankEntry, weights: dict[str, tuple] | None) -> list[str]:
    """The parameters and buffers the rank file creates, against the manifest and the weights shard."""
    made = {}
    for name, cls in trace.classes.items():
        prefix = "" if name == "RankModule" else name + "."
        made |= {prefix + k: shape for k, (shape, _) in cls.tensors.items()}
    listed = {k: t.shape for k, t in entry.tensors.items()}
    problems = []
    for what, other in (("manifest.json", listed), (entry.weights, weights)):
        if other is None:
            continue
        missing, extra = sorted(set(other) - set(made)), sorted(set(made) - set(other))
        wrong = [k for k in sorted(set(made) & set(other)) if tuple(other[k]) != made[k]]
        if missing or extra:
            problems.append(f"{trace.file}: creates tensors {extra[:3]} that {what} lacks, and lacks {missing[:3]}"
                            if extra and missing else
                            f"{trace.file}: creates tensors {extra[:3]} that {what} does not have" if extra else
                            f"{trace.file}: does not create {missing[:3]}, which {what} has")
        for k in wrong[:3]:
            problems.append(f"{trace.file}: creates {k} with shape {list(made[k])}, but {what} has {list(other[k])}")
    return problems


# ---------------------------------------------------------------- collectives and pipeline links


def _check_groups(manifest: Manifest, layout, traces: dict[str, RankTrace], sources: dict[str, str],
                  report: CheckReport) -> list[str]:
    """Per process group, every member issues the same sequence of collectives."""
    entries = {(e.coords.pp, e.coords.tp): e for e in manifest.ranks}
    problems = [f"{c.where()}: rt.{c.call} over {c.group}: each collective needs this rank's process group "
                f"(self.tp, self.pp or groups[...])"
                for t in traces.values() for c in _all_events(t) if c.group.startswith("<")]
    for p in range(layout.pp):  # the tp group of each pp coordinate, per class (stage)
        members = [entries[(p, t)] for t in range(layout.tp)]
        label = _group_label(layout, TP, lambda d, t, p=p: layout.rank_of(dp=d, pp=p, tp=t), layout.tp)
        for cls in traces[members[0].file].classes:
            problems += _compare(label, cls, TP, members, _class_phases(cls), traces, sources, report)
    for p in range(layout.pp if layout.size(CPTP) > max(layout.tp, layout.cp) and layout.fp8_recipe else 0):
        # fp8 amaxes under --cp, over cp x tp; every cp rank runs its tp coordinate's file
        members = [entries[(p, t)] for t in range(layout.tp)]
        label = _group_label(layout, CPTP, lambda d, i, p=p: layout.rank_of(
            dp=d, pp=p, cp=i // layout.tp, tp=i % layout.tp), layout.size(CPTP))
        for cls in traces[members[0].file].classes:
            problems += _compare(label, cls, CPTP, members, _class_phases(cls), traces, sources, report)
    for p in range(layout.pp if layout.ep > 1 else 0):  # the ep groups: their ranks' token exchanges, in order
        for t in range(layout.tp):
            members = [e for e in manifest.ranks if (e.coords.pp, e.coords.tp) == (p, t)]  # one per ep rank
            groups = [g for g in layout.expert_groups()[EP] if (layout.coords(g[0]).pp, layout.coords(g[0]).tp)
                      == (p, t)]
            label = f"ep group{'s' * (len(groups) > 1)} {', '.join(map(str, groups))}"
            for cls in traces[members[0].file].classes:
                problems += _compare(label, cls, EP, members, _class_phases(cls), traces, sources, report)
    if layout.pp > 1:  # the pp group of each tp coordinate: generated code issues no collective over it
        for t in range(layout.tp):
            members = [entries[(p, t)] for p in range(layout.pp)]
            label = _group_label(layout, PP, lambda d, p, t=t: layout.rank_of(dp=d, pp=p, tp=t), layout.pp)
            problems += _compare(label, "all stages", PP, members, _ALL_STAGES, traces, sources, report)
        for tie in manifest.pipeline.tied:
            holders = sorted({layout.stage_rank(s) for s in tie.stages})
            for t in range(layout.tp if len(holders) > 1 else 0):
                members = [entries[(p, t)] for p in holders]
                label = _group_label(layout, "tied-weight",
                                     lambda d, i, t=t, h=holders: layout.rank_of(dp=d, pp=h[i], tp=t),
                                     len(holders))
                problems += _compare(label, "sync_tied_grads", tie.name, members, _TIED, traces, sources, report)
    return problems


def _group_label(layout, axis: str, rank, size: int) -> str:
    """``tp group [0, 1]``, or ``tp groups [0, 1], [4, 5]`` over dp replicas (which run the same files)."""
    groups = [[rank(d, i) for i in range(size)] for d in range(layout.dp)]
    return f"{axis} group{'s' * (len(groups) > 1)} {', '.join(map(str, groups))}"


def _all_events(trace: RankTrace) -> list[Collective]:
    return [c for cls in trace.classes.values() for c in cls.forward + cls.backward] + trace.tied


def _class_phases(cls: str) -> dict:
    """What one class (pipeline stage) issues per call, forward and backward."""
    return {"forward": lambda tr: tr.classes[cls].forward if cls in tr.classes else [],
            "backward": lambda tr: tr.classes[cls].backward if cls in tr.classes else []}


_ALL_STAGES = {"forward": lambda tr: [c for k in tr.classes.values() for c in k.forward],
               "backward": lambda tr: [c for k in tr.classes.values() for c in k.backward]}
_TIED = {"after backward": lambda tr: tr.tied}


def _compare(label, scope, group, members, phases, traces, sources, report) -> list[str]:
    """Compare, per phase, the collectives over ``group`` that ``members`` (manifest entries) issue."""
    counts, problems = {}, []
    for phase, get in phases.items():
        seqs = [[c for c in get(traces[m.file]) if c.group == group] for m in members]
        counts[phase] = len(seqs[0])
        problem = _explain(label, scope, group, phase, members, seqs, traces, sources)
        if problem:
            problems.append(problem)
    if not problems and len(members) > 1:
        report.groups.append(GroupCheck(label, scope, [m.file for m in members], counts.get("forward", 0),
                                        counts.get("backward", counts.get("after backward", 0))))
    return problems


def _explain(label, scope, group, phase, members, seqs, traces, sources) -> str | None:
    keys = [tuple(c.key for c in s) for s in seqs]
    if len(set(keys)) == 1:
        return None
    # the odd one out: the rank in the smallest class of identical sequences; between two ranks, the
    # one whose forward no longer matches what the compiler recorded in the manifest (the edited file)
    sizes = {k: keys.count(k) for k in keys}
    agrees = [_matches_manifest(s, m) for s, m in zip(seqs, members, strict=True)]
    ref = max(range(len(seqs)), key=lambda i: (sizes[keys[i]], agrees[i], -i))
    odd = next(i for i in range(len(seqs)) if keys[i] != keys[ref])
    a, b = members[ref], members[odd]
    elsewhere = {c.ident: c for c in _all_events(traces[b.file]) if c.group != group}
    where, text = first_difference(seqs[ref], seqs[odd], a.file, _ranks_text(a.global_ranks), b.file,
                                   sources[b.file].splitlines(), phase, elsewhere)
    return f"{where} ({_ranks_text(b.global_ranks)}): {label} in {scope}: {text}; running this would hang"


def _matches_manifest(seq: list[Collective], entry: RankEntry) -> bool:
    """Whether ``seq`` issues what the compiler recorded for these lines (values of the same stage), in order."""
    if not seq:
        return True
    direction = seq[0].direction
    calls = {SUM_TIED_GRADS} if direction == "after backward" else {k.name for k in communicating(direction)}
    recorded = [c for c in entry.collectives if c.op in calls]
    stages = {c.stage for c in recorded if c.value in {x.value for x in seq}}
    expected = [(c.value, c.op) for c in recorded if c.stage in stages]
    mine = [(c.value, c.call) for c in seq]
    return mine == expected if direction == "forward" else sorted(mine) == sorted(expected)


def _check_links(manifest: Manifest, layout, traces: dict[str, RankTrace], sources: dict[str, str],
                 report: CheckReport) -> list[str]:
    """Every pipeline send has its receive: OUTPUTS of stage s = INPUTS of stage s + 1 (count, shape, dtype)."""
    if layout.pp == 1:
        return []
    entries = {(e.coords.pp, e.coords.tp): e for e in manifest.ranks}
    problems = []
    for t in range(layout.tp):
        first = traces[entries[(0, t)].file].module.Stage0
        want = [(i.microbatch_shape, i.dtype) for i in manifest.inputs if i.is_tensor]
        got = [(tuple(shape), str(dtype).removeprefix("torch.")) for _, shape, dtype, _ in first.INPUTS]
        if got != want:
            problems.append(f"{_decl(sources, entries[(0, t)].file, 'Stage0', 'INPUTS')}: stage 0 takes {got} "
                            f"from the schedule, but the batch inputs per microbatch are {want}")
        for s in range(layout.num_stages - 1):
            src, dst = entries[(layout.stage_rank(s), t)], entries[(layout.stage_rank(s + 1), t)]
            problem = _link(sources, traces, src.file, f"Stage{s}", dst.file, f"Stage{s + 1}")
            if problem:
                problems.append(problem)
            elif t == 0:
                n = len(traces[src.file].module.__dict__[f"Stage{s}"].OUTPUTS)
                report.links.append(f"stage {s} -> stage {s + 1}: {n} tensor{'s' * (n != 1)} per microbatch")
    return problems


def _decl(sources: dict[str, str], file: str, cls: str, attr: str) -> str:
    """``file:line`` of ``attr = ...`` in class ``cls``."""
    lines = sources[file].splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"class {cls}(")), 0)
    n = next((i for i in range(start, len(lines)) if lines[i].strip().startswith(f"{attr} =")), start)
    return f"{file}:{n + 1}"


def _link(sources, traces, src_file, src_cls, dst_file, dst_cls) -> str | None:
    sent = [(tuple(shape), str(dtype).removeprefix("torch."), rg) for _, shape, dtype, rg in
            traces[src_file].module.__dict__[src_cls].OUTPUTS]
    taken = [(tuple(shape), str(dtype).removeprefix("torch."), rg) for _, shape, dtype, rg in
             traces[dst_file].module.__dict__[dst_cls].INPUTS]
    out_at, in_at = _decl(sources, src_file, src_cls, "OUTPUTS"), _decl(sources, dst_file, dst_cls, "INPUTS")
    returned = traces[src_file].classes[src_cls].outputs
    if returned and returned != [(s, d) for s, d, _ in sent]:
        return (f"{out_at}: {src_cls}.forward returns {_metas(returned)} but its OUTPUTS declare "
                f"{_metas(sent)}; the pipeline would send the declared shapes and hang or fail")
    if sent == taken:
        return None
    if len(sent) != len(taken):
        return (f"{out_at}: {src_cls} sends {len(sent)} tensors per microbatch ({_metas(sent)}) but {in_at}: "
                f"{dst_cls} receives {len(taken)} ({_metas(taken)}); a send without its receive hangs")
    i = next(i for i in range(len(sent)) if sent[i] != taken[i])
    return (f"{out_at}: {src_cls} sends tensor #{i + 1} as {_metas([sent[i]])} but {in_at}: {dst_cls} receives "
            f"{_metas([taken[i]])}; a send without its matching receive hangs")


def _metas(metas) -> str:
    return ", ".join(f"{m[1]} {list(m[0])}" + (" (with gradient)" if len(m) > 2 and m[2] else "") for m in metas)
