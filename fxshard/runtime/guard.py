"""Name the rank and the collective when communication fails or times out.

Process groups are created with a timeout (``fxshard run --timeout``); when a collective raises —
a peer died, a peer issued a different collective, the timeout expired — the error is re-raised as
:class:`CollectiveError` saying which rank, which group and which collective did not complete,
instead of a bare backend traceback or a hang.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist


class CollectiveError(RuntimeError):
    pass


_current_step = {"step": None, "label": ""}


def set_context(step: int | None = None, label: str = "") -> None:
    _current_step["step"], _current_step["label"] = step, label


@contextlib.contextmanager
def guarded(what: str, group):
    try:
        yield
    except Exception as e:  # backend errors have many types (DistBackendError, RuntimeError, ...)
        rank = dist.get_rank() if dist.is_initialized() else -1
        ranks = dist.get_process_group_ranks(group) if group is not None and dist.is_initialized() else []
        where = f" at step {_current_step['step']}" if _current_step["step"] is not None else ""
        label = f" in {_current_step['label']}" if _current_step["label"] else ""
        raise CollectiveError(
            f"rank {rank}: {what} over process group ranks {ranks} did not complete{where}{label}: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e
