"""``python -m benchmarks.run --only peers``: fxshard against torchtitan and Megatron-Core on the same Llama, the
same initial weights and the same global batch, at tp2, dp2 (ZeRO 3 / FSDP2), dp2-replicated (every tool DDP-like: the
like-for-like dp row), pp2 (1F1B) and tp2·dp2.

Per layout, one set of gloo processes holds every tool and trains them in interleaved rounds
(:func:`benchmarks.common.interleave`); step time is reported as each tool's ratio to fxshard's in the same round.
Peak memory per rank is measured apart, one fresh process set per tool (all three packages imported in each, so the
baseline is the same), because tools sharing a process share its resident pages.  Losses are the global batch's mean
after each step, from the same weights (Hugging Face's, renamed for each peer: ``weights.py``).

The peers are not in ``make setup``'s environment: run it from ``make peers``' ``.venv-peers``.  A peer that does
not import or fails to build is reported with its error, not timed::

    .venv-peers/bin/python -m benchmarks.run --only peers        # results/peers-cpu.{md,json}
"""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import combine_ranks, interleave, paired_ratio, spawn, summarize
from benchmarks.peers.common import LAYOUTS, PeerLayout

TOOLS = ("fxshard", "torchtitan", "Megatron-Core", "DeepSpeed")
COMPILED = ("fxshard --compile", "torchtitan --compile")  # Megatron-Core's local spec has no torch.compile path
PACKAGES = {"torchtitan": "torchtitan", "Megatron-Core": "megatron.core", "DeepSpeed": "deepspeed"}


def missing_peers() -> dict[str, str]:
    """Peers whose package this environment lacks, with what to do about it."""
    return {tool: f"`{pkg}` is not installed in this environment; run from `make peers`' .venv-peers"
            for tool, pkg in PACKAGES.items() if importlib.util.find_spec(pkg.split(".")[0]) is None}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _model_and_batch():
    """The Hugging Face model's weights and the global batch, as fxshard compiled them (seed 0)."""
    from benchmarks.peers.fxshard_peer import MODEL_FILE
    from fxshard.capture.modelfile import load_model_file

    full, batch = load_model_file(MODEL_FILE).build(seed=0)
    return {k: v.detach().clone() for k, v in full.state_dict().items()}, batch


def build_peer(tool: str, layout: PeerLayout, out: str, hf: dict, batch: dict, device: torch.device):
    """``tool``'s :class:`~benchmarks.peers.common.Peer` on this rank, from the weights ``hf`` and the batch."""
    from benchmarks.models.peer_llama import make_model, size

    if tool == "DeepSpeed":
        from benchmarks.peers.deepspeed_peer import deepspeed_peer

        model = make_model()
        model.load_state_dict(hf)
        return deepspeed_peer(layout, model, batch, device)
    compiled = tool.endswith("--compile")
    if tool.startswith("fxshard"):
        from benchmarks.peers.fxshard_peer import fxshard_peer

        return fxshard_peer(Path(out), batch, device, compile=compiled)
    if tool.startswith("torchtitan"):
        from benchmarks.peers.torchtitan_peer import torchtitan_peer

        return torchtitan_peer(layout, hf, batch, size(), device, compile=compiled)
    from benchmarks.peers.megatron_peer import megatron_peer

    return megatron_peer(layout, hf, batch, size(), device)


def not_here(tool: str, layout: PeerLayout) -> str | None:
    """Why ``tool`` does not run ``layout`` at all (not an error: a layout the tool does not offer), or None."""
    if tool == "DeepSpeed":
        from benchmarks.peers.deepspeed_peer import LAYOUTS as DEEPSPEED_LAYOUTS
        from benchmarks.peers.deepspeed_peer import NOT_OFFERED

        return None if layout.name in DEEPSPEED_LAYOUTS else NOT_OFFERED
    return None


