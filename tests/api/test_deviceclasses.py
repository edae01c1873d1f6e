"""DeviceClasses (CEL selectors for the right driver), their generated YAML, the CLI, and the Helm chart's shape."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.deviceclasses import (
    CHART_DRIVER_PLACEHOLDER,
    FAMILIES,
    device_classes,
    generated_files,
    render_yaml,
)
from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from cli import deviceclasses_cmd
from cli.main import build_parser
from cli.main import main as gpu_dra
from dra.model.policy import parse_node_policy

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpu-dra-driver"


# --- a tiny parser + evaluator for the CEL subset our selectors use -----------------------------------
#   expr := term ('&&' term)*
#   term := 'has' '(' path ')' | path '==' STRING
#   path := IDENT ('.' IDENT | '[' STRING ']')*
# Parsing the whole string proves it is well-formed (balanced quotes, brackets, operators); evaluating it
# against sample devices proves it selects what the class name promises.

_TOKEN = re.compile(r"\s*(?:(?P<str>'[^'\\]*')|(?P<op>==|&&|[.()\[\]])|(?P<ident>[A-Za-z_][A-Za-z0-9_]*))")


def _tokens(expression: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expression):
        m = _TOKEN.match(expression, pos)
        assert m and m.end() > pos, f"cannot tokenize {expression[pos:]!r} in {expression!r}"
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def parse_selector(expression: str) -> list[tuple[str, Any]]:
    """-> list of terms: ('has', path) or ('eq', path, literal); paths are tuples of keys."""
    tokens, i = _tokens(expression), 0

    def take(kind: str, value: str | None = None) -> str:
        nonlocal i
        assert i < len(tokens), f"unexpected end of {expression!r}"
        k, v = tokens[i]
        assert k == kind and (value is None or v == value), f"expected {value or kind}, got {v!r} in {expression!r}"
        i += 1
        return v

    def path() -> tuple[str, ...]:
        keys = [take("ident")]
        while i < len(tokens) and tokens[i][1] in (".", "["):
            if take("op") == ".":
                keys.append(take("ident"))
            else:
                keys.append(take("str")[1:-1])
                take("op", "]")
        return tuple(keys)

    terms: list[tuple[str, Any]] = []
    while True:
        if tokens[i] == ("ident", "has"):
            i += 1
            take("op", "(")
            terms.append(("has", path()))
            take("op", ")")
        else:
            p = path()
            take("op", "==")
            terms.append(("eq", p, take("str")[1:-1]))
        if i == len(tokens):
            return terms
        take("op", "&&")


def _lookup(device: dict[str, Any], keys: tuple[str, ...]) -> Any:
    assert keys[0] == "device"
    value: Any = device
    for key in keys[1:]:
        value = value[key]  # a missing key is a runtime error in CEL too
    return value


def selects(expression: str, device: dict[str, Any]) -> bool:
    for term in parse_selector(expression):
        if term[0] == "has":
            parent, last = _lookup(device, term[1][:-1]), term[1][-1]
            if last not in parent:
                return False
        elif _lookup(device, term[1]) != term[2]:
            return False  # CEL's && short-circuits left to right for our purposes
    return True


def device(driver: str, device_type: str, **attributes: str) -> dict[str, Any]:
    return {"driver": driver, "attributes": {driver: {"type": device_type, **attributes}}}


def by_name(classes: list[dict[str, Any]]) -> dict[str, str]:
    return {c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"] for c in classes}


# --- our classes -------------------------------------------------------------------------------------

def test_class_names_for_the_default_driver() -> None:
    names = list(by_name(device_classes()))
    assert names == ["gpu.dra-driver.io", "mig.gpu.dra-driver.io", "slot.gpu.dra-driver.io",
                     "shared.gpu.dra-driver.io", "ampere.gpu.dra-driver.io", "ada-lovelace.gpu.dra-driver.io",
                     "hopper.gpu.dra-driver.io", "blackwell.gpu.dra-driver.io"]


@pytest.mark.parametrize("driver", [DEFAULT_DRIVER_NAME, "gpus.example.com", "x.y"])
def test_every_class_is_a_v1_device_class_whose_cel_names_only_its_driver(driver: str) -> None:
    for cls in device_classes(driver):
        assert cls["apiVersion"] == "resource.k8s.io/v1" and cls["kind"] == "DeviceClass"
        assert cls["metadata"]["name"] == driver or cls["metadata"]["name"].endswith(f".{driver}")
        assert "extendedResourceName" not in cls["spec"]
        [selector] = cls["spec"]["selectors"]
        expression = selector["cel"]["expression"]
        terms = parse_selector(expression)
        assert terms[0] == ("eq", ("device", "driver"), driver)
        for term in terms[1:]:
            assert term[1][:3] == ("device", "attributes", driver), expression


@pytest.mark.parametrize("driver", [DEFAULT_DRIVER_NAME, "gpus.example.com"])
def test_type_classes_select_their_device_type_only(driver: str) -> None:
    classes = by_name(device_classes(driver))
    for device_type, name in [("gpu", driver), ("mig", f"mig.{driver}"), ("slot", f"slot.{driver}"),
                              ("shared", f"shared.{driver}")]:
        for other in ("gpu", "mig", "slot", "shared"):
            assert selects(classes[name], device(driver, other, family="hopper")) == (other == device_type)
        assert not selects(classes[name], device("other.example.com", device_type))


def test_family_classes_select_whole_gpus_of_their_family() -> None:
    classes = by_name(device_classes())
    d = DEFAULT_DRIVER_NAME
    for family in FAMILIES:
        expression = classes[f"{family}.{d}"]
        assert f"device.attributes['{d}'].family == '{family}'" in expression
        assert selects(expression, device(d, "gpu", family=family))
        assert not selects(expression, device(d, "mig", family=family))
        assert not selects(expression, device(d, "gpu", family="turing"))
        assert not selects(expression, device(d, "gpu"))  # no family attribute: skipped, not an error


@pytest.mark.parametrize("bad", ["", "GPU.example.com", "gpu_example.com", "-gpu.io", "a" * 64, "x'y.io"])
def test_invalid_driver_names_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="DNS subdomain"):
        device_classes(bad)


# --- NVIDIA compatibility ----------------------------------------------------------------------------

def test_compat_classes_use_nvidias_names_and_driver() -> None:
    classes = device_classes(compat_nvidia=True)
    names = by_name(classes)
    assert list(names)[:4] == ["gpu.nvidia.com", "mig.nvidia.com", "slot.gpu.nvidia.com", "shared.gpu.nvidia.com"]
    assert names["gpu.nvidia.com"] == ("device.driver == 'gpu.nvidia.com' && "
                                       "device.attributes['gpu.nvidia.com'].type == 'gpu'")
    assert selects(names["mig.nvidia.com"], device(NVIDIA_DRIVER_NAME, "mig"))
    extended = {c["metadata"]["name"]: c["spec"].get("extendedResourceName") for c in classes}
    assert extended.pop("gpu.nvidia.com") == "nvidia.com/gpu"
    assert set(extended.values()) == {None}
    for expression in names.values():
        assert parse_selector(expression)[0] == ("eq", ("device", "driver"), NVIDIA_DRIVER_NAME)


def test_compat_mode_refuses_another_driver_name() -> None:
    assert device_classes(NVIDIA_DRIVER_NAME, compat_nvidia=True) == device_classes(compat_nvidia=True)
    with pytest.raises(ValueError, match="uses driver name gpu.nvidia.com"):
        device_classes("gpus.example.com", compat_nvidia=True)


# --- YAML, CLI, generated files -----------------------------------------------------------------------

def test_rendered_yaml_parses_back_to_the_objects() -> None:
    classes = device_classes("gpus.example.com")
    assert list(yaml.safe_load_all(render_yaml(classes))) == classes


def test_cli_prints_the_classes(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_dra(["deviceclasses", "--driver-name", "gpus.example.com"]) == 0
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == device_classes("gpus.example.com")
    assert gpu_dra(["deviceclasses", "--compat-nvidia"]) == 0
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == device_classes(compat_nvidia=True)


def test_cli_reports_a_bad_driver_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_dra(["deviceclasses", "--driver-name", "Bad_Name"]) == 2
    assert "Bad_Name" in capsys.readouterr().err
    assert callable(deviceclasses_cmd.add_arguments) and callable(deviceclasses_cmd.run)


def test_checked_in_yaml_equals_the_generated_output() -> None:
    files = generated_files()
    assert "deploy/deviceclasses/gpu-dra-driver.yaml" in files
    for relative, text in files.items():
        path = ROOT / relative
        assert path.exists(), f"{relative} missing: run python -m api.deviceclasses"
        assert path.read_text() == text, f"{relative} is stale: run python -m api.deviceclasses"


def test_chart_copy_becomes_the_default_classes_once_the_driver_name_is_filled_in() -> None:
    chart_copy = (CHART / "files" / "deviceclasses.yaml").read_text()
    filled = chart_copy.replace(CHART_DRIVER_PLACEHOLDER, "gpus.example.com")
    docs = [d for d in yaml.safe_load_all(filled) if d]
    assert docs == device_classes("gpus.example.com")
    template = (CHART / "templates" / "deviceclasses.yaml").read_text()
    assert f'replace "{CHART_DRIVER_PLACEHOLDER}"' in template
    assert '"files/deviceclasses.yaml"' in template and '"files/deviceclasses-nvidia-compat.yaml"' in template


# --- the Helm chart (helm is not needed: the files are checked as YAML) ---------------------------------

def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "gpu-dra-driver"
    assert chart["kubeVersion"] == ">=1.34.0-0"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"]) and chart["appVersion"]


def test_values_have_the_documented_keys() -> None:
    values = _values()
    assert values["driverName"] == DEFAULT_DRIVER_NAME
    assert values["compatNvidia"] is False
    assert set(values["image"]) >= {"repository", "tag", "pullPolicy"}
    assert values["kubeletDir"] == "/var/lib/kubelet" and values["driverRoot"] == "/"
    assert values["cdiRoot"] == "/var/run/cdi"
    assert isinstance(values["nodePolicy"], dict)
    assert values["deviceClasses"]["create"] is True
    assert values["validatingAdmissionPolicy"]["enabled"] is True
    assert values["kubeletPlugin"]["priorityClassName"] == "system-node-critical"
    assert values["controller"]["replicas"] == 1


def _templates() -> dict[str, str]:
    return {p.name: p.read_text() for p in (CHART / "templates").iterdir() if p.is_file()}


def test_every_value_a_template_uses_is_defined() -> None:
    values = _values()
    used = set()
    for text in _templates().values():
        used.update(re.findall(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text))
    assert used, "templates use no values?"
    for dotted in sorted(used):
        node: Any = values
        for key in dotted.strip(".").split("."):
            assert isinstance(node, dict) and key in node, f".Values{dotted} is not defined in values.yaml"
            node = node[key]


def _objects(name: str) -> list[dict[str, Any]]:
    """A template as YAML: whole-line directives dropped, inline ones replaced by a marker."""
    lines = []
    for line in _templates()[name].splitlines():
        stripped = line.strip()
        if stripped.startswith("{{") and stripped.endswith("}}"):
            continue
        lines.append(re.sub(r"\{\{.*?\}\}", "TEMPLATED", line))
    return [d for d in yaml.safe_load_all("\n".join(lines)) if d]


def _role(suffix: str) -> dict[str, Any]:
    """The chart's ClusterRole named ``<release>-<suffix>``, as helm renders it."""
    from testbed.helmchart import render

    [role] = [o for o in render() if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith(f"-{suffix}")]
    return role


