"""Fine-tuning, as a user runs it: a 0.5 B Hugging Face folder, chat SFT with LoRA at tp=2, beside a full fine-tune.

The acceptance run of the fine-tuning path (docs/fine-tuning.md), every step through the ``fxshard`` command line:

1. a Qwen2.5-0.5B-shaped folder (its published config: 24 layers, hidden 896, 14 heads, 2 KV heads, 151,936 ids,
   tied embeddings; random weights, bf16 on disk) written by ``save_pretrained``, with the byte-level chat
   tokenizer of ``fxshard data generate --chat`` copied in;
2. ``fxshard data generate --chat`` conversations, ``fxshard data tokenize --format chat`` (assistant tokens
   trained, the mask beside the token file);
3. ``fxshard compile FOLDER --tp 2 --lora 16`` and, beside it, ``fxshard compile FOLDER --tp 2`` (full fine-tune);
4. ``fxshard run`` on each with ``--data``, ``--pack``, a checkpoint at the last step and ``--metrics``;
5. ``fxshard export CKPT --peft DIR`` (loaded back with ``peft.PeftModel.from_pretrained``) and
   ``fxshard generate CKPT --chat``.

Reported per run: the peak resident memory of each rank (``VmHWM`` of every process under the ``fxshard run``,
sampled twice a second), the median step time over the steps after the first (from ``--metrics``), the first and
last loss, and the checkpoint's size on disk.  Absolute times on this shared 2-core machine mean little; the
LoRA ÷ full ratios come from the same run, the two runs one after the other.

::

    python -m benchmarks.finetune                   # 20 LoRA steps, 5 full steps, seq 256, batch 4
    python -m benchmarks.finetune --quick           # a 2-layer folder, 3 steps each: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FXSHARD = [str(Path(sys.executable).parent / "fxshard")]
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (its children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def _status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in lines if ":" in line)


def run_watched(args: list, log=print) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """Run an ``fxshard`` command and sample each rank's peak resident memory (``VmHWM``) while it runs.

    A rank is a descendant process whose environment names a ``RANK`` (torchrun's workers); the result maps
    ``rank N`` to its largest sampled ``VmHWM`` in bytes."""
    proc = subprocess.Popen([*FXSHARD, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peaks: dict[str, int] = {}
    done = threading.Event()

    def sample():
        while not done.is_set():
            for pid in _descendants(proc.pid):
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
                hwm = _status(pid).get("VmHWM", "").split()
                if rank is not None and hwm:
                    peaks[f"rank {rank}"] = max(peaks.get(f"rank {rank}", 0), int(hwm[0]) * 1024)
            done.wait(0.5)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    stdout, _ = proc.communicate()
    done.set()
    watcher.join()
    completed = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")
    if proc.returncode != 0:
        raise RuntimeError(f"fxshard {' '.join(map(str, args))} failed:\n{stdout[-4000:]}")
    log(stdout.strip().splitlines()[-1] if stdout.strip() else "")
    return completed, peaks


def cli(*args, log=print) -> str:
    done = subprocess.run([*FXSHARD, *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fxshard {' '.join(map(str, args))} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return done.stdout


def write_folder(work: Path, quick: bool, log=print) -> Path:
    """The Qwen2.5-0.5B-shaped folder (bf16 on disk, as Qwen publishes it) with the chat tokenizer in it."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = work / "qwen-hf"
    config = dict(QWEN_05B, num_hidden_layers=2) if quick else QWEN_05B
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config, eos_token_id=0, pad_token_id=0)).to(torch.bfloat16)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    for f in (work / "data" / "tokenizer").iterdir():
        shutil.copy(f, folder / f.name)
    log(f"folder: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, "
        f"{_size(folder) / 2**30:.2f} GiB on disk")
    return folder


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _step_figures(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    times = [r["seconds"] for r in steps[1:] if "seconds" in r]
    return {"steps": len(steps), "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "step_s": statistics.median(times) if times else None}


def train(work: Path, folder: Path, data: Path, name: str, steps: int, extra: list[str], seq: int, batch: int,
          log=print) -> dict:
    """Compile the folder at tp=2 (``extra``: the LoRA flags, or none), train, checkpoint: the run's figures."""
    out, ckpt, metrics = work / name, work / f"{name}-ckpt", work / f"{name}-metrics.jsonl"
    start = time.perf_counter()
    cli("compile", folder, "--tp", 2, "--seq", seq, "--batch", batch, *extra, "--out", out)
    compiled = time.perf_counter() - start
    _, peaks = run_watched(["run", out, "--steps", steps, "--data", data, "--pack", "--lr", "1e-4",
                            "--checkpoint", ckpt, "--save-every", steps, "--metrics", metrics], log=log)
    figures = _step_figures(metrics)
    figures |= {"compile_s": round(compiled, 1), "peak_rss": peaks, "checkpoint_bytes": _size(ckpt),
                "checkpoint": str(ckpt)}
    log(f"{name}: {json.dumps({k: v for k, v in figures.items() if k != 'checkpoint'})}")
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "finetune-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lora-steps", type=int, default=None)
    parser.add_argument("--full-steps", type=int, default=None)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    opts = parser.parse_args(argv)
    lora_steps = opts.lora_steps or (3 if opts.quick else 20)
    full_steps = opts.full_steps or (3 if opts.quick else 5)
    work = opts.work
    import shutil

    for stale in ("lora", "lora-ckpt", "full", "full-ckpt", "adapter", "chats"):
        shutil.rmtree(work / stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not (work / "data" / "tokenizer").is_dir():
        cli("data", "generate", work / "data", "--chat", "--documents", 2000)
    # the folder of an earlier run of the same size is kept: writing 0.5 B random weights takes minutes
    folder = work / "qwen-hf" if (work / "qwen-hf" / "config.json").exists() and not opts.quick else \
        write_folder(work, opts.quick)
    (work / "chats").mkdir()
    data = work / "chats" / "chats.bin"
    print(cli("data", "tokenize", work / "data" / "corpus", "--tokenizer", folder, "--format", "chat",
              "--seq", opts.seq, "--truncate", "drop", "--out", data).strip().splitlines()[-1])
    lora = train(work, folder, data, "lora", lora_steps, ["--lora", 16, "--lora-alpha", 32, "--lora-targets",
                                                         TARGETS], opts.seq, opts.batch)
    full = train(work, folder, data, "full", full_steps, [], opts.seq, opts.batch)
    peft_dir = work / "adapter"
    cli("export", lora["checkpoint"], "--peft", peft_dir)
    loaded = _peft_loads(folder, peft_dir)
    answer = cli("generate", lora["checkpoint"], "--chat", "--prompt", "say hello backwards", "--max-new-tokens",
                 16).strip()
    results = {"lora": lora, "full": full, "seq": opts.seq, "batch": opts.batch, "peft_loaded": loaded,
               "generated": answer, "adapter_bytes": _size(peft_dir), "folder_bytes": _size(folder)}
    return results


def _peft_loads(folder: Path, adapter: Path) -> str:
    """Load the exported adapter with peft onto the folder's model: the number of LoRA tensors it holds."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter)
    return f"{sum('lora_' in n for n, _ in model.named_parameters())} LoRA tensors"


def markdown(results: dict, command: str) -> str:
    lora, full = results["lora"], results["full"]

    def gib(b):
        return f"{b / 2**30:.2f} GiB"

    def peak(run):
        return ", ".join(f"{r}: {gib(b)}" for r, b in sorted(run["peak_rss"].items()))

    rows = [("steps", lora["steps"], full["steps"], ""),
            ("loss, first → last", f"{lora['first_loss']:.3f} → {lora['last_loss']:.3f}",
             f"{full['first_loss']:.3f} → {full['last_loss']:.3f}", ""),
            ("step time (median after the first)", f"{lora['step_s']:.1f} s", f"{full['step_s']:.1f} s",
             f"{lora['step_s'] / full['step_s']:.2f}"),
            ("peak RSS per rank", peak(lora), peak(full),
             f"{max(lora['peak_rss'].values()) / max(full['peak_rss'].values()):.2f}"),
            ("checkpoint on disk", gib(lora["checkpoint_bytes"]), gib(full["checkpoint_bytes"]),
             f"{lora['checkpoint_bytes'] / full['checkpoint_bytes']:.4f}")]
    table = "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    return f"""# Fine-tuning a 0.5 B Hugging Face folder: LoRA against a full fine-tune, tp=2

`{command}` ({results['date']}, {results['cpu']}). How: [benchmarks/finetune.py](../finetune.py).
A Qwen2.5-0.5B-shaped folder ({gib(results['folder_bytes'])} bf16 on disk, random weights), chat SFT on
`fxshard data generate --chat` conversations tokenized with `--format chat` (assistant tokens trained), seq
{results['seq']}, batch {results['batch']}, `--pack`, AdamW lr 1e-4, both at `--tp 2` on this 2-core CPU (gloo).
LoRA: `--lora 16 --lora-alpha 32 --lora-targets {TARGETS}`.

| | LoRA r=16 | full fine-tune | LoRA ÷ full |
|---|---|---|---|
{table}

- `fxshard export CKPT --peft DIR`: {gib(results['adapter_bytes'])}; `peft.PeftModel.from_pretrained` loads it
  ({results['peft_loaded']}).
- `fxshard generate CKPT --chat --prompt "say hello backwards"` answered: `{results['generated'][:120]}`
  (20 steps from random weights: the point is that it runs, not what it says; an empty answer is an end-of-text
  token first).
- Measured on a shared machine (other jobs ran beside it): absolute times are inflated, the LoRA ÷ full ratios,
  taken from the same run, are the figures.
- Peak RSS is each rank's `VmHWM`, sampled twice a second; the full fine-tune holds fp32 weights, gradients and
  two Adam moments of its half of the model, the LoRA run its half of the base weights and the adapters' state.
"""


if __name__ == "__main__":
    from benchmarks.common import cpu_line, environment, write_results

    results = main()
    env = environment()
    results |= {"date": env["date"], "cpu": cpu_line(env)}
    command = "python -m benchmarks.finetune " + " ".join(sys.argv[1:])
    name = "finetune-cpu-quick" if "--quick" in sys.argv else "finetune-cpu"
    paths = write_results(results, markdown(results, command.strip()), ROOT / "benchmarks" / "results", name)
    print("\n".join(map(str, paths)))
