"""The driver released and installed the way users install it, on a real node: `make release` of this tree into a
CNCF distribution registry (TLS, htpasswd basic authentication), `helm install oci://.../gpu-dra-driver --version`
with the registry's credentials in imagePullSecrets, the node's containerd pulling the image index from the
registry (nothing imported), and the DaemonSet's plugin pod running on a real kubelet v1.37 + containerd 2 + runc
with the node's GPUs simulated (the chart's simulatedFleet).

The local cluster runs with what a real cluster has and a kubelet-less one turns off: ServiceAccount admission (pods
get projected tokens through TokenRequest), the Node authorizer and NodeRestriction (the kubelet is
system:node:<name> with a client certificate), and webhooks called at their endpoints (no kube-proxy routes a
ClusterIP here; `--enable-aggregator-routing`). The chart is told the API server's address (k8sServiceHost and
k8sServicePort, as on kube-proxy-free clusters) and runs its pods in the node's network (no CNI).

Proven here: the release pushed one image index of linux/amd64 and linux/arm64 and a chart pinning it by digest,
refuses a version already pushed and a dirty tree, and its krew manifest names its archive where it is served; the
release's wheel, installed alone into a fresh virtualenv, gives `gpu-dra` and `kubectl gpu` that read this cluster;
the plugin pod runs from the pulled image, registers with the kubelet under socket names with its pod UID, and
publishes the node's slices; the controller and the webhook run, and the webhook pod refuses a bad claim; examples
run with their devices; the admission policy holds for the plugin's own projected token; `helm upgrade` to the next
release rolls the plugin onto the next image while running pods keep their devices and claims, and a later delete
unprepares; `helm uninstall` leaves no slices, classes or CDI specs behind. The tests run in file order on one
installation.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as kclient
from kubernetes import config as kconfig
from oci_registry import LocalRegistry
from realnode_helpers import EXAMPLES, RealNode, fleet_node, load_objects
from releaser import Releaser
from standin.workloads import wait_until
from test_realnode_examples import Checked, check_pod, finish

from api.names import DEFAULT_DRIVER_NAME
from kube.client import DEVICE_CLASSES, SLICES, ApiError, KubeApi
from kubeletplugin.transport.sockets import socket_paths
from testbed.helmchart import CHART, helm_binary
from testbed.hostplumbing import cgroup_dirs
from testbed.localcluster import free_port
from testbed.localnode import install_driver_root
from testbed.nodeplugin import LocalNodePlugin, NodePluginError

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RELEASE = "gpu-dra"
NAMESPACE = "gpu-dra"
FULLNAME = f"{RELEASE}-gpu-dra-driver"
DRIVER = DEFAULT_DRIVER_NAME
GPU_LABEL = {"nvidia.com/gpu.present": "true"}
PODS = "/api/v1/namespaces/{ns}/pods"
PULL_SECRET = "registry-credentials"
# The releases: the tree's version, then its next patch release for the upgrade.
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
NEXT_VERSION = ".".join([*VERSION.split(".")[:2], str(int(VERSION.split(".")[2]) + 1)])


class ChartPlugin(LocalNodePlugin):
    """The DaemonSet's plugin on the real node, seen from the host: its state directory (a hostPath at the same
    path), its metrics on the node's network (hostNetwork), its log from the kubelet's CRI log files. The kubelet
    runs the process; this class never starts or stops it."""

    def __init__(self, real: RealNode, metrics_port: int, driver_root: Path) -> None:
        # Not LocalNodePlugin.__init__: it makes directories for a process of its own.
        assert real.node is not None and real.kube is not None and real.fleet is not None
        self.real, self.node, self.kube = real, real.node, real.kube
        self.fleet = real.fleet
        self.driver = DRIVER
        self.extra_args, self.log_level, self.env = [], "info", {}
        self.state_dir = Path(self.node.plugins_dir) / DRIVER   # the chart's default: the plugin directory
        self.base = self.state_dir                              # MPS daemons' environment names it
        self.driver_root = driver_root
        self.metrics_port = metrics_port
        self.proc, self.starts = None, 0

    def start(self) -> "ChartPlugin":
        raise NodePluginError("the kubelet runs the chart's plugin")

    def pod(self) -> dict[str, Any] | None:
        """The DaemonSet's current pod (not one being deleted)."""
        pods = self.kube.list(PODS.format(ns=NAMESPACE), label_selector="app.kubernetes.io/component=kubelet-plugin")
        live = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
        return live[0] if live else None

    def running_pod(self) -> dict[str, Any]:
        pod = self.pod()
        if pod is None or pod["status"].get("phase") != "Running" or not all(
                "running" in (s.get("state") or {}) for s in pod["status"].get("containerStatuses") or [{}]):
            status = json.dumps((pod or {}).get("status"))[:1500]
            raise NodePluginError(f"the chart's plugin pod is not running: {status}\n--- plugin log ---\n"
                                  f"{self.log_tail()}")
        return pod

    def check_alive(self) -> None:
        self.running_pod()

    def log_tail(self, lines: int = 40) -> str:
        pod = self.pod()
        if pod is None:
            return "(no plugin pod)"
        try:
            text = self.node.container_log(NAMESPACE, pod["metadata"]["name"], "plugin")
        except Exception as exc:  # noqa: BLE001 - only for messages
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def sockets(self) -> list[Path]:
        """The plugin sockets in the kubelet's registry directory and in the plugin directory (only this driver registers here)."""
        return sorted([*Path(self.node.plugins_registry_dir).glob("*-reg.sock"),
                       *self.state_dir.glob("dra*.sock")])


