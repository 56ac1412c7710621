"""Token ids are checked in ``[0, vocabulary)`` wherever they come from, before training and as each example is read.

An id outside the vocabulary does not fail where one would expect: at tp=1 the embedding raises an ``IndexError``
in the middle of a run, and at tp>1 the vocabulary-parallel embedding masks every id outside a rank's rows, so a
``-1`` trains silently as a zero vector.  So every source is checked, by the example it comes in, naming it: a
token file's ids (the whole split before launch, and each sequence as a rank reads it), and the ``input_ids`` (and
a causal LM's ``labels``, which may also hold -100, the ignored label) of every ``make_dataset`` example,
``make_batches`` batch and example batch::

    ids = token_ids(model_file)               # None: the model has no vocabulary (no embedding)
    ids.check({"input_ids": t}, "model.py: make_dataset('train')[7]")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fxshard.errors import DataError

ID_KEYS = ("input_ids", "decoder_input_ids")  # inputs that index the vocabulary (a transformers model's names)
LABEL_KEY, IGNORE = "labels", -100  # a causal LM's labels: ids of the vocabulary, or the ignored label
_VOCAB: dict[tuple, int | None] = {}


@dataclass(frozen=True)
class TokenIds:
    """The vocabulary's size, and the check of the ids an example or batch holds."""

    vocab: int

    def check(self, values: Any, where: str) -> None:
        """Refuse ``values`` (an example or a batch: a dict by input name) holding an id outside the vocabulary."""
        if not isinstance(values, dict):
            return
        shapes = {k: tuple(values[k].shape) for k in ID_KEYS if isinstance(values.get(k), torch.Tensor)}
        for key in ID_KEYS:
            if key in shapes:
                self._check(values[key], key, where, allow_ignored=False)
        labels = values.get(LABEL_KEY)
        if isinstance(labels, torch.Tensor) and tuple(labels.shape) in shapes.values():  # a causal LM's labels
            self._check(labels, LABEL_KEY, where, allow_ignored=True)

    def check_array(self, ids: np.ndarray, where: str) -> None:
        """Refuse token-file ids (a numpy array read from the file) outside the vocabulary."""
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab))
        if len(bad):
            raise DataError(f"{where}: token id {int(ids[bad[0]])} (position {int(bad[0])} of the example), but the "
                            f"model's vocabulary has {self.vocab} ids (0..{self.vocab - 1}); {_FIX}")

    def _check(self, t: torch.Tensor, key: str, where: str, allow_ignored: bool) -> None:
        if t.dtype.is_floating_point or t.dtype == torch.bool or not t.numel():
            return
        bad = (t < 0) | (t >= self.vocab)
        if allow_ignored:
            bad &= t != IGNORE
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            also = " or -100 (ignored)" if allow_ignored else ""
            raise DataError(f"{where}: input {key!r} holds token id {int(t[at])} at {list(at)}, but the model's "
                            f"vocabulary has {self.vocab} ids (0..{self.vocab - 1}{also}); {_FIX}")


_FIX = "tokenize with the model's own tokenizer, or give the model a vocabulary that holds every id"


def token_ids(mf) -> TokenIds | None:
    """The id check of model file ``mf`` (a :class:`~fxshard.capture.modelfile.ModelFile`), or None when its model has
    no vocabulary; the model is built on meta once per file version and process."""
    try:
        key = (str(mf.path), mf.path.stat().st_mtime_ns)
    except OSError:
        key = (str(mf.path), None)
    if key not in _VOCAB:
        _VOCAB[key] = vocabulary_size(mf)
    vocab = _VOCAB[key]
    return TokenIds(vocab) if vocab is not None else None


def vocabulary_size(mf) -> int | None:
    """The model's vocabulary: a transformers config's ``vocab_size``, else the first embedding's rows."""
    model = mf.build_model(meta=True)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None
