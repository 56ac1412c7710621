"""A generated corpus and a small BPE tokenizer trained on it: text to try ``fxshard data tokenize`` on, for the
tests, the data benchmark and the docs' worked example, with no download.

The text is a Markov chain over made-up words (each word has a few likely successors, so a model has something
to learn), cut into sentences and documents of widely varying length (so packing has padding to save)::

    write_corpus(Path("corpus"), documents=1000)           # corpus/part-000.jsonl ...
    train_tokenizer(Path("corpus"), Path("tok"), vocab=256)  # tok/tokenizer.json, tok/tokenizer_config.json
    generate(Path("gen"), documents=1000)                  # both: gen/corpus, gen/tokenizer (fxshard data generate)

Each is written as a set (:class:`fxshard.files.FileSet`) into a folder fxshard names (never a link), replacing only
the files an earlier generate wrote: the corpus's ``part-*.jsonl`` of an earlier, larger corpus go with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EOS = "<eos>"
CORPUS_FILE = "a generated corpus file"
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vi", "do", "pe", "zu", "ha", "bo", "ri", "an", "el"]


def _lexicon(rng: np.random.Generator, words: int) -> list[str]:
    out: set[str] = set()
    while len(out) < words:
        out.add("".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))))
    return sorted(out)


def documents(count: int, seed: int = 0, words: int = 300, sentences: tuple[int, int] = (1, 40)) -> list[str]:
    """``count`` documents of ``sentences`` (at least, at most) sentences of 4 to 18 words."""
    rng = np.random.default_rng(seed)
    lexicon = np.array(_lexicon(np.random.default_rng(1234), words))  # the same words in every corpus
    successors = np.random.default_rng(99).integers(0, words, size=(words, 6))
    counts = rng.integers(sentences[0], sentences[1] + 1, size=count)
    lengths = rng.integers(4, 19, size=int(counts.sum()))
    per_doc = np.add.reduceat(lengths, np.concatenate([[0], np.cumsum(counts)[:-1]]))
    # one chain per document, all advanced together: a step of the chain is one array operation
    chain = np.zeros((count, int(per_doc.max())), dtype=np.int64)
    chain[:, 0] = rng.integers(0, words, size=count)
    for i in range(1, chain.shape[1]):
        fresh = rng.random(count) < 0.05
        step = successors[chain[:, i - 1], rng.integers(0, 6, size=count)]
        chain[:, i] = np.where(fresh, rng.integers(0, words, size=count), step)
    out, s = [], 0
    for d, n in enumerate(counts.tolist()):
        text, at, parts = lexicon[chain[d, :per_doc[d]]].tolist(), 0, []
        for length in lengths[s:s + n].tolist():
            parts.append(" ".join([text[at].capitalize(), *text[at + 1:at + length]]) + ".")
            at += length
        s += n
        out.append(" ".join(parts))
    return out


def generate(out: Path, documents_count: int, files: int = 1, vocab: int = 256, seed: int = 0) -> None:
    """``fxshard data generate OUT``: the corpus ``OUT/corpus`` and the tokenizer ``OUT/tokenizer`` trained on it."""
    from fxshard.errors import OptionError

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OptionError(f"{out}: is a file; data generate writes a folder (OUT/corpus, OUT/tokenizer): name a "
                          "new or existing folder")
    write_corpus(out / "corpus", documents_count, files, seed)
    train_tokenizer(out / "corpus", out / "tokenizer", vocab)


def write_corpus(folder: Path, documents_count: int, files: int = 1, seed: int = 0,
                 sentences: tuple[int, int] = (1, 40), chunk: int = 10_000) -> list[Path]:
    """A corpus of ``documents_count`` documents in ``files`` .jsonl files under ``folder`` (generated ``chunk``
    documents at a time)."""
    per = -(-documents_count // files)

    def part(k: int) -> str:
        n = min(per, documents_count - k * per)
        return "".join(json.dumps({"text": text}) + "\n" for c, lo in enumerate(range(0, n, chunk))
                       for text in documents(min(chunk, n - lo), seed=(seed * 1000 + k) * 1000 + c,
                                             sentences=sentences))

    return save_corpus(folder, files, part)


def save_corpus(folder: Path, files: int, part) -> list[Path]:
    """``folder/part-000.jsonl`` .. ``part-{files-1}``, ``part(k)`` the text of file ``k``: one set, which also drops
    the ``part-*.jsonl`` an earlier, larger generated corpus left (a tokenize of the folder would read them)."""
    from fxshard.files import FileSet, make_folder

    folder = make_folder(folder, "the corpus folder")
    paths = [folder / f"part-{k:03d}.jsonl" for k in range(files)]
    members = dict.fromkeys(sorted({*paths, *folder.glob("part-*.jsonl")}), CORPUS_FILE)
    with FileSet(members) as staged:
        for k, path in enumerate(paths):
            staged.write(path, part(k))
    return paths


def save_tokenizer(out: Path, tokenizer: str, config: dict) -> Path:
    """A Hugging Face tokenizer folder: ``tokenizer.json`` and ``tokenizer_config.json``, one set."""
    from fxshard.files import FileSet, make_folder

    out = make_folder(out, "the tokenizer folder")
    with FileSet({out / "tokenizer.json": "a tokenizer", out / "tokenizer_config.json": "a tokenizer's configuration"}
                 ) as staged:
        staged.write(out / "tokenizer.json", tokenizer)
        staged.write(out / "tokenizer_config.json", json.dumps(config, indent=1) + "\n")
    return out


def train_tokenizer(corpus: Path, out: Path, vocab: int = 256) -> Path:
    """A BPE tokenizer of ``vocab`` ids (``<eos>`` among them) trained on ``corpus``'s text, saved as a Hugging
    Face tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from fxshard.train.data.tokenize import corpus_files
    from fxshard.train.data.tokenize import documents as read_documents

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False)
    texts = (t for p in corpus_files(corpus) for t in read_documents(p))
    tokenizer.train_from_iterator(texts, trainer)
    return save_tokenizer(out, tokenizer.to_str(), {"eos_token": EOS})
