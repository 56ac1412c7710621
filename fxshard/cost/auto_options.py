"""The options of ``fxshard plan --auto`` and ``fxshard compile --auto``, declared once (:mod:`fxshard.flags`), with
their checks: a flag only the search reads, given without ``--auto``, is refused here, naming it.  The sequence and
batch the search runs at are :class:`fxshard.step_shape.StepShape`'s ``--seq`` and ``--batch``.

Without torch, as the layout's flags are: the command line declares these before torch loads::

    >>> [f.flag for f in flags(AutoOptions)][:3]
    ['--auto', '--gpus', '--gpus-per-node']
"""

from __future__ import annotations

from dataclasses import dataclass

from fxshard.errors import OptionError
from fxshard.flags import flags, option

__all__ = ["AutoOptions", "flags"]


@dataclass(frozen=True)
class AutoOptions:
    auto: bool = option(False, "search the layouts that divide --gpus (tp, pp with schedule and virtual stages, cp, "
                               "dp with ep, ZeRO stage, sp, recompute, microbatches), drop those that do not fit, "
                               "rank the rest by the time model's step on --hardware")
    gpus: int | None = option(None, "--auto: devices to lay the model out on")
    gpus_per_node: int | None = option(None, "--auto: devices per node (default: the hardware profile's)")
    hardware: str | None = option(None, "hardware profile: h100, h200, b200, a100, cpu-gloo, or a JSON file "
                                        "(fxshard calibrate writes one); plan states the predicted step time with it")
    top: int = option(5, "--auto: how many of the best layouts to print")

    def __post_init__(self):
        for flag, value in (("--gpus", self.gpus), ("--gpus-per-node", self.gpus_per_node), ("--top", self.top)):
            if value is not None and value < 1:
                raise OptionError(f"{flag} must be at least 1, got {value}")
        if not self.auto and self.gpus is not None:
            raise OptionError("--gpus is for --auto (the search); found it without --auto: add --auto, or give the "
                              "layout's own flags")
        if not self.auto and self.gpus_per_node is not None and self.hardware is None:
            raise OptionError("--gpus-per-node places the mesh on nodes for the time model: expected --hardware too")

    def check_compile(self) -> None:
        """``fxshard compile`` predicts nothing: without ``--auto`` it refuses ``--hardware``, which only the search
        reads there (``--seq`` and ``--batch`` are :func:`fxshard.capture.hf_folder.check_model_flags`'s)."""
        if self.hardware is not None and not self.auto:
            raise OptionError("--hardware without --auto: compile reads it only to search (--auto); add --auto, or use "
                              "`fxshard plan --hardware` to predict a layout's step")
