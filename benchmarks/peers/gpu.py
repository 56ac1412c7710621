"""The peers on one GPU (``scripts/gpu_peers.sh`` runs this): world size 1, bf16 with fp32 masters, fxshard eager,
fxshard ``--compile``, torchtitan with compile and Megatron-Core's local spec, interleaved in one process, on a 1B
Llama and an 8B-shaped one with 4 of its 32 layers; tokens/s, MFU against the device's dense bf16 peak, and each
tool's peak allocation (alone in its own process).  Then tp2 with both ranks sharing the GPU, fxshard against
torchtitan (eager), through :mod:`benchmarks.peers.bench`.

``--device cpu --sizes toy`` runs the same code at toy size on gloo: the check that it works before a GPU is lent
(there Megatron-Core is reported not run: its bf16 optimizer wraps only ``torch.cuda`` tensors, and with warm-up 0
the compiled rows time their compilation)::

    python -m benchmarks.peers.gpu --out $OUT                          # on the H200
    python -m benchmarks.peers.gpu --device cpu --sizes toy --out /tmp/peers-dry --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    combine_ranks,
    environment,
    interleave,
    paired_ratio,
    spawn,
    summarize,
    write_results,
)
from benchmarks.peers import bench
from benchmarks.peers.common import LAYOUTS, PeerLayout

WS1 = PeerLayout("ws1")
TOOLS_WS1 = ("fxshard", "fxshard --compile", "torchtitan --compile", "Megatron-Core")
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, the datasheets' figures


def peak_flops(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((v for k, v in PEAK_BF16.items() if k in name), None)


def flops_per_token(shape: dict) -> float:
    """6 × parameters (the input embedding left out: a lookup) + 12 × layers × width × sequence (the attention's
    scores and mixing): training FLOPs per token, the convention of torchtitan's MFU and :mod:`benchmarks.single`."""
    h, f, v, layers, kv = shape["hidden"], shape["ffn"], shape["vocab"], shape["layers"], shape["kv_heads"]
    head = h // shape["heads"]
    per_layer = h * h * 2 + 2 * h * kv * head + 3 * h * f + 2 * h
    params = layers * per_layer + v * h + h  # the blocks, the output layer, the final norm
    return 6 * params + 12 * layers * h * shape["seq"]


def _ws1_peer(tool: str, out: str, hf: dict, batch: dict, device: torch.device):
    from benchmarks.models.peer_llama import size

    if tool.startswith("fxshard"):
        from benchmarks.peers.fxshard_peer import fxshard_peer

        return fxshard_peer(Path(out), batch, device, compile=tool.endswith("--compile"))
    if tool.startswith("torchtitan"):
        from benchmarks.peers.torchtitan_peer import torchtitan_peer

        return torchtitan_peer(WS1, hf, batch, size(), device, compile=tool.endswith("--compile"), bf16=True)
    from benchmarks.peers.megatron_peer import megatron_peer

    return megatron_peer(WS1, hf, batch, size(), device, dtype=torch.bfloat16)


def _ws1_worker(rank: int, world: int, out: str, tools: list[str], rounds: int, warmup: int) -> dict:
    bench._quiet()
    device = bench._device()
    hf, batch = bench._model_and_batch()
    peers, failed, losses = {}, {}, {}
    for tool in tools:
        try:
            peers[tool] = _ws1_peer(tool, out, hf, batch, device)
            losses[tool] = []
        except Exception as e:  # noqa: BLE001  (reported, not timed)
            failed[tool] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
    steps = {t: (lambda t=t: losses[t].append(peers[t].step())) for t in peers}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = interleave(steps, rounds=rounds, warmup=warmup, sync=sync) if steps else {}
    return {"times": times, "losses": losses, "failed": failed}


def _ws1_memory(rank: int, world: int, out: str, tool: str, steps: int) -> dict:
    bench._quiet()
    device = bench._device()
    hf, batch = bench._model_and_batch()
    peer = _ws1_peer(tool, out, hf, batch, device)
    for _ in range(steps):
        peer.step()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else bench._rss_mib() / 1024
    return {"peak_gib": round(peak, 2)}


