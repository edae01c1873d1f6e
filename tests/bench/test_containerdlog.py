"""StartContainer durations read from containerd's log."""
from __future__ import annotations

import pytest

from bench.containerdlog import start_container_seconds

LOG = '''\
time="2026-12-05T02:11:39.543712663Z" level=info msg="StartContainer for \\"a0e1\\""
time="2026-12-05T02:11:39.600000000Z" level=info msg="CreateContainer within sandbox \\"ff\\" returns container id \\"b2\\""
time="2026-12-05T02:11:39.627141335Z" level=info msg="StartContainer for \\"a0e1\\" returns successfully"
time="2026-12-05T02:11:42.000000000Z" level=info msg="StartContainer for \\"b2\\""
time="2026-12-05T02:11:42.100000000Z" level=error msg="StartContainer for \\"b2\\" failed" error="boom"
time="2026-12-05T23:59:59.990000000Z" level=info msg="StartContainer for \\"c3\\""
time="2026-12-06T00:00:00.040000000Z" level=info msg="StartContainer for \\"c3\\" returns successfully"
time="2026-12-06T00:00:01.000000000Z" level=info msg="StartContainer for \\"d4\\" returns successfully"
'''


def test_each_successful_start_with_its_duration() -> None:
    got = start_container_seconds(LOG)
    assert set(got) == {"a0e1", "c3"}                 # b2 failed, d4's start is not in the text
    assert got["a0e1"] == pytest.approx(0.083428672, abs=2e-6)
    assert got["c3"] == pytest.approx(0.05, abs=2e-6)  # across midnight


def test_no_start_lines_no_durations() -> None:
    assert start_container_seconds("level=info msg=other\n") == {}
