"""Fixtures of the kubelet-plugin end-to-end tests: the API, a namespace of the test's own with its driver's
DeviceClasses, and simulated nodes running ``gpu-dra kubelet-plugin`` with a kubelet stand-in.

A test module in NVIDIA compatibility mode overrides ``compat_nvidia`` to return True: its plugins then run
with ``--compat-nvidia`` under NVIDIA's driver name, and its namespaces rely on the compatibility DeviceClasses.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from standin.node import SimulatedNode
from standin.workloads import apply_device_classes, create_namespace

from api.deviceclasses import device_classes
from api.names import NVIDIA_DRIVER_NAME
from kube.client import DEVICE_CLASSES, ApiError, KubeApi


@pytest.fixture
def kube(api_client: Any) -> KubeApi:
    return KubeApi(api_client)


@pytest.fixture
def compat_nvidia() -> bool:
    """Whether the test's plugin runs in NVIDIA compatibility mode; a module that tests that mode overrides it."""
    return False


@pytest.fixture
def plugin_driver(driver_name: str, compat_nvidia: bool) -> str:
    """The driver name the test's plugin runs under: NVIDIA's in compatibility mode, else the test's own."""
    return NVIDIA_DRIVER_NAME if compat_nvidia else driver_name


@pytest.fixture
def name_prefix(request: pytest.FixtureRequest, driver_name: str) -> str:
    """A prefix for the test's namespace and node names: the first label of its own driver name (no other test
    has it, even where the plugin runs under NVIDIA's name) and the module's topic, e.g. ``t7-crash``."""
    module = request.module.__name__.rpartition(".")[2]
    topic = module.removeprefix("test_").removeprefix("plugin_").replace("_", "-")
    return f"{driver_name.split('.')[0]}-{topic}"


@pytest.fixture(scope="module")
def nvidia_classes(api_client: Any) -> Iterator[dict[str, dict[str, Any]]]:
    """The compatibility-mode DeviceClasses, as a cluster admin installs them (and removes them after)."""
    kube = KubeApi(api_client)
    classes = {c["metadata"]["name"]: c for c in device_classes(compat_nvidia=True)}
    for cls in classes.values():
        try:
            kube.create(DEVICE_CLASSES, cls)
        except ApiError as exc:
            if not exc.conflict:
                raise
    yield classes
    for name in classes:
        try:
            kube.request("DELETE", f"{DEVICE_CLASSES}/{name}")
        except ApiError as exc:
            if not exc.not_found:
                raise


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kube: KubeApi, driver_name: str, compat_nvidia: bool,
              name_prefix: str) -> Iterator[str]:
    """A namespace of the test's own and the DeviceClasses its claims name; the namespace is deleted after."""
    create_namespace(kube, name_prefix)
    if compat_nvidia:
        request.getfixturevalue("nvidia_classes")
    else:
        apply_device_classes(kube, driver_name)
    yield name_prefix
    kube.request("DELETE", f"/api/v1/namespaces/{name_prefix}")


MakeNode = Callable[..., SimulatedNode]


@pytest.fixture
def make_node(cluster: Any, api_client: Any, plugin_driver: str, compat_nvidia: bool,
              name_prefix: str) -> Iterator[MakeNode]:
    """``make_node(gpus, policy=None, *, start=True, **kw)``: a simulated node of the test's own running
    ``gpu-dra kubelet-plugin`` and a kubelet stand-in, started unless ``start`` is False; ``kw`` goes to
    SimulatedNode. Every node made is stopped after the test."""
    nodes: list[SimulatedNode] = []

    def make(gpus: list[dict[str, Any]], policy: dict[str, Any] | None = None, *, start: bool = True,
             **kw: Any) -> SimulatedNode:
        name = f"{name_prefix}-node"
        spec: dict[str, Any] = {"name": name, "gpus": gpus}
        if policy is not None:
            spec["policy"] = policy
        if compat_nvidia:
            kw["extra_args"] = ("--compat-nvidia", *kw.get("extra_args", ()))
        node = SimulatedNode(cluster, api_client, name=name, driver=plugin_driver, fleet={"nodes": [spec]}, **kw)
        nodes.append(node)
        return node.start() if start else node

    yield make
    for node in nodes:
        node.stop()
