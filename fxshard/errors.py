"""The one error family users can cause.

Every message names where (module FQN, file, node), what was expected, what was found,
and how to fix it.  ``assert`` is reserved for fxshard's own bugs.
"""

from __future__ import annotations


class FxshardError(Exception):
    """Base class of every error a user's input can cause."""


class ModelFileError(FxshardError):
    """The model file does not follow the convention (make_model, make_inputs, loss_fn)."""


class CaptureError(FxshardError):
    """torch.export could not capture the model."""


class NeedsRealWeights(CaptureError):
    """Data-dependent code a capture on meta tensors cannot specialize (fxshard.capture.specialize runs the model on
    the example batch): a capture with the model's real weights can."""


class PlanError(FxshardError):
    """A plan, decorator or layout flag is inconsistent with the model."""


class ShardingError(FxshardError):
    """A tensor cannot be split the way the plan asks (sizes, unsupported ops)."""


class LayoutError(FxshardError):
    """The parallel layout (tp, pp, dp, zero, schedule) is not valid or not supported."""


class OutputFolderError(FxshardError):
    """A folder given as compiled output is not one fxshard wrote, or is damaged."""


class CheckError(FxshardError):
    """A static check found a program that would compute wrongly or hang."""


class RandomnessError(FxshardError):
    """Randomness in the model (a dropout variant) that cannot match single-device training under a layout."""


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order, for 'use tp in {...}' hints (pairs up to its square root: a device
    count of millions is as quick as one of eight)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class DataError(FxshardError):
    """Training data that does not fit the compiled program (shapes, token ids, too short, empty), refused before
    any rank starts where it can be seen then."""


class OptionError(FxshardError):
    """A run option out of its range (steps, learning rate, paths), refused before anything launches."""


class WeightsError(FxshardError):
    """A Hugging Face weights folder (``--weights DIR``) does not hold what the model needs."""


class FxshardWarning(UserWarning):
    """Something in the user's own input is probably a mistake (a plan key matching no module)."""


def warn(message: str) -> None:
    """Warn at the first caller outside fxshard, so Python shows the user's line, never one of ours."""
    import sys
    import warnings

    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("fxshard"):
        frame = frame.f_back
    warnings.warn_explicit(message, FxshardWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))
