"""The chart installs the image's nvidia-cdi-hook on each node and hands its host path to the plugin, or mounts and
passes the one cdiHookPath names; both paths agree with what the image and the plugin's option expect."""
from __future__ import annotations

import re
from typing import Any

from api.names import NVIDIA_DRIVER_NAME
from cli.kubeletplugin_cmd import _STRING_FLAGS
from testbed.helmchart import ROOT, helm, render, template_args


def daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "DaemonSet"
                and o["metadata"]["labels"].get("app.kubernetes.io/component") == "kubelet-plugin")


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def image_hook_path() -> str:
    """Where hack/build-image.py puts the hook in the image."""
    match = re.search(r'^CDI_HOOK = "([^"]+)"$', (ROOT / "hack" / "build-image.py").read_text(), re.M)
    assert match, "hack/build-image.py has no CDI_HOOK"
    return match.group(1)


def test_default_installs_the_images_hook_into_the_plugin_directory() -> None:
    pod = daemonset(render())["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    target = "/var/lib/kubelet/plugins/gpu.dra-driver.io/bin/nvidia-cdi-hook"
    assert init["command"] == ["python3", "-m", "dra.node.hookinstall", image_hook_path(), target]
    assert init["securityContext"]["runAsUser"] == 0
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/var/lib/kubelet/plugins"}
    (plugin,) = pod["containers"]
    assert env(plugin)["CDI_HOOK_PATH"] == target
    assert _STRING_FLAGS["--cdi-hook-path"][0] == "CDI_HOOK_PATH"
    # The plugin sees the installed file at its host path: the plugins directory is mounted at the same path.
    assert any(m["mountPath"] == "/var/lib/kubelet/plugins" for m in plugin["volumeMounts"])


def test_the_hook_follows_kubelet_dir_and_driver_name() -> None:
    pod = daemonset(render("--set", "kubeletDir=/data/kubelet", "--set", "compatNvidia=true"))["spec"]["template"]["spec"]
    target = f"/data/kubelet/plugins/{NVIDIA_DRIVER_NAME}/bin/nvidia-cdi-hook"
    assert pod["initContainers"][0]["command"][-1] == target
    assert env(pod["containers"][0])["CDI_HOOK_PATH"] == target


def test_cdi_hook_path_replaces_the_installed_hook_and_is_mounted() -> None:
    pod = daemonset(render("--set", "cdiHookPath=/usr/bin/nvidia-cdi-hook"))["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    plugin = pod["containers"][0]
    assert env(plugin)["CDI_HOOK_PATH"] == "/usr/bin/nvidia-cdi-hook"
    mount = next(m for m in plugin["volumeMounts"] if m["name"] == "cdi-hook")
    assert mount == {"name": "cdi-hook", "mountPath": "/usr/bin/nvidia-cdi-hook", "readOnly": True}
    volume = next(v for v in pod["volumes"] if v["name"] == "cdi-hook")
    assert volume["hostPath"] == {"path": "/usr/bin/nvidia-cdi-hook", "type": "File"}


def test_a_relative_cdi_hook_path_is_refused_by_the_schema() -> None:
    proc = helm(*template_args("--set", "cdiHookPath=bin/nvidia-cdi-hook"))
    assert proc.returncode != 0 and "cdiHookPath" in proc.stderr
