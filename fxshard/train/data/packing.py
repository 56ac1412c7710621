"""``--pack``: whole documents, back to back in sequences of the compiled length, attention kept inside each.

First fit over a window, in document order: a document goes into the oldest of the last ``WINDOW`` sequences
that has room for it, else it starts a new sequence; sequences are numbered as they start.  (Filling only the
current sequence pads about a quarter of short-document corpora; the window brings that to a few percent while
keeping documents near their neighbours.)  A document longer than a sequence is cut into pieces of the sequence's
length, each a document of its own: the full pieces are sequences of their own, the last piece is packed.  Every rank
and the single-device reference pack the same documents the same way, so a packed sequence is one example like any
other: the rows of every global batch are the same at any layout.

Inside a sequence, position ids restart at 0 for each document (and for the padding), which is what makes a
Hugging Face model's causal mask block-diagonal (``transformers.masking_utils.find_packed_sequence_indices``); the
label of a document's first token, predicted from the previous document's end, is -100, as are the padding's::

    packed = pack(starts=np.array([0, 5, 12, 16]), lengths=np.array([5, 7, 4, 20]), seq=16)
    packed.sequences                       # 3: [5, 7, 4], [16], [4] (the 20-token document in two pieces)
    packed.padding, unpacked_padding(...)  # the fraction of padded positions with and without packing
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE = -100  # the label cross entropy skips (torch's and transformers' ignore_index)
WINDOW = 64  # open sequences a document may join


@dataclass(frozen=True)
class Packed:
    """Sequence ``i`` holds segments ``[first[i], first[i+1])``; segment ``j`` is tokens ``[start[j], start[j] +
    length[j])`` of the file."""

    seq: int
    first: np.ndarray  # int64, sequences + 1
    start: np.ndarray  # int64, one per segment
    length: np.ndarray  # int32, one per segment

    @property
    def sequences(self) -> int:
        return len(self.first) - 1

    @property
    def tokens(self) -> int:
        return int(self.length.sum())

    @property
    def targets(self) -> int:
        """Positions with a label to predict: all but the first of each segment (a document predicts only within)."""
        return int(np.maximum(self.length.astype(np.int64) - 1, 0).sum())

    @property
    def padding(self) -> float:
        """The fraction of the sequences' positions that are padding."""
        return 1 - self.tokens / (self.sequences * self.seq) if self.sequences else 0.0

    def segments(self, i: int) -> list[tuple[int, int]]:
        lo, hi = int(self.first[i]), int(self.first[i + 1])
        return list(zip(self.start[lo:hi].tolist(), self.length[lo:hi].tolist(), strict=True))


def pieces(starts: np.ndarray, lengths: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents cut into pieces of at most ``seq`` tokens (empty documents dropped): starts and lengths."""
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    count = (lengths + seq - 1) // seq
    doc = np.repeat(np.arange(len(lengths)), count)
    k = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    piece_start = starts[doc] + k * seq
    return piece_start, np.minimum(seq, starts[doc] + lengths[doc] - piece_start)


def pack(starts: np.ndarray, lengths: np.ndarray, seq: int, window: int = WINDOW) -> Packed:
    """Pack documents (file offsets ``starts``, ``lengths``) into sequences of ``seq`` (see the module docstring).

    A document's full pieces are sequences of their own, numbered where the document comes; only its last, shorter
    piece looks for room among the open sequences (so a corpus of documents much longer than a sequence packs in
    one pass over its documents, not its pieces)."""
    lengths = np.asarray(lengths, np.int64)
    start, length = pieces(np.asarray(starts, np.int64), lengths, seq)
    kept = lengths[lengths > 0]
    count = (kept + seq - 1) // seq
    first_piece = (np.cumsum(count) - count).tolist()
    full = (kept // seq).tolist()
    rest = (kept % seq).tolist()
    room = [-1] * window  # room left in each open slot's sequence (-1: none yet); slots are reused oldest first
    slot_entry = [0] * window
    oldest = 0
    entries: list = []  # a packed sequence (a list of pieces), or (first piece, n): n sequences of one full piece
    for j0, f, r in zip(first_piece, full, rest, strict=True):  # sequential by nature: microseconds a document
        if f:
            entries.append((j0, f))
        if not r:
            continue
        j = j0 + f
        for k in range(window):
            slot = oldest + k - window if oldest + k >= window else oldest + k
            if room[slot] >= r:
                break
        else:
            slot, oldest = oldest, (oldest + 1) % window
            slot_entry[slot], room[slot] = len(entries), seq
            entries.append([])
        entries[slot_entry[slot]].append(j)
        room[slot] -= r
    order = np.concatenate([np.asarray(e, np.int64) if isinstance(e, list) else np.arange(e[0], e[0] + e[1])
                            for e in entries]) if entries else np.zeros(0, np.int64)
    sizes = np.concatenate([[len(e)] if isinstance(e, list) else np.ones(e[1], np.int64) for e in entries]) \
        if entries else np.zeros(0, np.int64)
    first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Packed(seq, first, start[order], length[order].astype(np.int32))


def unpacked_padding(lengths: np.ndarray, seq: int) -> float:
    """The padding fraction of one document per sequence (a long one in several): what packing saves."""
    lengths = np.asarray(lengths, np.int64)
    lengths = lengths[lengths > 0]
    slots = int(((lengths + seq - 1) // seq).sum()) * seq
    return 1 - int(lengths.sum()) / slots if slots else 0.0


def packed_row(ids: list[np.ndarray], seq: int, pad_id: int, masks: list[np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One packed sequence from its documents' ids: input ids, labels and position ids, each ``seq`` long.
    ``masks``: each document's loss mask (:mod:`~fxshard.train.data.loss_mask`): -100 labels where it is 0."""
    used = sum(len(x) for x in ids)
    input_ids = np.full(seq, pad_id, dtype=np.int64)
    labels = np.full(seq, IGNORE, dtype=np.int64)
    positions = np.empty(seq, dtype=np.int64)
    at = 0
    for k, x in enumerate(ids):
        n = len(x)
        input_ids[at:at + n] = x
        labels[at:at + n] = x if masks is None else np.where(masks[k].astype(bool), x, IGNORE)
        if at:
            labels[at] = IGNORE  # predicted from the previous document's last token: not a target
        positions[at:at + n] = np.arange(n)
        at += n
    positions[used:] = np.arange(seq - used)  # the padding is a document of its own, attending to itself
    return input_ids, labels, positions
