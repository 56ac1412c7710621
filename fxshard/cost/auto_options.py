"""The options of ``fxshard plan --auto`` and ``fxshard compile --auto``, declared once (:mod:`fxshard.flags`).

A leaf without torch, as the layout's flags are: the command line declares these before torch loads::

    >>> [f.flag for f in flags(AutoOptions)][:3]
    ['--auto', '--gpus', '--gpus-per-node']
"""

from __future__ import annotations

from dataclasses import dataclass

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
    global_batch: int | None = option(None, "--auto: sequences per step, all dp ranks (default: the example's batch)")
    top: int = option(5, "--auto: how many of the best layouts to print")
