"""ParkedCalls: the counts and bounds of calls waiting for a value (pure, no gRPC)."""

from __future__ import annotations

from shmrdv._rpc.parked import ParkedCalls, peer_host


def test_peer_host_drops_the_port() -> None:
    assert peer_host("ipv4:10.0.0.1:5123") == "ipv4:10.0.0.1"
    assert peer_host("ipv6:[::1]:80") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_parked_calls_bound_per_connection_per_host_and_in_all() -> None:
    parked = ParkedCalls(total=5, per_host=3, per_connection=2)
    a1, a2, b = "ipv4:10.0.0.1:1", "ipv4:10.0.0.1:2", "ipv4:10.0.0.2:1"
    parked.add(a1, 2)
    why = parked.refusal(a1)
    assert why is not None and "connection ipv4:10.0.0.1:1" in why
    assert parked.refusal(a2) is None  # another connection of the same host
    parked.add(a2, 1)
    why = parked.refusal(a2)
    assert why is not None and "max_waiting_per_peer=3" in why
    parked.add(b, 2)
    why = parked.refusal("ipv4:10.0.0.3:1")
    assert why is not None and "max_waiting=5" in why


def test_parked_calls_leaving_free_their_place() -> None:
    parked = ParkedCalls(total=1, per_host=1, per_connection=1)
    parked.add("ipv4:10.0.0.1:1", 1)
    assert parked.refusal("ipv4:10.0.0.1:1") is not None
    parked.add("ipv4:10.0.0.1:1", -1)
    assert parked.total == 0
    assert parked.refusal("ipv4:10.0.0.1:1") is None