class Installation:
    """The cluster, the node and the chart's release; with `releaser`, the registry the chart and image came from
    and `released`, the first release's dist/release-<version>.json. `image` is what the chart's pods run."""

    def __init__(self, real: RealNode, image: str, values: Path, plugin: ChartPlugin, controller_port: int,
                 webhook_port: int, releaser: Releaser | None = None, released: dict[str, Any] | None = None) -> None:
        self.real, self.image, self.values, self.plugin = real, image, values, plugin
        self.controller_port, self.webhook_port = controller_port, webhook_port
        self._releaser, self._released = releaser, released

    @property
    def kube(self) -> KubeApi:
        assert self.real.kube is not None
        return self.real.kube

    @property
    def releaser(self) -> Releaser:
        assert self._releaser is not None, "installed from the checkout, not from a release"
        return self._releaser

    @property
    def released(self) -> dict[str, Any]:
        assert self._released is not None, "installed from the checkout, not from a release"
        return self._released

    def helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Helm on this cluster and the chart's namespace; with the registry's credentials and CA."""
        assert self.real.cluster is not None
        registry = self._releaser.registry.client_env() if self._releaser else {}
        return subprocess.run([helm_binary(), *args, "--kubeconfig", str(self.real.cluster.kubeconfig),
                               "--namespace", NAMESPACE], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **registry})

    def component_pod(self, component: str, timeout: float = 60.0, ready: bool = False) -> dict[str, Any]:
        """The running (and, with `ready`, Ready) pod of a chart component, on the real node."""
        assert self.real.node is not None
        node = self.real.node

        def running() -> dict[str, Any] | None:
            node.check_running()
            for pod in self.kube.list(PODS.format(ns=NAMESPACE),
                                      label_selector=f"app.kubernetes.io/component={component}")["items"]:
                conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
                if pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp") \
                        and (not ready or conditions.get("Ready") == "True"):
                    return pod
            return None

        try:
            return wait_until(running, timeout, f"a running {component} pod")
        except AssertionError as exc:
            pods = self.kube.list(PODS.format(ns=NAMESPACE))["items"]
            events = {p["metadata"]["name"]: self.real.events(NAMESPACE, p["metadata"]["name"]) for p in pods}
            raise AssertionError(f"{exc}\npods: {json.dumps({n: p['status'] for n, p in zip(events, pods)})[:3000]}\n"
                                 f"events: {events}\n{node.logs_tail(15)}") from None


def chart_values(real: RealNode, image: dict[str, Any], plugin_port: int, controller_port: int, webhook_port: int,
                 driver_root: Path) -> dict[str, Any]:
    """The values for this cluster: the image's (the registry's credentials, or an imported image never pulled),
    the API server's address, the node's network, paths under the node's kubelet root and CDI directory, the
    simulated fleet for the node."""
    assert real.node is not None and real.cluster is not None
    on_the_node = {"kubernetes.io/hostname": real.node.name}
    return {
        **image,
        # No kube-proxy: the `kubernetes` Service's ClusterIP goes nowhere; the API server listens on loopback,
        # which pods in the node's network reach.
        "k8sServiceHost": "127.0.0.1", "k8sServicePort": real.cluster.ports["apiserver"],
        "kubeletDir": str(real.node.root_dir), "cdiRoot": str(real.node.cdi_dirs[0]), "driverRoot": str(driver_root),
        # As in deploy/kind/values-simulated.yaml: the node's policy in its fleet entry, no nodePolicy.
        "simulatedFleet": {"nodes": [fleet_node(real.node.name)]},
        # Ports are node ports with hostNetwork: free ones of this host.
        "kubeletPlugin": {"hostNetwork": True, "metricsPort": plugin_port, "nodeSelector": GPU_LABEL},
        "controller": {"hostNetwork": True, "metricsPort": controller_port, "nodeSelector": on_the_node},
        # One replica: two would need the same node port on the one node.
        "webhook": {"hostNetwork": True, "port": webhook_port, "replicas": 1, "nodeSelector": on_the_node},
        # The chart's mechanism with a cgroup under the node's own cgroup root instead of the host's top level
        # (the default gpu-dra-mps), so that stopping the node removes it with everything else it made.
        "mps": {"daemonCgroup": mps_cgroup(real)},
    }


def mps_cgroup(real: RealNode) -> str:
    """The cgroup, below the host's cgroup root, that the chart's plugin moves MPS daemons into."""
    assert real.node is not None
    return f"{real.node.cgroup_root.strip('/')}/gpu-dra-mps"


def build_image() -> tuple[str, Path]:
    """(name:tag, archive) of `make image`: hack/build-image.py reports them on its last line (cached: under a
    second when nothing changed, about 30 s cold)."""
    proc = subprocess.run([sys.executable, str(REPO / "hack" / "build-image.py"), "build"], capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "IMAGE_TAG": "", "IMAGE_REPOSITORY": ""})
    assert proc.returncode == 0, f"hack/build-image.py build failed:\n{proc.stderr[-3000:]}"
    name, path = proc.stdout.strip().splitlines()[-1].split()
    return name, Path(path)


@contextmanager
def installation(workdir: Path, from_release: bool = True) -> Iterator[Installation]:
    """The chart installed on a real node. From a release: `make release` into a registry with TLS and basic
    authentication, `helm install oci://...`, containerd pulls the image with the chart's imagePullSecrets. Else
    from the checkout: `make image`'s archive imported into the node's containerd, as `kind load image-archive`
    does, and deploy/helm/gpu-dra-driver."""
    t0 = time.monotonic()
    registry: LocalRegistry | None = None
    releaser: Releaser | None = None
    released: dict[str, Any] | None = None
    real: RealNode | None = None
    try:
        if from_release:
            registry = LocalRegistry(workdir / "registry").start()
            releaser = Releaser(registry, workdir)
            released = releaser.release(VERSION)
            image = str(released["image"]["reference"])
            print(f"\nregistry and make release {VERSION}: {time.monotonic() - t0:.1f}s")
        else:
            image, archive = build_image()
        # The node's containerd trusts the registry's CA (containerd's hosts.toml), as a node trusts its
        # registry's; the credentials come with each pull, from the pods' imagePullSecrets.
        real = RealNode(cluster_options={"service_accounts": True, "node_authorization": True,
                                         "endpoint_routing": True}, labels=GPU_LABEL,
                        node_options={"registry_cas": {registry.host: registry.ca}} if registry else {}).start()
        assert real.node is not None and real.node.workdir is not None and real.kube is not None
        node = real.node
        if registry:
            assert not [n for n in node.ctr("images", "ls", "-q").stdout.split() if registry.host in n], \
                "the node has the driver's image before the install"
            image_values: dict[str, Any] = {"imagePullSecrets": [{"name": PULL_SECRET}]}
        else:
            node.ctr("images", "import", "--snapshotter", node.snapshotter, str(archive), timeout=180)
            assert image in node.ctr("images", "ls", "-q").stdout.split()
            repository, tag = image.rsplit(":", 1)
            image_values = {"image": {"repository": repository, "tag": tag, "pullPolicy": "Never"}}
        # The simulated node's driver files: the CUDA stand-in, laid out as a host driver install.
        driver_root = node.workdir / "driver-root"
        driver_root.mkdir()
        assert real.fleet is not None
        install_driver_root(driver_root, node.bin_dir, "host", fleet=real.fleet, node_name=node.name)
        # The chart mounts the driver root with HostToContainer propagation, which containerd allows only from a
        # shared or slave mount, as / is on systemd hosts; here / is private. Node.stop unmounts it.
        for argv in (["mount", "--bind", driver_root, driver_root], ["mount", "--make-shared", driver_root]):
            subprocess.run(argv, check=True, capture_output=True)
        ports = (free_port(), free_port(), free_port())
        values = node.workdir / "values.yaml"
        values.write_text(yaml.safe_dump(chart_values(real, image_values, *ports, driver_root), sort_keys=False))
        real.namespace(NAMESPACE)
        if registry:
            # The pull secret, as `kubectl create secret docker-registry` makes it, in the release's namespace.
            real.kube.create(f"/api/v1/namespaces/{NAMESPACE}/secrets", {
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": PULL_SECRET},
                "type": "kubernetes.io/dockerconfigjson",
                "stringData": {".dockerconfigjson": json.dumps(registry.docker_config())}})
        inst = Installation(real, image, values, ChartPlugin(real, ports[0], driver_root), ports[1], ports[2],
                            releaser, released)
        chart = [releaser.chart, "--version", VERSION] if releaser else [str(CHART)]
        proc = inst.helm("install", RELEASE, *chart, "-f", str(values))
        assert proc.returncode == 0, proc.stderr
        print(f"\n+ cluster, node and helm install of {chart[0]}: {time.monotonic() - t0:.1f}s")
        yield inst
    finally:
        try:
            if real is not None and real.cluster is not None and real.kube is not None:
                subprocess.run([helm_binary(), "uninstall", RELEASE, "--kubeconfig", str(real.cluster.kubeconfig),
                                "--namespace", NAMESPACE, "--ignore-not-found"], capture_output=True, timeout=120)
        finally:
            try:
                if real is not None:
                    real.stop()
            finally:
                if releaser is not None:
                    releaser.stop()
                if registry is not None:
                    registry.stop()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installation]:
    with installation(tmp_path_factory.mktemp("release")) as inst:
        yield inst


def token_client(real: RealNode, token: str) -> KubeApi:
    assert real.cluster is not None
    conf = kclient.Configuration()
    conf.host = real.cluster.server
    conf.ssl_ca_cert = str(real.cluster.ca_file)
    conf.api_key = {"authorization": f"Bearer {token}"}
    return KubeApi(kclient.ApiClient(conf))


def claims_of(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


# ---- the local cluster's options ------------------------------------------------------------------


def test_the_kubelet_is_its_node_and_may_change_only_that_node(installed: Installation) -> None:
    """Node authorizer and NodeRestriction: the kubelet's identity is system:node:<name>; it may patch its own Node
    but not another one, nor set a node-restriction.kubernetes.io label (both refusals are NodeRestriction's)."""
    cluster, node = installed.real.cluster, installed.real.node
    assert cluster is not None and node is not None
    kubeconfig = cluster.node_kubeconfig(node.name)
    whoami = json.loads(cluster.kubectl("auth", "whoami", "-o", "json", "--kubeconfig", str(kubeconfig)).stdout)
    assert whoami["status"]["userInfo"]["username"] == f"system:node:{node.name}"
    assert "system:nodes" in whoami["status"]["userInfo"]["groups"]
    kubelet = KubeApi(kconfig.new_client_from_config(config_file=str(kubeconfig)))
    other = "restricted-node-b"
    cluster.add_node(other)

    def label(name: str, key: str) -> dict[str, Any]:
        return kubelet.request("PATCH", f"/api/v1/nodes/{name}", body={"metadata": {"labels": {key: "kubelet"}}},
                               content_type="application/merge-patch+json")

    try:
        label(node.name, "example.com/patched-by")
        with pytest.raises(ApiError, match=f'node "{node.name}" is not allowed to modify node "{other}"'):
            label(other, "example.com/patched-by")
        with pytest.raises(ApiError, match="is not allowed to modify labels: node-restriction.kubernetes.io/x"):
            label(node.name, "node-restriction.kubernetes.io/x")
    finally:
        cluster.delete_node(other)
        kubelet.api_client.close()


# ---- the release --------------------------------------------------------------------------------


def crane(installed: Installation, *args: str) -> subprocess.CompletedProcess[str]:
    binary = subprocess.run(["bash", str(REPO / "hack" / "build-oci-tools.sh"), "crane"], capture_output=True,
                            text=True, check=True).stdout.strip().splitlines()[-1]
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **installed.releaser.registry.client_env()})


