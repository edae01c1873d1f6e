"""Every example runs as a pod on a real node (kubelet v1.37, containerd 2, runc) and its container sees what its
claim should give: the asserts are on what the container itself printed (`testbed.podprobe`): its /dev/nvidia*
character devices with their major:minor, its NVIDIA_* and CUDA_* environment, its NVIDIA-related mounts, and
the GPUs or MIG devices libcuda.so.1 and libnvidia-ml.so.1 (the CUDA stand-in in the plugin's driver root,
loaded by soname through the CDI spec's mounts and hooks) show it: exactly its claims', none of another's.
Deleting the pod makes the kubelet unprepare: the CDI spec, the checkpointed claim, a dynamic MIG device and
an MPS daemon's directories are gone.

One node for the module; its GPUs are simulated (see realnode_helpers.fleet_node), so the devices are
described by major/minor in the CDI specs and runc creates them in the container.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from realnode_helpers import EXAMPLES, NVIDIA_MAJOR, NVIDIACTL, RealNode, load_objects

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from dra.sim.driverlayout import LAYOUTS, triplet
from dra.sim.driverroot import SIMULATED_CAPS_MAJOR, SimulatedDriverRoot
from dra.sim.standin import LISTING_CONTAINER_DIR
from testbed.demo_examples import load_examples
from testbed.nodeplugin import LocalNodePlugin
from testbed.podprobe import ContainerView, probe_marker

pytestmark = pytest.mark.e2e

MPS_PIPE = "/tmp/nvidia-mps"
_DEVICE_NAME = re.compile(r"^gpu-(\d+)(?:-mig-[0-9a-z]+-(\d+)-(\d+))?")


# GPU 5: dynamic MIG of one profile as capacity (one device, instances: 7), beside the shared fleet's GPUs.
MIG_CAPACITY_GPU = ({"model": "H100-80GB", "count": 1},
                    {"wholeGpu": False, "mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb"], "layout": "capacity"}})


@pytest.fixture(scope="module")
def real() -> Iterator[RealNode]:
    with RealNode(extra_gpus=[MIG_CAPACITY_GPU]).running() as node:
        yield node


@pytest.fixture(scope="module")
def ours(real: RealNode) -> LocalNodePlugin:
    return real.start_plugin(real.plugin(DEFAULT_DRIVER_NAME))


class Checked:
    """One container's view checked against its claims' allocation; what was prepared, for the clean-up checks."""

    def __init__(self) -> None:
        self.claim_uids: set[str] = set()
        self.mps_dirs: list[Path] = []
        self.dynamic_mig: list[str] = []


def expected_view(real: RealNode, plugin: LocalNodePlugin, results: list[dict[str, Any]]) -> tuple[
        dict[str, tuple[int, int]], str, list[str]]:
    """(device nodes, NVIDIA_VISIBLE_DEVICES, dynamic MIG UUIDs) that the allocation `results` should give one
    container, from the published devices and the simulated hardware (not from the plugin's answers)."""
    published = real.devices(plugin)
    nvml = real.hardware(plugin)
    from dra.node import migdevices

    nodes = dict([NVIDIACTL])
    visible: list[str] = []
    dynamic: list[str] = []
    root = SimulatedDriverRoot(plugin.driver_root, driver_version="")
    for r in results:
        attrs = published[r["device"]]
        m = _DEVICE_NAME.match(r["device"])
        assert m, r["device"]
        minor = int(m.group(1))
        nodes[f"/dev/nvidia{minor}"] = (NVIDIA_MAJOR, minor)
        if attrs["type"] in ("gpu",):
            visible.append(attrs["uuid"])
        elif attrs["type"] in ("slot", "shared"):
            visible.append(attrs["parentUUID"])
        else:
            assert attrs["type"] == "mig", attrs
            live = migdevices.list_mig_devices(nvml, attrs["parentUUID"])
            if "instanceMemoryMiB" in attrs:    # a share of one profile as capacity: the GPU's MIG devices
                migs = sorted(live, key=lambda x: -x.start)     # (one share at a time), made highest first
                assert len(migs) == int(r["consumedCapacity"]["instances"]), (r, migs)
                for mig in migs:
                    dynamic.append(mig.uuid)
                    visible.append(mig.uuid)
                    for cap in root.mig_cap_nodes(minor, mig.gi_id, mig.ci_id):
                        nodes[cap.path] = (cap.major, cap.minor)
                continue
            if "uuid" in attrs:      # static: the partition exists with its UUID
                mig = next(x for x in live if x.uuid == attrs["uuid"])
            else:                    # dynamic: created for this claim at its placement
                profile_id, start = int(m.group(2)), int(m.group(3))
                mig = next(x for x in live if (x.profile_id, x.start) == (profile_id, start))
                dynamic.append(mig.uuid)
            visible.append(mig.uuid)
            for cap in root.mig_cap_nodes(minor, mig.gi_id, mig.ci_id):
                nodes[cap.path] = (cap.major, cap.minor)
    return nodes, ",".join(visible), dynamic


def wants_mps(published: dict[str, dict[str, Any]], claims: list[dict[str, Any]], driver: str) -> bool:
    """Whether the allocation asks for MPS: an MPS slot or share, or an opaque config of this driver with the
    MPS strategy (e.g. a MIG device shared through MPS)."""
    for claim in claims:
        allocation = claim["status"]["allocation"]["devices"]
        if any(published[r["device"]].get("sharing") == "mps" for r in allocation["results"] if r["driver"] == driver):
            return True
        for cfg in allocation.get("config") or []:
            opaque = cfg.get("opaque") or {}
            if opaque.get("driver") == driver and (opaque["parameters"].get("sharing") or {}).get("strategy") == "MPS":
                return True
    return False


def parents_of(published: dict[str, dict[str, Any]], results: list[dict[str, Any]]) -> set[str]:
    """The physical GPUs behind allocation `results`."""
    return {published[r["device"]]["uuid" if published[r["device"]]["type"] == "gpu" else "parentUUID"]
            for r in results}


def check_cuda_view(view: ContainerView, hardware: Any, visible: list[str], parents: set[str], where: str) -> None:
    """cuda-probe found libcuda.so.1 and libnvidia-ml.so.1 by soname, and they show exactly `visible` (the
    claims' GPUs or MIG devices) through CUDA and the GPUs `parents` with those MIG devices under them through
    NVML, with the simulated hardware's names and memory."""
    assert view.probed and view.cuda_error is None and view.nvml_error is None, (where, view.cuda_error,
                                                                                  view.nvml_error)
    assert sorted(d.uuid for d in view.cuda) == sorted(visible), (where, view.cuda)
    assert sorted(d.uuid for d in view.nvml) == sorted(parents), (where, view.nvml)
    assert sorted(d.uuid for d in view.nvml_mig) == sorted(u for u in visible if u.startswith("MIG-")), (
        where, view.nvml_mig)
    for seen in view.cuda + view.nvml + view.nvml_mig:
        handle = hardware.nvmlDeviceGetHandleByUUID(seen.uuid)
        assert (seen.name, seen.memory_mib) == (hardware.nvmlDeviceGetName(handle),
                                                hardware.nvmlDeviceGetMemoryInfo(handle).total >> 20), (where, seen)


def driver_mounts(real: RealNode, claim_uids: set[str]) -> dict[str, str]:
    """What the claims' CDI specs mount into every GPU container (driver files, GPU listing): host path ->
    container path."""
    paths: dict[str, str] = {}
    for uid in claim_uids:
        for spec_file in real.cdi_files(uid):
            spec = json.loads(spec_file.read_text())
            paths |= {m["hostPath"]: m["containerPath"] for m in (spec.get("containerEdits") or {}).get("mounts") or []}
    return paths


def check_pod(real: RealNode, plugin: LocalNodePlugin, namespace: str, pod_name: str) -> Checked:
    """Each container of the running pod saw exactly the device nodes and NVIDIA_VISIBLE_DEVICES of its claims
    (this driver's results only); an MPS client also its daemon's pipe directory, read-only, with the daemon's
    control socket, and /dev/shm (the probe's marker shows up in the shm directory beside a running daemon's pipe
    directory on the host), a non-MPS one nothing of MPS."""
    pod = real.pod(namespace, pod_name)
    published = real.devices(plugin)
    out = Checked()
    for container in pod["spec"]["containers"]:
        view = real.view(namespace, pod_name, container["name"])
        assert view.complete, f"{pod_name}/{container['name']}: probe incomplete"
        results: list[dict[str, Any]] = []
        claim_names = [c["name"] for c in (container.get("resources") or {}).get("claims") or []]
        ext = (pod.get("status") or {}).get("extendedResourceClaimStatus")
        claims = [real.claim_of(namespace, pod, n) for n in claim_names]
        if ext:
            claims.append(real.kube.get(  # type: ignore[union-attr]
                f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{ext['resourceClaimName']}"))
        for claim in claims:
            out.claim_uids.add(claim["metadata"]["uid"])
            results += [r for r in claim["status"]["allocation"]["devices"]["results"] if r["driver"] == plugin.driver]
        assert results, f"{pod_name}/{container['name']}: no device of {plugin.driver} allocated"
        nodes, visible, dynamic = expected_view(real, plugin, results)
        out.dynamic_mig += dynamic
        assert view.devices == nodes, f"{pod_name}/{container['name']} saw {view.devices}, expected {nodes}"
        assert view.env.get("NVIDIA_VISIBLE_DEVICES") == visible, view.env
        where = f"{pod_name}/{container['name']}"
        check_cuda_view(view, real.hardware(plugin), visible.split(","), parents_of(published, results), where)
        # The driver's files and the GPU listing are the spec's common mounts (a mount's root is the end of its
        # host path; its mount point may differ where the image has a link, /lib64 -> usr/lib64); anything
        # else NVIDIA is MPS.
        common = driver_mounts(real, {c["metadata"]["uid"] for c in claims})
        listing = next(h for h, c in common.items() if c == LISTING_CONTAINER_DIR)
        assert listing.endswith(view.mounts.get(LISTING_CONTAINER_DIR, "-")), (listing, view.mounts)
        nvidia_mounts = {m for m, root in view.mounts.items()
                         if "nvidia" in m and not any(h.endswith(root) for h in common)}
        if wants_mps(published, claims, plugin.driver):
            assert view.env.get("CUDA_MPS_PIPE_DIRECTORY") == MPS_PIPE, view.env
            assert nvidia_mounts == {MPS_PIPE}, view.mounts
            marker = probe_marker(pod_name, container["name"])
            # The pipe directory is read-only in the container (the root daemon writes there following links).
            assert view.wrote == [f"/dev/shm/{marker}"], view.wrote
            assert {"control", "nvidia-cuda-mps-control.pid"} <= set(view.pipe_entries), view.pipe_entries
            # The container's directories are a running daemon's: its marker is in the shm beside that daemon's
            # pipe directory on the host.
            daemons = plugin.mps_daemons()
            shm = list(plugin.state_dir.rglob(marker))
            assert len(shm) == 1 and shm[0].parent.name == "shm", shm
            pipe = shm[0].parent.parent / "pipe"
            assert pipe in daemons.values(), f"{pipe} is no running MPS daemon's pipe directory: {daemons}"
            out.mps_dirs += [pipe, shm[0].parent]
        else:
            assert not any(k.startswith("CUDA_MPS_") for k in view.env), view.env
            assert not nvidia_mounts and view.wrote == [], (view.mounts, view.wrote)
    return out


def time_slices(plugin: LocalNodePlugin, uids: set[str]) -> list[dict[str, Any]]:
    claims = RealNode.checkpoint_claims(plugin)
    return [t for u in uids for t in ((claims.get(u) or {}).get("undo") or {}).get("timeSlices") or []]


def finish(real: RealNode, plugin: LocalNodePlugin, namespace: str, pods: list[str], checked: list[Checked]) -> None:
    """Delete the pods; the kubelet unprepares: no CDI spec or checkpoint record of the claims, no dynamic MIG
    device, no MPS directory, nothing counted as prepared."""
    for pod in pods:
        real.delete_pod(namespace, pod)
    uids = sorted({u for c in checked for u in c.claim_uids})
    real.wait_unprepared(plugin, uids)
    live = {m.uuid for m in real.mig_devices(plugin)}
    assert not live & {u for c in checked for u in c.dynamic_mig}, "dynamic MIG devices left on the GPUs"
    assert not [d for c in checked for d in c.mps_dirs if d.exists()], "MPS daemon directories left behind"
    assert plugin.mps_daemons() == {}, "MPS control daemons left running"
    assert plugin.metrics()["gpu_dra_prepared_claims"] == 0


def run_and_check(real: RealNode, plugin: LocalNodePlugin, namespace: str,
                  objects: list[dict[str, Any]]) -> tuple[list[str], list[Checked]]:
    real.namespace(namespace)
    pods = real.apply(namespace, objects)
    for pod in pods:
        real.wait_running(namespace, pod)
    return pods, [check_pod(real, plugin, namespace, p) for p in pods]


# ---- every example --------------------------------------------------------------------------------

EXAMPLE_NAMES = [e.name for e in load_examples(EXAMPLES)]
# What each example's allocation must be, beyond what check_pod verifies for any claim.
EXPECTED_TYPE = {
    "cel-memory": "gpu", "first-available": "gpu", "gpu-by-family": "gpu", "memory-share": "shared",
    "mig-partition": "mig", "mps-slot": "slot", "shared-claim": "slot", "time-slicing-slot": "slot",
}


def test_every_example_folder_is_covered() -> None:
    assert sorted(EXAMPLE_NAMES) == sorted(EXPECTED_TYPE), "a new example needs its expectation here"


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_example_runs_and_its_container_sees_its_devices(real: RealNode, ours: LocalNodePlugin, example: str) -> None:
    objects = load_objects(EXAMPLES / example / "claim.yaml")
    namespace = f"ex-{example}"
    pods, checked = run_and_check(real, ours, namespace, objects)
    published = real.devices(ours)
    claims = {c["metadata"]["name"]: c for c in real.kube.list(  # type: ignore[union-attr]
        f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims")["items"]}
    results = [r for c in claims.values() for r in c["status"]["allocation"]["devices"]["results"]]
    assert {published[r["device"]]["type"] for r in results} == {EXPECTED_TYPE[example]}, results
    uids = {u for c in checked for u in c.claim_uids}
    views = {p: real.view(namespace, p, "cuda") for p in pods}

    if example == "mig-partition":
        assert "uuid" not in published[results[0]["device"]], "expected a dynamic partition"
        assert views[pods[0]].env["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-")
        assert len([d for d in views[pods[0]].devices if d.startswith("/dev/nvidia-caps/")]) == 2
        assert all(d[0] == SIMULATED_CAPS_MAJOR for p, d in views[pods[0]].devices.items() if "caps" in p)
    if example == "first-available":
        assert results[0]["request"] == "gpu/h100"
    if example == "memory-share":
        # A share is an MPS client whose pinned device memory is the amount it consumed.
        assert results[0]["consumedCapacity"]["memory"] == "10Gi"
        assert views[pods[0]].env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    if example == "mps-slot":
        # The claim's MPS limits reach its clients through their environment (one daemon per GPU serves all).
        env = views[pods[0]].env
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", env
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M", env
    if example == "time-slicing-slot":
        ts, = time_slices(ours, uids)
        assert ts["interval"] == "Long"
        assert ts["gpuUuids"] == [views[pods[0]].env["NVIDIA_VISIBLE_DEVICES"]]
    if example == "shared-claim":
        # One claim, two pods: both run on the same slot at once.
        assert len(pods) == 2 and len(claims) == 1 and len(uids) == 1
        a, b = (views[p] for p in pods)
        assert a.devices == b.devices and a.env == b.env

    finish(real, ours, namespace, pods, checked)


# ---- scenarios the examples do not cover ----------------------------------------------------------

def claim_template(name: str, device_class: str, cel: str | None = None,
                   capacity: dict[str, str] | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"deviceClassName": device_class}
    if cel:
        request["selectors"] = [{"cel": {"expression": cel}}]
    if capacity:
        request["capacity"] = {"requests": capacity}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}}}


def pod_with(name: str, template: str, containers: list[str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never",
                     "containers": [{"name": c, "image": "unused", "command": ["true"],
                                     "resources": {"claims": [{"name": "gpu"}]}} for c in containers],
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}]}}