def _rules(suffix: str) -> dict[str, tuple[set[str], list[str] | None]]:
    """Verbs and resource names per resource; a resource in several rules (some by name) gets the union of their
    verbs and the names of the rule that has them."""
    role = _role(suffix)
    out: dict[str, tuple[set[str], list[str] | None]] = {}
    for r in role["rules"]:
        verbs, names = out.get(r["resources"][0], (set(), None))
        out[r["resources"][0]] = (verbs | set(r["verbs"]), names or r.get("resourceNames"))
    return out


def test_kubelet_plugin_rbac() -> None:
    rules = _rules("kubelet-plugin")
    # Least privilege: slices are replaced (PUT), never patched; a claim is read by name, never listed.
    assert rules["resourceslices"][0] == {"create", "get", "list", "watch", "update", "delete"}
    assert rules["resourceclaims"][0] == {"get"}
    # Least privilege: status.devices is written by server-side apply only, so patch is all it needs.
    assert rules["resourceclaims/status"][0] == {"patch"}
    verbs, names = rules["resourceclaims/driver"]
    assert verbs == {"associated-node:patch"} and names == [DEFAULT_DRIVER_NAME]
    assert rules["nodes"][0] == {"get"}
    assert rules["events"][0] == {"create", "patch"}


def test_controller_rbac_manages_device_classes() -> None:
    role = _role("controller")
    classes = [r for r in role["rules"] if r["resources"] == ["deviceclasses"]]
    by_name = [r for r in classes if r.get("resourceNames")]
    # Reads and rewrites only the chart's own classes, by name; create, list and delete cannot name them.
    assert [set(r["verbs"]) for r in by_name] == [{"get", "update"}] and by_name[0]["resourceNames"]
    # It reads through list+watch caches (controller.clusterstate): watch beside each list.
    assert {v for r in classes if not r.get("resourceNames") for v in r["verbs"]} == {"create", "list", "watch",
                                                                                      "delete"}
    rules = _rules("controller")
    assert rules["resourceslices"][0] == {"list", "watch", "delete"}
    # Claims only listed and watched, for the MPS tenancy Events on pending claims (controller.pendingclaims): never
    # read one by one, never written.
    assert rules["resourceclaims"][0] == {"list", "watch"}


