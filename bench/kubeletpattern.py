"""The kubelet's own pattern for the ``plugin`` benchmark: single calls seconds apart, and an idle plugin.

A kubelet does not call back to back: it makes one NodePrepareResources call when a pod starts, seconds after the
last call, and one NodeUnprepareResources when it ends. Between calls the plugin is idle. Here, on the plugin
that ``bench.plugin_api`` started (registered, publishing, metrics served, as a deployed plugin runs):

* **idle**: the plugin's CPU (each thread's time on a CPU, /proc/<pid>/task/*/schedstat, summed) and wake-ups
  (context switches) over a window with no call, per second and split by thread name, and its resident memory
  after it, beside a bare gRPC server's (``bench.floorserver``) and what each heavy import adds in a fresh
  interpreter; then one prepare after that window, beside its floor after the same wait;
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
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.core import Figure

SETTLE_S = 5.0
FLOOR_SETTLE_S = 1.0   # the bare server idles this long after answering, before its VmRSS is read
# The plugin's heavy imports in the order the breakdown adds them ("a+b": one step).
PLUGIN_IMPORTS = ("grpc", "structlog", "prometheus_client", "pydantic", "api.config",
                  "kube.client+kube.connect+kubernetes.config", "kubeletplugin.plugin")
# Run by a fresh interpreter: one step's imports, then its name on stdout, then wait for the parent to read VmRSS.
_IMPORT_STEPS = """import importlib, sys
print("python", flush=True); sys.stdin.readline()
for step in sys.argv[1:]:
    for name in step.split("+"):
        importlib.import_module(name)
    print(step, flush=True); sys.stdin.readline()
