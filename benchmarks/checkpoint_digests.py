"""What a checkpoint's content digests cost (issue 45 item 8): per save, hashing every tensor a rank writes; per resume,
hashing every tensor it reads back.  Each against the save or the read itself, on real files.

A rank's shard holds, per parameter, its value and AdamW's two moments (fp32) and step: what
:func:`fxshard.train.checkpoint.save_checkpoint` writes.  Two states are measured: samples/gpt.py's (its
``make_model()``), and a larger shape made of the same kinds of tensors (``--params`` parameters in 4096 x 4096
blocks).  The save is safetensors' ``save_file`` with the fsync the checkpoint does; the digest is
:func:`fxshard.train.digests.tensor_digests` (xxHash XXH3-128), and beside it ``hashlib.sha256`` over the same bytes,
the alternative measured when choosing it; the resume reads every tensor back (``safe_open``, copied into memory as
a resume copies it into its parameter), then hashes it::

    python -m benchmarks.checkpoint_digests --params 100_000_000 --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
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
    block = 4096 * 4096
    g = torch.Generator().manual_seed(0)
    return _with_adam({f"layer{i}.weight": torch.randn(4096, 4096, generator=g) for i in range(max(1, params // block))})


def _with_adam(params: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in params.items():
        out |= {f"{name}|param": p, f"{name}|exp_avg": torch.randn_like(p), f"{name}|exp_avg_sq": torch.rand_like(p),
                f"{name}|step": torch.tensor(7.0)}
    return out


def _seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed by the machine's other work


def measure(state: dict[str, torch.Tensor], folder: Path, rounds: int) -> dict:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fxshard.train.digests import tensor_digest, tensor_digests

    path = folder / "shard.safetensors"

    def save():
        save_file(state, str(path))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def read(hashed: bool):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key).clone()  # into memory, as a resume copies it into its parameter
                if hashed:
                    tensor_digest(t)

    def sha256():
        for t in state.values():
            hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).digest()

    save()
    out = {"bytes": sum(t.numel() * t.element_size() for t in state.values()), "tensors": len(state),
           "save": _seconds(save, rounds), "digest": _seconds(lambda: tensor_digests(state), rounds),
           "sha256": _seconds(sha256, rounds), "read": _seconds(lambda: read(False), rounds),
           "read_hashed": _seconds(lambda: read(True), rounds)}
    path.unlink()
    return out


def table(rows: dict[str, dict]) -> str:
    lines = ["| state | size | save (fsync'd) | digests (XXH3) | sha256 | read back | read + check |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['bytes'] / 2**20:,.1f} MiB, {r['tensors']} tensors | {r['save'] * 1e3:,.1f} ms "
                     f"| {r['digest'] * 1e3:,.1f} ms ({r['digest'] / r['save']:.0%} of the save) "
                     f"| {r['sha256'] * 1e3:,.1f} ms | {r['read'] * 1e3:,.1f} ms "
                     f"| {r['read_hashed'] * 1e3:,.1f} ms (+{(r['read_hashed'] - r['read']) * 1e3:,.1f} ms) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=100_000_000, help="parameters of the larger shape")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="folder for the shard files (default: a temporary)")
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=a.work) as folder:
        rows = {"samples/gpt.py": measure(gpt_state(), Path(folder), a.rounds)}
        rows[f"{a.params / 1e6:,.0f}M parameters"] = measure(large_state(a.params), Path(folder), a.rounds)
    print(table(rows))


if __name__ == "__main__":
    main()
