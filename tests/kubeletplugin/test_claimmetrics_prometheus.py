"""The per-claim series as a real Prometheus sees them (testbed.prometheus, the pinned release): the collector's
/metrics for two pods on MPS slots of one GPU, scraped as the chart's monitor scrapes the plugin pod. With
honor_labels every query of the chart's dashboard answers with the two pods' series; without it Prometheus puts the
plugin pod's namespace and pod over theirs (exported_namespace), which is why the chart and the docs set it."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pynvml
import pytest
from dashboard_check import check_the_dashboard
from prometheus_client import CollectorRegistry, generate_latest
from standin.workloads import wait_until

from dra.model.devices import Device
from dra.node.checkpoint import ClaimRecord, PreparedDevice, ReservedPod, UndoInfo
from kube.podresources import ContainerDevice
from kubeletplugin.claimmetrics import ClaimMetricsCollector, claim_devices
from testbed import prometheus
from testbed.localcluster import free_port

GPU = "GPU-11111111-2222-3333-4444-555555555555"
NODE, NAMESPACE, DRIVER = "node-a", "team-a", "gpu.dra-driver.io"
MiB = 1 << 20
PODS = {"metrics-a": ("0b9f2c3d-1111-2222-3333-444455556666", 101, 300),     # pod: (UID, pid, MiB)
        "metrics-b": ("7e7e7e7e-1111-2222-3333-444455556666", 102, 700)}
PLUGIN_POD = {"namespace": "gpu-dra", "pod": "gpu-dra-kubelet-plugin-x7k2p", "container": "plugin"}


class _Nvml:
    """NVML as an MPS GPU answers: the two pods' client processes, no utilisation samples."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802 - pynvml's name
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:  # noqa: N802 - pynvml's name
        return []

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: str) -> list[Any]:  # noqa: N802 - pynvml's name
        out = []
        for _uid, pid, mib in PODS.values():
            info = pynvml.c_nvmlProcessInfo_t()
            info.pid, info.usedGpuMemory = pid, mib * MiB
            out.append(info)
        return out

    def nvmlDeviceGetProcessUtilization(self, handle: str, since: int) -> list[Any]:  # noqa: N802 - pynvml's name
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)


@pytest.fixture
def plugin_metrics(tmp_path: Path) -> Iterator[int]:
    """The collector on a /metrics endpoint (its port): two pods, each with its claim on an MPS slot of GPU."""
    devices, records, rows = {}, [], []
    for k, (pod, (uid, pid, _mib)) in enumerate(PODS.items()):
        name = f"gpu-0-slot-{k}"
        devices[name] = Device(name=name, kind="slot", gpu_uuid=GPU, gpu_index=0, gpu_minor=0,
                               gpu_pci_bus_id="0000:01:00.0", sharing="mps",
                               attributes={"productName": {"string": "NVIDIA H200"}})
        records.append(ClaimRecord(uid=f"claim-{k}", namespace=NAMESPACE, name=f"{pod}-gpu", state="PrepareCompleted",
                                   undo=UndoInfo(), reserved_for=(ReservedPod(name=pod, uid=uid),),
                                   devices=(PreparedDevice(device=name, pool=NODE, requests=("gpu",), uuid=GPU),)))
        rows.append(ContainerDevice(NAMESPACE, pod, "cuda", NAMESPACE, f"{pod}-gpu", DRIVER, NODE, name))
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/{'c' * 64}\n")
    registry = CollectorRegistry()
    ClaimMetricsCollector(nvml=_Nvml(), registry=registry, proc_root=tmp_path, node_name=NODE,
                          claim_devices=lambda: claim_devices(records, devices, NODE),
                          pod_resources=lambda: rows, read_claim=None)

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _config(port: int, honor_labels: bool) -> dict[str, Any]:
    # The target labels the chart's monitor gives the plugin pod's target.
    return {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "gpu-dra-kubelet-plugin", "honor_labels": honor_labels,
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"],
                                                    "labels": {**PLUGIN_POD, "node": NODE}}]}]}


def _two_samples(prom: prometheus.Prometheus) -> None:
    wait_until(lambda: len(prom.query("count_over_time(gpu_dra_claim_gpu_processes[1m]) >= 2")) == len(PODS), 60,
               "two scrapes of both pods' series")


def test_with_honor_labels_every_dashboard_query_shows_the_two_pods(plugin_metrics: int) -> None:
    with prometheus.running(_config(plugin_metrics, honor_labels=True)) as prom:
        _two_samples(prom)
        check_the_dashboard(prom, namespace=NAMESPACE, node=NODE, gpu_uuid=GPU, pods=set(PODS),
                            memory=sum(mib for _uid, _pid, mib in PODS.values()) * MiB)
        # The GPU labels join the DCGM exporter's: its names, its values.
        series = prom.query("gpu_dra_claim_gpu_memory_used_bytes")
        assert {(s["metric"]["Hostname"], s["metric"]["gpu"], s["metric"]["UUID"], s["metric"]["modelName"])
                for s in series} == {(NODE, "0", GPU, "NVIDIA H200")}
        # The plugin's own series (none of these labels) keep the plugin pod's.
        errors = prom.query("gpu_dra_claim_metrics_errors_total")
        assert errors and all(s["metric"]["namespace"] == "gpu-dra" for s in errors)


def test_without_honor_labels_the_plugin_pods_labels_win(plugin_metrics: int) -> None:
    with prometheus.running(_config(plugin_metrics, honor_labels=False)) as prom:
        wait_until(lambda: len(prom.query("gpu_dra_claim_gpu_processes")) == len(PODS), 60, "both pods' series")
        assert prom.query(f"gpu_dra_claim_gpu_processes{{namespace='{NAMESPACE}'}}") == []
        series = prom.query(f"gpu_dra_claim_gpu_processes{{exported_namespace='{NAMESPACE}'}}")
        assert {s["metric"]["exported_pod"] for s in series} == set(PODS)
        assert {s["metric"]["pod"] for s in series} == {PLUGIN_POD["pod"]}
