"""The data options of ``fxshard run``: one dataclass, nested in :class:`fxshard.train.options.RunOptions` as the
optimizer's are, so each field is a flag (``--data``, ``--pack``, ``--data-workers`` ...) and the launcher hands it
on to every rank.  Light: the command line reads it without loading torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class DataOptions:
    data: Path | None = field(default=None, metadata=_help(
        "token file to train on: a flat binary file of uint16/uint32 token ids (nanoGPT's train.bin, Megatron's "
        ".bin) with a .json or Megatron .idx sidecar, as `fxshard data tokenize` writes; read in sequences of the "
        "compiled length (a file with a loss mask, from --format chat: one conversation per sequence, trained where "
        "the mask is 1).  Wins over the model file's make_dataset() (said at launch)"))
    eval_data: Path | None = field(default=None, metadata=_help(
        "token file of the validation split (default: the validation documents the sidecar of --data names, or "
        "val.bin beside a train.bin)"))
    pack: bool = field(default=False, metadata=_help(
        "with --data: fill each sequence with whole documents, EOS-separated; position ids restart per document "
        "and attention stays inside it (the model must take position_ids)"))
    data_workers: int = field(default=2, metadata=_help(
        "DataLoader worker processes per rank loading ahead of the step (0: load in the rank itself)"))
    shuffle: bool = field(default=True, metadata=_help(
        "read the training examples in a seeded random order, a new permutation each epoch"))
    data_seed: int = field(default=0, metadata=_help("seed of the shuffled order (the same on every rank)"))

    def __post_init__(self):
        from fxshard.errors import OptionError

        if not (isinstance(self.data_workers, int) and self.data_workers >= 0):
            raise OptionError(f"--data-workers {self.data_workers}: expected 0 or more worker processes")
        if self.pack and self.data is None:
            raise OptionError("--pack packs the documents of a token file: give it --data PATH (a model file's "
                              "make_dataset() packs its own examples)")
        if self.eval_data is not None and self.data is None:
            raise OptionError(f"--eval-data {self.eval_data}: a validation token file goes with --data PATH (the "
                              "training token file); without --data the model file's make_dataset('validation') "
                              "gives the validation split")
