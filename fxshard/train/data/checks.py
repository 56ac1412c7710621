"""What the launcher checks of the training data before any rank starts, each refusal naming the file and the fix.

- ``--data`` and the model file's ``make_dataset`` both present: ``--data`` wins, and the launch says so;
- an empty split, or one shorter than a global batch (a token file too short for one batch of sequences);
- an example shaped unlike the compiled row (the first of each split, and every ``make_batches`` batch);
- token ids outside ``[0, vocabulary)`` (a token file's whole split is read, a chunk at a time; the first example of a
  dataset and every ``make_batches`` batch; each example is checked again as it is read:
  :mod:`~fxshard.train.data.ids`);
- ``--pack`` on a model whose attention cannot take document masks (:mod:`~fxshard.train.data.document_masks`), or
  on documents of which none has a position to predict (only their EOS: every label would be ignored).

It returns what it found, for the launch line, the run record and ``fxshard report``::

    summary = check_data(Path("out/llama"), DataOptions(data=Path("corpus.bin"), pack=True))
    summary["train"]["padding"]     # {"packed": 0.031, "unpacked": 0.412, ...}
"""

from __future__ import annotations

from pathlib import Path

from fxshard.errors import DataError
from fxshard.train.data.options import DataOptions


def check_data(out: Path, options: DataOptions = DataOptions(), say=print, splits: tuple[str, ...] = ("train",)
               ) -> dict:
    """Check the data of ``splits`` for the compiled folder ``out``; return ``{split: summary}``."""
    from fxshard.capture.modelfile import load_model_file
    from fxshard.codegen.manifest import read_manifest

    manifest = read_manifest(out)
    return check_model_data(load_model_file(Path(out) / manifest.model_file), manifest.seed, options, say, splits)


def check_model_data(mf, seed: int = 0, options: DataOptions = DataOptions(), say=print,
                     splits: tuple[str, ...] = ("train",)) -> dict:
    """:func:`check_data` of a model file (a :class:`~fxshard.capture.modelfile.ModelFile`) compiled with ``seed``."""
    from fxshard.train.data.sources import resolve_source
    from fxshard.train.data.spec import BatchSpec

    if options.data is not None and callable(getattr(mf.module, "make_dataset", None)):
        say(f"data: --data {options.data} is used; the model file's make_dataset() is not")
    spec = BatchSpec.of(mf.build_inputs(seed), f"{mf.path}: make_inputs()")
    found = {}
    for split in splits:
        source = resolve_source(mf, spec, split, options, seed)
        found[split] = _check_source(source, spec, split, mf, options)
    return found


def _check_source(source, spec, split: str, mf, options: DataOptions) -> dict:
    summary = {"source": source.name, "kind": source.kind}
    from fxshard.train.data.ids import token_ids

    ids = token_ids(mf)
    if source.kind == "batches":
        from fxshard.train.data.spec import BatchSpec

        for i, batch in enumerate(source.batches):
            where = f"{source.name.split(': ')[0]}: {source.name.split(': ')[-1]} batch {i}"
            BatchSpec.check_batch(spec, batch, spec.rows, where)
            if ids is not None:
                ids.check(batch, where)
        return summary
    if source.kind == "stream":
        from fxshard.train.data.loader import endless

        first, where = next(endless(source.dataset, source.name)), f"{source.name} (its first example)"
        spec.check_example(first, where)
        if ids is not None:
            ids.check(first, where)
        return summary
    n = len(source.dataset)
    summary["examples"] = n
    if n == 0:
        raise DataError(f"{source.name}: the {split} split is empty; "
                        + ("the token file holds fewer tokens than one sequence" if source.kind == "tokens" else
                           "return a dataset with examples"))
    if n < spec.rows:
        what = "sequences" if source.kind == "tokens" else "examples"
        raise DataError(f"{source.name}: {n} {what}, fewer than one global batch of {spec.rows}; "
                        + ("give a longer token file, or compile a smaller batch or sequence"
                           if source.kind == "tokens" else "give the split at least one batch of examples"))
    if source.kind == "tokens":
        summary |= _check_tokens(source, mf, split, ids)
    else:
        spec.check_example(source.dataset[0], f"{source.name}[0]")
        if ids is not None:
            ids.check(source.dataset[0], f"{source.name}[0]")
    return summary


def _check_tokens(source, mf, split: str, ids) -> dict:
    windows = source.dataset
    part = windows.split
    vocab = ids.vocab if ids is not None else None
    low, top = part.file.id_range(part.lo, part.hi)
    if vocab is not None and (low < 0 or top >= vocab):
        at = part.file.first_outside(0, vocab, part.lo, part.hi)
        raise DataError(f"{part.file.path}: token id {part.file.read(at, 1)[0]} in the {split} split, but {mf.path}'s "
                        f"model has a vocabulary of {vocab} (ids 0..{vocab - 1}); the first such id is token {at} of "
                        "the file. Tokenize with the model's own tokenizer, or give the model a vocabulary that holds "
                        "every id")
    out = {"tokens": part.hi - part.lo, "max_id": top, "vocab_size": vocab}
    if windows.packed is not None and not windows.packed.targets:
        raise DataError(f"--pack: {part.file.path}: no position of the {split} split has a label: each of its "
                        f"{len(windows.split.document_table()[1]):,} documents is a single token (its EOS: empty "
                        "documents), and a packed sequence predicts only within a document, so every label would be "
                        "ignored and the loss be 0/0. Tokenize a corpus with text, or train it unpacked")
    if windows.padding() is not None:
        out["padding"] = windows.padding()
    if windows.mask is not None:
        from fxshard.train.data.loss_mask import mask_summary

        out |= mask_summary(windows)
    return out


def data_record(out: Path, options: DataOptions) -> dict | None:
    """What a run's record keeps of its data: the token file and, packed, the padding packing saved (the packing of
    this process is reused: rank 0 packed the same file to train on it)."""
    if options.data is None:
        return None
    from fxshard.capture.modelfile import load_model_file
    from fxshard.codegen.manifest import read_manifest
    from fxshard.train.data.spec import BatchSpec
    from fxshard.train.data.windows import token_source

    manifest = read_manifest(out)
    mf = load_model_file(Path(out) / manifest.model_file)
    spec = BatchSpec.of(mf.build_inputs(manifest.seed))
    windows = token_source(mf, spec, "train", options).dataset
    return {"source": str(options.data), "pack": options.pack, "sequences": len(windows),
            "padding": windows.padding()}


def describe(summary: dict) -> str:
    """One line per split, for the launch."""
    lines = []
    for split, s in summary.items():
        line = f"data ({split}): {s['source']}"
        if "examples" in s:
            line += f", {s['examples']:,} examples"
        if "trained_tokens" in s:
            line += (f"; {s['conversations']:,} conversations, {s['trained_tokens']:,} trained tokens "
                     f"({s['trained_tokens'] / max(1, s['tokens']):.1%} of their tokens)")
        if "conversation_padding" in s:
            line += f"; one conversation per sequence: {s['conversation_padding']:.1%} padding"
        if "padding" in s:
            p = s["padding"]
            line += (f"; packed: {p['packed']:.1%} padding (one document per sequence: {p['unpacked']:.1%}; "
                     f"{p['unpacked'] - p['packed']:.1%} of the positions saved)")
        lines.append(line)
    return "\n".join(lines)
