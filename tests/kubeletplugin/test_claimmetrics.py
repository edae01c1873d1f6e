"""Per-claim GPU metrics: the cgroup of a process, the kubelet's PodResources answer, the pods the claims are
reserved for and NVML's process lists joined into one series per pod and claim device (kubeletplugin.claimmetrics)."""
from __future__ import annotations

import re
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pynvml
import pytest
from claims import reserved, resource_claim
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.generated.podresources.v1 import api_pb2 as pb
from api.generated.podresources.v1 import api_pb2_grpc as pb_grpc
from dra.model.devices import Device
from dra.node.checkpoint import ClaimRecord, MpsUse, PreparedDevice, ReservedPod, UndoInfo
from dra.node.containers import ContainerCgroup, parse_cgroup
from kube.podresources import ContainerDevice, PodResourcesClient, PodResourcesError, container_devices
from kubeletplugin.claimmetrics import ClaimMetricsCollector, claim_devices, joined_labels
from kubeletplugin.claims import ClaimError

DRIVER = "gpu.dra-driver.io"
GPU = "GPU-11111111-2222-3333-4444-555555555555"
MIG = "MIG-aaaaaaaa-2222-3333-4444-555555555555"
UID_A = "0b9f2c3d-1111-2222-3333-444455556666"
UID_B = "7e7e7e7e-1111-2222-3333-444455556666"
CID_A = "a" * 64
CID_B = "b" * 64
MiB = 1 << 20


# ---- cgroups ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    f"0::/gpu-dra-node-x/kubepods/besteffort/pod{UID_A}/{CID_A}\n",                             # cgroupfs, v2
    f"12:memory:/kubepods/burstable/pod{UID_A}/{CID_A}\n1:name=systemd:/kubepods/burstable/pod{UID_A}/{CID_A}\n",
    f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_A.replace('-', '_')}.slice/"
    f"cri-containerd-{CID_A}.scope\n",                                                            # systemd
    f"0::/kubepods.slice/kubepods-pod{UID_A.replace('-', '_')}.slice/crio-{CID_A}.scope\n",      # guaranteed QoS
    f"0::/../../kubepods-besteffort-pod{UID_A.replace('-', '_')}.slice/cri-containerd-{CID_A}.scope\n",  # seen from
    # a container's own cgroup namespace (the plugin's): the path is relative to its root
])
def test_cgroup_names_pod_and_container(text: str) -> None:
    assert parse_cgroup(text) == ContainerCgroup(UID_A, CID_A)


@pytest.mark.parametrize("text", [
    "0::/user.slice/user-0.slice/session-1.scope\n",              # a host process
    f"0::/kubepods/besteffort/pod{UID_A}\n",                       # the pod's cgroup itself: no container
    f"0::/kubepods/besteffort/pod{UID_A}/not-a-container-id\n",
    f"0::/{CID_A}\n",                                              # a container ID without a pod
    "",
])
def test_cgroup_of_no_container(text: str) -> None:
    assert parse_cgroup(text) is None


# ---- PodResources -------------------------------------------------------------------------------------------

def _pod(namespace: str, name: str, containers: dict[str, list[tuple[str, str, str]]]) -> pb.PodResources:
    """containers: name → [(claim, driver, device)]"""
    return pb.PodResources(namespace=namespace, name=name, containers=[
        pb.ContainerResources(name=c, dynamic_resources=[
            pb.DynamicResource(claim_name=claim, claim_namespace=namespace, claim_resources=[
                pb.ClaimResource(driver_name=driver, pool_name="node-a", device_name=device,
                                 cdi_devices=[pb.CDIDevice(name=f"{driver}/claim={device}")])])
            for claim, driver, device in claims])
        for c, claims in containers.items()])


def test_list_keeps_this_drivers_devices() -> None:
    response = pb.ListPodResourcesResponse(pod_resources=[
        _pod("team-a", "train", {"main": [("gpu-a", DRIVER, "gpu-1-slot-0"), ("nic", "other.example.com", "eth1")],
                                 "sidecar": []}),
        _pod("team-b", "infer", {"main": [("gpu-b", DRIVER, "gpu-1-slot-1")]}),
    ])
    assert container_devices(response, DRIVER) == [
        ContainerDevice("team-a", "train", "main", "team-a", "gpu-a", DRIVER, "node-a", "gpu-1-slot-0"),
        ContainerDevice("team-b", "infer", "main", "team-b", "gpu-b", DRIVER, "node-a", "gpu-1-slot-1"),
    ]