def test_the_release_pushed_an_index_of_both_platforms_and_a_chart_pinning_it(installed: Installation) -> None:
    releaser = installed.releaser
    repository, digest = installed.image.split("@")
    assert repository == f"{releaser.image}:{VERSION}"
    proc = crane(installed, "manifest", f"{releaser.image}:{VERSION}")
    assert proc.returncode == 0, proc.stderr
    assert "sha256:" + hashlib.sha256(proc.stdout.encode()).hexdigest() == digest
    index = json.loads(proc.stdout)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert sorted(m["platform"]["architecture"] for m in index["manifests"]) == ["amd64", "arm64"]
    proc = installed.helm("show", "chart", releaser.chart, "--version", VERSION)
    assert proc.returncode == 0, proc.stderr
    chart = yaml.safe_load(proc.stdout)
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    assert chart["annotations"] == {"gpu.dra-driver.io/image-digest": digest}
    assert installed.released["chart"]["reference"] == releaser.chart
    assert sorted(installed.released["files"]) == sorted([
        f"gpu_dra_driver-{VERSION}-py3-none-any.whl", f"gpu_dra_driver-{VERSION}.tar.gz",
        f"gpu-dra-driver-{VERSION}.tgz", f"kubectl-gpu-{VERSION}.tar.gz", f"krew-gpu-{VERSION}.yaml"])


