"""The Helm chart as Helm renders it (the pinned Helm, built by hack/build-helm.sh): `helm lint`, `helm template`
with the default values, the kind walkthrough's simulated fleet and NVIDIA compatibility mode, and the values
schema refusing bad values."""
from __future__ import annotations

import base64
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.deviceclasses import device_classes
from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from cli.main import build_parser
from controller.cluster import DRIVER_LABEL, MANAGED_BY, MANAGED_BY_LABEL
from testbed.helmchart import CHART, ROOT, helm, render, template_args

SIMULATED = str(ROOT / "deploy" / "kind" / "values-simulated.yaml")
NAMESPACED = {"ServiceAccount", "ConfigMap", "Secret", "Service", "Deployment", "DaemonSet", "PodDisruptionBudget",
              "Certificate", "Issuer", "NetworkPolicy"}


def by_kind(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for o in objects:
        out.setdefault(o["kind"], []).append(o)
    return out


def one(objects: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (
        component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"{len(found)} {kind} objects for component {component}"
    return found[0]


def policy(objects: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy named `<fullname>-<suffix>`, after checking its binding names it."""
    [found] = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"].endswith(suffix)]
    [binding] = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
                 and o["spec"]["policyName"] == found["metadata"]["name"]]
    assert binding["spec"]["validationActions"] == ["Deny"]
    return found


def container(workload: dict[str, Any]) -> dict[str, Any]:
    [c] = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


@pytest.fixture(scope="module")
def default() -> list[dict[str, Any]]:
    return render()


@pytest.mark.parametrize("values", [[], ["-f", SIMULATED], ["--set", "compatNvidia=true"]],
                         ids=["default", "simulated", "compat"])
def test_helm_lint_is_clean(values: list[str]) -> None:
    proc = helm("lint", "--strict", str(CHART), *values)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_chart_defaults_name_the_image_make_image_builds() -> None:
    import tomllib

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pinned = dict(line.split("=", 1) for line in (ROOT / "hack" / "versions.env").read_text().splitlines()
                  if "=" in line and not line.startswith("#"))
    # `make image` tags registry.local/gpu-dra/driver:<project version>; the chart's default tag is its appVersion.
    assert chart["appVersion"] == project and values["image"]["tag"] == ""
    assert values["image"]["repository"] == pinned["DRIVER_IMAGE_REPOSITORY"]


def test_default_render_has_every_object_once(default: list[dict[str, Any]]) -> None:
    kinds = Counter(o["kind"] for o in default)
    assert kinds == {"DaemonSet": 1, "Deployment": 2, "ServiceAccount": 2, "ClusterRole": 2, "ClusterRoleBinding": 2,
                     "ConfigMap": 1, "DeviceClass": 8, "ValidatingAdmissionPolicy": 5,
                     "ValidatingAdmissionPolicyBinding": 5, "Secret": 1, "Service": 2, "PodDisruptionBudget": 1,
                     "ValidatingWebhookConfiguration": 1, "NetworkPolicy": 3, "MutatingAdmissionPolicy": 1,
                     "MutatingAdmissionPolicyBinding": 1}, kinds
    for o in default:
        if o["kind"] != "DeviceClass":  # named after the driver
            assert o["metadata"]["name"].startswith("gpu-dra-gpu-dra-driver"), o["metadata"]["name"]
        if o["kind"] in NAMESPACED:
            assert o["metadata"]["namespace"] == "gpu-dra", o["metadata"]
        else:
            assert "namespace" not in o["metadata"], o["metadata"]


def test_kubelet_plugin_daemonset(default: list[dict[str, Any]]) -> None:
    ds = one(default, "DaemonSet")
    c = container(ds)
    assert c["command"] == ["gpu-dra", "kubelet-plugin"] and c["image"] == "registry.local/gpu-dra/driver:0.1.0"
    # The image's user is 65532; the plugin must be root (host directories) and privileged (GPU device nodes).
    assert c["securityContext"] == {"privileged": True, "runAsUser": 0, "runAsGroup": 0}
    env = env_of(c)
    assert env["DRIVER_NAME"] == DEFAULT_DRIVER_NAME and env["COMPAT_NVIDIA"] == "false"
    assert env["PLUGIN_DIR"] == f"/var/lib/kubelet/plugins/{DEFAULT_DRIVER_NAME}"
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}} and "FLEET" not in env
    assert "envFrom" not in c and "hostNetwork" not in ds["spec"]["template"]["spec"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpu-dra-gpu-dra-driver-kubelet-plugin"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    host = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    for name in ("plugins-registry", "plugins", "cdi"):
        assert mounts[name] == host[name], name  # the kubelet dials the paths the plugin reports
    assert host["driver-root"] == "/" and mounts["driver-root"] == "/driver-root"
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_mps_daemons_go_to_a_host_cgroup_by_default(default: list[dict[str, Any]]) -> None:
    """The plugin pod runs in the host's PID namespace, sees the host's cgroup tree and names the cgroup MPS daemons
    join (docs/mps.md); with the value empty, none of it."""
    ds = one(default, "DaemonSet")
    pod, c = ds["spec"]["template"]["spec"], container(ds)
    assert pod["hostPID"] is True
    env = env_of(c)
    assert (env["MPS_CGROUP"], env["MPS_CGROUP_ROOT"]) == ("gpu-dra-mps", "/host/sys/fs/cgroup")
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["host-cgroup"] == {"name": "host-cgroup", "mountPath": "/host/sys/fs/cgroup"}  # writable
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["host-cgroup"]["hostPath"] == {"path": "/sys/fs/cgroup", "type": "Directory"}
    # The flags the environment sets are the plugin's.
    args = build_parser().parse_args(["kubelet-plugin", "--mps-cgroup", "/gpu-dra-mps/"])
    from cli.kubeletplugin_cmd import options_from_args

    assert options_from_args(args).mps_cgroup == "gpu-dra-mps"
    # (The per-claim GPU metrics need the host's PIDs too: off as well.)
    off = one(render("--set", "mps.daemonCgroup=", "--set", "claimMetrics.enabled=false"), "DaemonSet")
    assert "hostPID" not in off["spec"]["template"]["spec"]
    assert not {"MPS_CGROUP", "MPS_CGROUP_ROOT"} & set(env_of(container(off)))
    assert "host-cgroup" not in {v["name"] for v in off["spec"]["template"]["spec"]["volumes"]}
    custom = one(render("--set", "mps.daemonCgroup=system.slice/gpu-dra-mps"), "DaemonSet")
    assert env_of(container(custom))["MPS_CGROUP"] == "system.slice/gpu-dra-mps"


def test_controller_deployment(default: list[dict[str, Any]]) -> None:
    d = one(default, "Deployment", "controller")
    c = container(d)
    parsed = build_parser().parse_args(["controller", *c["args"]])
    assert (parsed.driver_name, parsed.compat_nvidia, parsed.metrics_port) == (DEFAULT_DRIVER_NAME, False, 8080)
    pod = d["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"] == {"type": "Recreate"}


def test_rbac_binds_each_role_to_its_service_account(default: list[dict[str, Any]]) -> None:
    accounts = {o["metadata"]["name"] for o in default if o["kind"] == "ServiceAccount"}
    roles = {o["metadata"]["name"]: o for o in default if o["kind"] == "ClusterRole"}
    for binding in (o for o in default if o["kind"] == "ClusterRoleBinding"):
        assert binding["roleRef"]["name"] in roles
        [subject] = binding["subjects"]
        assert subject["name"] in accounts and subject["namespace"] == "gpu-dra"
    plugin_role = roles["gpu-dra-gpu-dra-driver-kubelet-plugin"]
    driver_rule = [r for r in plugin_role["rules"] if r["resources"] == ["resourceclaims/driver"]]
    assert driver_rule[0]["resourceNames"] == [DEFAULT_DRIVER_NAME]
    # Only what the code calls (the e2e test test_least_privilege runs those calls with these grants alone).
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in plugin_role["rules"]} == {
        (("resourceslices",), ("create", "get", "list", "watch", "update", "delete")),
        (("resourceclaims",), ("get",)), (("resourceclaims/status",), ("patch",)),
        (("resourceclaims/driver",), ("associated-node:patch",)), (("nodes",), ("get",)),
        (("events",), ("create", "patch"))}   # no pods: the per-claim GPU metrics need none
    controller_role = roles["gpu-dra-gpu-dra-driver-controller"]
    by_name = [r for r in controller_role["rules"] if r.get("resourceNames")]
    assert [(r["resources"], r["verbs"]) for r in by_name] == [(["deviceclasses"], ["get", "update"])]
    assert by_name[0]["resourceNames"] == [c["metadata"]["name"] for c in device_classes(DEFAULT_DRIVER_NAME)]
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in controller_role["rules"] if not r.get("resourceNames")} == {
        (("deviceclasses",), ("create", "list", "watch", "delete")), (("resourceslices",), ("list", "watch", "delete")),
        (("nodes",), ("list", "watch")), (("resourceclaims", "devicetaintrules"), ("list", "watch")),
        (("events",), ("create",))}
    # Without the pending-claim Events: no right to read claims or DeviceTaintRules, nor to post Events; the
    # controller is told not to, and the policy on its Events is not rendered.
    quiet = render("--set", "controller.pendingClaimEvents=false")
    [quiet_role] = [o for o in quiet if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-controller")]
    assert {r for rule in quiet_role["rules"] for r in rule["resources"]} == {"deviceclasses", "resourceslices", "nodes"}
    [quiet_controller] = [o for o in quiet if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-controller")]
    assert "--pending-interval=0" in quiet_controller["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [o for o in quiet if o["metadata"]["name"].endswith("-controller-events")]
    assert len([o for o in default if o["metadata"]["name"].endswith("-controller-events")]) == 2
    compat = {o["metadata"]["name"]: o for o in render("--set", "compatNvidia=true") if o["kind"] == "ClusterRole"}
    [compat_names] = [r["resourceNames"] for r in compat["gpu-dra-gpu-dra-driver-controller"]["rules"]
                      if r.get("resourceNames")]
    assert compat_names == [c["metadata"]["name"] for c in device_classes(compat_nvidia=True)]


def test_device_classes_and_admission_policy(default: list[dict[str, Any]]) -> None:
    classes = [o for o in default if o["kind"] == "DeviceClass"]
    assert classes == device_classes(DEFAULT_DRIVER_NAME)
    slices = policy(default, "-resourceslices")
    claims = policy(default, "-resourceclaim-status")
    for p, resource in ((slices, "resourceslices"), (claims, "resourceclaims/status")):
        assert p["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == [resource]
        variables = {v["name"]: v["expression"] for v in p["spec"]["variables"]}
        assert variables["driverName"] == f"'{DEFAULT_DRIVER_NAME}'"
        assert "'authentication.kubernetes.io/node-name' in request.userInfo.extra" in variables["userNodeName"]
        assert p["spec"]["matchConditions"][0]["expression"] == \
            "request.userInfo.username == 'system:serviceaccount:gpu-dra:gpu-dra-gpu-dra-driver-kubelet-plugin'"
    # The controller's writes: its classes (the names its RBAC has, the labels controller.cluster puts on the
    # classes it makes) and this driver's slices. What they admit: e2e/test_least_privilege.py.
    classes_policy = policy(default, "-controller-deviceclasses")
    slices_policy = policy(default, "-controller-slice-deletes")
    for p, operations in ((classes_policy, ["CREATE", "UPDATE", "DELETE"]), (slices_policy, ["DELETE"])):
        assert p["spec"]["matchConditions"][0]["expression"] == \
            "request.userInfo.username == 'system:serviceaccount:gpu-dra:gpu-dra-gpu-dra-driver-controller'"
        assert p["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == operations
        assert {v["name"]: v["expression"] for v in p["spec"]["variables"]}["driverName"] == f"'{DEFAULT_DRIVER_NAME}'"
    variables = {v["name"]: v["expression"] for v in classes_policy["spec"]["variables"]}
    assert yaml.safe_load(variables["classNames"]) == [c["metadata"]["name"] for c in device_classes(DEFAULT_DRIVER_NAME)]
    assert f"'{MANAGED_BY_LABEL}' in variables.labels" in variables["managedBy"]
    assert f"'{DRIVER_LABEL}' in variables.labels" in variables["driverLabel"]
    assert any(f"variables.managedBy == '{MANAGED_BY}'" in v["expression"]
               for v in classes_policy["spec"]["validations"])


def test_webhook_deployment_service_and_certificate(default: list[dict[str, Any]], tmp_path: Path) -> None:
    d = one(default, "Deployment", "webhook")
    c = container(d)
    parsed = build_parser().parse_args(["webhook", *c["args"]])
    assert (parsed.driver_name, parsed.compat_nvidia, parsed.port) == (DEFAULT_DRIVER_NAME, False, 8443)
    pod = d["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    assert d["spec"]["replicas"] == 2
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    [port] = c["ports"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert parsed.tls_cert_file == f"{mount['mountPath']}/tls.crt"
    secret_name = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"]

    svc = one(default, "Service", "webhook")
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": port["name"]}]
    pdb = one(default, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()

    secret = one(default, "Secret")
    assert secret["metadata"]["name"] == secret_name and secret["type"] == "kubernetes.io/tls"
    vwc = one(default, "ValidatingWebhookConfiguration")
    for hook in vwc["webhooks"]:
        assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert hook["clientConfig"]["service"] == {"name": svc["metadata"]["name"], "namespace": "gpu-dra",
                                                   "path": "/validate", "port": 443}
    # Helm's certificate is valid for the Service's DNS name, signed by the CA in caBundle.
    for key in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    proc = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), "-verify_hostname",
                           f"{svc['metadata']['name']}.gpu-dra.svc", str(tmp_path / "tls.crt")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert d["spec"]["template"]["metadata"]["annotations"]["checksum/tls"]


def test_webhook_configuration_matches_only_claims_and_templates_of_this_driver(default: list[dict[str, Any]]) -> None:
    vwc = one(default, "ValidatingWebhookConfiguration")
    hooks = {h["name"]: h for h in vwc["webhooks"]}
    assert set(hooks) == {f"resourceclaims.{DEFAULT_DRIVER_NAME}", f"resourceclaimtemplates.{DEFAULT_DRIVER_NAME}"}
    for name, hook in hooks.items():
        [rule] = hook["rules"]
        assert rule["apiGroups"] == ["resource.k8s.io"] and rule["resources"] == [name.split(".")[0]]
        assert rule["operations"] == ["CREATE"]
        assert (hook["failurePolicy"], hook["sideEffects"], hook["admissionReviewVersions"]) == ("Fail", "None", ["v1"])
        conditions = {c["name"]: c["expression"] for c in hook["matchConditions"]}
        spec = "object.spec" if name.startswith("resourceclaims.") else "object.spec.spec"
        assert f"{spec}.devices.config.exists(" in conditions["configures-this-driver"]
        assert f"c.opaque.driver == '{DEFAULT_DRIVER_NAME}'" in conditions["configures-this-driver"]
        assert "resource-claim-controller" in conditions["not-made-from-a-checked-template"]


def test_simulated_fleet_values(tmp_path: Path) -> None:
    objects = render("-f", SIMULATED)
    ds = one(objects, "DaemonSet")
    c = container(ds)
    assert env_of(c)["FLEET"] == "/etc/gpu-dra/fleet.yaml"
    assert c["image"] == "registry.local/gpu-dra/driver:0.1.0" and c["imagePullPolicy"] == "Never"
    config = one(objects, "ConfigMap")
    fleet = yaml.safe_load(config["data"]["fleet.yaml"])
    assert [n["name"] for n in fleet["nodes"]] == ["kind-worker", "kind-worker2"]
    # No nodePolicy: each fleet node's own policy applies (NODE_POLICY would replace it).
    assert "node-policy.yaml" not in config["data"] and "NODE_POLICY" not in env_of(c)
    assert fleet["nodes"][1]["policy"]["default"]["slots"]["strategy"] == "time-slicing"
    for d in (o for o in objects if o["kind"] == "Deployment"):
        assert container(d)["imagePullPolicy"] == "Never"


def test_a_node_policy_is_written_and_named_to_the_plugin() -> None:
    objects = render("--set-json", 'nodePolicy={"default": {"wholeGpu": true}, "rules": [{"match": {"model": "H100"}, '
                                   '"mig": "dynamic"}]}')
    assert env_of(container(one(objects, "DaemonSet")))["NODE_POLICY"] == "/etc/gpu-dra/node-policy.yaml"
    policy = yaml.safe_load(one(objects, "ConfigMap")["data"]["node-policy.yaml"])
    assert policy == {"default": {"wholeGpu": True}, "rules": [{"match": {"model": "H100"}, "mig": "dynamic"}]}


def test_nvidia_compat_mode() -> None:
    objects = render("--set", "compatNvidia=true", "--set", "driverName=ignored.example.com")
    text = yaml.safe_dump_all(objects)
    assert "ignored.example.com" not in text
    env = env_of(container(one(objects, "DaemonSet")))
    assert (env["DRIVER_NAME"], env["COMPAT_NVIDIA"]) == (NVIDIA_DRIVER_NAME, "true")
    controller = build_parser().parse_args(["controller", *container(one(objects, "Deployment", "controller"))["args"]])
    webhook = build_parser().parse_args(["webhook", *container(one(objects, "Deployment", "webhook"))["args"]])
    assert controller.compat_nvidia and webhook.compat_nvidia and webhook.driver_name == NVIDIA_DRIVER_NAME
    assert [o for o in objects if o["kind"] == "DeviceClass"] == device_classes(compat_nvidia=True)
    vwc = one(objects, "ValidatingWebhookConfiguration")
    assert {h["name"] for h in vwc["webhooks"]} == {f"resourceclaims.{NVIDIA_DRIVER_NAME}",
                                                    f"resourceclaimtemplates.{NVIDIA_DRIVER_NAME}"}
    for hook in vwc["webhooks"]:
        assert f"c.opaque.driver == '{NVIDIA_DRIVER_NAME}'" in hook["matchConditions"][0]["expression"]
    for suffix in ("-resourceslices", "-resourceclaim-status"):
        variables = {v["name"]: v["expression"] for v in policy(objects, suffix)["spec"]["variables"]}
        assert variables["driverName"] == f"'{NVIDIA_DRIVER_NAME}'"


def test_explicit_api_endpoint_for_clusters_without_kube_proxy() -> None:
    objects = render("--set", "k8sServiceHost=10.1.2.3", "--set", "k8sServicePort=6443",
                     "--set", "kubeletPlugin.hostNetwork=true", "--set", "controller.hostNetwork=true")
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-kubernetes-api"))
    assert config["data"] == {"KUBERNETES_SERVICE_HOST": "10.1.2.3", "KUBERNETES_SERVICE_PORT": "6443"}
    for component in ("DaemonSet", "controller"):
        w = one(objects, "DaemonSet") if component == "DaemonSet" else one(objects, "Deployment", component)
        assert container(w)["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
        pod = w["spec"]["template"]["spec"]
        assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    # The webhook talks to no API server.
    assert "envFrom" not in container(one(objects, "Deployment", "webhook"))
    # In the node's network its replicas hold a node port each: no surge pod on upgrades (it would find no port).
    assert "strategy" not in one(objects, "Deployment", "webhook")["spec"]
    webhook = one(render("--set", "webhook.hostNetwork=true"), "Deployment", "webhook")["spec"]
    assert webhook["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    # Changing the endpoint restarts the pods that read it.
    before = one(render(), "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    after = one(objects, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert before["checksum/kubernetes-api"] != after["checksum/kubernetes-api"]
    proc = helm(*template_args("--set", "k8sServiceHost=10.1.2.3"))
    assert proc.returncode != 0 and "k8sServiceHost and k8sServicePort go together" in proc.stderr


def test_webhook_certificate_modes(tmp_path: Path) -> None:
    ca = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    mine = render("--set", "webhook.tls.mode=secret", "--set", "webhook.tls.secretName=my-tls",
                  "--set-string", f"webhook.tls.caBundle={ca}")
    assert "Secret" not in by_kind(mine)
    vwc = one(mine, "ValidatingWebhookConfiguration")
    assert {h["clientConfig"]["caBundle"] for h in vwc["webhooks"]} == {base64.b64encode(ca.encode()).decode()}
    pod = one(mine, "Deployment", "webhook")["spec"]["template"]["spec"]
    assert pod["volumes"][0]["secret"]["secretName"] == "my-tls"

    cm = render("--set", "webhook.tls.mode=cert-manager")
    cert, issuer = one(cm, "Certificate"), one(cm, "Issuer")
    assert cert["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"] and "selfSigned" in issuer["spec"]
    assert "gpu-dra-gpu-dra-driver-webhook.gpu-dra.svc" in cert["spec"]["dnsNames"]
    vwc = one(cm, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "gpu-dra/gpu-dra-gpu-dra-driver-webhook"}
    assert all("caBundle" not in h["clientConfig"] for h in vwc["webhooks"])
    own = render("--set", "webhook.tls.mode=cert-manager", "--set", "webhook.tls.certManager.issuerRef.name=corp",
                 "--set", "webhook.tls.certManager.issuerRef.kind=ClusterIssuer")
    assert "Issuer" not in by_kind(own)
    assert one(own, "Certificate")["spec"]["issuerRef"] == {"name": "corp", "kind": "ClusterIssuer"}


def test_components_can_be_turned_off() -> None:
    objects = render("--set", "webhook.enabled=false", "--set", "controller.enabled=false",
                     "--set", "deviceClasses.create=false", "--set", "validatingAdmissionPolicy.enabled=false",
                     "--set", "mps.tenancyTolerations=false")
    assert Counter(o["kind"] for o in objects) == {"DaemonSet": 1, "ServiceAccount": 1, "ClusterRole": 1,
                                                   "ClusterRoleBinding": 1, "ConfigMap": 1, "NetworkPolicy": 1,
                                                   "Service": 1}   # the plugins' metrics Service
    single = render("--set", "webhook.replicas=1")
    assert "PodDisruptionBudget" not in by_kind(single)


@pytest.mark.parametrize(("args", "error"), [
    (["--set", "webhook.replicas=two"], "at '/webhook/replicas': got string, want integer"),
    (["--set-string", "kubeletPlugin.metricsPort=8080"], "at '/kubeletPlugin/metricsPort': got string, want integer"),
    (["--set", "compatNvidia=yes"], "at '/compatNvidia': got string, want boolean"),
    (["--set", "webhook.bogus=1"], "at '/webhook': additional properties 'bogus' not allowed"),
    (["--set", "driverNam=x.example.com"], "additional properties 'driverNam' not allowed"),
    (["--set", "webhook.failurePolicy=Never"], "at '/webhook/failurePolicy'"),
    (["--set", "driverName=Not_A_Domain"], "at '/driverName'"),
    (["--set", "controller.replicas=2"], "at '/controller/replicas': maximum"),
    (["--set", "webhook.tls.mode=secret"], "at '/webhook/tls/secretName'"),
    (["--set", "kubeletDir=var/lib/kubelet"], "at '/kubeletDir'"),
    (["--set", "mps.daemonCgroup=../escape"], "at '/mps/daemonCgroup'"),
], ids=["wrong-type", "string-port", "string-bool", "unknown-key", "typo-top-level", "enum", "driver-name",
        "controller-replicas", "secret-mode-without-secret", "relative-path", "cgroup-dot-dot"])
def test_values_schema_refuses_bad_values(args: list[str], error: str) -> None:
    proc = helm(*template_args(*args))
    assert proc.returncode != 0, f"helm template {args} succeeded"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert error in proc.stderr, proc.stderr


def test_values_file_and_schema_agree() -> None:
    """Every key of values.yaml is described by the schema (no key the schema would refuse)."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if isinstance(value, dict) and node.get("additionalProperties") is False:
            for key, sub in value.items():
                assert key in node["properties"], f"{path}.{key} is in values.yaml but not in values.schema.json"
                walk(sub, node["properties"][key], f"{path}.{key}")
        if value and node.get("additionalProperties") is False:  # {}: optional fields to fill in
            missing = set(node["properties"]) - set(value)
            assert not missing, f"{path}: {missing} described by the schema but not in values.yaml"

    walk(values, schema, "")


@pytest.mark.parametrize("version, rendered", [("v1.35.3", False), ("v1.36.0", True), ("v1.37.2", True)])
def test_the_mps_tenancy_policy_is_rendered_where_the_cluster_has_it(version: str, rendered: bool) -> None:
    """MutatingAdmissionPolicy and device taints are on by default from 1.36: before, neither is used."""
    proc = helm("template", "r", str(CHART), "--kube-version", version)
    assert proc.returncode == 0, proc.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(proc.stdout) if d]
    assert ("MutatingAdmissionPolicy" in kinds) is rendered
    off = helm("template", "r", str(CHART), "--kube-version", version, "--set", "mps.tenancyTolerations=false")
    assert "MutatingAdmissionPolicy" not in off.stdout


GPU_NODE_TERMS = [{"matchExpressions": [{"key": key, "operator": "In", "values": ["true"]}]}
                  for key in ("feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present")]


def _plugin_affinity(objects: list[dict[str, Any]]) -> Any:
    return one(objects, "DaemonSet")["spec"]["template"]["spec"].get("affinity")


def test_the_plugin_runs_on_gpu_nodes_only_by_default(default: list[dict[str, Any]]) -> None:
    """NFD's NVIDIA PCI label or GFD's label, either one: a CPU-only node gets no plugin pod to crash-loop."""
    required = _plugin_affinity(default)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == {"nodeSelectorTerms": GPU_NODE_TERMS}


def test_the_plugin_placement_can_be_overridden() -> None:
    assert _plugin_affinity(render("--set", "kubeletPlugin.gpuNodeLabels=null")) is None
    assert _plugin_affinity(render("--set-json", "kubeletPlugin.gpuNodeLabels=[]")) is None
    only = render("--set-json", 'kubeletPlugin.gpuNodeLabels=["example.com/gpu"]')
    assert _plugin_affinity(only)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "example.com/gpu", "operator": "In", "values": ["true"]}]}]}
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}
    import json

    assert _plugin_affinity(render("--set-json", f"kubeletPlugin.affinity={json.dumps(own)}")) == own


def test_the_kind_cluster_labels_its_workers_as_gpu_nodes() -> None:
    """The kind cluster of deploy/README.md runs simulated GPUs on its workers: they carry GFD's label."""
    nodes = yaml.safe_load((ROOT / "deploy" / "kind" / "cluster.yaml").read_text())["nodes"]
    workers = [n for n in nodes if n["role"] == "worker"]
    assert workers and all(n.get("labels", {}).get("nvidia.com/gpu.present") == "true" for n in workers)
