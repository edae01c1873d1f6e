"""The kubelet's own pattern for the ``plugin`` benchmark: single calls seconds apart, and an idle plugin.

A kubelet does not call back to back: it makes one NodePrepareResources call when a pod starts, seconds after the
last call, and one NodeUnprepareResources when it ends. Between calls the plugin is idle. Here, on the plugin
that ``bench.plugin_api`` started (registered, publishing, metrics served, as a deployed plugin runs):

* **idle**: the plugin's CPU (utime + stime of /proc/<pid>/stat) over a window with no call, per second, and its
  resident memory after it; then one prepare after that window, beside its floor after the same wait;
* **spaced**: rounds of prepare and unprepare, each call after ``gap`` seconds of idle, timed as the client sees
  it. Each floor is measured after its own gap in the same rounds: a gRPC call that does nothing on the same
  process (GetInfo on its registration socket) plus what the claim itself needs (``bench.plugin_api._Floor``:
  claim GET and the CDI and checkpoint writes). The plugin's own histogram (``/metrics``, read between calls,
  not timed) splits each call into the claim handler and what lies outside it (gRPC, the service layer,
  locks, gauges).
"""
from __future__ import annotations

import os
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.core import Figure

SETTLE_S = 5.0
HANDLER_METRIC = {"prepare": "gpu_dra_node_prepare_claim_duration_seconds_sum",
                  "unprepare": "gpu_dra_node_unprepare_claim_duration_seconds_sum"}


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def handler_seconds(metrics_url: str, operation: str) -> float:
    """The plugin's total time inside its claim handler for ``operation`` so far (its histogram's sum)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    name = HANDLER_METRIC[operation]
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{metrics_url} has no {name}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


@dataclass
class Calls:
    """What the spaced rounds measured, in seconds."""

    plugin: list[float] = field(default_factory=list)     # client-side time of the plugin's call
    handler: list[float] = field(default_factory=list)    # of which inside the claim handler
    floor: list[float] = field(default_factory=list)      # no-op gRPC call + the claim's own work

    def outside(self) -> list[float]:
        return [c - h for c, h in zip(self.plugin, self.handler)]


@dataclass
class Pattern:
    """The plugin and the floor's pieces, as bench.plugin_api set them up."""

    pid: int
    metrics_url: str
    call: Callable[[str, tuple[str, str]], float]      # (operation, claim) -> seconds, one claim per call
    noop: Callable[[], float]                          # a gRPC call that does nothing on the plugin's process
    floor: Any                                         # bench.plugin_api._Floor

    def _plugin_call(self, operation: str, claim: tuple[str, str], calls: Calls) -> None:
        before = handler_seconds(self.metrics_url, operation)
        calls.plugin.append(self.call(operation, claim))
        calls.handler.append(handler_seconds(self.metrics_url, operation) - before)

    def _floor_call(self, operation: str, claim: tuple[str, str]) -> float:
        rpc = self.noop()
        return rpc + (self.floor.prepare(claim[0]) if operation == "prepare" else self.floor.unprepare(claim[0]))

    def idle(self, seconds: float, claim: tuple[str, str]) -> tuple[float, float, Calls]:
        """CPU per second over ``seconds`` without calls, RSS after it, then one prepare (and unprepare) with
        its floor, each after the same wait. Returns (CPU s/s, RSS MiB, the calls)."""
        time.sleep(min(SETTLE_S, seconds))   # what the last calls queued (status writes, slice syncs) is done
        cpu, started = cpu_seconds(self.pid), time.monotonic()
        time.sleep(seconds)
        cpu_per_s = (cpu_seconds(self.pid) - cpu) / (time.monotonic() - started)
        rss = rss_mib(self.pid)
        calls = Calls()
        self._plugin_call("prepare", claim, calls)
        time.sleep(seconds)
        calls.floor.append(self._floor_call("prepare", claim))
        self.call("unprepare", claim)
        self.floor.unprepare(claim[0])
        return cpu_per_s, rss, calls

    def spaced(self, rounds: int, gap: float, claims: list[tuple[str, str]]) -> dict[str, Calls]:
        """``rounds`` × (prepare, its floor, unprepare, its floor), each after ``gap`` seconds of idle."""
        out = {"prepare": Calls(), "unprepare": Calls()}
        for r in range(rounds):
            claim = claims[r % len(claims)]
            for operation in ("prepare", "unprepare"):
                time.sleep(gap)
                self._plugin_call(operation, claim, out[operation])
                time.sleep(gap)
                out[operation].floor.append(self._floor_call(operation, claim))
        return out


def figures(idle_s: float, idle_cpu: float, rss: float, after_idle: Calls, spaced: dict[str, Calls],
            gap: float) -> list[Figure]:
    med = statistics.median
    out = [
        Figure("plugin.idle.cpu_ms_per_s", f"plugin CPU while idle, registered and publishing ({idle_s:.0f} s)",
               idle_cpu * 1000, "ms/s",
               f"utime+stime of /proc/<pid>/stat, in 10 ms ticks: steps of {10 / idle_s:.2f} ms/s"),
        Figure("plugin.idle.rss_mib", "plugin resident memory after the idle window", rss, "MiB", "VmRSS"),
        Figure("plugin.idle.prepare_ratio", f"first prepare after {idle_s:.0f} s idle / its floor "
               f"({after_idle.plugin[0] * 1000:.2f} / {after_idle.floor[0] * 1000:.2f} ms, handler "
               f"{after_idle.handler[0] * 1000:.2f} ms)", after_idle.plugin[0] / after_idle.floor[0], "x",
               "one call"),
    ]
    for operation, calls in spaced.items():
        p50, f50 = med(calls.plugin), med(calls.floor)
        n = len(calls.plugin)
        out += [
            Figure(f"plugin.spaced.{operation}.p50_ratio", f"{operation} every {gap:g} s p50 / floor p50 "
                   f"({p50 * 1000:.2f} / {f50 * 1000:.2f} ms)", p50 / f50, "x",
                   f"{n} calls, each after {gap:g} s idle; floor = no-op gRPC call + the claim's own I/O, "
                   "each after the same gap"),
            Figure(f"plugin.spaced.{operation}.p99_over_p50", f"{operation} every {gap:g} s p99 / p50 "
                   f"({_p(calls.plugin, 0.99) * 1000:.2f} ms p99)", _p(calls.plugin, 0.99) / p50, "x"),
            Figure(f"plugin.spaced.{operation}.outside_handler_ms", f"{operation} every {gap:g} s: client time "
                   f"outside the claim handler (handler p50 {med(calls.handler) * 1000:.2f} ms)",
                   med(calls.outside()) * 1000, "ms", "the plugin's histogram read between calls"),
        ]
    return out