def test_a_version_already_pushed_is_refused(installed: Installation) -> None:
    proc = installed.releaser.make_release(VERSION)
    assert proc.returncode != 0
    assert f"the chart {VERSION} is already in oci://{installed.releaser.chart[6:]}" in proc.stderr, proc.stderr


def test_a_dirty_tree_is_refused(installed: Installation) -> None:
    untracked = installed.releaser.repo / "api" / "scratch.py"
    untracked.write_text("")
    try:
        proc = installed.releaser.make_release(NEXT_VERSION)
    finally:
        untracked.unlink()
    assert proc.returncode != 0 and "the tree is not clean (api/scratch.py" in proc.stderr, proc.stderr


def test_the_krew_manifest_names_the_archive_where_it_is_published(installed: Installation) -> None:
    dist = installed.releaser.dist
    manifest = yaml.safe_load((dist / f"krew-gpu-{VERSION}.yaml").read_text())
    assert manifest["spec"]["version"] == f"v{VERSION}"
    uris = {p["uri"] for p in manifest["spec"]["platforms"]}
    assert uris == {f"{installed.releaser.url}/kubectl-gpu-{VERSION}.tar.gz"}
    with urllib.request.urlopen(uris.pop(), timeout=10) as resp:
        served = resp.read()
    assert {p["sha256"] for p in manifest["spec"]["platforms"]} == {hashlib.sha256(served).hexdigest()}


