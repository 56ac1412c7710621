"""World size 1: fxshard's generated code against the same transformers model in a plain torch loop, eager and
compiled, on one device (issue 34's ~1B figure: ``python -m benchmarks.run --only single --device cuda``).

The model is ``benchmarks/models/llama.py``: samples/llama.py's ``LlamaForCausalLM`` at TinyLlama 1.1B's shape,
bf16, batch 4 × 2048 tokens (``tiny`` on the CPU, a rehearsal).  Four contenders in one process, interleaved
round by round (:func:`benchmarks.common.interleave`):

- ``fxshard``: the model file compiled by ``fxshard.compiler.compile(path, Layout(dtype="bf16"), meta=True)``; its
  ``RankModule`` built, given fp32 storage, loaded and split into bf16 parameters and fp32 masters as
  ``fxshard run --dtype bf16`` does (:func:`fxshard.train.modules._prepare`);
- ``fxshard --compile``: the same module's forward through :func:`fxshard.runtime.compiled.compile_module`, as
  ``fxshard run --compile``;
- ``transformers``: the unmodified ``LlamaForCausalLM``, ``model(**batch).loss``, in a plain loop;
- ``transformers + torch.compile``: ``torch.compile(model)`` on the same model.

All four take the same mixed-precision recipe, the one ``--dtype bf16`` trains with: bf16 parameters and
gradients, AdamW (foreach) on fp32 master weights (:class:`fxshard.runtime.mixed_precision.MasterWeightAdamW`), so
the step times differ by the forward and backward code alone.  The two fxshard contenders share one set of
weights and optimizer, the two transformers ones another (the 1B model's state fits an 80 GB GPU twice, not four
times); each weight set steps twice per round, so the two sets take their steps in lock step and their losses at
each step are compared.  Both start from the same fp32 weights (seed 0) and batch.

Tokens/s is the batch's tokens over the median step.  MFU counts 6 FLOPs per parameter per token (the input
embedding, a lookup, left out) plus attention's 12·layers·hidden·seq per token (forward and backward, the
causal half not subtracted: PaLM's appendix B), over the GPU's dense bf16 peak from its datasheet (989 TFLOP/s
for the H100 and H200 SXM) and over the rate of an 8192³ bf16 matrix product measured in the same process.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    combine_ranks,
    device_sync,
    interleave,
    markdown_table,
    paired_ratio,
    spawn,
    summarize,
)
from benchmarks.tp_step import model_size

MODEL_FILE = Path(__file__).resolve().parent / "models" / "llama.py"
CONTENDERS = ("fxshard", "fxshard --compile", "transformers", "transformers + torch.compile")
WEIGHTS_OF = {"fxshard": "fxshard", "fxshard --compile": "fxshard", "transformers": "transformers",
              "transformers + torch.compile": "transformers"}
DATASHEET_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense bf16, SXM, by NVIDIA's datasheets


def flops_per_token(model: torch.nn.Module, config) -> float:
    """6 per parameter (the input embedding left out) + 12·layers·(heads·head_dim)·seq (attention's scores and
    weighted values, forward and backward)."""
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    return 6 * params + 12 * config.num_hidden_layers * width * _size()["seq"]


def _size() -> dict:
    from benchmarks.models import llama

    return llama.size()


def _fxshard(out: Path, full: torch.nn.Module, device: torch.device):
    """fxshard's rank module (world size 1) with ``full``'s weights, bf16 parameters and fp32 masters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fxshard.codegen.manifest import import_rank_file, read_manifest
    from fxshard.runtime.mixed_precision import MasterWeightAdamW, promote, split_masters
    from fxshard.train.optim import OptimConfig

    manifest = read_manifest(out)
    layout = manifest.layout
    mesh = init_device_mesh(device.type, layout.mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
    entry = manifest.rank(layout.coords(dist.get_rank()))
    module = import_rank_file(out / entry.file).RankModule({a: mesh.get_group(a) for a in ("dp", "pp", "tp")}, device)
    module.return_outputs = False  # as fxshard.train.modules.build_rank does
    promote(module)  # fp32 storage, so the masters are the fp32 weights exactly
    source = dict(full.named_parameters()) | dict(full.named_buffers())
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    with torch.no_grad():
        for key, t in entry.tensors.items():
            own[key].copy_(source[t.source])
    params = list(module.parameters())
    optimizer = MasterWeightAdamW(params, split_masters(params, layout.compute_dtype), OptimConfig())
    return module, optimizer, manifest


def _plain(full: torch.nn.Module):
    from fxshard.runtime.mixed_precision import MasterWeightAdamW, split_masters
    from fxshard.train.optim import OptimConfig

    params = list(full.parameters())
    return MasterWeightAdamW(params, split_masters(params, torch.bfloat16), OptimConfig())


def _stepper(loss_fn, optimizer, losses: list):
    def step():
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read after the rounds: a .item() here would wait for the GPU mid-step

    return step


def matmul_tflops(device: torch.device) -> float | None:
    """TFLOP/s of an 8192³ bf16 matrix product on ``device`` (median of 10 after 3, random data), None on a CPU."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192 ** 3 / statistics.median(times) / 1e12


def _worker(rank: int, world: int, out: str, size: str, rounds: int, warmup: int,
            contenders: tuple[str, ...] = CONTENDERS) -> dict:
    import torch.distributed as dist

    from fxshard.capture.inputs import flatten_batch
    from fxshard.capture.modelfile import load_model_file

    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    with model_size(size), torch.device(device):
        mf = load_model_file(MODEL_FILE)
        full, inputs = mf.build_model(seed=0), mf.build_inputs(seed=0)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    config = full.config
    fpt = flops_per_token(full, config)
    module, fx_opt, manifest = _fxshard(Path(out), full, device)
    plain_opt = _plain(full)  # full's own parameters become bf16 now, after fxshard's copied the fp32 weights
    leaves = [v.to(device) if isinstance(v, torch.Tensor) else v for v in flatten_batch(inputs, manifest.inputs)]
    from fxshard.runtime.compiled import compile_module

    compiled_module = compile_module(_Forward(module, module.forward))  # compiled at its first call
    compiled_full = torch.compile(full)
    losses: dict[str, list] = {"fxshard": [], "transformers": []}
    loss_of = {"fxshard": lambda: module(*leaves)[0],
               "fxshard --compile": lambda: compiled_module(*leaves)[0],
               "transformers": lambda: full(**inputs).loss,
               "transformers + torch.compile": lambda: compiled_full(**inputs).loss}
    opt_of = {"fxshard": fx_opt, "transformers": plain_opt}
    steps = {n: _stepper(loss_of[n], opt_of[WEIGHTS_OF[n]], losses[WEIGHTS_OF[n]]) for n in contenders}
    sync = device_sync(device)
    first_step_s = {}
    for name in contenders:  # one untimed step each: the compiled ones compile
        start = time.perf_counter()
        steps[name]()
        sync()
        first_step_s[name] = round(time.perf_counter() - start, 2)
    times = interleave(steps, rounds=rounds, warmup=warmup, sync=sync)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"times": times, "losses": {k: [float(v) for v in vs] for k, vs in losses.items()},
            "first_step_s": first_step_s, "flops_per_token": fpt, "matmul_tflops": matmul_tflops(device),
            "tokens_per_step": int(inputs["input_ids"].numel()), "peak_memory_gb": peak and round(peak / 2**30, 1),
            "parameters": sum(p.numel() for p in full.parameters()),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}


class _Forward(torch.nn.Module):
    """The fxshard module's forward as a module of its own, so compiling it leaves the eager module's forward eager
    (:func:`compile_module` replaces a module's forward in place); parameters are the eager module's."""

    def __init__(self, module: torch.nn.Module, forward):
        super().__init__()
        self.inner = module
        self._forward = forward

    def forward(self, *args):
        return self._forward(*args)


def run(size: str, work: Path, rounds: int, warmup: int, device: str = "cpu",
        contenders: tuple[str, ...] = CONTENDERS) -> dict:
    """Compile the model file at world size 1 (bf16, on meta: no weights written), then time ``contenders`` (the
    four, or some of them: a test leaves the compiled ones out)."""
    from benchmarks.common import BACKEND_OF
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    out = Path(tempfile.mkdtemp(dir=work, prefix="single-"))
    with model_size(size):
        compile_model(MODEL_FILE, Layout(dtype="bf16"), out=out, meta=True)
        found = spawn(_worker, 1, str(out), size, rounds, warmup, contenders, backend=BACKEND_OF[device],
                      timeout=900)[0]
    times = combine_ranks([found.pop("times")])
    summary = summarize(times)
    s = _size_of(size)
    tokens = found["tokens_per_step"]
    peak = next((v for k, v in DATASHEET_TFLOPS.items() if k in found["device_name"]), None)
    rows = {}
    base = "transformers + torch.compile" if "transformers + torch.compile" in contenders else "transformers"
    for name in contenders:
        step_s = summary[name]["median_ms"] / 1e3
        achieved = found["flops_per_token"] * tokens / step_s / 1e12
        rows[name] = summary[name] | {
            "tokens_per_s": round(tokens / step_s), "tflops": round(achieved, 1),
            "mfu_datasheet": peak and round(achieved / peak, 3),
            "mfu_measured": found["matmul_tflops"] and round(achieved / found["matmul_tflops"], 3),
            "first_step_s": found["first_step_s"][name],
            "vs_plain_compiled": paired_ratio(times, base, name),
            "vs_plain_eager": paired_ratio(times, "transformers", name)}
    fx, hf = found["losses"]["fxshard"], found["losses"]["transformers"]
    rel = [abs(a - b) / abs(b) for a, b in zip(fx, hf, strict=True)]
    return {"size": size, "model": f"Llama {found['parameters'] / 1e9:.2f}B" if found["parameters"] > 5e8 else
            f"Llama {found['parameters'] / 1e6:.2f}M", "batch": s["batch"], "seq": s["seq"], "device": device,
            "device_name": found["device_name"], "datasheet_tflops": peak, "matmul_tflops": found["matmul_tflops"],
            "flops_per_token": found["flops_per_token"], "tokens_per_step": tokens,
            "peak_memory_gb": found["peak_memory_gb"], "rounds": rounds, "warmup": warmup, "contenders": rows,
            "first_loss": {"fxshard": fx[0], "transformers": hf[0]},
            "largest_loss_difference": max(rel), "largest_loss_difference_first_5": max(rel[:5]),
            "steps_compared": len(fx), "losses": found["losses"]}


def _size_of(size: str) -> dict:
    from benchmarks.models.llama import SIZES

    return SIZES[size]


def markdown(result: dict) -> str:
    mfu_head = f"MFU of {result['datasheet_tflops']:g} TFLOP/s (datasheet)" if result["datasheet_tflops"] else \
        "MFU (datasheet)"
    measured = f"MFU of {result['matmul_tflops']:.0f} TFLOP/s (measured 8192³ bf16 product)" \
        if result["matmul_tflops"] else "MFU (measured product)"
    rows = []
    for name, r in result["contenders"].items():
        rows.append([name, f"{r['median_ms']:.1f} ({r['p25_ms']:.1f}–{r['p75_ms']:.1f})", f"{r['tokens_per_s']:,}",
                     r["tflops"], r["mfu_datasheet"] if r["mfu_datasheet"] is not None else "—",
                     r["mfu_measured"] if r["mfu_measured"] is not None else "—", r["first_step_s"],
                     f"**{r['vs_plain_compiled']['median']:.3f}** ({r['vs_plain_compiled']['p25']:.3f}–"
                     f"{r['vs_plain_compiled']['p75']:.3f})", f"{r['vs_plain_eager']['median']:.3f}"])
    head = (f"{result['model']} (`benchmarks/models/llama.py` {result['size']}: samples/llama.py's LlamaForCausalLM), "
            f"bf16 parameters and gradients with AdamW on fp32 masters, batch {result['batch']} × {result['seq']} "
            f"tokens, on {result['device_name']}, world size 1; {result['rounds']} interleaved rounds after "
            f"{result['warmup']} warm-up rounds and one untimed step each (it compiles the compiled ones).  "
            f"{result['flops_per_token'] / 1e9:.2f} GFLOP per token.  Peak GPU memory "
            f"{result['peak_memory_gb']} GiB (both weight sets).  First-step loss fxshard "
            f"{result['first_loss']['fxshard']:.6f}, transformers {result['first_loss']['transformers']:.6f}; largest "
            f"relative loss difference over the first 5 steps {result['largest_loss_difference_first_5']:.1e}, over "
            f"all {result['steps_compared']} (one batch, memorized: the loss falls and bf16's rounding differences "
            f"grow) {result['largest_loss_difference']:.1e}.")
    table = markdown_table(["contender", "step ms, median (p25–p75)", "tokens/s", "TFLOP/s", mfu_head, measured,
                            "first step s (compiles)", "plain compiled ÷ this, per round (higher: this is faster)",
                            "plain eager ÷ this"], rows)
    return head + "\n\n" + table
