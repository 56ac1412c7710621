"""Run the benchmarks and write ``results/latest.json`` and ``results/latest.md``.

::

    python -m benchmarks.run              # everything, a few minutes (make bench)
    python -m benchmarks.run --quick      # tiny sizes, two steps each: a smoke run (results/quick.*)
    python -m benchmarks.run --only tp    # one part: tp (step time and collectives), pipeline, traffic, memory,
                                          # activations (saved bytes per layer vs Korthikanti and the plan),
                                          # recompute (step time of each --recompute mode), or compile
                                          # (compile time and peak RSS of a 70B-shaped Llama, 2 to 80 layers)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (  # noqa: E402
    activations,
    comm,
    comm_axes,
    compile_scaling,
    memory,
    pipeline_idle,
    recompute_time,
    tp_step,
)
from benchmarks.common import environment, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("tp", "pipeline", "traffic", "memory", "activations", "recompute", "compile")


def plan(quick: bool) -> dict:
    """What to run: model sizes and rounds for tp, (pp, microbatches) pairs and rounds for pipelines."""
    if quick:
        return {"tp_sizes": ["tiny"], "tp_rounds": 2, "tp_warmup": 0,
                "pipelines": [(2, 4)], "pipeline_rounds": 2, "pipeline_warmup": 0,
                "recompute_rounds": 2, "recompute_warmup": 0}
    return {"tp_sizes": ["tiny", "small", "medium"], "tp_rounds": 40, "tp_warmup": 2,
            "pipelines": [(2, 4), (4, 8)], "pipeline_rounds": 10, "pipeline_warmup": 2,
            "recompute_rounds": 20, "recompute_warmup": 2}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and two steps: a smoke run")
    parser.add_argument("--only", choices=PARTS, action="append", help="run only this part (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and markdown results")
    args = parser.parse_args(argv)
    parts = args.only or list(PARTS)
    settings = plan(args.quick)
    name = "quick" if args.quick else "latest"
    command = "python -m benchmarks.run" + (" --quick" if args.quick else "") + \
        "".join(f" --only {p}" for p in args.only or [])
    results: dict = {"command": command, "environment": environment(), "settings": settings}
    sections = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fxshard-bench-") as work:
        if "tp" in parts:
            results["tp_step"] = [tp_step.run(size, Path(work), settings["tp_rounds"], settings["tp_warmup"])
                                  for size in settings["tp_sizes"]]
            sections += ["## Tensor-parallel step time", tp_step.markdown(results["tp_step"]),
                         "## Collectives per step", comm.markdown(results["tp_step"])]
        if "pipeline" in parts:
            results["pipeline"] = [pipeline_idle.run(pp, m, Path(work), settings["pipeline_rounds"],
                                                     settings["pipeline_warmup"])
                                   for pp, m in settings["pipelines"]]
            sections += ["## Pipeline idle fraction", pipeline_idle.markdown(results["pipeline"])]
        if "traffic" in parts:
            results["traffic"] = comm_axes.run(Path(work))
            sections += ["## Pipeline and data-parallel traffic per step", comm_axes.markdown(results["traffic"])]
        if "memory" in parts:
            results["memory"] = memory.run(2 if args.quick else 4, Path(work))
            sections += ["## Memory per rank under each ZeRO stage", memory.markdown(results["memory"])]
        if "activations" in parts:
            results["activations"] = activations.run(Path(work), args.quick)
            sections += ["## Activation bytes per layer per token (Korthikanti et al. 2022, and the plan)",
                         activations.markdown(results["activations"])]
        if "recompute" in parts:
            results["recompute"] = recompute_time.run(Path(work), settings["recompute_rounds"],
                                                      settings["recompute_warmup"], args.quick)
            sections += ["## Step time under each recompute mode", recompute_time.markdown(results["recompute"])]
        if "compile" in parts:  # a fresh process per layer count: its peak RSS is its own
            results["compile"] = compile_scaling.run(Path(work), args.quick)
            sections += ["## Compile time and memory (70B-shaped Llama on meta, tp=8 pp=4)",
                         compile_scaling.markdown(results["compile"])]
    results["elapsed_s"] = round(time.perf_counter() - start, 1)
    env = results["environment"]
    head = (f"`{command}` on {env['cpu_count']} CPU cores, torch {env['torch']}, gloo, "
            f"{env['threads_per_process']} thread per process, {env['date']} ({results['elapsed_s']:.0f} s). "
            "Absolute times on a shared CPU mean little; compare the ratios, measured in the same run.")
    markdown = "\n\n".join([head, *sections])
    json_path, md_path = write_results(results, markdown, args.out, name)
    print(f"\n{markdown}\n\nwrote {json_path} and {md_path}")
    return results


if __name__ == "__main__":
    main()
