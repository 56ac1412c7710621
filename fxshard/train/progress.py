"""What rank 0 shows while ``fxshard run`` trains: a progress bar on a terminal, one plain line per step otherwise.

On a terminal (rank 0's stdout, which the local launcher's workers inherit) a rich bar shows the step, the
loss, tokens per second and the time left; piped or logged, each step is the line it has always been, with
tokens per second added after it (scripts read ``step N/M  loss X  (T s)``)::

    progress = StepProgress(steps=5, first_step=1, tokens_per_step=64)
    progress.step(1, 5.54, seconds=0.21)   # "step 1/5  loss 5.540000  (0.210 s)  305 tokens/s"
    progress.close()
"""

from __future__ import annotations

import sys


class StepProgress:
    """Rank 0's display of the steps; ``log`` prints a line (plain mode, and messages such as saved checkpoints)."""

    def __init__(self, steps: int, first_step: int, tokens_per_step: int | None, log=print,
                 terminal: bool | None = None):
        self.steps, self.first_step, self.tokens_per_step, self.log = steps, first_step, tokens_per_step, log
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self._bar = None
        if self.terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[loss]}"), TextColumn("{task.fields[speed]}"),
                                 TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=steps, completed=first_step - 1, loss="loss —",
                                            speed="")
            self._bar.start()

    def rate(self, seconds: float) -> str:
        if not self.tokens_per_step or seconds <= 0:
            return ""
        return f"{self.tokens_per_step / seconds:,.0f} tokens/s"

    def step(self, step: int, loss: float, seconds: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"loss {loss:.6f}", speed=self.rate(seconds))
            return
        rate = self.rate(seconds)
        self.log(f"step {step}/{self.steps}  loss {loss:.6f}  ({seconds:.3f} s){'  ' + rate if rate else ''}")

    def print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, highlight=False, markup=False)
        else:
            self.log(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def tokens_per_step(manifest, grad_accum: int = 1) -> int | None:
    """Tokens one optimizer step trains on: rows x sequence of the batch's first integer input of two or more
    dimensions (``input_ids``); None for a model without one (then no tokens/s is shown)."""
    for i in manifest.inputs:
        if i.is_tensor and "int" in i.dtype and len(i.shape) >= 2:
            return i.shape[0] * i.shape[1] * grad_accum
    return None
