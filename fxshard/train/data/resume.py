"""A resumed run continues the data its checkpoint trained on, or says that it does not.

A checkpoint's data state (:meth:`~fxshard.train.data.loader.Batches.state_dict`) holds the position, the order's
seed and shuffle, and what the examples are (:func:`identity`): the source's kind and example count, packing, and a
token file's size and digest (:func:`fxshard.train.digests.file_digest`).  A resume given other data (another file,
one changed since, ``--data-seed``, ``--no-shuffle``, ``--pack``) would train on other examples at the old position
and say nothing; :func:`check_data_state` refuses it, naming what changed, unless ``--allow-data-change`` asks to
continue at the saved position with the data given.  A position the run could not have reached (negative, past
every batch the checkpoint trained) is refused as damage::

    current = identity_of(batches, digest=True)          # {"kind": "tokens", "examples": 3200, "file": {...}, ...}
    check_data_state(trainer, current, allow=False, where="ckpt/step-00000040")
"""

from __future__ import annotations

from fxshard.errors import FxshardError

FIELDS = ("kind", "examples", "packed", "file", "seed", "shuffle")


class DataChangedError(FxshardError):
    """A resume whose data differs from the data its checkpoint trained on."""


def identity_of(batches, digest: bool) -> dict:
    """What ``batches`` (a :class:`~fxshard.train.data.loader.Batches`) reads: kind, examples, packing, the order's
    seed and shuffle, and for a token file its size (and with ``digest`` its digest: the whole file read once)."""
    source = batches.source
    out = {"kind": source.kind, "examples": len(source) if source.sized else None,
           "seed": batches.seed if batches.shuffle else None,  # an order not shuffled has no seed to change
           "shuffle": batches.shuffle, "packed": None, "file": None}
    if source.kind == "tokens":
        from fxshard.train.digests import file_digest

        windows = source.dataset
        path = windows.split.file.path
        out["packed"] = windows.packed is not None
        out["file"] = file_digest(path) if digest else {"size": path.stat().st_size}
    return out


def check_position(state: dict, batches: int | None, where: str) -> int:
    """The saved position: a whole number of examples, no more than the checkpoint's ``batches`` global batches."""
    position, rows = state.get("position"), state.get("global_batch")
    if not (isinstance(position, int) and not isinstance(position, bool) and position >= 0):
        raise DataChangedError(f"{where}: data position {position!r}; expected the examples consumed (0 or more): "
                               "the checkpoint is damaged")
    if isinstance(batches, int) and isinstance(rows, int) and position > batches * rows:
        raise DataChangedError(f"{where}: data position {position:,}, past the {batches:,} global batches of {rows} "
                               f"the checkpoint trained ({batches * rows:,} examples): the checkpoint is damaged")
    return position


def check_data_state(trainer: dict, current: dict, allow: bool, where: str) -> None:
    """Refuse a resume whose data ``current`` (:func:`identity_of`) differs from what ``trainer`` (the checkpoint's
    trainer state) saved, unless ``allow``; refuse a position the run could not have reached in any case."""
    state = trainer.get("data")
    if not isinstance(state, dict):
        return
    check_position(state, trainer.get("batches"), where)
    saved = dict(state.get("identity") or {}) | {k: state[k] for k in ("seed", "shuffle", "examples") if k in state}
    changed = [_said(k, saved[k], current.get(k)) for k in FIELDS
               if k in saved and current.get(k) is not None and saved[k] is not None and not _same(k, saved[k],
                                                                                                    current[k])]
    if changed and not allow:
        raise DataChangedError(
            f"{where}: resumed with other data than it trained on: {'; '.join(changed)}. The run would continue at "
            f"the saved position ({state.get('position', 0):,} examples) of other examples. Resume with the data "
            "options it saved (its --data, --data-seed, --shuffle, --pack), or pass --allow-data-change to continue "
            "at that position with the data given")


def _same(key: str, saved, current) -> bool:
    if key == "file":  # the digest when both have one, else the size
        if "digest" in saved and "digest" in current:
            return saved["digest"] == current["digest"] and saved.get("size") == current.get("size")
        return saved.get("size") == current.get("size")
    return saved == current


def _said(key: str, saved, current) -> str:
    if key == "file":
        def one(f):
            return f"{f.get('size', '?'):,} bytes" + (f", {f['digest'][:24]}" if "digest" in f else "")
        return f"the token file is another ({one(current)}; the checkpoint's: {one(saved)})"
    flag = {"seed": "--data-seed", "shuffle": "--shuffle", "packed": "--pack"}.get(key)
    what = {"kind": "the data source", "examples": "the examples"}.get(key, flag)
    return f"{what} {current!r} (saved: {saved!r})"
