"""Run the benchmarks and write ``results/latest.json`` and ``results/latest.md``.

::

    python -m benchmarks.run              # everything, a few minutes (make bench)
    python -m benchmarks.run --quick      # tiny sizes, two steps each: a smoke run (results/quick.*)
    python -m benchmarks.run --only tp    # one part: tp (step time and collectives), matmul (the step's fp32
                                          # products on MKL and on oneDNN), pipeline, traffic, memory,
                                          # activations (saved bytes per layer vs Korthikanti and the plan),
                                          # recompute (step time of each --recompute mode), zero1 (ZeRO 1
                                          # collectives and step time before/after the distributed optimizer),
                                          # or compile
                                          # (compile time and peak RSS of a 70B-shaped Llama, 2 to 80 layers)
    python -m benchmarks.run --device cuda  # the tp part on NCCL, on the GPUs this machine has
                                            # (results/nccl.*: the CPU results stay as they are)
    python -m benchmarks.run --only single --device cuda   # world size 1: fxshard's code against the same
                                            # transformers model in a plain loop, eager and compiled, a ~1B Llama
                                            # in bf16 at seq 2048 (results/single-cuda.*; on the CPU a tiny one)
    python -m benchmarks.run --only auto    # fxshard calibrate, then 12 layouts at world size 4 predicted and
                                            # measured: ratios, rank correlation (results/auto-cpu.*)
    python -m benchmarks.run --only cp      # context parallelism: allgather, ring, a2a at cp=2 and cp=4 against cp=1
                                            # (step time, bytes sent, the ring's hidden transfer: results/cp-cpu.*)
    python -m benchmarks.run --only data    # a 50M-token file at tp=2 dp=2: step time against the example
                                            # batch, peak RSS over 10 and 2,000 steps (results/data-cpu.*)
    .venv-peers/bin/python -m benchmarks.run --only peers  # fxshard against torchtitan, Megatron-Core and
                                            # DeepSpeed (make peers) at tp2, dp2, pp2, tp2·dp2: step time ratios,
                                            # peak memory, losses from the same weights (results/peers-cpu.*)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import (  # noqa: E402
    activations,
    auto,
    comm,
    comm_axes,
    comm_experts,
    compile_scaling,
    context_parallel,
    cpu_matmul,
    data,
    memory,
    overlap,
    pipeline_idle,
    recompute_time,
    single,
    tp_step,
    zero1,
)
from benchmarks.common import BACKEND_OF, cpu_line, environment, write_results  # noqa: E402
from benchmarks.peers import bench as peers  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("tp", "matmul", "overlap", "pipeline", "traffic", "zero1", "memory", "activations", "recompute", "compile")
# parts run only when --only names them, into results files of their own
ALONE = ("single", "data", "auto", "cp", "peers")
GPU_PARTS = ("tp", "single")  # what --device cuda runs


def plan(quick: bool, device: str = "cpu") -> dict:
    """What to run: model sizes and rounds for tp, (pp, microbatches) pairs and rounds for pipelines."""
    if device == "cuda":  # steps of milliseconds: more rounds cost little; the compiles are the time
        return {"tp_sizes": ["tiny"] if quick else ["small", "medium"], "tp_rounds": 2 if quick else 50,
                "tp_warmup": 0 if quick else 3, "single_size": "tiny" if quick else "1b",
                "single_rounds": 2 if quick else 10, "single_warmup": 0 if quick else 2}
    single = {"single_size": "tiny", "single_rounds": 2 if quick else 6, "single_warmup": 0 if quick else 1,
              "cp_rounds": 2 if quick else 8, "cp_warmup": 0 if quick else 1}
    if quick:
        return single | {"tp_sizes": ["tiny"], "tp_rounds": 2, "tp_warmup": 0,
                "pipelines": [(2, 4)], "pipeline_rounds": 2, "pipeline_warmup": 0,
                "recompute_rounds": 2, "recompute_warmup": 0, "zero1_rounds": 2, "zero1_warmup": 0, "matmul_rounds": 2}
    return single | {"tp_sizes": ["tiny", "small", "medium"], "tp_rounds": 24, "tp_warmup": 2,
            "pipelines": [(2, 4), (4, 8)], "pipeline_rounds": 10, "pipeline_warmup": 2,
            "recompute_rounds": 12, "recompute_warmup": 2, "zero1_rounds": 20, "zero1_warmup": 2, "matmul_rounds": 20}


# part -> its key in the results and its sections: (heading, markdown of the part's result)
SECTIONS = {
    "tp": ("tp_step", [("Tensor-parallel step time", tp_step.markdown), ("Collectives per step", comm.markdown)]),
    "matmul": ("cpu_matmul", [("The step's matrix products on MKL and on oneDNN (--compile's CPU kernel)",
                                cpu_matmul.markdown)]),
    "overlap": ("overlap", [("Backward all-reduce overlapped with the weight gradients (tp=2)", overlap.markdown)]),
    "pipeline": ("pipeline", [("Pipeline idle fraction", pipeline_idle.markdown)]),
    "traffic": ("traffic", [("Pipeline and data-parallel traffic per step", comm_axes.markdown),
                            ("Expert-parallel all-to-all traffic per step", comm_experts.traffic_markdown)]),
    "zero1": ("zero1", [("ZeRO 1 before and after the distributed optimizer", zero1.markdown)]),
    "memory": ("memory", [("Memory per rank under each ZeRO stage", memory.markdown)]),
    "activations": ("activations", [("Activation bytes per layer per token (Korthikanti et al. 2022, and the plan)",
                                     activations.markdown)]),
    "recompute": ("recompute", [("Step time under each recompute mode", recompute_time.markdown)]),
    "compile": ("compile", [("Compile time and memory (70B-shaped Llama on meta, tp=8 pp=4)",
                             compile_scaling.markdown)]),
    "single": ("single", [("World size 1: fxshard's code against the same transformers model, eager and compiled",
                           single.markdown)]),
    "data": ("data", [("Training data: step time with a token file, host memory over steps", data.markdown)]),
    "auto": ("auto", [("The time model against measured steps (12 layouts at world size 4, gloo)", auto.markdown)]),
    "cp": ("cp", [("Context parallelism: step time against cp=1, bytes sent, the ring's hidden transfer",
                   context_parallel.markdown)]),
    "peers": ("peers", [("fxshard against torchtitan, Megatron-Core and DeepSpeed on the same Llama, weights and batch",
                         peers.markdown)]),
}


def run_part(part: str, settings: dict, work: Path, quick: bool, device: str = "cpu"):
    if part == "tp":
        return [tp_step.run(size, work, settings["tp_rounds"], settings["tp_warmup"], device=device)
                for size in settings["tp_sizes"]]
    if part == "matmul":
        return cpu_matmul.run(settings["tp_sizes"], settings["matmul_rounds"])
    if part == "overlap":
        return [overlap.run(size, work, settings["tp_rounds"], settings["tp_warmup"]) for size in settings["tp_sizes"]]
    if part == "pipeline":
        return [pipeline_idle.run(pp, m, work, settings["pipeline_rounds"], settings["pipeline_warmup"])
                for pp, m in settings["pipelines"]]
    if part == "traffic":
        return comm_axes.run(work) | {"experts": comm_experts.run(work)}  # --ep's all-to-alls: a table of their own
    if part == "zero1":
        return zero1.run(work, settings["zero1_rounds"], settings["zero1_warmup"])
    if part == "memory":
        return memory.run(2 if quick else 4, work)
    if part == "activations":
        return activations.run(work, quick)
    if part == "recompute":
        return recompute_time.run(work, settings["recompute_rounds"], settings["recompute_warmup"], quick)
    if part == "data":
        return data.run(work, quick)
    if part == "auto":
        return auto.run(work, quick)
    if part == "cp":
        return context_parallel.run(work, settings["cp_rounds"], settings["cp_warmup"], quick)
    if part == "peers":
        return peers.run(work, quick, settings.get("peer_layouts"))
    if part == "single":
        return single.run(settings["single_size"], work, settings["single_rounds"], settings["single_warmup"], device)
    assert part == "compile"
    return compile_scaling.run(work, quick)  # a fresh process per layer count: its peak RSS is its own


def render(results: dict) -> str:
    """The markdown of a results dict: the run's line, then each part it holds, in :data:`PARTS` order."""
    env = results["environment"]
    if env["backend"] == "nccl":
        head = (f"`{results['command']}` on {env['gpus']} × {env['gpu']} ({env['cpu_count']} CPU cores: "
                f"{cpu_line(env)}), torch "
                f"{env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, {env['date']} "
                f"({results['elapsed_s']:.0f} s).")
    else:
        head = (f"`{results['command']}` on {env['cpu_count']} CPU cores of {cpu_line(env)}, torch {env['torch']}, "
                "gloo, "
                f"{env['threads_per_process']} thread per process, {env['date']} ({results['elapsed_s']:.0f} s). "
                "Absolute times on a shared CPU mean little; compare the ratios, measured in the same run.")
    runs: dict[tuple[str, str], list[str]] = {}
    for part, where in results.get("earlier", {}).items():
        runs.setdefault((where["command"], where["date"]), []).append(part)
    for (command, date), parts in runs.items():
        head += f" Not rerun here: {', '.join(parts)}, from `{command}`, {date}."
    sections = [head]
    for part in PARTS + ALONE:
        key, parts = SECTIONS[part]
        if key in results:
            for heading, markdown in parts:
                sections += [f"## {heading}", markdown(results[key])]
    return "\n\n".join(sections)