# ---- install --------------------------------------------------------------------------------------


def test_the_plugin_pod_runs_the_pulled_image_registers_and_publishes(installed: Installation) -> None:
    plugin, node = installed.plugin, installed.real.node
    assert node is not None
    pod = installed.component_pod("kubelet-plugin", timeout=180)
    assert pod["spec"]["nodeName"] == node.name
    # The chart's own image, pinned by the release's digest, pulled with the chart's imagePullSecrets.
    assert pod["spec"]["containers"][0]["image"] == installed.image
    assert pod["spec"]["imagePullSecrets"] == [{"name": PULL_SECRET}]
    status, = pod["status"]["containerStatuses"]
    repository = installed.image.split("@")[0].rsplit(":", 1)[0]
    assert status["imageID"] == f"{repository}@{installed.image.split('@')[1]}"
    # The kubelet pulled it from the registry (the node had no such image before the install).
    events = "\n".join(installed.real.events(NAMESPACE, p["metadata"]["name"])
                       for p in installed.kube.list(PODS.format(ns=NAMESPACE))["items"])
    assert f'Pulled: Successfully pulled image "{installed.image}"' in events, events
    try:
        plugin.wait_registered(60)
    except NodePluginError as exc:
        pytest.fail(str(exc), pytrace=False)
    # Rolling-update socket names: both carry the pod's UID.
    uid = pod["metadata"]["uid"]
    expected = socket_paths(DRIVER, node.plugins_registry_dir, plugin.state_dir, uid)
    assert plugin.sockets() == sorted([expected.registration, expected.dra])
    devices = installed.real.devices(plugin)
    kinds = {a["type"] for a in devices.values()}
    assert kinds == {"gpu", "mig", "slot", "shared"}, kinds
    assert plugin.sim_state.is_file(), "the simulated GPUs keep their state in the hostPath state directory"


def test_the_controller_and_the_webhook_run(installed: Installation) -> None:
    installed.component_pod("controller")
    with urllib.request.urlopen(f"http://127.0.0.1:{installed.controller_port}/healthz", timeout=5) as resp:
        assert resp.status == 200
    webhook = installed.component_pod("webhook", ready=True)
    classes = [c["metadata"]["name"] for c in installed.kube.list(DEVICE_CLASSES)["items"]]
    assert len([c for c in classes if c.endswith(DRIVER)]) == 8, classes

    def endpoints() -> list[str]:
        slices = installed.kube.list(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices",
                                     label_selector=f"kubernetes.io/service-name={FULLNAME}-webhook")["items"]
        return [a for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")
                for a in e["addresses"]]

    # The API server calls the webhook at this address (endpoint routing): the pod's, which is the node's.
    assert wait_until(endpoints, 30, "the webhook's ready endpoint") == [webhook["status"]["podIP"]]


def test_a_claim_with_a_bad_config_is_refused_by_the_webhook_pod(installed: Installation, tmp_path: Path) -> None:
    cluster = installed.real.cluster
    assert cluster is not None
    template, _pod = load_objects(EXAMPLES / "mps-slot" / "claim.yaml")
    template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["mps"][
        "activeThreadPercentage"] = 150
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(template))
    installed.real.namespace("bad-config")
    proc = cluster.kubectl("apply", "-n", "bad-config", "-f", str(path), check=False)
    assert proc.returncode != 0
    assert f'admission webhook "resourceclaimtemplates.{DRIVER}" denied the request' in proc.stderr, proc.stderr
    assert "spec.spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentage: must be between 1 " \
           "and 100, got 150" in proc.stderr, proc.stderr
    # The valid example is admitted.
    proc = cluster.kubectl("apply", "-n", "bad-config", "-f", str(EXAMPLES / "mps-slot" / "claim.yaml"),
                           "--dry-run=server", check=False)
    assert proc.returncode == 0, proc.stderr


# ---- workloads ------------------------------------------------------------------------------------


def run_example(installed: Installation, example: str, prefix: str = "chart") -> tuple[str, list[str], list[Checked]]:
    namespace = f"{prefix}-{example}"
    installed.real.namespace(namespace)
    pods = installed.real.apply(namespace, load_objects(EXAMPLES / example / "claim.yaml"))
    for pod in pods:
        installed.real.wait_running(namespace, pod)
    return namespace, pods, [check_pod(installed.real, installed.plugin, namespace, p) for p in pods]