def test_admission_policy_limits_the_plugin_to_its_node() -> None:
    policy, binding = _objects("validatingadmissionpolicy.yaml")
    rule = policy["spec"]["matchConstraints"]["resourceRules"][0]
    assert rule["resources"] == ["resourceslices"] and set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    text = _templates()["validatingadmissionpolicy.yaml"]
    assert "authentication.kubernetes.io/node-name" in text and "[oldObject]" in text   # DELETE: the stored slice
    # node name, pool name and driver are all bound to the plugin's node and the chart's driver
    for field in ("s.spec.nodeName", "s.spec.pool.name", "s.spec.driver", 'include "gpu-dra-driver.driverName"'):
        assert field in text, field
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_kubelet_plugin_daemonset() -> None:
    [ds] = _objects("kubelet-plugin.yaml")
    assert ds["kind"] == "DaemonSet"
    [container] = ds["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["gpu-dra", "kubelet-plugin"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    volumes = {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes >= {"plugins-registry", "plugins", "cdi", "driver-root", "config"}
    text = _templates()["kubelet-plugin.yaml"]
    for host_path in ('"%s/plugins_registry" .Values.kubeletDir', '"%s/plugins" .Values.kubeletDir',
                      ".Values.cdiRoot", ".Values.driverRoot"):
        assert text.count(host_path) >= 2, host_path  # mounted at the same path it has on the host


def test_kubelet_plugin_metrics_port_probes_and_quiet_period_come_from_values(monkeypatch: pytest.MonkeyPatch) -> None:
    [ds] = _objects("kubelet-plugin.yaml")
    [container] = ds["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    text = _templates()["kubelet-plugin.yaml"]
    assert "value: {{ .Values.kubeletPlugin.metricsPort | quote }}" in text
    assert "value: {{ .Values.kubeletPlugin.healthQuietPeriod | quote }}" in text
    assert env["METRICS_PORT"] == env["HEALTH_QUIET_PERIOD"] == "TEMPLATED"
    assert container["ports"] == [{"name": "metrics", "containerPort": "TEMPLATED"}]
    assert "containerPort: {{ .Values.kubeletPlugin.metricsPort }}" in text
    # Liveness only for what a restart cures; readiness also follows ResourceSlice publishing.
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert container["startupProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    values = _values()["kubeletPlugin"]
    monkeypatch.setenv("METRICS_PORT", str(values["metricsPort"]))
    monkeypatch.setenv("HEALTH_QUIET_PERIOD", str(values["healthQuietPeriod"]))
    monkeypatch.setenv("NODE_NAME", "n")
    from cli.kubeletplugin_cmd import options_from_args

    options = options_from_args(build_parser().parse_args(["kubelet-plugin"]))
    assert (options.metrics_port, options.health_quiet_period) == (8080, 300.0)


def test_controller_deployment_passes_flags_the_controller_accepts() -> None:
    [deployment] = _objects("controller.yaml")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["gpu-dra", "controller"]
    values = _values()
    filled = {"--driver-name": values["driverName"], "--metrics-port": str(values["controller"]["metricsPort"]),
              "--log-level": values["logLevel"]}
    args = [a.replace("TEMPLATED", filled[a.split("=", 1)[0]]) if "TEMPLATED" in a else a for a in container["args"]]
    parsed = build_parser().parse_args(["controller", *args])
    assert (parsed.driver_name, parsed.compat_nvidia, parsed.metrics_port, parsed.log_level) == (
        DEFAULT_DRIVER_NAME, True, 8080, "info")  # --compat-nvidia sits inside an `if compatNvidia` block
    assert container["ports"][0]["containerPort"] == "TEMPLATED"


def test_node_policy_in_values_is_a_valid_policy() -> None:
    policy = parse_node_policy(_values()["nodePolicy"], "values.yaml nodePolicy")
    assert policy is not None


def test_kubelet_plugin_env_in_chart_is_read_by_the_command() -> None:
    """The DaemonSet configures `gpu-dra kubelet-plugin` only through environment variables, so every
    variable it sets must be one the command reads (or one kept for the runtime, NVIDIA_VISIBLE_DEVICES)."""
    import argparse
    import re as _re

    from cli import kubeletplugin_cmd

    template = (CHART / "templates" / "kubelet-plugin.yaml").read_text()
    env_block = template.split("env:", 1)[1].split("volumeMounts:", 1)[0]
    set_by_chart = set(_re.findall(r"^\s*- name: ([A-Z_]+)\s*$", env_block, flags=_re.M))
    parser = argparse.ArgumentParser()
    kubeletplugin_cmd.add_arguments(parser)
    helps = " ".join(action.help or "" for action in parser._actions)
    read_by_command = set(_re.findall(r"\[env ([A-Z_]+)\]", helps))
    assert set_by_chart, "no env found in the kubelet-plugin template"
    assert set_by_chart - read_by_command == {"NVIDIA_VISIBLE_DEVICES"}


def test_kind_values_carry_a_valid_simulated_fleet() -> None:
    """The kind values' fleet must load as the plugin will load it (same parser, same errors)."""
    from dra.sim.fleet import parse_fleet

    values = yaml.safe_load((ROOT / "deploy" / "kind" / "values-simulated.yaml").read_text())
    fleet = parse_fleet(values["simulatedFleet"], "deploy/kind/values-simulated.yaml")
    assert [n.name for n in fleet.nodes] == ["kind-worker", "kind-worker2"]
