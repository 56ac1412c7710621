"""A chat token file through ``--data``: one conversation per example (right-padded, padding labelled -100 and
masked from attention) or packed (``--pack``: each conversation its own block of restarting positions), labels
-100 wherever the loss mask is 0; dp ranks read the one-device order; a conversation longer than the compiled
sequence is refused before launch, naming it and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fxshard.capture.modelfile import load_model_file
from fxshard.errors import DataError
from fxshard.train.data import DataOptions, global_batches, open_batches
from fxshard.train.data.checks import check_model_data, describe
from fxshard.train.data.loss_mask import LossMask
from fxshard.train.data.packing import IGNORE
from fxshard.train.data.tokens import TokenFile

MODELS = Path(__file__).resolve().parent.parent / "models"
CHAT, PADDED = MODELS / "chat_llama.py", MODELS / "llama_padded.py"
SEQ = 128


def _conversations(root: Path, split_docs: range) -> list[tuple[np.ndarray, np.ndarray]]:
    file = TokenFile.open(root / "chat.bin")
    mask = LossMask.beside(file)
    lengths = file.document_lengths()
    return [(file.read(int(file.starts[d]), int(lengths[d])), mask.read(int(file.starts[d]), int(lengths[d])))
            for d in split_docs]


def test_unpacked_each_example_is_one_conversation_padded_with_its_labels(chat_corpus):
    root, summary = chat_corpus
    train = summary.conversations - summary.validation_documents
    convs = _conversations(root, range(train))
    options = DataOptions(data=root / "chat.bin", shuffle=False)
    batches = global_batches(CHAT, "train", options)
    assert len(batches.source) == train
    seen = 0
    for batch in (next(batches) for _ in range(3)):
        for row in range(batch["input_ids"].shape[0]):
            ids, mask = convs[seen]
            n = len(ids)
            assert batch["input_ids"][row, :n].tolist() == ids.tolist()
            assert batch["labels"][row, :n].tolist() == np.where(mask == 1, ids, IGNORE).tolist()
            assert (batch["labels"][row, n:] == IGNORE).all() and batch["position_ids"][row].tolist() == \
                list(range(SEQ))
            seen += 1


def test_a_model_taking_an_attention_mask_gets_the_padding_masked(chat_corpus, tmp_path):
    """llama_padded.py takes attention_mask (sequences of 16): a file of short conversations fills it 1, then
    0."""
    root, _ = chat_corpus
    ids = np.arange(1, 41) % 200
    (tmp_path / "s.bin").write_bytes(ids.astype(np.uint16).tobytes())
    mask = (np.arange(40) % 3 == 0).astype(np.uint8)
    (tmp_path / "s.mask").write_bytes(mask.tobytes())
    from fxshard.train.data.tokens import megatron_index_bytes

    (tmp_path / "s.idx").write_bytes(megatron_index_bytes(np.uint16, np.array([5, 16, 9, 10])))
    (tmp_path / "s.json").write_text(json.dumps({"dtype": "uint16", "eos": 0, "loss_mask": {
        "version": 1, "file": "s.mask", "dtype": "uint8"}}))
    batch = next(global_batches(PADDED, "train", DataOptions(data=tmp_path / "s.bin", shuffle=False)))
    starts = [0, 5, 21, 30]
    for row, n in enumerate([5, 16, 9, 10]):
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (16 - n)
        lo = starts[row]
        want = np.where(mask[lo:lo + n] == 1, ids[lo:lo + n], IGNORE).tolist() + [IGNORE] * (16 - n)
        assert batch["labels"][row].tolist() == want


def test_packed_conversations_keep_their_masks_and_attention_blocks(chat_corpus):
    root, summary = chat_corpus
    train = summary.conversations - summary.validation_documents
    convs = {tuple(ids.tolist()): mask for ids, mask in _conversations(root, range(train))}
    batches = global_batches(CHAT, "train", DataOptions(data=root / "chat.bin", pack=True, shuffle=False))
    assert len(batches.source) < train  # conversations share sequences
    found = 0
    for batch in (next(batches) for _ in range(3)):
        for row in range(batch["input_ids"].shape[0]):
            positions = batch["position_ids"][row].numpy()
            starts = [*np.flatnonzero(positions == 0).tolist(), SEQ]
            for lo, hi in zip(starts, starts[1:], strict=False):
                ids = batch["input_ids"][row, lo:hi].numpy()
                mask = convs.get(tuple(ids.tolist()))
                if mask is None:  # the padding at the end of the sequence
                    assert (batch["labels"][row, lo:hi] == IGNORE).all()
                    continue
                want = np.where(mask == 1, ids, IGNORE)
                want[0] = IGNORE  # a conversation's first token follows another's: not a target
                assert batch["labels"][row, lo:hi].tolist() == want.tolist()
                found += 1
    assert found > 12  # more conversations than rows: packing put several in a sequence


@pytest.mark.parametrize("pack", [False, True])
def test_dp_ranks_read_the_one_device_batches(chat_corpus, pack):
    root, _ = chat_corpus
    options = DataOptions(data=root / "chat.bin", pack=pack, data_workers=0)
    whole = global_batches(CHAT, "train", options)
    ranks = [open_batches(CHAT, None, "train", d, 2, options, workers=0) for d in range(2)]
    for _ in range(4):
        want = next(whole)
        got = [next(r) for r in ranks]
        for key in ("input_ids", "labels", "position_ids"):
            assert np.array_equal(np.concatenate([g[key].numpy() for g in got]), want[key].numpy())


def test_the_launch_says_what_is_trained_and_refuses_a_conversation_over_the_sequence(chat_corpus, tmp_path):
    root, summary = chat_corpus
    mf = load_model_file(CHAT)
    found = check_model_data(mf, options=DataOptions(data=root / "chat.bin"), say=lambda *_: None)
    line = describe(found)
    trained = found["train"]["trained_tokens"]
    train = summary.conversations - summary.validation_documents
    assert f"{train} conversations, {trained:,} trained tokens" in line
    assert "one conversation per sequence:" in line and "padding" in line
    # a file tokenized without --seq holds a conversation over the compiled 128 tokens
    for suffix in (".bin", ".mask", ".idx", ".json"):
        shutil.copy(root / f"chat{suffix}", tmp_path / f"long{suffix}")
    side = json.loads((tmp_path / "long.json").read_text())
    side["loss_mask"]["file"] = "long.mask"
    (tmp_path / "long.json").write_text(json.dumps(side))
    small = tmp_path / "small.py"
    small.write_text(CHAT.read_text().replace("4, 128, 512", "4, 32, 512"))
    says = (r"long\.bin: conversation \d+ of the train split is \d+ tokens, longer than the compiled "
            r"sequence of 32 \(\d+ of its conversations are\); .* tokenize again with --seq 32 "
            "--truncate right")
    with pytest.raises(DataError, match=says):
        check_model_data(load_model_file(small), options=DataOptions(data=tmp_path / "long.bin"),
                         say=lambda *_: None)


def test_a_mask_that_does_not_pair_with_its_ids_is_refused(chat_corpus, tmp_path):
    root, _ = chat_corpus
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(root / f"chat{suffix}", tmp_path / f"c{suffix}")
    (tmp_path / "chat.mask").write_bytes((root / "chat.mask").read_bytes()[:-3])
    file = TokenFile.open(tmp_path / "c.bin")
    with pytest.raises(DataError, match=f"chat.mask: {file.tokens - 3} mask bytes for the {file.tokens} "
                                        "tokens of c.bin; the two files are not a pair"):
        LossMask.beside(file)
    side = json.loads((tmp_path / "c.json").read_text())
    side["loss_mask"]["version"] = 7
    (tmp_path / "c.json").write_text(json.dumps(side))
    with pytest.raises(DataError, match="this fxshard reads version 1"):
        LossMask.beside(file)


@pytest.mark.parametrize("pack", [False, True])
def test_the_models_loss_is_the_mean_over_the_tokens_the_mask_trains(chat_corpus, pack):
    """The loss the compiled model sees (labels from the mask) is the cross entropy of the next token averaged
    over exactly the positions whose token the file's mask trains: computed here from the logits and the mask
    alone."""
    import torch
    import torch.nn.functional as F

    root, summary = chat_corpus
    train = summary.conversations - summary.validation_documents
    masks = {tuple(ids.tolist()): mask for ids, mask in _conversations(root, range(train))}
    batch = next(global_batches(CHAT, "train", DataOptions(data=root / "chat.bin", pack=pack)))
    trained = torch.zeros_like(batch["input_ids"], dtype=torch.bool)  # token t trained: predicted from t - 1
    for row in range(trained.shape[0]):
        positions = batch["position_ids"][row].numpy()
        starts = [*np.flatnonzero(positions == 0).tolist(), SEQ] if pack else [0, SEQ]
        for lo, hi in zip(starts, starts[1:], strict=False):
            ids = batch["input_ids"][row, lo:hi].tolist()
            key = next((k for k in masks if list(k) == ids[:len(k)]), None)
            if key is not None:
                trained[row, lo + 1:lo + len(key)] = torch.from_numpy(masks[key][1:].astype(bool))
    model = load_model_file(CHAT).build_model(0)
    with torch.no_grad():
        loss = model(**batch).loss
        # use_cache=False as the compiled forward: with a cache transformers builds no per-document mask
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
    targets = trained[:, 1:]
    manual = F.cross_entropy(logits[:, :-1][targets], batch["input_ids"][:, 1:][targets])
    assert targets.sum() > 0 and torch.allclose(loss, manual, rtol=1e-6), (loss, manual)