@pytest.mark.parametrize("example", ["gpu-by-family", "mps-slot"])
def test_an_example_runs_with_its_devices(installed: Installation, example: str) -> None:
    namespace, pods, checked = run_example(installed, example)
    finish(installed.real, installed.plugin, namespace, pods, checked)


# What a fresh virtualenv holds after `pip install` of the wheel: gpu-dra-driver and what its requirements need,
# their markers evaluated (extras, such as dev, left out). pip's own packaging reads them.
CLOSURE = """
import importlib.metadata as md, json
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name as name
need, todo = set(), ["gpu-dra-driver"]
while todo:
    dist = name(todo.pop())
    if dist in need:
        continue
    need.add(dist)
    for r in map(Requirement, md.requires(dist) or []):
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            todo.append(r.name)
installed = {name(d.metadata["Name"]) for d in md.distributions()} - {"pip", "setuptools"}
print(json.dumps({"need": sorted(need), "installed": sorted(installed)}))
"""


def test_the_released_wheel_alone_gives_gpu_dra_and_kubectl_gpu(installed: Installation, tmp_path: Path) -> None:
    """`pip install dist/gpu_dra_driver-X.Y.Z-py3-none-any.whl` into a fresh virtualenv: only the runtime
    dependencies, and `gpu-dra` and `kubectl gpu` (kubectl finds kubectl-gpu on PATH) read this cluster."""
    real = installed.real
    assert real.cluster is not None and real.node is not None
    wheel = installed.releaser.dist / f"gpu_dra_driver-{VERSION}-py3-none-any.whl"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    proc = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                           str(wheel)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "KUBECONFIG": str(real.cluster.kubeconfig), "HOME": str(tmp_path)}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)

    deps = json.loads(run(str(venv / "bin/python"), "-c", CLOSURE).stdout)
    assert deps["installed"] == deps["need"], deps
    assert not {"pytest", "mypy", "ruff", "grpcio-tools", "hypothesis"} & set(deps["installed"])
    assert run(str(venv / "bin/gpu-dra"), "--version").stdout.strip() == f"gpu-dra {VERSION}"
    where = run(str(venv / "bin/python"), "-c", "import cli; print(cli.__file__)").stdout
    assert where.startswith(str(venv)), where           # the wheel's code, not the checkout's
    namespace, pods, checked = run_example(installed, "gpu-by-family", "pip")
    kubectl = str(real.cluster.bin_dir / "kubectl")
    for argv in ([str(venv / "bin/gpu-dra"), "status", real.node.name], [kubectl, "gpu", "status", real.node.name]):
        proc = run(*argv)
        assert proc.returncode == 0 and pods[0] in proc.stdout and real.node.name in proc.stdout, \
            f"{argv[1:]}: {proc.stdout}{proc.stderr}"
    proc = run(kubectl, "gpu", "explain", f"pod/{pods[0]}", "-n", namespace)
    assert proc.returncode == 0 and real.node.name in proc.stdout, proc.stdout + proc.stderr
    finish(real, installed.plugin, namespace, pods, checked)


def test_the_admission_policy_holds_for_the_plugins_own_token(installed: Installation) -> None:
    """The DaemonSet pod's projected token (read on the host, where the kubelet wrote it) is bound to the pod and
    its node: with it, the plugin may write its own node's slices and no other's, and only in its own pool and
    under its own driver name."""
    real, plugin = installed.real, installed.plugin
    assert real.node is not None and real.cluster is not None
    pod = plugin.running_pod()
    tokens = list((Path(real.node.root_dir) / "pods" / pod["metadata"]["uid"] / "volumes").glob(
        "kubernetes.io~projected/kube-api-access-*/token"))
    assert len(tokens) == 1, tokens
    token = tokens[0].read_text()
    claims = claims_of(token)["kubernetes.io"]
    assert (claims["serviceaccount"]["name"], claims["node"]["name"], claims["pod"]["uid"]) == (
        f"{FULLNAME}-kubelet-plugin", real.node.name, pod["metadata"]["uid"])
    a, b, other = real.node.name, "policy-node-b", "other.example.com"
    as_plugin = token_client(real, token)
    real.cluster.add_node(b)
    try:
        theirs = installed.kube.create(SLICES, slice_body(f"{b}-by-admin", b, b, DRIVER))
        own = as_plugin.create(SLICES, slice_body(f"{a}-extra", a, a, DRIVER))
        as_plugin.delete(SLICES, own["metadata"]["name"])
        for name, node, pool, driver, says in (
                (f"{a}-on-b", b, b, DRIVER, f"may only write ResourceSlices of its own node, not slices of node {b}"),
                (f"{a}-in-b", a, b, DRIVER, f"may only write ResourceSlices of pool {a} (its node), not of pool {b}"),
                (f"{a}-other", a, a, other, f"may only write ResourceSlices of that driver, not of driver {other}")):
            assert says in refused(lambda: as_plugin.create(SLICES, slice_body(name, node, pool, driver)))
        theirs["metadata"]["labels"] = {"changed-by": a}
        refused(lambda: as_plugin.replace(SLICES, theirs))
        refused(lambda: as_plugin.delete(SLICES, theirs["metadata"]["name"]))
        assert installed.kube.get(f"{SLICES}/{b}-by-admin")["metadata"].get("labels") is None
    finally:
        installed.kube.request("DELETE", f"{SLICES}/{b}-by-admin")
        real.cluster.delete_node(b)
        as_plugin.api_client.close()


