"""What fxshard runs with, for ``fxshard --version`` and bug reports: its version, torch's, and torch's backend::

    describe()   # "fxshard 0.1.0\ntorch 2.13.0+cpu (CPU build; NCCL not available; gloo available)"
"""

from __future__ import annotations

SUPPORTED_TORCH = ">=2.13,<2.16"  # pyproject.toml's range
TESTED_TORCH = "2.13"  # the minor release the test suite runs on (the CPU wheel scripts/setup.sh installs)


def describe() -> str:
    import torch
    import torch.distributed as dist

    import fxshard

    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda} build"
        build += f"; {torch.cuda.device_count()} GPU(s) visible" if torch.cuda.is_available() else "; no GPU visible"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip} build"
    else:
        build = "CPU build"
    backends = [f"{name} {'available' if ok else 'not available'}"
                for name, ok in (("NCCL", dist.is_available() and dist.is_nccl_available()),
                                 ("gloo", dist.is_available() and dist.is_gloo_available()))]
    text = f"fxshard {fxshard.__version__}\ntorch {torch.__version__} ({build}; {'; '.join(backends)})"
    if not torch.__version__.startswith(TESTED_TORCH + "."):
        text += f"\nnote: fxshard's tests run on torch {TESTED_TORCH}; torch {SUPPORTED_TORCH} is accepted"
    return text
