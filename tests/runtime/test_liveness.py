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