def slice_body(name: str, node: str, pool: str, driver: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}]}}


def refused(call: Any) -> str:
    """The message of the admission policy's refusal (422 Invalid, naming the ValidatingAdmissionPolicy)."""
    with pytest.raises(ApiError) as err:
        call()
    assert err.value.status == 422 and "ValidatingAdmissionPolicy" in err.value.message, err.value
    return err.value.message


# ---- upgrade and uninstall ------------------------------------------------------------------------


def cgroups_of(pid: int) -> dict[str, str]:
    """Hierarchy (its controllers; "" for cgroup v2's) -> the process's cgroup, as the host sees it."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        out[controllers] = path
    return out


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot: with the PID, it names one process (no PID reuse)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[19])


def process_status(pid: int) -> str:
    """State and parent of a process, for messages."""
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":\t" in line)
        ppid = status["PPid"].strip()
        parent = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        return f"pid {pid}: {status['State'].strip()}, parent {ppid} ({parent[:200]})"
    except OSError as err:
        return f"pid {pid}: {err}"


def alive(pid: int, born: int) -> bool:
    """The process that started at `born` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()
    return int(fields[19]) == born and fields[0] != "Z"


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


def compute_mode(installed: Installation, gpu_uuid: str) -> str:
    """The simulated GPU's compute mode, as the plugin left it in the node's state file."""
    nvml = installed.real.hardware(installed.plugin)
    mode = nvml.nvmlDeviceGetComputeMode(nvml.nvmlDeviceGetHandleByUUID(gpu_uuid))
    names = {nvml.NVML_COMPUTEMODE_DEFAULT: "DEFAULT", nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS"}
    return names.get(mode, str(mode))


def test_helm_upgrade_to_the_next_release_rolls_the_plugin_and_running_pods_keep_their_devices(installed: Installation) -> None:
    """... and MPS clients keep their daemon: the chart's plugin moved it out of its container's cgroup (into
    `mps.daemonCgroup`) and runs in the host's PID namespace, so replacing the plugin pod does not end it; the new
    plugin takes it over untouched and stops it with its last claim."""
    real, plugin, node = installed.real, installed.plugin, installed.real.node
    assert node is not None
    running = [run_example(installed, e, "upgrade") for e in ("mig-partition", "time-slicing-slot", "mps-slot")]
    containers = {(ns, p): node.container_ids(ns, p) for ns, pods, _ in running for p in pods}
    old = plugin.running_pod()
    slices_before = {d: a for d, a in real.devices(plugin).items()}
    # The mps-slot pod's daemon, started by the chart's plugin: in the cgroup the chart names, in every hierarchy,
    # and so in none of the plugin container's cgroups; its GPU in EXCLUSIVE_PROCESS.
    daemons = plugin.mps_daemons()
    assert len(daemons) == 1, daemons
    (daemon, pipe), = daemons.items()
    born = start_time(daemon)
    gpu = environ_of(daemon)["CUDA_VISIBLE_DEVICES"]
    assert compute_mode(installed, gpu) == "EXCLUSIVE_PROCESS"
    plugin_container = node.container_ids(NAMESPACE, old["metadata"]["name"])["plugin"]
    plugin_cgroups = cgroups_of(node.running_tasks()[plugin_container])
    assert any(plugin_container in c for c in plugin_cgroups.values()), plugin_cgroups
    expected_cgroups = {h: f"/{mps_cgroup(real)}" for h in plugin_cgroups}
    assert cgroups_of(daemon) == expected_cgroups, (cgroups_of(daemon), plugin_cgroups)

    t0 = time.monotonic()
    upgrade = installed.releaser.release(NEXT_VERSION)["image"]["reference"]
    print(f"\nmake release {NEXT_VERSION} (pods running): {time.monotonic() - t0:.1f}s")
    # --reuse-values keeps this installation's values; the next chart's own pinned image comes with it.
    proc = installed.helm("upgrade", RELEASE, installed.releaser.chart, "--version", NEXT_VERSION, "--reuse-values")
    assert proc.returncode == 0, proc.stderr

    def rolled() -> dict[str, Any] | None:
        pod = plugin.pod()
        if pod is None or pod["metadata"]["uid"] == old["metadata"]["uid"] or pod["status"].get("phase") != "Running":
            return None
        return pod

    new = wait_until(rolled, 180, "the DaemonSet's new plugin pod")
    # The next release's image, pulled: another digest.
    assert new["spec"]["containers"][0]["image"] == upgrade
    upgrade_id = f"{upgrade.split('@')[0].rsplit(':', 1)[0]}@{upgrade.split('@')[1]}"
    assert new["status"]["containerStatuses"][0]["imageID"] == upgrade_id
    assert old["status"]["containerStatuses"][0]["imageID"] != upgrade_id
    try:
        plugin.wait_registered(60)
    except NodePluginError as exc:
        pytest.fail(str(exc), pytrace=False)
    expected = socket_paths(DRIVER, node.plugins_registry_dir, plugin.state_dir, new["metadata"]["uid"])
    wait_until(lambda: plugin.sockets() == sorted([expected.registration, expected.dra]), 30,
               f"only the new pod's sockets (now: {plugin.sockets()})")
    assert real.devices(plugin).keys() == slices_before.keys()
    # The webhook rolls too, although its one replica holds the node port (no surge pod with hostNetwork).
    def webhook_images() -> list[tuple[str, bool]]:
        pods = installed.kube.list(PODS.format(ns=NAMESPACE), label_selector="app.kubernetes.io/component=webhook")
        return [(p["spec"]["containers"][0]["image"], any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or []))
            for p in pods["items"]]

    wait_until(lambda: webhook_images() == [(upgrade, True)], 120,
               f"the webhook to run the new image alone (now: {webhook_images()})")

    # The MPS daemon ran through it: the same process, still outside any container's cgroup, while the old plugin
    # container's cgroups are gone; the new plugin took it over (it restarted none) and the GPU stayed exclusive.
    assert plugin.mps_daemons() == {daemon: pipe}
    assert start_time(daemon) == born and cgroups_of(daemon) == expected_cgroups
    wait_until(lambda: not [d for d in cgroup_dirs(node.cgroup_root) if plugin_container in d.name], 30,
               "the old plugin container's cgroups to be removed")
    assert compute_mode(installed, gpu) == "EXCLUSIVE_PROCESS"
    assert "restarting it" not in plugin.log_tail(1000), plugin.log_tail(1000)

    # The pods ran through it: same containers, never restarted, their tasks still running in containerd.
    tasks = node.running_tasks()
    for (ns, name), ids in containers.items():
        pod = real.pod(ns, name)
        assert pod["status"]["phase"] == "Running" and node.container_ids(ns, name) == ids
        assert all(s["restartCount"] == 0 for s in pod["status"]["containerStatuses"])
        assert set(ids.values()) <= set(tasks), (ids, tasks)
    # ... and still see their devices; deleting them now makes the new plugin unprepare what the old one prepared.
    for ns, pods, checked in running:
        assert [check_pod(real, plugin, ns, p).claim_uids for p in pods] == [c.claim_uids for c in checked]
    for ns, pods, _ in running[:-1]:
        for pod_name in pods:
            real.delete_pod(ns, pod_name)
    ns, pods, _ = running[-1]
    assert plugin.mps_daemons() == {daemon: pipe}   # the MPS pod's claim still holds it
    # The last unprepare stops the daemon (finish: no daemon, no MPS directory left) and gives the GPU its mode back.
    finish(real, plugin, ns, pods, [c for _, _, checked in running for c in checked])
    assert not alive(daemon, born), process_status(daemon)
    assert compute_mode(installed, gpu) == "DEFAULT"