def notes(layout: PeerLayout, ran: list[str], backend: str) -> dict[str, str]:
    """How each tool that ran splits the layout's dp work, where the tools differ."""
    out = {}
    if layout.dp > 1 and not layout.sharded:  # like for like: every tool all-reduces whole gradients
        out["fxshard"] = "--zero 0 (gradients all-reduced in buckets during backward, nothing sharded)"
        out["torchtitan"] = ("FSDP2 on a replicate mesh (`data_parallel_replicate_degree`), its way to replicate: "
                             "parameters whole, gradients all-reduced")
        out["Megatron-Core"] = "its DistributedDataParallel (gradients all-reduced, no sharding)"
        out["DeepSpeed"] = "ZeRO stage 0 (its DDP)"
    elif layout.dp > 1:
        out["fxshard"] = "--zero 3 (parameters, gradients and optimizer state sharded over dp)"
        out["torchtitan"] = "FSDP2 (fully_shard per block and the whole model), as its recipe"
        if "Megatron-Core" in ran:
            from benchmarks.peers.megatron_peer import DISTOPT_ON_CPU

            out["Megatron-Core"] = ("its DistributedDataParallel (gradients all-reduced, no sharding): on the CPU "
                                    f"its distributed optimizer refuses the parameters, {DISTOPT_ON_CPU}"
                                    if backend == "gloo" else "its distributed optimizer (ZeRO 1)")
        out["DeepSpeed"] = "ZeRO stage 3"
    return {t: why for t, why in out.items() if t in ran}


def _agreed_failures(failed: dict[str, str]) -> dict[str, str]:
    """Every rank's failures, on every rank: a tool that failed on one rank is left out on all."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failed)
    return {tool: why for per_rank in gathered for tool, why in per_rank.items()}


def _quiet() -> None:
    """The peers' import-time warnings (no Apex, no Transformer Engine, DTensor RNG on the CPU) left out of the log."""
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("torchtitan").setLevel(logging.WARNING)


def _worker(rank: int, world: int, layout_name: str, out: str, tools: list[str], rounds: int, warmup: int) -> dict:
    _quiet()
    layout, device = LAYOUTS[layout_name], _device()
    hf, batch = _model_and_batch()
    peers, failed = {}, {}
    for tool in tools:
        try:
            peers[tool] = build_peer(tool, layout, out, hf, batch, device)
        except Exception as e:  # noqa: BLE001  (reported in the results page, with its traceback's last line)
            failed[tool] = f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]
            failed[tool + " traceback"] = traceback.format_exc()[-3000:]
    failed = _agreed_failures(failed)
    losses = {tool: [] for tool in peers if tool not in failed}
    steps = {tool: (lambda t=tool: losses[t].append(peers[t].step())) for tool in losses}
    times = interleave(steps, rounds=rounds, warmup=warmup, sync=torch.cuda.synchronize if device.type == "cuda"
                       else (lambda: None)) if steps else {}
    profiles = {tool: profile_step(steps[tool]) for tool in steps}  # one more step each, under torch.profiler
    return {"times": times, "losses": losses, "failed": failed, "profiles": profiles if rank == 0 else {}}


def profile_step(step, top: int = 8) -> dict:
    """One call of ``step`` under torch.profiler (CPU activity): how many ops it dispatched, their self time, and
    the ``top`` ops by self time (name, calls, ms): where a tool's step goes, next to the others'."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"ops": sum(e.count for e in events if e.key.startswith("aten::")),
            "self_ms": round(sum(e.self_cpu_time_total for e in events) / 1e3, 2),
            "top": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in events[:top]]}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _memory_worker(rank: int, world: int, layout_name: str, out: str, tool: str, steps: int) -> dict:
    """Peak memory of one tool alone: peak RSS (the CPU) or torch.cuda's peak allocation (a GPU) over ``steps``."""
    _quiet()
    for pkg in PACKAGES.values():  # every process imports all three, so every tool starts from the same baseline
        if importlib.util.find_spec(pkg.split(".")[0]) is not None:
            __import__(pkg)
    layout, device = LAYOUTS[layout_name], _device()
    hf, batch = _model_and_batch()
    base = _rss_mib()
    peer = build_peer(tool, layout, out, hf, batch, device)
    for _ in range(steps):
        peer.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cuda = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return {"base_mib": base, "peak_mib": peak, "cuda_peak_mib": cuda}