"""
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


def import_rss(cwd: Path, steps: Sequence[str] = PLUGIN_IMPORTS) -> list[tuple[str, float]]:
    """VmRSS (MiB) of a fresh interpreter at its start and after each import step, in order."""
    proc = subprocess.Popen([sys.executable, "-c", _IMPORT_STEPS, *steps], cwd=cwd, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    out = []
    try:
        for step in ("python", *steps):
            if proc.stdout.readline().strip() != step:
                raise RuntimeError(f"import step {step} failed (exit {proc.wait(10)})")
            out.append((step, rss_mib(proc.pid)))
            proc.stdin.write("\n")
            proc.stdin.flush()
    finally:
        proc.stdin.close()
        proc.wait(10)
    return out


@dataclass(frozen=True)
class ThreadStat:
    name: str        # /proc/<pid>/task/<tid>/comm: Python threads are "python", gRPC's C-core threads named
    cpu_ns: int      # first field of schedstat: time on a CPU, in ns
    switches: int    # voluntary + nonvoluntary context switches: how often it was woken or preempted


def thread_stats(pid: int) -> dict[int, ThreadStat]:
    """Every thread of a process now, by tid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            name = (task / "comm").read_text().strip()
            cpu_ns = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):   # it exited while being read
            continue
        switches = sum(int(line.split()[1]) for line in status
                       if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")))
        out[int(tid)] = ThreadStat(name, cpu_ns, switches)
    return out


@dataclass
class ThreadUse:
    """What the threads of one name used over a window."""

    threads: int = 0
    cpu_s: float = 0.0
    switches: int = 0


def thread_use(before: dict[int, ThreadStat], after: dict[int, ThreadStat]) -> dict[str, ThreadUse]:
    """Per thread name, the deltas from ``before`` to ``after``. A thread born in between counts from 0; one that
    exited in between is not in ``after``, so its share is lost."""
    out: dict[str, ThreadUse] = {}
    for tid, now in after.items():
        then = before.get(tid, ThreadStat(now.name, 0, 0))
        use = out.setdefault(now.name, ThreadUse())
        use.threads += 1
        use.cpu_s += (now.cpu_ns - then.cpu_ns) / 1e9
        use.switches += now.switches - then.switches
    return out


@dataclass
class Calls:
    """What the spaced rounds measured, in seconds."""

    plugin: list[float] = field(default_factory=list)     # client-side time of the plugin's call
    handler: list[float] = field(default_factory=list)    # of which inside the claim handler
    floor: list[float] = field(default_factory=list)      # no-op gRPC call + the claim's own work

    def outside(self) -> list[float]:
        return [c - h for c, h in zip(self.plugin, self.handler)]


@dataclass
class Idle:
    """What the idle window measured."""

    seconds: float                  # the window as timed
    threads: dict[str, ThreadUse]   # by thread name
    floor_threads: dict[str, ThreadUse]   # the bare gRPC server's, over the same window
    tick_cpu_s: float               # utime + stime of /proc/<pid>/stat over the window: the cross-check
    rss: float                      # MiB, after the window
    calls: Calls                    # the first prepare after the window, and its floor

    @property
    def cpu_per_s(self) -> float:
        return sum(u.cpu_s for u in self.threads.values()) / self.seconds

    @property
    def floor_cpu_per_s(self) -> float:
        return sum(u.cpu_s for u in self.floor_threads.values()) / self.seconds

    @property
    def wakeups_per_s(self) -> float:
        return sum(u.switches for u in self.threads.values()) / self.seconds

    def split(self, total: Callable[[ThreadUse], float], fmt: str, floor: bool = False) -> str:
        """"name ×threads per-second-value" for each thread name, largest first."""
        ranked = sorted((self.floor_threads if floor else self.threads).items(), key=lambda kv: -total(kv[1]))
        return ", ".join(f"{name}{f' ×{u.threads}' if u.threads > 1 else ''} {total(u) / self.seconds:{fmt}}"
                         for name, u in ranked)


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

    def idle(self, seconds: float, claim: tuple[str, str], floor_pid: int) -> Idle:
        """CPU and wake-ups over ``seconds`` without calls, beside those of the bare gRPC server ``floor_pid``
        over the same window; RSS after it, then one prepare (and unprepare) with its floor, each after the same
        wait."""
        time.sleep(min(SETTLE_S, seconds))   # what the last calls queued (status writes, slice syncs) is done
        before, floor_before = thread_stats(self.pid), thread_stats(floor_pid)
        ticks, started = cpu_seconds(self.pid), time.monotonic()
        time.sleep(seconds)
        after, floor_after = thread_stats(self.pid), thread_stats(floor_pid)
        ticks_after, took = cpu_seconds(self.pid), time.monotonic() - started
        idle = Idle(took, thread_use(before, after), thread_use(floor_before, floor_after), ticks_after - ticks,
                    rss_mib(self.pid), Calls())
        self._plugin_call("prepare", claim, idle.calls)
        time.sleep(seconds)
        idle.calls.floor.append(self._floor_call("prepare", claim))
        self.call("unprepare", claim)
        self.floor.unprepare(claim[0])
        return idle

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


def figures(idle: Idle, rss_floor: float, imports: list[tuple[str, float]], spaced: dict[str, Calls],
            gap: float) -> list[Figure]:
    med = statistics.median
    after_idle = idle.calls
    added = ", ".join(f"{step} +{rss - prev:.1f}" for (_, prev), (step, rss) in zip(imports, imports[1:]))
    out = [
        Figure("plugin.idle.cpu_ms_per_s", f"plugin CPU while idle, registered and publishing ({idle.seconds:.3g} s)",
               idle.cpu_per_s * 1000, "ms/s",
               "sum of each thread's delta of /proc/<pid>/task/*/schedstat (ns on a CPU); a thread born in the "
               "window counts from 0, one that exits in it loses its share. By thread name (Python's threads are "
               f"all 'python', the others gRPC C-core's), ms/s: {idle.split(lambda u: u.cpu_s * 1000, '.2f')}. "
               f"Cross-check, utime+stime in 10 ms ticks: {idle.tick_cpu_s * 1000 / idle.seconds:.2f} ms/s"),
        Figure("plugin.idle.cpu_floor_ms_per_s", "bare gRPC server (grpcio sync + registration stubs) CPU while idle, "
               "same window", idle.floor_cpu_per_s * 1000, "ms/s",
               f"python -m bench.floorserver, schedstat as above, ms/s: "
               f"{idle.split(lambda u: u.cpu_s * 1000, '.2f', floor=True)}"),
        Figure("plugin.idle.wakeups_per_s", "plugin wake-ups while idle (context switches, all threads)",
               idle.wakeups_per_s, "wakeups/s", "deltas of voluntary_ctxt_switches + nonvoluntary_ctxt_switches "
               f"of /proc/<pid>/task/*/status; by thread name: {idle.split(lambda u: u.switches, '.1f')}"),
        Figure("plugin.idle.rss_mib", f"plugin resident memory after the idle window (plugin {idle.rss:.1f} MiB; "
               f"a bare gRPC server {rss_floor:.1f} MiB)", idle.rss, "MiB",
               f"VmRSS. A fresh interpreter {imports[0][1]:.1f} MiB, then MiB added by importing {added} "
               f"(= {imports[-1][1]:.1f}); the rest at run time +{idle.rss - imports[-1][1]:.1f}"),
        Figure("plugin.idle.rss_floor_mib", "bare gRPC server (grpc + registration stubs) resident memory", rss_floor,
               "MiB", f"VmRSS of python -m bench.floorserver {FLOOR_SETTLE_S:g} s after it answered GetInfo"),
        Figure("plugin.idle.prepare_ratio", f"first prepare after {idle.seconds:.3g} s idle / its floor "
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