def test_a_share_of_two_mig_instances_sees_exactly_its_two_mig_devices(real: RealNode, ours: LocalNodePlugin) -> None:
    """One MIG profile as capacity: a share of 2 instances gets two new MIG devices, and its container sees
    exactly those through its device nodes, NVIDIA_VISIBLE_DEVICES, CUDA and NVML; unprepare destroys them."""
    published = real.devices(ours)
    assert [n for n in published if n.startswith("gpu-5-")] == ["gpu-5-mig-1g10gb-19"]
    cel = f"has(device.attributes['{DEFAULT_DRIVER_NAME}'].instanceMemoryMiB)"
    pods, checked = run_and_check(real, ours, "mig-capacity", [
        claim_template("two-1g", f"mig.{DEFAULT_DRIVER_NAME}", cel, {"instances": "2"}),
        pod_with("two-1g", "two-1g", ["cuda"])])
    view = real.view("mig-capacity", "two-1g", "cuda")
    assert len(view.env["NVIDIA_VISIBLE_DEVICES"].split(",")) == 2 and len(view.nvml_mig) == 2, view.env
    assert len(checked[0].dynamic_mig) == 2
    finish(real, ours, "mig-capacity", pods, checked)


def test_static_mig_partition(real: RealNode, ours: LocalNodePlugin) -> None:
    """A partition that exists before the claim (static MIG): the container gets it and its capability nodes,
    and it is still there, still published, after the unprepare."""
    published = real.devices(ours)
    static = {n: a for n, a in published.items() if a["type"] == "mig" and "uuid" in a}
    assert sorted(a["profile"] for a in static.values()) == ["2g.20gb", "3g.40gb"], static
    name, attrs = next((n, a) for n, a in static.items() if a["profile"] == "3g.40gb")
    a = f"device.attributes['{DEFAULT_DRIVER_NAME}']"
    cel = f"has({a}.uuid) && {a}.uuid == '{attrs['uuid']}'"   # dynamic partitions have no uuid
    pods, checked = run_and_check(real, ours, "static-mig", [
        claim_template("static-3g", f"mig.{DEFAULT_DRIVER_NAME}", cel), pod_with("static-3g", "static-3g", ["cuda"])])
    view = real.view("static-mig", "static-3g", "cuda")
    assert view.env["NVIDIA_VISIBLE_DEVICES"] == attrs["uuid"]
    assert checked[0].dynamic_mig == []
    finish(real, ours, "static-mig", pods, checked)
    assert attrs["uuid"] in {m.uuid for m in real.mig_devices(ours)}
    assert name in real.devices(ours)