def test_helm_uninstall_leaves_no_slices_classes_or_cdi_specs(installed: Installation) -> None:
    real, plugin = installed.real, installed.plugin
    assert real.cluster is not None
    proc = installed.helm("uninstall", RELEASE)
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in installed.kube.list(DEVICE_CLASSES)["items"] if c["metadata"]["name"].endswith(DRIVER)]
    for kind, name in (("validatingwebhookconfiguration", f"{FULLNAME}-webhook"),
                       ("validatingadmissionpolicy", f"{FULLNAME}-resourceslices"),
                       ("clusterrole", f"{FULLNAME}-kubelet-plugin")):
        assert real.cluster.kubectl("get", kind, name, check=False).returncode != 0, f"{kind} {name} left behind"
    wait_until(lambda: not installed.kube.list(PODS.format(ns=NAMESPACE))["items"], 60, "the chart's pods to be gone")
    assert plugin.sockets() == [], "the plugin's sockets are left behind"
    # The kubelet wipes the slices of a driver whose plugin has been gone for 30 s (its wiping delay).
    t0 = time.monotonic()
    wait_until(lambda: not installed.kube.list(SLICES, field_selector=f"spec.driver={DRIVER}")["items"], 60,
               "the kubelet to wipe the driver's ResourceSlices")
    print(f"\nslices wiped {time.monotonic() - t0:.1f}s after the plugin pod was gone")
    assert real.cdi_files() == [], "CDI specs left behind"