def _first_losses(per_rank: list[dict]) -> dict[str, list[float]]:
    """Each tool's losses from a rank that reports them (the last pipeline stage)."""
    out = {}
    for tool in per_rank[0]["losses"]:
        out[tool] = next((r["losses"][tool] for r in per_rank if r["losses"][tool] and r["losses"][tool][0]
                          is not None), [])
    return out


def run_layout(layout: PeerLayout, work: Path, tools: list[str], rounds: int, warmup: int, memory_steps: int,
               backend: str = "gloo", log=print) -> dict:
    from benchmarks.peers.fxshard_peer import compile_layout

    out = work / f"peers-{layout.name}"
    if not out.exists():
        compile_layout(layout, out)
    skipped = {t: why for t in tools if (why := not_here(t, layout))}
    tools = [t for t in tools if t not in skipped]
    log(f"peers {layout.name}: {', '.join(tools)}, {warmup} + {rounds} interleaved rounds")
    per_rank = spawn(_worker, layout.world, layout.name, str(out), tools, rounds, warmup, backend=backend,
                     timeout=1800)
    failed = per_rank[0]["failed"]
    ran = [t for t in tools if t not in failed]
    times = combine_ranks([r["times"] for r in per_rank]) if ran else {}
    result = {"layout": layout.name, "world": layout.world, "rounds": rounds, "warmup": warmup,
              "failed": {t: why for t, why in failed.items() if not t.endswith(" traceback")} | skipped,
              "tracebacks": {t[:-len(" traceback")]: why for t, why in failed.items() if t.endswith(" traceback")},
              "summary": summarize(times) if ran else {}, "losses": _first_losses(per_rank),
              "profiles": per_rank[0].get("profiles", {})}
    base = next((t for t in ran if t.startswith("fxshard")), None)
    result["ratio_to_fxshard"] = {t: paired_ratio(times, t, "fxshard --compile" if "--compile" in t else base)
                                  for t in ran if base and ("fxshard --compile" in ran or "--compile" not in t)}
    result["notes"] = notes(layout, ran, backend)
    result["memory"] = {}
    for tool in ran if memory_steps else []:
        mem = spawn(_memory_worker, layout.world, layout.name, str(out), tool, memory_steps, backend=backend,
                    timeout=1800)
        result["memory"][tool] = {"peak_mib": round(max(m["peak_mib"] for m in mem), 1),
                                  "above_base_mib": round(max(m["peak_mib"] - m["base_mib"] for m in mem), 1),
                                  "cuda_peak_mib": None if mem[0]["cuda_peak_mib"] is None else
                                  round(max(m["cuda_peak_mib"] for m in mem), 1)}
    return result


def run(work: Path, quick: bool, layouts: list[str] | None = None, compiled: bool = False, log=print) -> dict:
    """Every layout of :data:`LAYOUTS` (or ``layouts``) at the size ``FXSHARD_PEERS_SIZE`` names (default: toy when
    ``quick``, else small)."""
    from benchmarks.models.peer_llama import SIZE_VARIABLE, size

    os.environ.setdefault(SIZE_VARIABLE, "toy" if quick else "small")
    missing = missing_peers()
    tools = [t for t in TOOLS + (COMPILED if compiled else ()) if t.split(" ")[0] not in missing]
    rounds, warmup, memory_steps = (2, 0, 1) if quick else (6, 1, 2)
    results = [run_layout(LAYOUTS[name], work, tools, rounds, warmup, memory_steps, log=log)
               for name in layouts or LAYOUTS]
    return {"size": os.environ[SIZE_VARIABLE], "shape": size(), "missing": missing, "layouts": results}


