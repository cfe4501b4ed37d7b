"""ServerLimits: the connection and call bounds of a gRPC server, and their defaults."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import rpc_helpers
from helpers import SHMRDV_PATH
from rpc_helpers import StepSource

from shmrdv._errors import InvalidArgumentError
from shmrdv._rpc.limits import ServerLimits, descriptor_limit
from shmrdv._rpc.server import RpcServer

source = rpc_helpers.source

_DEFAULT_UNDER = """
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from shmrdv._rpc.limits import ServerLimits
print(ServerLimits().connections())
"""


@pytest.mark.parametrize(("nofile", "connections"), [(16, 4), (256, 64), (1024, 256), (8192, 1024)])
def test_limits_default_connections_are_a_quarter_of_the_descriptor_limit(
    nofile: int, connections: int
) -> None:
    """Connections can never take the descriptors the rest of the process needs."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < nofile:
        pytest.skip(f"the hard descriptor limit is {hard}")
    out = subprocess.run(
        [sys.executable, "-c", _DEFAULT_UNDER, str(nofile)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": SHMRDV_PATH},
        check=True,
    )
    assert int(out.stdout) == connections


def test_limits_bound_the_calls_awaiting_their_request() -> None:
    assert ServerLimits().max_awaiting_request == 1024
    assert ServerLimits(max_concurrent_rpcs=400).max_awaiting_request == 100
    assert ServerLimits(max_concurrent_rpcs=2).max_awaiting_request == 1


def test_limits_given_connections_are_kept() -> None:
    assert ServerLimits(max_connections=3).connections() == 3


def test_limits_refuse_connections_that_would_take_the_descriptors() -> None:
    half = descriptor_limit() // 2
    assert ServerLimits(max_connections=half).connections() == half
    with pytest.raises(InvalidArgumentError, match=f"max_connections={half + 1}.*at most {half}"):
        ServerLimits(max_connections=half + 1)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_connections", 0),
        ("max_connections", -3),
        ("max_connections", 2.0),
        ("max_concurrent_rpcs", 0),
        ("max_concurrent_rpcs", None),
        ("max_concurrent_rpcs", False),
        ("first_message_timeout", 0.0),
        ("first_message_timeout", 3601),
        ("first_message_timeout", float("nan")),
        ("first_message_timeout", None),
    ],
)
def test_limits_refuse_bad_values_naming_them(option: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=option) as info:
        ServerLimits(**{option: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_server_refuses_limits_of_another_type(source: StepSource) -> None:
    with pytest.raises(InvalidArgumentError, match="limits must be a ServerLimits"):
        RpcServer("127.0.0.1:0", source, limits={"max_connections": 4})  # type: ignore[arg-type]
