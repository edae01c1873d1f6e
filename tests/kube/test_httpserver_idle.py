"""Idle servers and workers of the node plugin sleep until something happens: counted by the voluntary context
switches of their threads (Linux /proc), so a loop that wakes on a tick fails here whatever the machine's speed."""
from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from kube.httpserver import serve_health_and_metrics


def wakeups(thread: threading.Thread) -> int:
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")))


def test_an_idle_metrics_server_does_not_wake_and_still_answers_and_stops() -> None:
    others = set(threading.enumerate())
    server = serve_health_and_metrics(0, lambda: (True, "ok"), "127.0.0.1")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200
        [loop] = [t for t in set(threading.enumerate()) - others if t.name == "health-metrics"]
        time.sleep(0.5)                       # the answered connection is gone
        before = wakeups(loop)
        time.sleep(1.0)
        assert wakeups(loop) - before <= 1    # a 0.2 s select timeout wakes it 5 times
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200
    finally:
        began = time.monotonic()
        server.shutdown()
        server.server_close()
    assert time.monotonic() - began < 2      # shutdown() wakes the idle loop


class _Writer:
    def __init__(self) -> None:
        self.published: list[str] = []

    def publish(self, ref: object, entries: object, ready_since: float) -> None:
        self.published.append(ref.uid)   # type: ignore[attr-defined]


def test_idle_claim_status_workers_do_not_wake() -> None:
    import structlog

    from kubeletplugin.claimstatus import ClaimStatusReporter
    from kubeletplugin.transport.nodedriver import ClaimRef

    writer = _Writer()
    reporter = ClaimStatusReporter(writer, "pool", lambda: {}, quiet_s=0.0)
    # A prepared claim's checkpoint record, as much of it as the reporter reads.
    record = SimpleNamespace(completed=True, updated=1.0, devices=[], undo=SimpleNamespace(mig_devices=[]))
    try:
        reporter.publish(ClaimRef(namespace="ns", name="c", uid="u1"), record, structlog.get_logger())
        assert reporter.flush(5) and writer.published == ["u1"]
        [worker] = reporter._threads
        before = wakeups(worker)
        time.sleep(2.5)
        assert wakeups(worker) - before <= 1    # a one-second tick wakes it twice or more
        reporter.publish(ClaimRef(namespace="ns", name="c", uid="u2"), record, structlog.get_logger())
        assert reporter.flush(5) and writer.published == ["u1", "u2"]
    finally:
        reporter.close()
