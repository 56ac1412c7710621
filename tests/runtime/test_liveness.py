"""What a failed collective says about the group's other ranks, from their heartbeats (single process: the
heartbeats' readings are given; tests/cli/test_timeouts.py stops real ranks)."""

from __future__ import annotations

import pytest

from fxshard.runtime import guard
from fxshard.runtime.liveness import PeerState, peer_states

TIMEOUT = "Timed out waiting 8000ms for recv operation to complete"


@pytest.mark.parametrize("states, says, hint", [
    ({1: PeerState(1, False, "training step 4")},
     "rank 1 (last seen in training step 4) does not answer, its heartbeat stopped: it is stopped (e.g. SIGSTOP), "
     "hung or dead; ", guard.NOT_THE_CODE),
    ({1: PeerState(1, False, ""), 3: PeerState(3, False, "training step 2")},
     "rank 1 (last seen in start-up), rank 3 (last seen in training step 2) do not answer, their heartbeats "
     "stopped: they are stopped (e.g. SIGSTOP), hung or dead; ", guard.NOT_THE_CODE),
    ({1: PeerState(1, True, "training step 1")}, "rank 1 (training step 1) is alive but not in this collective; ",
     guard.HINT),
    (None, "", guard.HINT),
])
def test_the_peers_decide_the_hint(monkeypatch, states, says, hint):
    monkeypatch.setattr(guard, "peer_states", lambda ranks: states)
    peers, got = guard._peers([0, 1, 3], 0, TIMEOUT, guard.HINT)
    assert peers == says and got.startswith(hint)


def test_a_killed_peer_is_said_to_have_died(monkeypatch):
    monkeypatch.setattr(guard, "peer_states", lambda ranks: {1: PeerState(1, False, "training step 3")})
    peers, hint = guard._peers([0, 1], 0, "Connection reset by peer", guard.HINT)
    assert peers.endswith("it died or was killed; ") and "fxshard check" not in hint
    monkeypatch.setattr(guard, "peer_states", lambda ranks: None)
    assert guard._peers([0, 1], 0, "Connection reset by peer", guard.HINT)[1].startswith("a peer rank of this group")


def test_without_a_store_there_is_no_heartbeat():
    assert peer_states([1]) is None


def test_stop_ends_the_heartbeat_thread_before_the_process_exits(monkeypatch):
    """A daemon thread inside a store call at interpreter exit aborts the process: stop() joins it first."""
    from datetime import timedelta

    import torch.distributed as dist

    from fxshard.runtime import liveness

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    assert liveness.start(0, lambda: "training step 1")
    thread = liveness._store["thread"]
    assert peer_states([0], watch_s=1.2)[0].alive  # it beats into the real store
    liveness.stop()
    assert not thread.is_alive() and peer_states([0]) is None
