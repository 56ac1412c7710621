"""What a checkpoint's content digests cost (issue 45 item 8): a save with its digests against the same save
without, and a resume's read with its check against the same read without, on real files.

A rank's shard holds, per parameter, its value and AdamW's two moments (fp32) and step: what
:func:`fxshard.train.checkpoint.save_checkpoint` writes.  Two states are measured: samples/gpt.py's (its
``make_model()``), and a larger shape made of the same kinds of tensors (``--params`` parameters in 2048 x 2048
blocks: the default, 8.4M, is a ~100 MB shard).  The save is safetensors' ``save_file`` with the fsync the
checkpoint does; with digests it first hashes every tensor (:func:`fxshard.train.digests.tensor_digests`, xxHash
XXH3-128) and writes them into the header.  The read takes every tensor back (``safe_open``, copied into memory as
a resume copies it into its parameter); with the check it hashes each and compares (``check_tensor``).
``hashlib.sha256`` over the same bytes, the alternative measured when choosing XXH3, is timed beside them.

The variants take turns within each round, their order rotating from round to round (benchmarks/README.md: "same
run, interleaved"), so the machine's other work slows them alike; the ratios are the median of each round's own
ratio::

    python -m benchmarks.checkpoint_digests --params 8_400_000 --rounds 7
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def gpt_state() -> dict[str, torch.Tensor]:
    from fxshard.capture.modelfile import load_model_file

    model = load_model_file(ROOT / "samples" / "gpt.py").build_model(0)
    return _with_adam({n: p.detach().float() for n, p in model.named_parameters()})


def large_state(params: int) -> dict[str, torch.Tensor]:
    block = 2048 * 2048
    g = torch.Generator().manual_seed(0)
    count = max(1, round(params / block))
    return _with_adam({f"layer{i}.weight": torch.randn(2048, 2048, generator=g) for i in range(count)})


def _with_adam(params: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in params.items():
        out |= {f"{name}|param": p, f"{name}|exp_avg": torch.randn_like(p), f"{name}|exp_avg_sq": torch.rand_like(p),
                f"{name}|step": torch.tensor(7.0)}
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(state: dict[str, torch.Tensor], folder: Path, rounds: int) -> dict:
    """Each variant's median seconds, and the median over rounds of (with digests) / (without)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fxshard.train.digests import check_tensor, digests_of, shard_metadata, tensor_digests

    plain, digested = folder / "plain.safetensors", folder / "digested.safetensors"

    def save(path: Path, metadata: dict | None) -> None:
        save_file(state, str(path), metadata=metadata)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def read(path: Path, checked: bool) -> None:
        with safe_open(str(path), framework="pt") as f:
            digests = digests_of(f.metadata(), str(path)) if checked else None
            for key in f.keys():
                t = f.get_tensor(key).clone()  # into memory, as a resume copies it into its parameter
                if checked:
                    check_tensor(t, digests[key], str(path), key)

    def sha256() -> None:
        for t in state.values():
            hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).digest()

    variants = {"save": lambda: save(plain, None),
                "save_digested": lambda: save(digested, shard_metadata(tensor_digests(state))),
                "read": lambda: read(plain, False), "read_checked": lambda: read(digested, True),
                "digest": lambda: tensor_digests(state), "sha256": sha256}
    for fn in variants.values():  # warm: files written, pages cached as a resume after a save finds them
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # the order rotates every round
            times[name].append(_timed(variants[name]))
    plain.unlink()
    digested.unlink()
    out = {"bytes": sum(t.numel() * t.element_size() for t in state.values()), "tensors": len(state),
           "rounds": rounds} | {name: statistics.median(ts) for name, ts in times.items()}
    for ratio, (num, den) in {"save_ratio": ("save_digested", "save"), "read_ratio": ("read_checked", "read")}.items():
        out[ratio] = statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))
    return out


def table(rows: dict[str, dict]) -> str:
    lines = ["| state | size | save (fsync'd) | save + digests | ratio | read back | read + check | ratio "
             "| digests alone (XXH3) | sha256 alone |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        ms = {k: f"{r[k] * 1e3:,.1f} ms" for k in ("save", "save_digested", "read", "read_checked", "digest", "sha256")}
        lines.append(f"| {name} | {r['bytes'] / 2**20:,.1f} MiB, {r['tensors']} tensors | {ms['save']} "
                     f"| {ms['save_digested']} | {r['save_ratio']:.2f}x | {ms['read']} | {ms['read_checked']} "
                     f"| {r['read_ratio']:.2f}x | {ms['digest']} | {ms['sha256']} |")
    return "\n".join(lines) + f"\n\nMedians of {next(iter(rows.values()))['rounds']} interleaved rounds; a ratio is " \
        "the median of each round's own."


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=8_400_000, help="parameters of the larger shape (8.4M: ~100 MB)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--work", type=Path, default=None, help="folder for the shard files (default: a temporary)")
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=a.work) as folder:
        rows = {"samples/gpt.py": measure(gpt_state(), Path(folder), a.rounds)}
        large = large_state(a.params)
        params = sum(t.numel() for k, t in large.items() if k.endswith("|param"))
        rows[f"{params / 1e6:,.1f}M parameters"] = measure(large, Path(folder), a.rounds)
    print(table(rows))


if __name__ == "__main__":
    main()