def with_earlier_layouts(results: dict, earlier: dict) -> dict:
    """``results`` of a run of some layouts (``--layout``), with the other layouts of the ``earlier`` results file
    kept, each saying which run measured it (its command and date), in :data:`LAYOUTS` order."""
    if earlier["peers"].get("size", results["peers"].get("size")) != results["peers"].get("size"):
        raise SystemExit(f"the earlier results measured FXSHARD_PEERS_SIZE={earlier['peers']['size']}, this run "
                         f"{results['peers']['size']}: rerun every layout (no --layout), or set the same size")
    ran = {r["layout"] for r in results["peers"]["layouts"]}
    kept = {r["layout"]: r | {"measured": r.get("measured") or {"command": earlier["command"],
                                                                  "date": earlier["environment"]["date"]}}
            for r in earlier["peers"]["layouts"] if r["layout"] not in ran}
    layouts = {r["layout"]: r for r in results["peers"]["layouts"]} | kept
    out = dict(results)
    out["peers"] = dict(results["peers"], layouts=[layouts[n] for n in LAYOUTS if n in layouts])
    return out


# ---------------------------------------------------------------- the results page


def _ms(s: dict) -> str:
    return f"{s['median_ms']:.1f} [{s['p25_ms']:.1f}, {s['p75_ms']:.1f}]"


def _loss_cells(losses: dict, tool: str) -> tuple[str, str]:
    mine, ours = losses.get(tool) or [], losses.get("fxshard") or []
    if not mine:
        return "not reported", ""
    diff = max((abs(a - b) for a, b in zip(mine, ours, strict=False)), default=float("nan"))
    return f"{mine[-1]:.6f} ({len(mine)} steps)", f"{diff:.1e}"


def layout_markdown(r: dict) -> str:
    from benchmarks.common import markdown_table

    rows = []
    for tool, s in r["summary"].items():
        ratio = r["ratio_to_fxshard"].get(tool)
        mem = r["memory"].get(tool, {})
        peak = mem.get("cuda_peak_mib") or mem.get("peak_mib", "")
        loss, diff = _loss_cells(r["losses"], tool)
        rows.append([tool, _ms(s), f"{ratio['median']:.3f} [{ratio['p25']:.3f}, {ratio['p75']:.3f}]" if ratio else "",
                     f"{s['cpu_median_ms']:.1f}", peak, mem.get("above_base_mib", ""), loss, diff])
    head = [f"### {r['layout']} ({r['world']} ranks; {r['warmup']} warm-up + {r['rounds']} timed rounds)"]
    if r.get("measured"):
        head.append(f"Measured by `{r['measured']['command']}`, {r['measured']['date']} (not rerun since).")
    if rows:
        head.append(markdown_table(["tool", "step ms, median [p25, p75]", "÷ fxshard's step, same round",
                                    "CPU ms per step (all ranks)", "peak MiB per rank", "above baseline MiB",
                                    "loss after the last step", "largest |Δ loss| from fxshard"], rows))
    peers = {t: q["median"] for t, q in r["ratio_to_fxshard"].items() if not t.startswith("fxshard")}
    eager = {t: v for t, v in peers.items() if "--compile" not in t}
    if eager:
        best = min(eager, key=eager.get)
        head.append(f"fxshard against the fastest peer ({best}): **{eager[best]:.2f}×** its speed "
                    f"({'at least' if eager[best] >= 1 else 'below'} the issue's 1.0× goal).")
        if eager[best] < 1:
            head.append(behind(r, best))
    head += [f"- **{tool}** (dp): {how}" for tool, how in r.get("notes", {}).items()]
    if r.get("profiles"):
        prof = [[tool, p["ops"], f"{p['self_ms']:.1f}", "; ".join(f"{n} ×{c} {ms:.1f} ms" for n, c, ms in p["top"][:5])]
                for tool, p in r["profiles"].items()]
        head.append("One more step of each under torch.profiler, rank 0 (aten ops dispatched, their self CPU time, "
                    "the 5 heaviest):\n\n" + markdown_table(["tool", "aten ops", "self ms", "heaviest"], prof))
    head += [f"- **{tool}** not run: {why.removeprefix('not run: ')}" for tool, why in r["failed"].items()]
    return "\n\n".join(head)


