"""Name the rank and the collective when communication fails or times out.

Process groups are created with a timeout (``fxshard run --timeout``); when a collective raises —
a peer died, a peer issued a different collective, the timeout expired — the error is re-raised as
:class:`CollectiveError` saying which rank, which group and which collective did not complete: its
kind, shape and dtype, the line of the generated rank file that issued it, and its number among the
collectives this rank issued over that group in this step (ranks that agree issue the same one as
number N).  The group's other ranks are asked through their heartbeats (:mod:`fxshard.runtime.liveness`): one
that stopped answering is named and the rank files are not blamed; peers alive elsewhere mean the ranks issue
different collectives.  A bare backend traceback or a hang is what it replaces::

    rank 1: all_gather float32 [8, 16, 128] (rank_pp0_tp1.py:619, collective #18 over this group in
    training step 1) over process group ranks [0, 1] did not complete: RuntimeError: Timed out ...

Under ``fxshard run`` (torch's elastic launcher) :func:`recorded` writes the error to the file the
launcher reads, so the launcher's summary names the rank and the collective too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time

import torch.distributed as dist

from fxshard.errors import FxshardError
from fxshard.runtime import trace
from fxshard.runtime.liveness import peer_states


class CollectiveError(FxshardError, RuntimeError):
    """A collective did not complete: a peer died, issued a different collective, or the timeout expired."""


HINT = ("every rank of a process group must issue the same collectives in the same order; "
        "`fxshard check OUT` names the line where edited or stale rank files differ")
NOT_THE_CODE = "the rank files are not at fault"
STOPPED = ("a peer rank of this group did not reach this point within --timeout: it is stopped (e.g. SIGSTOP), "
           f"stuck or far slower; {NOT_THE_CODE}")
_GONE = re.compile(r"connection (closed|reset)|broken pipe|peer|socket closed|EOF", re.IGNORECASE)
_GLOO_NOISE = re.compile(r"\s*This is typically caused by .*$")  # gloo's advice ("... GLHF!"), said better here

_current_step = {"step": None, "label": ""}
_issued: dict[int, int] = {}  # id of a process group -> collectives issued over it in this step


def set_context(step: int | None = None, label: str = "") -> None:
    _current_step["step"], _current_step["label"] = step, label
    _issued.clear()


def doing() -> str:
    """What this rank is doing, as its heartbeat tells its peers (:mod:`fxshard.runtime.liveness`)."""
    return _current_step["label"] or "start-up"



def call_site() -> tuple[str, int]:
    """(file, line) of the generated code that called the public runtime function calling this."""
    frame = sys._getframe(2)
    return frame.f_code.co_filename, frame.f_lineno

@contextlib.contextmanager
def guarded(what: str, group, tensor=None, site: tuple[str, int] | None = None, cat: str = "collective"):
    """Run a collective; if it raises, raise :class:`CollectiveError` naming rank, group and collective.

    ``tensor`` and ``site`` (file, line of the generated code) make the message name shape, dtype and line;
    ``cat``: the trace category of its event (``"schedule"`` for a whole pipeline step, which holds the
    stage actions and their sends and receives, not one collective)."""
    number = _issued[id(group)] = _issued.get(id(group), 0) + 1
    try:
        if trace.enabled():  # fxshard run --trace: time it as one event of this rank
            with trace.span(what, cat, **_trace_args(group, tensor, site, number)):
                yield
        else:
            yield
    except Exception as e:  # backend errors have many types (DistBackendError, RuntimeError, ...)
        raise CollectiveError(_message(what, group, tensor, site, number, e)) from e


def _trace_args(group, tensor, site, number: int) -> dict:
    """What a traced collective's event says: its group, buffer, the generated line that issued it."""
    args = {"number": number, "step": _current_step["step"]}
    try:
        args["ranks"] = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    except Exception:  # the default group, or one already torn down: the ranks are not what matters here
        pass
    if tensor is not None:
        args |= {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                 "bytes": tensor.numel() * tensor.element_size()}
    if site:
        args["site"] = f"{os.path.basename(site[0])}:{site[1]}"
    return args