def test_field_numbers_are_the_kubelets() -> None:
    # From the kubelet's published api.proto: what must match on the wire.
    expect = {
        ("ListPodResourcesResponse", "pod_resources"): 1, ("PodResources", "name"): 1,
        ("PodResources", "namespace"): 2, ("PodResources", "containers"): 3, ("ContainerResources", "name"): 1,
        ("ContainerResources", "dynamic_resources"): 5, ("DynamicResource", "claim_name"): 2,
        ("DynamicResource", "claim_namespace"): 3, ("DynamicResource", "claim_resources"): 4,
        ("ClaimResource", "cdi_devices"): 1, ("ClaimResource", "driver_name"): 2, ("ClaimResource", "pool_name"): 3,
        ("ClaimResource", "device_name"): 4, ("GetPodResourcesRequest", "pod_name"): 1,
        ("GetPodResourcesRequest", "pod_namespace"): 2,
    }
    for (message, field), number in expect.items():
        assert pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number, (message, field)
    assert pb.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"


class _Lister(pb_grpc.PodResourcesListerServicer):
    def __init__(self, response: pb.ListPodResourcesResponse) -> None:
        self.response = response

    def List(self, request: Any, context: Any) -> pb.ListPodResourcesResponse:  # noqa: N802 - gRPC name
        return self.response


def test_client_reads_the_socket_and_names_it_when_it_cannot(tmp_path: Path) -> None:
    sock = tmp_path / "kubelet.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(_Lister(pb.ListPodResourcesResponse(pod_resources=[
        _pod("team-a", "train", {"main": [("gpu-a", DRIVER, "gpu-0")]})])), server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    client = PodResourcesClient(sock, timeout=5)
    try:
        assert [(d.pod, d.device) for d in client.list(DRIVER)] == [("train", "gpu-0")]
    finally:
        client.close()
        server.stop(None)
    missing = PodResourcesClient(tmp_path / "none.sock", timeout=1)
    with pytest.raises(PodResourcesError, match=r"PodResources List on .*none\.sock failed: UNAVAILABLE"):
        missing.list(DRIVER)
    missing.close()


# ---- the collector ------------------------------------------------------------------------------------------

