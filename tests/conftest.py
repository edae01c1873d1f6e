"""Session fixtures for the end-to-end tests: one real local control plane for all of them.

The cluster starts on first use only, so unit-test runs never build or start anything. When the
binaries cannot be built or the control plane does not come up, every e2e test fails with the reason.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

_started: dict[str, Any] = {}
_driver_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    from testbed.localcluster import ClusterError, LocalCluster

    c = LocalCluster()
    try:
        c.start()
    except ClusterError as exc:
        pytest.fail(f"the local Kubernetes control plane did not start: {exc}", pytrace=False)
    _started["times"] = c.times
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def api_client(cluster: Any) -> Any:
    client = cluster.api_client()
    yield client
    client.close()


@pytest.fixture
def driver_name() -> str:
    """A driver name of its own per test, so that tests on the shared cluster never see each other's slices."""
    return f"t{next(_driver_numbers)}.e2e.dra-driver.io"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    times = _started.get("times")
    if times is not None:
        terminalreporter.write_line(f"local control plane start-up: {times}")
