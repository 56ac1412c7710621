"""What fxshard runs with, for ``fxshard --version`` and bug reports: its version, torch's, and torch's backend::

    describe()   # "fxshard 0.1.0\ntorch 2.13.0+cpu (CPU build; NCCL not available; gloo available)"
"""

from __future__ import annotations


def _supported() -> str:
    """pyproject.toml's torch range, as the installed package declares it."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        return next((r.split("torch", 1)[1].split(";")[0].strip() for r in requires("fxshard") or []
                     if r.startswith("torch") and not r.startswith("torch-")), "")
    except PackageNotFoundError:
        return ""


# the minor releases the tests run on: 2.13 by `make test` (the CPU wheel scripts/setup.sh installs), 2.14 by
# `make test-compat` (torch 2.14.1 in a second environment); pyproject.toml's range admits these and no other
TESTED_TORCH = ("2.13", "2.14")


def describe() -> str:
    import torch
    import torch.distributed as dist

    from fxshard.version import __version__

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
    text = f"fxshard {__version__}\ntorch {torch.__version__} ({build}; {'; '.join(backends)})"
    note = untested_torch()
    return text + (f"\nnote: {note}" if note else "")


def untested_torch() -> str | None:
    """A note when torch is not a release fxshard's tests run on (None when it is)."""
    import torch

    if any(torch.__version__.startswith(minor + ".") for minor in TESTED_TORCH):
        return None
    tested = " and ".join(TESTED_TORCH)
    return (f"torch {torch.__version__} is not among the releases fxshard's tests run on (torch {tested}; fxshard "
            f"declares {_supported() or 'see pyproject.toml'}): fxshard uses torch's export, pipelining and FSDP2 "
            f"internals, so report a failure with `fxshard --version`, or install torch=={TESTED_TORCH[-1]}.*")