class _Nvml:
    """NVML's process queries, for the GPU and the MIG device of these tests."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND

    def __init__(self, compute: dict[str, list[tuple[int, int | None]]], mps: dict[str, list[tuple[int, int]]] | None,
                 samples: dict[str, list[tuple[int, int, int, int]]]) -> None:
        self.compute, self.mps, self.samples = compute, mps, samples
        self.broken: set[str] = set()

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802 - pynvml's name
        if uuid in self.broken:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return uuid

    @staticmethod
    def _infos(rows: list[tuple[int, int | None]]) -> list[Any]:
        out = []
        for pid, used in rows:
            info = pynvml.c_nvmlProcessInfo_t()
            info.pid = pid
            info.usedGpuMemory = used if used is not None else 0
            out.append(info if used is not None else type("I", (), {"pid": pid, "usedGpuMemory": None})())
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:  # noqa: N802 - pynvml's name
        return self._infos(self.compute.get(handle, []))

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: str) -> list[Any]:  # noqa: N802 - pynvml's name
        if self.mps is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)   # a driver without the query
        return self._infos(self.mps.get(handle, []))

    def nvmlDeviceGetProcessUtilization(self, handle: str, since: int) -> list[Any]:  # noqa: N802 - pynvml's name
        rows = [s for s in self.samples.get(handle, []) if s[1] > since]
        if not rows:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        out = []
        for pid, stamp, sm, mem in rows:
            s = pynvml.c_nvmlProcessUtilizationSample_t()
            s.pid, s.timeStamp, s.smUtil, s.memUtil = pid, stamp, sm, mem
            out.append(s)
        return out


def _proc(root: Path, pid: int, cgroup: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cgroup").write_text(cgroup)


def _device(name: str, kind: str = "slot", sharing: str = "mps", **kw: Any) -> Device:
    return Device(name=name, kind=kind, gpu_uuid=GPU, gpu_index=1, gpu_minor=1, gpu_pci_bus_id="0000:01:00.0",
                  sharing=sharing, attributes={"productName": {"string": "NVIDIA H200"}}, **kw)


# The physical GPU's labels on every series, the DCGM exporter's names and values: a query joins on them.
GPU_LABELS = {"gpu_uuid": GPU, "Hostname": "node-a", "gpu": "1", "UUID": GPU, "modelName": "NVIDIA H200"}


DEVICES = {d.name: d for d in (_device("gpu-1-slot-0"), _device("gpu-1-slot-1"),
                               _device("gpu-1-mig-1g-10gb-19-0", kind="mig", sharing="none",
                                       mig_profile_name="1g.10gb"),
                               _device("gpu-1", kind="gpu", sharing="none"))}


def _record(uid: str, namespace: str, name: str, device: str, uuid: str, request: str = "gpu",
            undo: UndoInfo | None = None, state: str = "PrepareCompleted",
            pods: tuple[tuple[str, str], ...] = ()) -> ClaimRecord:
    return ClaimRecord(uid=uid, namespace=namespace, name=name, state=state, undo=undo or UndoInfo(),
                       devices=(PreparedDevice(device=device, pool="node-a", requests=(request,), uuid=uuid),),
                       reserved_for=tuple(ReservedPod(name=n, uid=u) for n, u in pods))


def _series(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.startswith(("gpu_dra_claim_gpu", "gpu_dra_gpu_unattributed", "gpu_dra_claim_metrics_errors")):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _labels(namespace: str, pod: str, claim: str, device: str, sharing: str = "mps", mig_profile: str = "",
            container: str = "main") -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"namespace": namespace, "pod": pod, "container": container, "claim": claim,
                         "request": "gpu", "device": device, "mig_profile": mig_profile,
                         "sharing": sharing, **GPU_LABELS}.items()))


def _claim(namespace: str, name: str, uid: str, pods: list[tuple[str, str]]) -> dict[str, Any]:
    return resource_claim(name, namespace, uid=uid, reserved_for=reserved(*pods), typed=False)


UID_C, UID_X, UID_E = ("c0c0c0c0-1111-2222-3333-444455556666", "d0d0d0d0-1111-2222-3333-444455556666",
                       "e0e0e0e0-1111-2222-3333-444455556666")


@pytest.fixture
def scene(tmp_path: Path) -> dict[str, Any]:
    """Two pods on MPS slots of one GPU (team-b's pod with two containers referencing its claim), a third on a MIG
    device of it; processes 101 (pod a), 102 and 103 (pod b), 201 (MIG pod), 300 (a host process), 400 (a pod that
    holds no claim device on the GPU). The claims as the API server has them now are in state["claims"]."""
    proc = tmp_path / "proc"
    _proc(proc, 101, f"0::/kubepods/besteffort/pod{UID_A}/{CID_A}\n")
    _proc(proc, 102, f"0::/kubepods/besteffort/pod{UID_B}/{CID_B}\n")
    _proc(proc, 103, f"0::/kubepods/besteffort/pod{UID_B}/{'e' * 64}\n")
    _proc(proc, 201, f"0::/kubepods/besteffort/pod{UID_C}/{'c' * 64}\n")
    _proc(proc, 300, "0::/system.slice/nvidia-cuda-mps-server.scope\n")
    _proc(proc, 400, f"0::/kubepods/besteffort/pod{UID_X}/{'d' * 64}\n")
    records = [_record("u1", "team-a", "gpu-a", "gpu-1-slot-0", GPU, pods=(("train", UID_A),)),
               _record("u2", "team-b", "gpu-b", "gpu-1-slot-1", GPU, pods=(("infer", UID_B),)),
               _record("u3", "team-c", "gpu-c", "gpu-1-mig-1g-10gb-19-0", MIG, pods=(("mig", UID_C),)),
               _record("u4", "team-d", "gpu-d", "gpu-1-slot-1", GPU, state="PrepareStarted")]
    rows = [ContainerDevice("team-a", "train", "main", "team-a", "gpu-a", DRIVER, "node-a", "gpu-1-slot-0"),
            ContainerDevice("team-b", "infer", "main", "team-b", "gpu-b", DRIVER, "node-a", "gpu-1-slot-1"),
            ContainerDevice("team-b", "infer", "sidecar", "team-b", "gpu-b", DRIVER, "node-a", "gpu-1-slot-1"),
            ContainerDevice("team-c", "mig", "main", "team-c", "gpu-c", DRIVER, "node-a", "gpu-1-mig-1g-10gb-19-0")]
    claims = {("team-a", "gpu-a"): _claim("team-a", "gpu-a", "u1", [("train", UID_A)]),
              ("team-b", "gpu-b"): _claim("team-b", "gpu-b", "u2", [("infer", UID_B)]),
              ("team-c", "gpu-c"): _claim("team-c", "gpu-c", "u3", [("mig", UID_C)])}
    now = 1_000_000.0
    nvml = _Nvml(compute={GPU: [(300, 64 * MiB), (400, 1 * MiB)], MIG: [(201, None)]},
                 mps={GPU: [(101, 300 * MiB), (102, 500 * MiB), (103, 20 * MiB)]},
                 samples={GPU: [(101, int((now - 5) * 1e6), 30, 10), (101, int((now - 1) * 1e6), 40, 12),
                                (102, int((now - 2) * 1e6), 70, 20), (102, int((now - 100) * 1e6), 99, 99)]})
    registry = CollectorRegistry()
    state: dict[str, Any] = {"rows": rows, "records": records, "claims": claims, "reads": [], "nvml": nvml,
                             "registry": registry, "proc": proc, "monotonic": [0.0]}

    def pod_resources() -> list[ContainerDevice]:
        if state.get("podresources_error"):
            raise PodResourcesError("PodResources List on /x.sock failed: UNAVAILABLE: no socket")
        return state["rows"]

    def read_claim(namespace: str, name: str, uid: str) -> dict[str, Any]:
        state["reads"].append((namespace, name, uid))
        if state.get("apiserver_down"):
            raise ClaimError(f"reading ResourceClaim {namespace}/{name}: the API server is unavailable",
                             reason="unavailable")
        return state["claims"][(namespace, name)]

    ClaimMetricsCollector(nvml=nvml, registry=registry, proc_root=proc, clock=lambda: now,
                          claim_devices=lambda: claim_devices(state["records"], DEVICES, "node-a"),
                          pod_resources=pod_resources, read_claim=read_claim, reread_interval=10,
                          monotonic=lambda: state["monotonic"][0], node_name="node-a")
    return state


UNATTRIBUTED = ("gpu_dra_gpu_unattributed_processes", tuple(sorted(GPU_LABELS.items())))


def test_two_pods_on_mps_slots_of_one_gpu_are_two_series(scene: dict[str, Any]) -> None:
    got = _series(scene["registry"])
    a = _labels("team-a", "train", "gpu-a", "gpu-1-slot-0")
    b = _labels("team-b", "infer", "gpu-b", "gpu-1-slot-1", container="main|sidecar")
    assert got[("gpu_dra_claim_gpu_memory_used_bytes", a)] == 300 * MiB
    assert got[("gpu_dra_claim_gpu_memory_used_bytes", b)] == 520 * MiB        # its two processes
    assert got[("gpu_dra_claim_gpu_processes", a)] == 1
    assert got[("gpu_dra_claim_gpu_processes", b)] == 2
    assert got[("gpu_dra_claim_gpu_sm_utilization_percent", a)] == 40           # the latest sample
    assert got[("gpu_dra_claim_gpu_memory_utilization_percent", a)] == 12
    assert got[("gpu_dra_claim_gpu_sm_utilization_percent", b)] == 70           # the old 99 is outside the window
    # Two containers of one pod hold the device: which of them runs a process is not known, and no series says
    # it is (neither "main" nor "sidecar" alone).
    for container in ("main", "sidecar"):
        assert not [k for k in got if k[1] == _labels("team-b", "infer", "gpu-b", "gpu-1-slot-1", container=container)]
    # The MIG device through its own handle; NVML without a memory figure counts 0 bytes.
    mig = _labels("team-c", "mig", "gpu-c", "gpu-1-mig-1g-10gb-19-0", sharing="none", mig_profile="1g.10gb")
    assert got[("gpu_dra_claim_gpu_processes", mig)] == 1
    assert got[("gpu_dra_claim_gpu_memory_used_bytes", mig)] == 0
    # The MPS server (a host process) and a pod that holds no claim device on this GPU.
    assert got[UNATTRIBUTED] == 2
    # The claim whose prepare did not complete has no series.
    assert not [k for k in got if ("claim", "gpu-d") in k[1]]
    # Pod 400's UID is in no record: the claims on its GPU were read again (once), and do not name it either.
    assert sorted(scene["reads"]) == [("team-a", "gpu-a", "u1"), ("team-b", "gpu-b", "u2")]
    assert got[("gpu_dra_claim_metrics_errors_total", (("source", "apiserver"),))] == 0


def test_a_container_that_runs_nothing_has_its_series_at_zero(scene: dict[str, Any]) -> None:
    scene["rows"].append(ContainerDevice("team-a", "train", "main", "team-a", "gpu-a", DRIVER, "node-a",
                                         "gpu-1-slot-0"))
    scene["nvml"].mps[GPU] = [(102, 500 * MiB)]
    got = _series(scene["registry"])
    assert got[("gpu_dra_claim_gpu_processes", _labels("team-a", "train", "gpu-a", "gpu-1-slot-0"))] == 0
    assert got[("gpu_dra_claim_gpu_memory_used_bytes", _labels("team-a", "train", "gpu-a", "gpu-1-slot-0"))] == 0


def test_a_pod_sharing_a_claim_prepared_for_another_is_found_by_reading_the_claim_again(
        scene: dict[str, Any]) -> None:
    # team-a/eval joined claim gpu-a after it was prepared for train: the record names train only.
    _proc(scene["proc"], 105, f"0::/kubepods/besteffort/pod{UID_E}/{'f' * 64}\n")
    scene["nvml"].mps[GPU].append((105, 40 * MiB))
    scene["rows"].append(ContainerDevice("team-a", "eval", "main", "team-a", "gpu-a", DRIVER, "node-a",
                                         "gpu-1-slot-0"))
    scene["claims"][("team-a", "gpu-a")] = _claim("team-a", "gpu-a", "u1", [("train", UID_A), ("eval", UID_E)])
    got = _series(scene["registry"])
    evaluation = _labels("team-a", "eval", "gpu-a", "gpu-1-slot-0")
    assert got[("gpu_dra_claim_gpu_memory_used_bytes", evaluation)] == 40 * MiB
    assert got[("gpu_dra_claim_gpu_processes", _labels("team-a", "train", "gpu-a", "gpu-1-slot-0"))] == 1
    assert got[UNATTRIBUTED] == 2
    reads = len(scene["reads"])
    # Known from now on; pod 400, still unknown, has the claims read again at most every 10 s.
    _series(scene["registry"])
    assert len(scene["reads"]) == reads
    scene["monotonic"][0] = 11
    got = _series(scene["registry"])
    assert len(scene["reads"]) == 2 * reads
    assert got[("gpu_dra_claim_gpu_memory_used_bytes", evaluation)] == 40 * MiB


def test_a_pod_the_claim_is_not_reserved_for_is_not_credited(scene: dict[str, Any]) -> None:
    # A process on the claim's GPU in a pod of another UID (e.g. a pod of the same name created again): not the
    # claim's, even though PodResources lists a pod of that name.
    _proc(scene["proc"], 106, f"0::/kubepods/besteffort/pod99999999-1111-2222-3333-444455556666/{'9' * 64}\n")
    scene["nvml"].mps[GPU].append((106, 8 * MiB))
    got = _series(scene["registry"])
    assert got[("gpu_dra_claim_gpu_processes", _labels("team-a", "train", "gpu-a", "gpu-1-slot-0"))] == 1
    assert got[UNATTRIBUTED] == 3


def test_sources_that_fail_are_counted(scene: dict[str, Any]) -> None:
    scene["nvml"].broken.add(MIG)
    got = _series(scene["registry"])
    assert got[("gpu_dra_claim_metrics_errors_total", (("source", "nvml"),))] == 1
    assert got[("gpu_dra_claim_gpu_processes", _labels("team-c", "mig", "gpu-c", "gpu-1-mig-1g-10gb-19-0",
                                                       sharing="none", mig_profile="1g.10gb"))] == 0
    scene["podresources_error"] = True
    got = _series(scene["registry"])
    assert got[("gpu_dra_claim_metrics_errors_total", (("source", "podresources"),))] == 1
    assert not [k for k in got if k[0] == "gpu_dra_claim_gpu_processes"]


def test_an_api_server_that_does_not_answer_costs_only_the_pods_no_record_names(scene: dict[str, Any]) -> None:
    scene["apiserver_down"] = True
    got = _series(scene["registry"])
    # Pod 400 is in no record: the two claims on its GPU could not be read.
    assert got[("gpu_dra_claim_metrics_errors_total", (("source", "apiserver"),))] == 2
    assert got[UNATTRIBUTED] == 2
    # The pods the records name are placed without the API server.
    assert got[("gpu_dra_claim_gpu_processes", _labels("team-a", "train", "gpu-a", "gpu-1-slot-0"))] == 1
    assert got[("gpu_dra_claim_gpu_processes", _labels("team-b", "infer", "gpu-b", "gpu-1-slot-1",
                                                       container="main|sidecar"))] == 2


def test_a_driver_without_the_mps_query_still_reports_compute_processes(scene: dict[str, Any]) -> None:
    scene["nvml"].mps = None
    got = _series(scene["registry"])
    assert got[("gpu_dra_claim_metrics_errors_total", (("source", "nvml"),))] == 0
    assert got[UNATTRIBUTED] == 2    # 300 and 400, as before
    assert got[("gpu_dra_claim_gpu_processes", _labels("team-c", "mig", "gpu-c", "gpu-1-mig-1g-10gb-19-0",
                                                       sharing="none", mig_profile="1g.10gb"))] == 1


def test_sharing_label_of_whole_devices_follows_the_claims_config(scene: dict[str, Any]) -> None:
    scene["records"] = [_record("u5", "team-a", "gpu-a", "gpu-1", GPU, pods=(("train", UID_A),),
                                undo=UndoInfo(mps_devices=(MpsUse(device=GPU, gpu=GPU),)))]
    scene["rows"] = [ContainerDevice("team-a", "train", "main", "team-a", "gpu-a", DRIVER, "node-a", "gpu-1")]
    got = _series(scene["registry"])
    assert got[("gpu_dra_claim_gpu_memory_used_bytes", _labels("team-a", "train", "gpu-a", "gpu-1"))] == 300 * MiB


def test_devices_of_one_pod_on_one_gpu_are_one_series_naming_them_all(scene: dict[str, Any]) -> None:
    # team-a's pod: container main holds slot 0 through gpu-a, container tools slot 1 through claim gpu-e. A
    # process on the GPU is in one of them; which, nothing on the node says.
    scene["records"].append(_record("u6", "team-a", "gpu-e", "gpu-1-slot-1", GPU, pods=(("train", UID_A),)))
    scene["claims"][("team-a", "gpu-e")] = _claim("team-a", "gpu-e", "u6", [("train", UID_A)])
    scene["rows"] = [ContainerDevice("team-a", "train", "main", "team-a", "gpu-a", DRIVER, "node-a", "gpu-1-slot-0"),
                     ContainerDevice("team-a", "train", "tools", "team-a", "gpu-e", DRIVER, "node-a", "gpu-1-slot-1")]
    got = _series(scene["registry"])
    joint = tuple(sorted({"namespace": "team-a", "pod": "train", "container": "main|tools", "claim": "gpu-a|gpu-e",
                          "request": "gpu", "device": "gpu-1-slot-0|gpu-1-slot-1", "mig_profile": "",
                          "sharing": "mps", **GPU_LABELS}.items()))
    assert got[("gpu_dra_claim_gpu_processes", joint)] == 1
    assert got[("gpu_dra_claim_gpu_memory_used_bytes", joint)] == 300 * MiB
    assert [k for k in got if k[0] == "gpu_dra_claim_gpu_processes"] == [("gpu_dra_claim_gpu_processes", joint)]


def test_joined_labels() -> None:
    assert joined_labels([("main", "c", "gpu"), ("sidecar", "c", "gpu")]) == ("main|sidecar", "c", "gpu")
    assert joined_labels([("b", "x"), ("a", "x"), ("b", "y")]) == ("a|b", "x|y")
    assert joined_labels([("main", "gpu,extra")]) == ("main", "gpu,extra")


def test_operations_doc_lists_every_metric_the_plugin_serves() -> None:
    from kubeletplugin.metrics import PluginMetrics

    metrics = PluginMetrics()
    ClaimMetricsCollector(nvml=None, registry=metrics.registry, claim_devices=lambda: [], pod_resources=lambda: [],
                          read_claim=None)
    served = set(re.findall(r"^# HELP (\S+) ", generate_latest(metrics.registry).decode(), re.M))
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    missing = {m for m in served if f"`{m}`" not in doc and not m.endswith("_created")}   # _created: one sentence
    assert served and not missing, f"metrics missing from docs/operations.md: {missing}"


def test_a_gpu_without_unattributed_processes_says_0(scene: dict[str, Any]) -> None:
    # Only pod a's process on the GPU: its count is 0, not absent (a panel shows "none", not an empty graph).
    scene["nvml"].compute, scene["nvml"].mps = {}, {GPU: [(101, 300 * MiB)]}
    got = _series(scene["registry"])
    assert got[UNATTRIBUTED] == 0
    assert got[("gpu_dra_claim_gpu_processes", _labels("team-a", "train", "gpu-a", "gpu-1-slot-0"))] == 1