def behind(r: dict, peer: str) -> str:
    """Where fxshard's step goes against ``peer``'s, from the profiled step of each (rank 0), and what differs in
    the comparison itself: the rounds' spread, the matmuls each dispatched, dp work sharded against not."""
    ours, theirs = r.get("profiles", {}).get("fxshard"), r.get("profiles", {}).get(peer)
    if not ours or not theirs:
        return f"Behind {peer}; no profile of this run to say where."
    heavy = "; ".join(f"{n} ×{c} {ms:.1f} ms" for n, c, ms in ours["top"][:3])
    text = (f"Behind {peer}: in the profiled step fxshard dispatched {ours['ops']} aten ops ({ours['self_ms']:.1f} ms "
            f"of self CPU time on rank 0) against {theirs['ops']} ({theirs['self_ms']:.1f} ms); fxshard's heaviest: "
            f"{heavy}.")
    ratio = r["ratio_to_fxshard"][peer]
    if ratio["p25"] < 1 < ratio["p75"]:
        text += (f" Within the rounds' spread: {peer}'s step over fxshard's is {ratio['p25']:.2f} to "
                 f"{ratio['p75']:.2f} between the quartiles of the rounds.")
    mm = {t: next((c for n, c, _ in p["top"] if n == "aten::mm"), None) for t, p in (("fxshard", ours), (peer, theirs))}
    if peer == "Megatron-Core" and mm["fxshard"] and mm[peer] and mm[peer] < mm["fxshard"]:
        text += (f" fxshard runs {mm['fxshard']} matrix products to Megatron-Core's {mm[peer]}: Megatron's layer spec "
                 "fuses q, k and v into one linear and gate and up into another, where fxshard runs the unmodified "
                 "model's own linears, each its own kernel (on 2 CPU cores at this size a product is mostly "
                 "dispatch).")
    if peer == "Megatron-Core" and "distributed optimizer refuses" in r.get("notes", {}).get(peer, ""):
        sharded = {t: q["median"] for t, q in r["ratio_to_fxshard"].items()
                   if t not in ("fxshard", peer) and not t.startswith("fxshard")}
        text += _UNSHARDED + (f" Against the other sharded tools here fxshard is "
                              f"{'ahead' if all(v >= 1 for v in sharded.values()) else 'not always ahead'} ("
                              + ", ".join(f"{t} {v:.2f}" for t, v in sharded.items()) + f"); the like-for-like row "
                              f"is {r['layout']}-replicated, where every tool replicates." if sharded else "")
    return text


_UNSHARDED = (" Not like for like: Megatron-Core's dp here all-reduces whole gradients and shards nothing (its note "
              "below; its sharded recipe, the distributed optimizer, runs only on a GPU), while fxshard's ZeRO 3 "
              "all-gathers each block's parameters before use and reduce-scatters its gradients "
              "(FSDP::all_gather, FSDP::post_backward_reduce in its profile), as torchtitan's FSDP2 does.")


def markdown(results: dict) -> str:
    from benchmarks.peers.shims import CPU_SHIMS

    shape = results["shape"]
    parts = [f"A Llama of {shape['layers']} layers, hidden {shape['hidden']}, SwiGLU {shape['ffn']}, "
             f"{shape['heads']} heads ({shape['kv_heads']} key/value), vocabulary {shape['vocab']}, batch "
             f"{shape['batch']} × {shape['seq']} tokens (`FXSHARD_PEERS_SIZE={results['size']}`), fp32, AdamW. "
             "Every tool starts from the same weights and trains on the same global batch; each layout's tools "
             "share one set of processes and take turns step by step. The ratio column is each tool's step time "
             "over fxshard's in the same round (above 1: slower than fxshard). Peak memory: each tool alone in "
             "fresh processes that import all the peers (the baseline), peak RSS on the CPU, torch.cuda's peak "
             "allocation on a GPU."]
    for tool, why in results.get("missing", {}).items():
        parts.append(f"- **{tool}** not run: {why}")
    parts += [layout_markdown(r) for r in results["layouts"]]
    rows = [f"- **{peer}**: {where}. Without it: {error}. Changed here: {change}."
            for peer, shims in CPU_SHIMS.items() for where, error, change in shims]
    parts.append("### What the peers needed to run on a CPU with gloo\n\nNone of these changes the computation; "
                 "each is a device placement or a collective's reduce op (`benchmarks/peers/shims.py`).\n\n"
                 + "\n".join(rows))
    return "\n\n".join(parts)
