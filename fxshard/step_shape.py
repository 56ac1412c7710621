"""The shape of a training step, as the command line sets it apart from the model file's example: ``--seq``,
``--batch``.

A Hugging Face folder's example batch is this shape (:mod:`fxshard.capture.hf_folder`), ``fxshard plan`` evaluates
the cost model at it and ``--auto`` searches at it (``plan`` and ``compile``).  Declared once here
(:mod:`fxshard.flags`), so every command that takes them takes the same two flags with the same meaning;
``--global-batch``, the old name of ``--batch`` under ``--auto``, still parses, hidden, and warns::

    >>> StepShape(seq=4096, batch=512)
    StepShape(seq=4096, batch=512, global_batch=None)
    >>> [f.flag for f in flags(StepShape)]
    ['--seq', '--batch', '--global-batch']
"""

from __future__ import annotations

from dataclasses import dataclass

from fxshard.errors import OptionError, warn
from fxshard.flags import flags, option

__all__ = ["StepShape", "flags"]


@dataclass(frozen=True)
class StepShape:
    seq: int | None = option(None, "tokens per sequence: of a Hugging Face folder's example batch; --auto searches at "
                                   "it; plan evaluates at it (default: the example's)")
    batch: int | None = option(None, "sequences per step over all dp ranks: of a Hugging Face folder's example batch; "
                                     "--auto searches at it; plan evaluates at it (default: the example's)")
    global_batch: int | None = option(None, "deprecated: the old name of --batch", hidden=True)

    def __post_init__(self):
        for flag, value in (("--seq", self.seq), ("--batch", self.batch), ("--global-batch", self.global_batch)):
            if value is not None and value < 1:
                raise OptionError(f"{flag} must be at least 1, got {value}")
        if self.global_batch is None:
            return
        if self.batch is not None and self.batch != self.global_batch:
            raise OptionError(f"--global-batch {self.global_batch} and --batch {self.batch}: --global-batch is the "
                              "old name of --batch (sequences per step, over all dp ranks); give --batch alone")
        warn("--global-batch is deprecated: it is --batch (sequences per step, over all dp ranks); use --batch")
        object.__setattr__(self, "batch", self.global_batch)  # one name from here on
        object.__setattr__(self, "global_batch", None)
