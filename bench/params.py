"""How hard each benchmark works: the full run, ``--quick`` and the tiny run of the smoke test."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Params:
    repeats: int              # timed runs of one-node figures (median over these)
    fleet_nodes: int          # nodes of the generated fleet
    fleet_repeats: int        # timed passes over the whole fleet
    fleet_memory_nodes: int | None   # nodes whose slices are held in the memory pass (None: all)
    mig_cycles: int           # MIG create/destroy cycles per timed batch
    mig_batches: int
    claim_repeats: int        # prepare+unprepare rounds per claim kind
    parallel_claims: int      # independent claims prepared at once
    parallel_rounds: int      # serial + parallel rounds (median over these)
    nvml_latency_s: float     # added to each MIG-changing NVML call in the parallel-claims figure
    reconcile_nodes: int
    reconcile_rounds: int     # first sync + resync + restart on a fresh in-memory API, each round
    fleet_file: str | None = None   # benchmark this fleet file instead of the generated fleet
    api_rounds: int = 60            # plugin over gRPC: prepare+unprepare rounds (each beside its floor)
    api_parallel: int = 32          # plugin over gRPC: callers at once on independent claims
    api_startups: int = 5           # plugin starts timed to GetInfo
    idle_s: float = 30.0            # plugin: idle window (CPU per second), then one prepare after it
    spaced_rounds: int = 10         # plugin: prepare + unprepare rounds, each call after spaced_gap_s of idle
    spaced_gap_s: float = 2.0       # plugin: the idle gap before each spaced call and each floor call
    publish_nodes: int = 100        # publish: nodes of 8 × H100 (5 slices each) published on a real API server
    publish_workers: int = 8        # publish: writes in flight, for gpu-dra publish and its raw-ingest floor alike
    status_nodes: int = 1000        # status: nodes of 8 × H100 whose status is read from a real API server
    sched_nodes: int = 200          # scheduler: nodes of 8 × H100 published for each device-model shape
    sched_pods: int = 1000          # scheduler: pods (one claim each) bound per shape
    sched_profile_dir: str | None = None   # scheduler: write the scheduler's CPU/heap profiles and metrics here
    sched_profile_s: int = 30       # scheduler: seconds of the CPU profile, from the first pod on
    sched_shapes: tuple[str, ...] | None = None   # scheduler: only these device-model shapes (and the baseline)
    loops_nodes: int = 200          # controlloops: nodes × the demo's node-a published (1000 for the large row)
    loops_window_s: float = 60.0    # controlloops: each window of one new pending pod a second
    loops_pending: int = 100        # controlloops: pods pending throughout
    peer_bin: str | None = None     # peer: the Go reference kubelet plugin (hack/build-peer-driver.sh)
    peer_pods: int = 20             # peer: pods per driver on the real node, interleaved
    peer_b2b_rounds: int = 40       # peer: prepare+unprepare cycles per driver over the DRA socket

    def with_fleet(self, path: str | None) -> "Params":
        return replace(self, fleet_file=path)

    def with_peer_bin(self, path: str | None) -> "Params":
        return replace(self, peer_bin=path)

    def with_loops_nodes(self, nodes: int | None) -> "Params":
        return self if nodes is None else replace(self, loops_nodes=nodes)

    def with_publish_nodes(self, nodes: int | None) -> "Params":
        return self if nodes is None else replace(self, publish_nodes=nodes)

    def with_scheduler(self, nodes: int | None = None, pods: int | None = None,
                       profile_dir: str | None = None, shapes: tuple[str, ...] | None = None) -> "Params":
        """The scheduler benchmark's fleet size, pods, profile directory and shapes, where given."""
        out = self
        if shapes is not None:
            out = replace(out, sched_shapes=shapes)
        if nodes is not None:
            out = replace(out, sched_nodes=nodes)
        if pods is not None:
            out = replace(out, sched_pods=pods)
        if profile_dir is not None:
            out = replace(out, sched_profile_dir=profile_dir)
        return out


FULL = Params(repeats=15, fleet_nodes=100, fleet_repeats=5, fleet_memory_nodes=None,
              mig_cycles=1000, mig_batches=7, claim_repeats=25, parallel_claims=32, parallel_rounds=3,
              nvml_latency_s=0.010, reconcile_nodes=100, reconcile_rounds=3)
QUICK = Params(repeats=5, fleet_nodes=100, fleet_repeats=2, fleet_memory_nodes=10,
               mig_cycles=300, mig_batches=3, claim_repeats=5, parallel_claims=32, parallel_rounds=1,
               nvml_latency_s=0.010, reconcile_nodes=100, reconcile_rounds=1, api_rounds=20, api_startups=2,
               idle_s=10.0, spaced_rounds=5, spaced_gap_s=1.0,
               publish_nodes=40, status_nodes=200, sched_nodes=50, sched_pods=300, peer_pods=8,
               peer_b2b_rounds=20, loops_nodes=50, loops_window_s=20.0, loops_pending=40)
TINY = Params(repeats=1, fleet_nodes=3, fleet_repeats=1, fleet_memory_nodes=None,
              mig_cycles=4, mig_batches=1, claim_repeats=1, parallel_claims=8, parallel_rounds=1,
              nvml_latency_s=0.001, reconcile_nodes=3, reconcile_rounds=1, api_rounds=3, api_parallel=4,
              api_startups=1, idle_s=0.5, spaced_rounds=2, spaced_gap_s=0.05, publish_nodes=3, publish_workers=2,
              status_nodes=10, sched_nodes=3, sched_pods=12, sched_profile_s=2, peer_pods=2, peer_b2b_rounds=3,
              loops_nodes=3, loops_window_s=3.0, loops_pending=4)
