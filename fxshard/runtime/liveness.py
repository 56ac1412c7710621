"""Tell a stopped or dead peer from one that is alive but waiting elsewhere, when a collective fails.

A timed-out collective says only that *some* peer did not take part.  Every rank therefore bumps a counter in
the job's store (the TCPStore that torch's launcher hosts for the ranks) every half second from a daemon
thread, with what it is doing (``training step 4``).  A rank that is stopped (SIGSTOP), killed or crashed
stops bumping; one blocked in a collective keeps bumping, since the collective waits without the GIL.  When a
collective fails, :func:`peer_states` reads the group's counters twice, a few seconds apart::

    start(rank, lambda: "training step 4")         # once, after the process group formed
    peer_states([1, 3])   # -> {1: PeerState(rank=1, alive=False, doing="training step 4"), 3: ...}

Best effort throughout: without ``MASTER_ADDR``/``MASTER_PORT`` or a reachable store there is no heartbeat
and :func:`peer_states` returns None; the error message then says less, never something wrong.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

INTERVAL_S = 0.5
WATCH_S = 3.0  # six beats: a live rank on a crowded CPU still bumps its counter in that time

_store = {"client": None, "prefix": "", "lock": threading.Lock(), "thread": None}
_stopping = threading.Event()


@dataclass(frozen=True)
class PeerState:
    rank: int
    alive: bool  # its counter moved while we watched
    doing: str  # what it last said it was doing ("" when it never beat)


def start(rank: int, doing: Callable[[], str]) -> bool:
    """Start this rank's heartbeat; False where there is no store to beat into."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or _store["client"] is not None:
        return False
    try:  # a client of its own: the heartbeat never waits behind the process group's store traffic
        client = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=10))
    except Exception:
        return False
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    _store["client"], _store["prefix"] = client, f"fxshard/heartbeat/{run}/"
    _stopping.clear()
    _store["thread"] = threading.Thread(target=_beat, args=(rank, doing), daemon=True, name="fxshard-heartbeat")
    _store["thread"].start()
    return True


def stop() -> None:
    """End the heartbeat and wait for its thread: a daemon thread still inside a store call while the interpreter
    exits is ended mid-C++, which aborts the process ("terminate called without an active exception")."""
    thread = _store["thread"]
    if thread is None:
        return
    _stopping.set()
    thread.join(timeout=10)
    _store["thread"] = _store["client"] = None


def _beat(rank: int, doing: Callable[[], str]) -> None:
    key = _store["prefix"] + str(rank)
    count = 0
    while not _stopping.is_set():
        count += 1
        try:
            with _store["lock"]:
                _store["client"].set(key, f"{count} {doing()}")
        except Exception:  # the store is gone (the launcher ended): nobody is left to ask
            return
        _stopping.wait(INTERVAL_S)


def peer_states(ranks: list[int], watch_s: float = WATCH_S) -> dict[int, PeerState] | None:
    """Whether each of ``ranks`` is still beating, watched for ``watch_s`` seconds; None without a heartbeat."""
    if _store["client"] is None or not ranks:
        return None
    try:
        first = _read(ranks)
        time.sleep(watch_s)
        second = _read(ranks)
    except Exception:
        return None
    return {r: PeerState(r, second[r] is not None and second[r][0] != (first[r] or (None,))[0],
                         (second[r] or first[r] or (0, ""))[1]) for r in ranks}


def _read(ranks: list[int]) -> dict[int, tuple[int, str] | None]:
    out = {}
    with _store["lock"]:
        for r in ranks:
            key = _store["prefix"] + str(r)
            if not _store["client"].check([key]):
                out[r] = None
                continue
            count, _, doing = _store["client"].get(key).decode().partition(" ")
            out[r] = (int(count), doing)
    return out