def test_two_containers_share_one_claim(real: RealNode, ours: LocalNodePlugin) -> None:
    """Both containers of a pod name the same claim: both see the one GPU, and it is prepared once."""
    pods, checked = run_and_check(real, ours, "two-containers", [
        claim_template("one-gpu", DEFAULT_DRIVER_NAME), pod_with("two-containers", "one-gpu", ["a", "b"])])
    a, b = (real.view("two-containers", "two-containers", c) for c in ("a", "b"))
    assert a.devices == b.devices and a.env["NVIDIA_VISIBLE_DEVICES"] == b.env["NVIDIA_VISIBLE_DEVICES"]
    assert len(checked[0].claim_uids) == 1
    assert ours.metrics()["gpu_dra_prepared_claims"] == 1
    finish(real, ours, "two-containers", pods, checked)


def mps_template(name: str, parent_uuid: str, threads: int, memory: str) -> dict[str, Any]:
    """A template for one MPS slot of the GPU `parent_uuid` with its own client limits."""
    a = f"device.attributes['{DEFAULT_DRIVER_NAME}']"
    template = claim_template(name, f"slot.{DEFAULT_DRIVER_NAME}",
                              f"{a}.sharing == 'mps' && {a}.parentUUID == '{parent_uuid}'")
    template["spec"]["spec"]["devices"]["config"] = [{"requests": ["gpu"], "opaque": {
        "driver": DEFAULT_DRIVER_NAME,
        "parameters": {"apiVersion": f"{DEFAULT_DRIVER_NAME}/v1alpha1", "kind": "GpuConfig",
                       "sharing": {"strategy": "MPS",
                                   "mps": {"activeThreadPercentage": threads, "pinnedMemoryLimit": memory}}}}}]
    return template


