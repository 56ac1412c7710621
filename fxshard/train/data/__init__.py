"""Training data: each dp rank reads its own rows of every global batch, the same rows at any layout.

The seam between data and the training loop is one function and a stateful iterator::

    from fxshard.train.data import open_batches

    batches = open_batches(model_file, manifest, split="train", dp_rank=d, dp_size=D,
                           options=DataOptions(data=Path("tokens.bin")), state=None,
                           reads=inputs_read(out, manifest, pp_rank))
    batch = next(batches)        # this dp rank's rows of the next global batch: make_inputs()'s form (a dict of
                                 # keyword arguments or a tuple) with G/D rows; inputs outside ``reads`` are None
    saved = batches.state_dict() # the data position, JSON-able: examples consumed, epoch, seed, token cursor
    batches.load_state_dict(saved)  # the next batch is the one after the last taken (under any dp, tp or pp)

``model_file`` is a :class:`~fxshard.capture.modelfile.ModelFile` or its path; ``manifest`` the compiled folder's
(its seed), or None (the single-device reference).  The source of a split is, first match: ``--data``'s token file,
the model file's ``make_dataset(split)``, ``make_batches()`` (train), the example batch
(:mod:`~fxshard.train.data.sources`).  Global batch ``n`` is the split's examples at stream positions
``[n·G, (n+1)·G)``, each epoch a new seeded permutation; dp rank ``d`` reads ``[n·G + d·G/D, ...)``
(:mod:`~fxshard.train.data.order`), so one device (:func:`global_batches`) sees the same batches in the same order.
Loading runs in ``options.data_workers`` DataLoader workers (pinned memory where there is a GPU).
Nothing is checked lazily that can be checked before launch: :func:`fxshard.train.data.checks.check_data`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fxshard.train.data.loader import Batches
from fxshard.train.data.options import DataOptions

__all__ = ["Batches", "DataOptions", "global_batches", "inputs_read", "open_batches"]


def open_batches(model_file, manifest=None, split: str = "train", dp_rank: int = 0, dp_size: int = 1,
                 options: DataOptions | None = None, state: dict | None = None, *,
                 reads: set | None = None, workers: int | None = None, seed: int | None = None) -> Batches:
    """This dp rank's batches of ``split`` (see the module docstring).  ``reads``: the batch's input keys this rank
    loads (None: all; :func:`inputs_read` gives a pipeline rank's); ``workers``: overrides ``options.data_workers``;
    ``seed``: the compile's seed without a manifest (it seeds ``make_inputs``, ``make_batches``, ``make_dataset``).

    Example::

        batches = open_batches("samples/llama.py", split="train", dp_rank=1, dp_size=2)
        next(batches)["input_ids"].shape   # torch.Size([2, 16]): half of make_inputs()'s 4 rows
    """
    from fxshard.capture.modelfile import ModelFile, load_model_file
    from fxshard.capture.rows import Rows
    from fxshard.train.data.sources import resolve_source
    from fxshard.train.data.spec import BatchSpec

    options = options if options is not None else DataOptions()
    mf = model_file if isinstance(model_file, ModelFile) else load_model_file(model_file)
    seed = manifest.seed if manifest is not None else seed or 0
    counted = Rows.of_inputs(manifest.inputs).counted if manifest is not None else None  # as the compile found
    spec = BatchSpec.of(mf.build_inputs(seed), f"{mf.path}: make_inputs()", counted)
    source = resolve_source(mf, spec, split, options, seed, manifest)
    unread = frozenset(k for k in spec.keys if reads is not None and k not in reads)
    from fxshard.train.data.ids import token_ids

    batches = Batches(source, spec, split, dp_rank, dp_size, seed=options.data_seed,
                      shuffle=options.shuffle and split == "train",
                      workers=options.data_workers if workers is None else workers, unread=unread,
                      ids=token_ids(mf) if source.kind in ("dataset", "stream") or "make_batches" in source.name
                      else None)  # a token file's are checked as its sequences are read; make_inputs() at compile
    if state is not None:
        batches.load_state_dict(state)
    return batches


def global_batches(model_file, split: str = "train", options: DataOptions | None = None, seed: int = 0,
                   state: dict | None = None) -> Batches:
    """The whole global batches of ``split`` in the order every layout trains on them: what single-device training
    (:func:`fxshard.train.reference.reference_losses`, ``fxshard verify``) takes.  ``seed``: the compile's."""
    return open_batches(model_file, None, split, 0, 1, options, state, workers=0, seed=seed)


def inputs_read(out: Path, manifest, pp_rank: int) -> set | None:
    """The batch keys a rank at pipeline coordinate ``pp_rank`` loads (None: every input).

    The first stage takes every tensor input (the schedule hands them to it); a later stage takes those its class
    names in ``BATCH`` (labels, masks: taken from its microbatch, never sent between stages), and the targets a
    token-mean loss counts for the step's divisor, which the rank file's ``count_tokens`` reads."""
    if manifest.layout.pp == 1:
        return None
    from fxshard.ir.layout import Coords

    entry = manifest.rank(Coords(pp=pp_rank))
    keys = {_key(i.path): i.name for i in manifest.inputs if i.is_tensor}
    if any(st.index == 0 for st in entry.stages or ()):
        return set(keys)
    counted = _count_tokens_reads(Path(out) / entry.file) | _stage_batch_reads(Path(out) / entry.file)
    return {k for k, name in keys.items() if name in counted}


def _key(path: str) -> Any:
    """The top-level key of a manifest input path: ``"[1]['input_ids']"`` -> ``"input_ids"``; ``"[0][2]"`` -> 2."""
    import ast

    parts = path.strip("[]").split("][")
    return ast.literal_eval(parts[1])


def _stage_batch_reads(rank_file: Path) -> set[str]:
    """The user inputs the pipeline stages of a rank file take from their microbatch (each class's ``BATCH``)."""
    import ast

    found: set[str] = set()
    for node in ast.parse(rank_file.read_text()).body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "BATCH"
                                                         for t in item.targets):
                    found |= set(ast.literal_eval(item.value))
    return found


def _count_tokens_reads(rank_file: Path) -> set[str]:
    """The arguments the generated ``count_tokens`` uses (none where the loss is not a token mean)."""
    import ast

    for node in ast.parse(rank_file.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "count_tokens":
            args = {a.arg for a in node.args.args}
            return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} & args
    return set()