def run_ws1(size: str, work: Path, rounds: int, warmup: int, backend: str, log=print) -> dict:
    from benchmarks.models.peer_llama import SIZE_VARIABLE
    from benchmarks.models.peer_llama import size as shape_of
    from benchmarks.peers.fxshard_peer import compile_layout

    os.environ[SIZE_VARIABLE] = size
    out = compile_layout(WS1, work / f"ws1-{size}", dtype="bf16")
    log(f"ws1 {size}: {', '.join(TOOLS_WS1)}")
    r = spawn(_ws1_worker, 1, str(out), list(TOOLS_WS1), rounds, warmup, backend=backend, timeout=1200)[0]
    ran = [t for t in TOOLS_WS1 if t not in r["failed"]]
    times = combine_ranks([r["times"]]) if ran else {}
    summary = summarize(times) if ran else {}
    shape = shape_of()
    tokens = shape["batch"] * shape["seq"]
    name, peak = peak_flops(torch.device("cuda") if backend == "nccl" else torch.device("cpu"))
    rows = {}
    for tool in ran:
        tps = tokens / (summary[tool]["median_ms"] / 1e3)
        base = "fxshard --compile" if "--compile" in tool else "fxshard"
        rows[tool] = {"median_ms": summary[tool]["median_ms"], "tokens_per_s": round(tps, 1),
                      "mfu": round(tps * flops_per_token(shape) / peak, 4) if peak else None,
                      "ratio_to_fxshard": paired_ratio(times, tool, base) if base in ran else None,
                      "losses": r["losses"][tool]}
        try:
            rows[tool]["peak_gib"] = spawn(_ws1_memory, 1, str(out), tool, 2, backend=backend,
                                           timeout=900)[0]["peak_gib"]
        except Exception as e:  # noqa: BLE001
            rows[tool]["peak_gib"] = f"failed: {str(e).splitlines()[-1][:200]}"
    return {"size": size, "shape": shape, "device": name, "peak_flops": peak, "rows": rows, "failed": r["failed"]}


def ws1_markdown(result: dict) -> str:
    from benchmarks.common import markdown_table

    rows = [[tool, f"{r['median_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
             f"{r['mfu']:.1%}" if r["mfu"] is not None else "", r.get("peak_gib", ""),
             f"{r['ratio_to_fxshard']['median']:.3f}" if r["ratio_to_fxshard"] else "",
             f"{r['losses'][-1]:.4f}" if r["losses"] else ""] for tool, r in result["rows"].items()]
    s = result["shape"]
    text = [f"### World size 1, `{result['size']}` ({s['layers']} layers, hidden {s['hidden']}, batch {s['batch']} × "
            f"{s['seq']}, bf16 with fp32 masters) on {result['device']}",
            markdown_table(["tool", "step ms", "tokens/s", "MFU", "peak GiB", "÷ fxshard's step (same kind)",
                            "last loss"], rows)]
    text += [f"- **{t}** not run: {why}" for t, why in result["failed"].items()]
    return "\n\n".join(text)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", default="1b,8b-4l", help="comma-separated sizes of benchmarks/models/peer_llama.py")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tp2-size", default=None, help="size of the tp2 run on the shared GPU (default: the first)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks.peers.gpu --device cuda: torch sees no GPU (torch.cuda.is_available() is False)")
    missing = bench.missing_peers()
    if missing:
        sys.exit("benchmarks.peers.gpu: " + "; ".join(f"{t}: {why}" for t, why in missing.items()))
    backend = "nccl" if args.device == "cuda" else "gloo"
    results: dict = {"command": "python -m benchmarks.peers.gpu " + " ".join(argv or sys.argv[1:]),
                     "environment": environment(backend), "ws1": [], "tp2": None}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fxshard-peers-gpu-") as work:
        for size in args.sizes.split(","):
            results["ws1"].append(run_ws1(size, Path(work), args.rounds, args.warmup, backend))
            _write(results, args.out, start)  # what ran so far survives a later timeout
        from benchmarks.models.peer_llama import SIZE_VARIABLE

        os.environ[SIZE_VARIABLE] = args.tp2_size or args.sizes.split(",")[0]
        results["tp2"] = bench.run_layout(LAYOUTS["tp2"], Path(work), ["fxshard", "torchtitan"], args.rounds,
                                          args.warmup, memory_steps=0, backend=backend)
    return _write(results, args.out, start)


def _write(results: dict, out: Path, start: float) -> dict:
    results["elapsed_s"] = round(time.perf_counter() - start, 1)
    parts = [f"`{results['command']}`, torch {results['environment']['torch']}, {results['environment']['date']} "
             f"({results['elapsed_s']:.0f} s)."] + [ws1_markdown(r) for r in results["ws1"]]
    if results["tp2"]:
        parts.append("### tp2, both ranks on the one GPU\n\n" + bench.layout_markdown(results["tp2"]))
    write_results(results, "\n\n".join(parts), out, "peers-gpu")
    print(json.dumps({r["size"]: {t: (x["tokens_per_s"], x["mfu"]) for t, x in r["rows"].items()}
                      for r in results["ws1"]}))
    return results


if __name__ == "__main__":
    main()