def test_two_pods_on_mps_slots_of_one_gpu_are_clients_of_one_daemon(real: RealNode, ours: LocalNodePlugin) -> None:
    """Two pods, each with its own claim on an MPS slot of the same GPU: both run, each container's environment
    carries its own claim's limits, and both use the pipe directory of the one daemon serving that GPU."""
    slots = [a for a in real.devices(ours).values() if a["type"] == "slot" and a.get("sharing") == "mps"]
    assert slots, "the node publishes no MPS slot"
    parent = slots[0]["parentUUID"]
    namespace = "mps-two-pods"
    pods, checked = run_and_check(real, ours, namespace, [
        mps_template("mps-a", parent, 15, "8Gi"), mps_template("mps-b", parent, 25, "12Gi"),
        pod_with("mps-a", "mps-a", ["cuda"]), pod_with("mps-b", "mps-b", ["cuda"])])
    a, b = (real.view(namespace, p, "cuda").env for p in ("mps-a", "mps-b"))
    assert (a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == ("15", "0=8192M"), a
    assert (b["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], b["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == ("25", "0=12288M"), b
    assert a["NVIDIA_VISIBLE_DEVICES"] == b["NVIDIA_VISIBLE_DEVICES"] == parent
    # check_pod found each container's markers in a running daemon's pipe directory: the same one for both.
    pipes = {c.mps_dirs[0] for c in checked}
    assert len(pipes) == 1, f"the two pods are clients of different daemons: {pipes}"
    assert len(ours.mps_daemons()) == 1, ours.mps_daemons()
    finish(real, ours, namespace, pods, checked)


def test_an_mps_client_running_as_another_user_is_served(real: RealNode, ours: LocalNodePlugin) -> None:
    """A pod running as UID 65534 (runAsUser) on an MPS slot is a client of the daemon like a root one: the
    daemon's control socket accepts every user (0666, as NVIDIA's), and CUDA's initialisation in the container is
    served by an MPS server of the client's own user, as the daemon's log on the host says."""
    slots = [a for a in real.devices(ours).values() if a["type"] == "slot" and a.get("sharing") == "mps"]
    assert slots, "the node publishes no MPS slot"
    namespace = "mps-other-user"
    pod = pod_with("nobody", "nobody", ["cuda"])
    pod["spec"]["securityContext"] = {"runAsUser": 65534, "runAsGroup": 65534}
    pods, checked = run_and_check(real, ours, namespace, [
        mps_template("nobody", slots[0]["parentUUID"], 20, "4Gi"), pod])
    [pipe] = {c.mps_dirs[0] for c in checked}
    assert oct((pipe / "control").stat().st_mode & 0o777) == oct(0o666)
    log = (pipe.parent / "log" / "control.log").read_text()
    assert re.search(r"New client \d+ of user ID 65534 served by the MPS server of user ID 65534", log), log
    view = real.view(namespace, "nobody", "cuda")
    assert {"control", "control_privileged", "control_lock", "log",
            "nvidia-cuda-mps-control.pid"} <= set(view.pipe_entries), view.pipe_entries
    finish(real, ours, namespace, pods, checked)


# ---- the driver root's layouts ------------------------------------------------------------------

LIBRARY_FOLDER = {"host": f"/usr/lib/{triplet()}", "operator": f"/usr/lib/{triplet()}", "single-folder": "/lib64"}


def test_every_layout_is_covered() -> None:
    assert sorted(LIBRARY_FOLDER) == sorted(LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_probe_finds_its_gpu_in_every_driver_root_layout(real: RealNode, layout: str) -> None:
    """The CUDA stand-in laid out as a host Debian, a GPU-operator or a single-folder driver install: the
    plugin's own discovery builds the spec (library files mounted, soname links made by the CDI hook's
    create-symlinks, the library folder given to update-ldcache), and the container's cuda-probe finds exactly
    its one GPU by soname, nvidia-smi -L lists it."""
    driver = f"{layout}.{DEFAULT_DRIVER_NAME}"
    real.add_classes(driver=driver)
    plugin = real.start_plugin(real.plugin(driver, layout=layout))
    try:
        namespace = f"layout-{layout}"
        pods, checked = run_and_check(real, plugin, namespace, [
            claim_template("one-gpu", driver), pod_with("one-gpu", "one-gpu", ["cuda"])])
        view = real.view(namespace, "one-gpu", "cuda")
        assert [d.uuid for d in view.cuda] == [view.env["NVIDIA_VISIBLE_DEVICES"]], view.cuda
        assert view.smi == [f"GPU 0: {view.cuda[0].name} (UUID: {view.cuda[0].uuid})"], view.smi
        spec_file, = real.cdi_files(next(iter(checked[0].claim_uids)))
        hooks = [h["args"] for h in json.loads(spec_file.read_text())["containerEdits"]["hooks"]]
        assert ["nvidia-cdi-hook", "update-ldcache", "--folder", LIBRARY_FOLDER[layout]] in hooks, hooks
        links = next(a for a in hooks if a[1] == "create-symlinks")
        assert f"{LIBRARY_FOLDER[layout]}/libcuda.so.1" in " ".join(links), links
        finish(real, plugin, namespace, pods, checked)
    finally:
        plugin.stop()


# ---- NVIDIA compatibility mode --------------------------------------------------------------------

COMPAT = EXAMPLES / "nvidia-compat"


@pytest.fixture(scope="class")
def compat(real: RealNode) -> Iterator[LocalNodePlugin]:
    """A second plugin on the same node, in NVIDIA compatibility mode (driver gpu.nvidia.com), for this class."""
    real.add_classes(compat_nvidia=True)
    plugin = real.start_plugin(real.plugin(NVIDIA_DRIVER_NAME, "--compat-nvidia"))
    yield plugin
    plugin.stop()


class TestNvidiaCompat:
    @pytest.mark.parametrize("file", sorted(p.name for p in COMPAT.glob("*.yaml")))
    def test_nvidia_example_runs_unchanged(self, real: RealNode, compat: LocalNodePlugin, file: str) -> None:
        """NVIDIA's objects applied as they are (only the pod made runnable here); `nvidia.com/gpu: 1` in a pod's
        limits is served through DRA: the kubelet prepares the claim the scheduler made for it."""
        namespace = "compat-" + file.removesuffix(".yaml")
        objects = load_objects(COMPAT / file)
        pods, checked = run_and_check(real, compat, namespace, objects)
        pod = real.pod(namespace, pods[0])
        view = real.view(namespace, pods[0], "cuda")
        uids = checked[0].claim_uids
        if file == "extended-resource.yaml":
            assert "resourceClaims" not in pod["spec"]
            mapping, = pod["status"]["extendedResourceClaimStatus"]["requestMappings"]
            assert (mapping["containerName"], mapping["resourceName"]) == ("cuda", "nvidia.com/gpu")
            assert view.env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
        if file == "gpu-time-slicing.yaml":
            ts, = time_slices(compat, uids)
            assert ts["interval"] == "Long" and ts["gpuUuids"] == [view.env["NVIDIA_VISIBLE_DEVICES"]]
        if file == "mig-mps.yaml":
            assert view.env["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-") and checked[0].dynamic_mig
            assert view.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50", view.env
            assert view.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M", view.env
        finish(real, compat, namespace, pods, checked)
