"""``fxshard run --tensorboard DIR``: the steps ``--metrics`` records, as TensorBoard scalars, written by rank 0.

The metrics JSONL stays the source of truth: every record it gets (``fxshard/train/launch.py``) is also written here,
at its step, with torch's ``SummaryWriter`` (the optional extra ``tensorboard``): the loss, the learning rate, the
gradient norm (the global one, before clipping), tokens per second, and the evaluation's loss at the steps that
evaluate.  A resumed run writes on into the same folder, purging what an interrupted run had written after the step
it resumes from::

    board = Board(Path("runs/llama"), first_step=1)
    board.write({"step": 1, "loss": 5.5, "lr": 3e-4, "grad_norm": 1.2, "seconds": 0.5, "tokens": 4096})
    board.close()          # tensorboard --logdir runs/llama
"""

from __future__ import annotations

import math
from pathlib import Path

from fxshard.errors import OptionError

# metrics key -> TensorBoard tag (tokens_per_s is the record's tokens over its seconds)
TAGS = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s", "eval_loss": "eval/loss"}


def check_tensorboard(folder: Path) -> None:
    """Before launch: the ``tensorboard`` package is installed, and ``folder`` is a folder that exists or can be
    made, not a link, and can be written."""
    try:
        import tensorboard  # noqa: F401  torch's SummaryWriter writes with it
    except ImportError:
        raise OptionError(f"--tensorboard {folder}: needs the tensorboard package, which is not installed; "
                          "pip install 'fxshard[tensorboard]' (or pip install tensorboard), or drop --tensorboard "
                          "(--metrics writes the same figures as JSON lines)") from None
    if folder.exists() and not folder.is_dir() and not folder.is_symlink():
        raise OptionError(f"--tensorboard {folder}: is a file; --tensorboard names a folder, e.g. {folder}-runs")
    if not folder.exists() and not folder.parent.is_dir():
        raise OptionError(f"--tensorboard {folder}: the folder {folder.parent} does not exist; create it first")
    from fxshard.files import make_folder, try_writing

    try:
        make_folder(folder, "the TensorBoard events", parents=False)  # never a link
        try_writing(folder / ".fxshard-write-test", "the TensorBoard events")  # a new temporary in it: no link
    except OSError as e:
        raise OptionError(f"--tensorboard {folder}: cannot be written ({e.strerror}); choose a folder you can write "
                          "to") from None


class Board:
    """Rank 0's TensorBoard writer: one event file per run in ``folder`` (SummaryWriter names it by time, host and
    process, so it never opens another's file), flushed after every step so a watching TensorBoard sees it."""

    def __init__(self, folder: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        from fxshard.files import make_folder

        make_folder(folder, "the TensorBoard events")  # checked before launch; again here, where it is opened
        # resumed: an interrupted run's events after the step it saved are dropped, as the resumed run redoes them
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=first_step if first_step > 1 else None)

    def write(self, record: dict) -> None:
        """Add one ``--metrics`` record's scalars at its step."""
        step = record["step"]
        values = dict(record)
        if record.get("tokens") and record.get("seconds"):
            values["tokens_per_s"] = record["tokens"] / record["seconds"]
        for key, tag in TAGS.items():
            value = values.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
