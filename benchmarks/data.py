"""Training data: is the loader ever the bottleneck, and does host memory grow with the steps?

samples/llama.py at tp=2 dp=2 (4 ranks) reads a token file of at least 50M tokens (``--quick``: 0.5M) that
``fxshard data tokenize`` wrote from a generated corpus (:mod:`fxshard.train.data.synthetic`, a BPE tokenizer of the
model's 256 ids trained on it), shuffled, through 2 DataLoader workers per rank:

- **step time**: ``fxshard run``'s own step (:meth:`fxshard.train.program.Program.step`) on the token file and on
  the example batch (no data source: ``make_inputs()`` every step), two programs in the same four processes
  taking turns (:func:`benchmarks.common.interleave`); the ratio per round, token file ÷ example batch;
- **host memory**: the peak RSS (``VmHWM``) of each rank and of its loader workers after 10 and after 2,000 training
  steps, each in fresh processes; the largest rank's difference.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import combine_ranks, interleave, markdown_table, paired_ratio, spawn, summarize

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "samples" / "llama.py"
STEPS_PER_CALL = 5
CONTENDERS = ("example batch", "token file")


def write_token_file(work: Path, documents: int, log=print) -> dict:
    """Generate a corpus of ``documents`` documents, train a 256-id tokenizer on its first file, tokenize it all."""
    from fxshard.train.data.synthetic import train_tokenizer, write_corpus
    from fxshard.train.data.tokenize import tokenize

    start = time.perf_counter()
    files = write_corpus(work / "corpus", documents, files=max(1, documents // 20_000))
    generated = time.perf_counter() - start
    train_tokenizer(files[0], work / "tokenizer", vocab=256)
    start = time.perf_counter()
    done = tokenize(work / "corpus", work / "tokenizer", work / "corpus.bin", validation=0.001)
    seconds = time.perf_counter() - start
    log(f"data: {done.tokens:,} tokens in {done.documents:,} documents ({generated:.0f} s to generate, "
        f"{seconds:.0f} s to tokenize)")
    return {"path": str(done.path), "tokens": done.tokens, "documents": done.documents, "bytes":
            done.path.stat().st_size, "generate_s": round(generated, 1), "tokenize_s": round(seconds, 1),
            "tokens_per_s": round(done.tokens / seconds)}


def _hwm(pid: int | str = "self") -> int:
    """Peak resident set of a process, bytes (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _set_up(out: str, steps: int, data):
    """A program of ``out`` and its training stream of ``data`` (DataOptions), as ``fxshard run`` sets them up."""
    import torch

    from fxshard.train.launch import open_stream
    from fxshard.train.options import RunOptions
    from fxshard.train.program import Program

    program = Program(Path(out), RunOptions(steps, data=data), torch.device("cpu"))
    return program, open_stream(program, "train")


def _setups(out: str, data: str, steps: int, workers: int) -> dict:
    from fxshard.train.data import DataOptions

    options = {"example batch": DataOptions(), "token file": DataOptions(data=Path(data), data_workers=workers)}
    return {name: _set_up(out, steps, o) for name, o in options.items()}


def _step_worker(rank: int, world: int, out: str, data: str, rounds: int, warmup: int) -> dict:
    runs = _setups(out, data, (warmup + rounds) * STEPS_PER_CALL, 2)

    def stepper(name: str):
        program, stream = runs[name]

        def call():
            for _ in range(STEPS_PER_CALL):
                program.step(next(stream))
        return call

    try:
        return {"times": interleave({name: stepper(name) for name in CONTENDERS}, rounds, warmup)}
    finally:
        for _, stream in runs.values():
            stream.close()


def _memory_worker(rank: int, world: int, out: str, data: str, steps: int) -> dict:
    from fxshard.train.data import DataOptions

    program, stream = _set_up(out, steps, DataOptions(data=Path(data), data_workers=2))
    try:
        for _ in range(steps):
            program.step(next(stream))
        workers = [w.pid for w in getattr(stream._it, "_workers", [])]
        return {"rank": _hwm(), "workers": [_hwm(pid) for pid in workers], "position": stream.position}
    finally:
        stream.close()


def run(work: Path, quick: bool = False, rounds: int = 20, warmup: int = 2, log=print) -> dict:
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    layout = Layout(tp=2, dp=2)
    token_file = write_token_file(work, 1_500 if quick else 160_000, log)
    out = str(work / "data-llama")
    compile_model(MODEL, layout, out=out)
    world = layout.world_size
    rounds, warmup = (2, 1) if quick else (rounds, warmup)
    log(f"data: step time with the token file and with the example batch, {rounds} rounds of {STEPS_PER_CALL} steps")
    per_rank = spawn(_step_worker, world, out, token_file["path"], rounds, warmup)
    times = combine_ranks([r["times"] for r in per_rank])
    steps = summarize({name: {k: [v / STEPS_PER_CALL for v in vs] for k, vs in t.items()}
                       for name, t in times.items()})
    memory = {}
    for n in (10, 50 if quick else 2_000):
        log(f"data: peak RSS over {n} steps")
        memory[n] = spawn(_memory_worker, world, out, token_file["path"], n, timeout=3600)
    short, long = memory.values()
    growth = max((b["rank"] - a["rank"]) / a["rank"] for a, b in zip(short, long, strict=True))
    return {"model": str(MODEL.relative_to(ROOT)), "layout": layout.describe(), "token_file": token_file,
            "rounds": rounds, "steps_per_call": STEPS_PER_CALL, "step": steps,
            "ratio": paired_ratio(times, "token file", "example batch"),
            "memory": {str(n): rows for n, rows in memory.items()}, "rank_growth": growth}


def markdown(result: dict) -> str:
    t = result["token_file"]
    head = (f"{result['model']} at {result['layout']}: a token file of {t['tokens']:,} tokens ({t['bytes'] / 1e6:.0f} "
            f"MB, {t['documents']:,} generated documents; `fxshard data tokenize` took {t['tokenize_s']:.0f} s, "
            f"{t['tokens_per_s']:,} tokens/s), read shuffled by 2 loader workers per rank.")
    s, r = result["step"], result["ratio"]
    steps = markdown_table(
        ["batches from", "step ms, median (p25–p75)", "CPU ms (all ranks)"],
        [[name, f"{s[name]['median_ms']:.1f} ({s[name]['p25_ms']:.0f}–{s[name]['p75_ms']:.0f})",
          f"{s[name]['cpu_median_ms']:.1f}"] for name in CONTENDERS])
    ratio = (f"Token file ÷ example batch, per round of {result['steps_per_call']} steps ({result['rounds']} rounds, "
             f"interleaved): **{r['median']:.3f}** (p25–p75 {r['p25']:.3f}–{r['p75']:.3f}).")
    rows = []
    for n, ranks in result["memory"].items():
        for i, m in enumerate(ranks):
            rows.append([n, i, f"{m['rank'] / 2**20:.1f}", ", ".join(f"{w / 2**20:.1f}" for w in m["workers"]),
                         f"{m['position']:,}"])
    memory = markdown_table(["steps", "rank", "peak RSS MiB", "its loader workers' peak RSS MiB",
                             "examples read (all dp ranks)"], rows)
    return "\n\n".join([head, steps, ratio, memory,
                        f"Largest growth of a rank's peak RSS from 10 to the most steps: "
                        f"**{100 * result['rank_growth']:.2f}%**."])
