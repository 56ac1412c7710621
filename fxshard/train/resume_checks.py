"""What a checkpoint must be before a run resumes it or ``fxshard export`` reads it, checked before anything launches.

- the checkpoint is whole (:func:`check_checkpoint`): its index reads, every shard it names is there, with the size
  and header the index recorded (each tensor's digest inside), or an earlier step to resume from is named;
- a new run does not overwrite another run's steps (:func:`check_new_run`);
- the resume continues the run the checkpoint saved (:func:`check_resumable`): the same model, steps left to run,
  the same learning-rate schedule, and the same data (:func:`check_data_state`: the token file's size and digest,
  packing, the order's seed and shuffle; ``--allow-data-change`` continues at the saved position with the data
  given), at a data position the run could have reached::

    folder = check_checkpoint("ckpt", print)                # ckpt/step-00000040
    check_resumable(CheckpointReader(folder), manifest, out, steps=100, optim_config=optim, data=options.data)
"""

from __future__ import annotations

import json
from pathlib import Path

from fxshard.codegen.manifest import Manifest, inside
from fxshard.train.checkpoint import (
    INDEX,
    LATEST,
    CheckpointConfig,
    CheckpointError,
    CheckpointReader,
    _check_recorded,
    _complete_steps,
    find_checkpoint,
    read_index,
)


def check_checkpoint(path: str | Path, say=None) -> Path:
    """Before launch: the checkpoint ``path`` leads to is whole — its index parses and every shard file it names
    exists with a safetensors header whose tensors fit in the file.  Returns the checkpoint folder; a damaged
    one is a :class:`CheckpointError` naming the file, and the earlier step to resume from instead."""
    folder = find_checkpoint(path, say)
    try:
        index = read_index(folder / INDEX)
        files = {piece["file"] for rec in index["tensors"].values() for piece in rec["pieces"]}
        for name in sorted(files):
            shard = inside(folder, name, "a tensor piece's file", folder / INDEX, CheckpointError)
            _check_shard(shard)
            _check_recorded(shard, (index.get("files") or {}).get(name))
    except CheckpointError as e:
        raise CheckpointError(f"{e}{_earlier(Path(path), folder)}") from e.__cause__
    return folder


def check_new_run(config: CheckpointConfig) -> None:
    """A run without ``--resume`` into a folder that holds an earlier run's checkpoints would overwrite its steps and
    move ``latest`` back: refused, unless ``--overwrite`` says to replace them."""
    folder = Path(config.folder)
    if config.resume or config.overwrite or not folder.is_dir():
        return
    steps = _complete_steps(folder)
    if not steps and not (folder / LATEST).exists():
        return
    newest = f"newest {steps[-1].name}" if steps else f"{LATEST} but no complete step"
    raise CheckpointError(f"--checkpoint {folder}: holds an earlier run's checkpoints ({len(steps)} step"
                          f"{'s' * (len(steps) != 1)}, {newest}), which a new run would overwrite, moving "
                          f"{LATEST} back; continue that run with --resume, choose another --checkpoint folder, or "
                          "pass --overwrite to start over (its steps are deleted when this run saves its first)")


RESTORED_SCHEDULE = ("lr", "lr_schedule", "warmup_steps", "min_lr", "decay_steps")  # the scheduler's saved state


def check_resumable(reader: CheckpointReader, manifest: Manifest, out: Path, steps: int, optim_config,
                    allow_changed_model: bool = False) -> None:
    """Before launch, what a resumed run would refuse after it: a checkpoint of another model (its digest, unless
    ``allow_changed_model``, and its parameters' names and shapes in any case), ``--steps`` at or below its step,
    and a learning-rate schedule other than the one whose state it saved (a resumed run takes the saved state)."""
    from dataclasses import asdict

    reader.check_model(manifest, out, allow_changed_model)
    if reader.step >= steps:
        raise CheckpointError(f"{reader.path} is at step {reader.step}; --steps {steps} leaves nothing to run "
                              f"(--steps counts from the start: pass more than {reader.step})")
    saved, given = reader.index.get("optimizer") or {}, asdict(optim_config)
    changed = [f"--{k.replace('_', '-')} {given[k]} (saved: {saved[k]})" for k in RESTORED_SCHEDULE
               if k in saved and saved[k] != given[k]]
    if changed and (reader.index.get("trainer") or {}).get("scheduler") is not None:
        raise CheckpointError(f"{reader.path}: resumed with {', '.join(changed)}; the checkpoint's learning-rate "
                              "schedule continues as it was saved, so the run would not be what these options say. "
                              "Resume with the saved values, or start a new run (another --checkpoint folder)")


def _earlier(path: Path, damaged: Path) -> str:
    """How to resume from the complete step before ``damaged``, where ``path`` is a folder of steps."""
    if damaged == path:  # a step folder given directly
        return " — resume from an earlier step"
    earlier = [p for p in _complete_steps(path) if p.name < damaged.name]
    if not earlier:
        return f" — no earlier complete step in {path}; start without --resume"
    return f" — resume from {earlier[-1].name}, the newest complete step before it: echo {earlier[-1].name} > " \
           f"{path / LATEST}"


def _check_shard(file: Path) -> None:
    """A safetensors file: an 8-byte header length, a JSON header, and the data its offsets promise."""
    if not file.is_file():
        raise CheckpointError(f"{file}: shard file missing from the checkpoint")
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + length > size:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: not a whole safetensors file ({e}); the checkpoint is damaged") from e
    if 8 + length + end > size:
        raise CheckpointError(f"{file}: truncated ({size} bytes, its header promises {8 + length + end}); the "
                              "checkpoint is damaged")


def current_identity(out, options) -> dict:
    """:func:`identity_of` the training data a run of the compiled folder ``out`` with data options ``options``
    reads, the token file's digest included (before launch: read once)."""
    from pathlib import Path

    from fxshard.capture.modelfile import load_model_file
    from fxshard.codegen.manifest import read_manifest
    from fxshard.train.data import open_batches
    from fxshard.train.data.resume import identity_of

    manifest = read_manifest(out)
    batches = open_batches(load_model_file(Path(out) / manifest.model_file), manifest, "train", 0, 1, options,
                           workers=0)
    try:
        return identity_of(batches, digest=True)
    finally:
        batches.close()