def merged_with_earlier(results: dict, folder: Path, ran: list[str]) -> dict:
    """``results`` of an ``--only`` run, with the parts it did not run taken from the earlier ``latest.json``
    (so rerunning one part keeps the others' numbers); ``earlier`` says, per part taken, which run measured it."""
    path = folder / "latest.json"
    if not path.exists():
        return results
    earlier = json.loads(path.read_text())
    out = dict(results, earlier={})
    for part in PARTS:
        key = SECTIONS[part][0]
        if part in ran or key not in earlier:
            continue
        out[key] = earlier[key]
        out["earlier"][part] = earlier.get("earlier", {}).get(part) or {"command": earlier["command"],
                                                                        "date": earlier["environment"]["date"]}
    out["settings"] = {**earlier.get("settings", {}), **results["settings"]}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and two steps: a smoke run")
    parser.add_argument("--only", choices=PARTS + ALONE, action="append", help="run only this part (repeatable); "
                        "the other parts' results in latest.json are kept; single runs only when named, into "
                        "results/single-DEVICE.*")
    parser.add_argument("--layout", choices=list(peers.LAYOUTS), action="append",
                        help="--only peers: run only this layout (repeatable); the results file keeps the others' "
                             "from the run that measured them")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and markdown results")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the tp part on NCCL (results/nccl.*; the other parts are CPU measurements), or "
                             "--only single")
    args = parser.parse_args(argv)
    alone = [p for p in args.only or [] if p in ALONE]
    if alone and set(args.only) != set(alone):
        parser.error(f"--only {' '.join(alone)} runs alone, into results files of its own; run the other parts "
                     "in another command")
    if args.device == "cuda" and not set(args.only or ["tp"]) <= set(GPU_PARTS):
        parser.error(f"--device cuda runs the tp part or single; drop --only "
                     f"{' '.join(set(args.only) - set(GPU_PARTS))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False)")
    if args.layout and alone != ["peers"]:
        parser.error("--layout chooses the layouts of --only peers")
    parts = alone or (["tp"] if args.device == "cuda" else [p for p in PARTS if p in (args.only or PARTS)])
    settings = plan(args.quick, args.device) | ({"peer_layouts": args.layout} if args.layout else {})
    name = ("quick" if args.quick else "latest") if args.device == "cpu" else ("quick-nccl" if args.quick else "nccl")
    if alone:
        name = ("quick-" if args.quick else "") + f"{alone[0]}-{args.device}"
    command = "python -m benchmarks.run" + (" --quick" if args.quick else "") + \
        (" --device cuda" if args.device == "cuda" else "") + "".join(f" --only {p}" for p in args.only or []) + \
        "".join(f" --layout {name}" for name in args.layout or [])
    results: dict = {"command": command, "environment": environment(BACKEND_OF[args.device]), "settings": settings}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fxshard-bench-") as work:
        for part in parts:
            results[SECTIONS[part][0]] = run_part(part, settings, Path(work), args.quick, args.device)
    results["elapsed_s"] = round(time.perf_counter() - start, 1)
    if args.only and not args.quick and args.device == "cpu" and not alone:
        results = merged_with_earlier(results, args.out, parts)
    if args.layout and (args.out / f"{name}.json").exists():
        results = peers.with_earlier_layouts(results, json.loads((args.out / f"{name}.json").read_text()))
    markdown = render(results)
    json_path, md_path = write_results(results, markdown, args.out, name)
    print(f"\n{markdown}\n\nwrote {json_path} and {md_path}")
    return results


if __name__ == "__main__":
    main()