def _message(what: str, group, tensor, site, number: int | None, e: Exception, unknown: str = HINT) -> str:
    rank = dist.get_rank() if dist.is_initialized() else -1
    try:
        ranks = (dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
                 ) if dist.is_initialized() else []  # group None: the default group, every rank
    except Exception:  # a group this rank has already torn down
        ranks = []
    if tensor is not None:
        what += f" {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
    step = _current_step["label"] or (f"step {_current_step['step']}" if _current_step["step"] is not None else "")
    at = [f"{os.path.basename(site[0])}:{site[1]}"] if site else []
    if number is not None:
        at.append(f"collective #{number} over this group" + (f" in {step}" if step else ""))
    elif step and step not in what:
        at.append(step)
    where = f" ({', '.join(at)})" if at else ""
    cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
    cause = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", cause)  # gloo's source location
    cause = _GLOO_NOISE.sub("", cause)
    peers, hint = _peers(ranks, rank, cause, unknown)
    return (f"rank {rank}: {what}{where} over process group ranks {ranks} did not complete: {peers}"
            f"{type(e).__name__}: {cause}; {hint}")


def _peers(ranks: list[int], me: int, cause: str, unknown: str) -> tuple[str, str]:
    """What the group's other ranks were doing (from their heartbeats), and the hint that follows from it: a
    silent peer (stopped, killed, crashed) is named and the code is not blamed; peers alive elsewhere mean the
    ranks issue different collectives; without heartbeats, ``unknown``."""
    states = peer_states([r for r in ranks if r != me])
    gone = bool(_GONE.search(cause))
    if states is None:  # no heartbeat to ask: judge by the error alone
        if gone:
            return "", f"a peer rank of this group died or was killed; {NOT_THE_CODE}"
        return "", unknown
    silent = [s for s in states.values() if not s.alive]
    if silent:
        names = ", ".join(f"rank {s.rank} (last seen in {s.doing or 'start-up'})" for s in silent)
        one = len(silent) == 1
        fate = ("died or was killed" if gone else
                f"{'is' if one else 'are'} stopped (e.g. SIGSTOP), hung or dead")
        answer = "does not answer, its heartbeat stopped: it" if one else \
            "do not answer, their heartbeats stopped: they"
        return (f"{names} {answer} {fate}; ",
                f"{NOT_THE_CODE} (a rank's own error, if it reported one, names its cause)")
    busy = ", ".join(f"rank {s.rank} ({s.doing})" for s in states.values())
    return f"{busy} {'is' if len(states) == 1 else 'are'} alive but not in this collective; ", HINT


@contextlib.contextmanager
def named_phase(what: str, group=None):
    """Around communication torch issues itself (DDP's bucketed all-reduce, FSDP2's all-gathers and
    reduce-scatters, process-group start-up): a backend error becomes a :class:`CollectiveError` naming the
    rank, the phase and the group.  Errors fxshard already named pass through."""
    try:
        yield
    except CollectiveError:
        raise
    except Exception as e:
        if not _is_backend_error(e):
            raise
        raise CollectiveError(_message(what, group, None, None, None, e, STOPPED)) from e


def _is_backend_error(e: Exception) -> bool:
    kinds = tuple(k for k in (getattr(dist, "DistError", None), getattr(dist, "DistBackendError", None),
                              getattr(dist, "DistStoreError", None)) if k is not None)
    text = str(e)
    return isinstance(e, kinds) or ("gloo" in text.lower() or "nccl" in text.lower() or "Timed out" in text)


@contextlib.contextmanager
def recorded():
    """Write an error raised inside to the file torch's elastic launcher reads (``TORCHELASTIC_ERROR_FILE``),
    so that the launcher's ``ChildFailedError`` carries this rank's message; then re-raise it."""
    try:
        yield
    except Exception as e:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path:
            with contextlib.suppress(OSError), open(path, "w") as f:
                json.dump({"message": f"{type(e).__name__}: {e}", "timestamp": int(time.time())}, f)
        raise
