"""The validating admission webhook on the real API server: `gpu-dra webhook` runs on 127.0.0.1 with a certificate
made for the test, the chart's ValidatingWebhookConfiguration (rendered by the pinned Helm) is registered with its
service reference replaced by that URL and CA, and claims and templates go in through `kubectl apply`."""
from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from tlscerts import ServingCert, make_serving_cert

from api.names import CONFIG_API_VERSION, NVIDIA_CONFIG_API_VERSION, NVIDIA_DRIVER_NAME
from testbed.helmchart import ROOT, render
from testbed.localcluster import free_port

pytestmark = pytest.mark.e2e

DRIVER = "wh.e2e.dra-driver.io"
NAMESPACE = "webhook-e2e"
CONTROLLER_SA = "system:serviceaccount:kube-system:resource-claim-controller"
BAD_MPS = {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig",
           "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}}
GOOD_MPS = {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}
BAD_FIELD = "spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentage: must be between 1 and 100, got 150"


def claim_spec(driver: str | None, parameters: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example"}}]}}
    if driver is not None:
        spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}]
    return spec


def claim(name: str, driver: str | None, parameters: Any = None) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": claim_spec(driver, parameters)}


def template(name: str, driver: str | None, parameters: Any = None) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {"spec": claim_spec(driver, parameters)}}


@dataclass
class Webhook:
    """A `gpu-dra webhook` process and the chart's webhook configuration pointing at it."""
    cluster: Any
    certs: ServingCert
    driver: str
    compat_nvidia: bool
    name: str
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    def start(self) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "cli.main", "webhook", "--address", "127.0.0.1", "--port", str(self.port),
                "--tls-cert-file", str(self.certs.cert), "--tls-private-key-file", str(self.certs.key),
                "--driver-name", self.driver]
        if self.compat_nvidia:
            argv.append("--compat-nvidia")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ctx = ssl.create_default_context(cafile=str(self.certs.ca))
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{self.port}/readyz", context=ctx, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode() if self.proc.stderr and self.proc.poll() is not None else ""
                    raise AssertionError(f"gpu-dra webhook did not come up: {exc} {err}") from exc
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def register(self, tmp: Path) -> dict[str, Any]:
        """The chart's ValidatingWebhookConfiguration, sent to this process instead of the in-cluster Service."""
        values = ["--set", "compatNvidia=true"] if self.compat_nvidia else ["--set", f"driverName={self.driver}"]
        [vwc] = [o for o in render(*values, "--show-only", "templates/webhook.yaml", namespace=NAMESPACE)
                 if o["kind"] == "ValidatingWebhookConfiguration"]
        vwc["metadata"]["name"] = self.name
        ca = base64.b64encode(self.certs.ca.read_bytes()).decode()
        for hook in vwc["webhooks"]:
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.port}/validate", "caBundle": ca}
        path = tmp / f"{self.name}.json"
        path.write_text(json.dumps(vwc))
        self.cluster.kubectl("apply", "-f", str(path))
        return vwc

    def unregister(self) -> None:
        self.cluster.kubectl("delete", "validatingwebhookconfiguration", self.name, "--ignore-not-found")


def apply(cluster: Any, tmp: Path, obj: dict[str, Any], *, dry_run: bool = False,
          user: str | None = None) -> subprocess.CompletedProcess[str]:
    path = tmp / f"{obj['kind']}-{obj['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(obj))
    args = ["apply", "-f", str(path)] + (["--dry-run=server"] if dry_run else []) + (["--as", user] if user else [])
    return cluster.kubectl(*args, check=False)


def wait_until_enforced(cluster: Any, tmp: Path, probe: dict[str, Any]) -> None:
    """The API server picks up a new webhook configuration from its watch; until then claims pass unchecked."""
    deadline = time.monotonic() + 30
    while True:
        proc = apply(cluster, tmp, probe, dry_run=True)
        if proc.returncode != 0 and "denied the request" in proc.stderr:
            return
        assert time.monotonic() < deadline, f"the webhook was never called: {proc.stdout} {proc.stderr}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def namespace(cluster: Any) -> Iterator[str]:
    cluster.kubectl("create", "namespace", NAMESPACE)
    yield NAMESPACE
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("webhook-e2e")


@pytest.fixture(scope="module")
def certs(tmp: Path) -> ServingCert:
    return make_serving_cert(tmp / "tls")


def _webhook(cluster: Any, certs: ServingCert, tmp: Path, *, compat: bool, name: str,
             probe: dict[str, Any]) -> Iterator[Webhook]:
    hook = Webhook(cluster, certs, NVIDIA_DRIVER_NAME if compat else DRIVER, compat, name)
    hook.start()
    try:
        hook.register(tmp)
        wait_until_enforced(cluster, tmp, probe)
        yield hook
    finally:
        hook.unregister()
        hook.stop()


@pytest.fixture(scope="module")
def webhook(cluster: Any, namespace: str, certs: ServingCert, tmp: Path) -> Iterator[Webhook]:
    yield from _webhook(cluster, certs, tmp, compat=False, name="gpu-dra-e2e-webhook",
                        probe=claim("probe", DRIVER, BAD_MPS))


def test_kubectl_apply_refuses_a_claim_with_a_bad_config_naming_the_field(cluster: Any, webhook: Webhook,
                                                                          tmp: Path) -> None:
    proc = apply(cluster, tmp, claim("bad-mps", DRIVER, BAD_MPS))
    assert proc.returncode != 0
    assert f'admission webhook "resourceclaims.{DRIVER}" denied the request' in proc.stderr, proc.stderr
    assert BAD_FIELD in proc.stderr, proc.stderr
    assert cluster.kubectl("get", "resourceclaim", "-n", NAMESPACE, "bad-mps", check=False).returncode != 0


def test_kubectl_apply_refuses_a_template_with_a_bad_config_naming_the_field(cluster: Any, webhook: Webhook,
                                                                             tmp: Path) -> None:
    typo = {**GOOD_MPS, "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentag": 50}}}
    proc = apply(cluster, tmp, template("bad-template", DRIVER, typo))
    assert proc.returncode != 0
    assert f'admission webhook "resourceclaimtemplates.{DRIVER}" denied the request' in proc.stderr, proc.stderr
    assert "spec.spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentag: unknown field" \
        in proc.stderr, proc.stderr


def test_good_configs_no_configs_and_other_drivers_configs_are_created(cluster: Any, webhook: Webhook,
                                                                       tmp: Path) -> None:
    for obj in (claim("good-mps", DRIVER, GOOD_MPS), template("good-template", DRIVER, GOOD_MPS),
                claim("no-config", None), claim("other-driver", "other.example.com", BAD_MPS),
                template("other-driver-template", "other.example.com", {"anything": True})):
        proc = apply(cluster, tmp, obj)
        assert proc.returncode == 0, (obj["metadata"]["name"], proc.stderr)
        assert "created" in proc.stdout


def test_claims_the_resource_claim_controller_makes_are_not_sent(cluster: Any, webhook: Webhook, tmp: Path) -> None:
    """Claims made for pods from templates were checked as templates: the webhook is not asked again, so a webhook
    that is down (failurePolicy Fail) never holds up a pod."""
    proc = apply(cluster, tmp, claim("from-template", DRIVER, BAD_MPS), user=CONTROLLER_SA)
    assert proc.returncode == 0, proc.stderr


def test_nvidia_compat_mode_checks_nvidias_types(cluster: Any, namespace: str, certs: ServingCert,
                                                 tmp: Path) -> None:
    bad = {"apiVersion": NVIDIA_CONFIG_API_VERSION, "kind": "GpuConfig",
           "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": True}}}
    good = {"apiVersion": NVIDIA_CONFIG_API_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}
    for _ in _webhook(cluster, certs, tmp, compat=True, name="gpu-dra-e2e-webhook-compat",
                      probe=claim("probe-nvidia", NVIDIA_DRIVER_NAME, bad)):
        proc = apply(cluster, tmp, claim("nvidia-bad", NVIDIA_DRIVER_NAME, bad))
        assert proc.returncode != 0
        assert f'admission webhook "resourceclaims.{NVIDIA_DRIVER_NAME}" denied the request' in proc.stderr
        assert ("spec.devices.config[0].opaque.parameters.sharing.mpsConfig.multiUser: multi-user MPS is not "
                "supported") in proc.stderr, proc.stderr
        for obj in (claim("nvidia-good", NVIDIA_DRIVER_NAME, good), template("nvidia-good", NVIDIA_DRIVER_NAME, good)):
            proc = apply(cluster, tmp, obj)
            assert proc.returncode == 0, proc.stderr


def test_a_webhook_that_is_down_refuses_only_claims_configuring_the_driver(cluster: Any, namespace: str,
                                                                           certs: ServingCert, tmp: Path) -> None:
    """failurePolicy Fail: what the webhook would check is refused while it is down; nothing else is held up."""
    for hook in _webhook(cluster, certs, tmp, compat=False, name="gpu-dra-e2e-webhook-down",
                         probe=claim("probe-down", DRIVER, BAD_MPS)):
        hook.stop()
        proc = apply(cluster, tmp, claim("while-down", DRIVER, GOOD_MPS))
        assert proc.returncode != 0
        assert f'failed calling webhook "resourceclaims.{DRIVER}"' in proc.stderr, proc.stderr
        for obj in (claim("while-down-no-config", None), claim("while-down-other", "other.example.com", BAD_MPS)):
            proc = apply(cluster, tmp, obj)
            assert proc.returncode == 0, proc.stderr
        assert apply(cluster, tmp, claim("while-down-controller", DRIVER, GOOD_MPS), user=CONTROLLER_SA).returncode == 0


# --- slow and idle clients ---------------------------------------------------------------------------------------

# Four trickling bodies per worker of the webhook (ConnectionLimits.workers), as in the report: each declares the
# largest body the webhook takes and sends one byte every two seconds.
SLOW_BODIES = 4 * 4
IDLE = 128
API_SERVER_TIMEOUT = 5.0  # the chart's webhook.timeoutSeconds


def _review(obj: dict[str, Any], uid: str) -> bytes:
    request = {"uid": uid, "kind": {"group": "resource.k8s.io", "version": "v1", "kind": obj["kind"]},
               "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
               "operation": "CREATE", "namespace": NAMESPACE, "object": obj, "userInfo": {"username": "alice"}}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def _timed_request(hook: Webhook, method: str, path: str, body: bytes | None = None) -> tuple[float, int, bytes]:
    """Seconds to the answer (connection and TLS handshake included), its status and body; from 127.0.0.1."""
    ctx = ssl.create_default_context(cafile=str(hook.certs.ca))
    began = time.monotonic()
    conn = http.client.HTTPSConnection("127.0.0.1", hook.port, context=ctx, timeout=2 * API_SERVER_TIMEOUT)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        data = resp.read()
    except TimeoutError:
        raise AssertionError(f"{method} {path}: no answer within {2 * API_SERVER_TIMEOUT:.0f}s") from None
    finally:
        conn.close()
    return time.monotonic() - began, resp.status, data


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        sock.settimeout(0)
        return sock.recv(1) == b""
    except (BlockingIOError, ssl.SSLWantReadError):
        return False
    except OSError:  # reset
        return True


def test_slow_bodies_and_idle_connections_do_not_delay_a_review(certs: ServingCert) -> None:
    """128 idle connections, then 16 clients that send a complete head (Content-Length: 3145728) and trickle the
    body: a review and /healthz are still answered within a second, and every trickling client is cut before the
    API server's webhook timeout. The clients come from other loopback addresses than the review, as other pods
    would (several, as the idle ones fill more than one client's share)."""
    hook = Webhook(None, certs, DRIVER, False, "slow-clients")
    hook.start()
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    opened: dict[socket.socket, float] = {}
    done = threading.Event()

    def trickle() -> None:
        while not done.wait(2.0):
            for sock in list(opened):
                try:
                    sock.sendall(b" ")
                except OSError:  # cut by the server
                    pass

    try:
        with ExitStack() as stack:
            for i in range(IDLE):
                stack.enter_context(closing(socket.create_connection(
                    ("127.0.0.1", hook.port), timeout=5, source_address=(f"127.0.1.{1 + i // 32}", 0))))
            for _ in range(SLOW_BODIES):
                raw = socket.create_connection(("127.0.0.1", hook.port), timeout=5, source_address=("127.0.2.1", 0))
                sock = stack.enter_context(closing(ctx.wrap_socket(raw, server_hostname="127.0.0.1")))
                sock.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 3145728\r\n\r\n{")
                opened[sock] = time.monotonic()
            threading.Thread(target=trickle, daemon=True).start()
            try:
                took, status, data = _timed_request(hook, "POST", "/validate",
                                                    _review(claim("slow-bad", DRIVER, BAD_MPS), "uid-bad"))
                assert status == 200, data
                answer = json.loads(data)["response"]
                assert answer["uid"] == "uid-bad" and answer["allowed"] is False, answer
                assert BAD_FIELD in answer["status"]["message"]
                assert took < 1, f"a review waited {took:.1f}s behind slow and idle clients"
                took, status, data = _timed_request(hook, "POST", "/validate",
                                                    _review(claim("slow-good", DRIVER, GOOD_MPS), "uid-good"))
                assert status == 200 and json.loads(data)["response"] == {"uid": "uid-good", "allowed": True}, data
                assert took < 1, f"a review waited {took:.1f}s behind slow and idle clients"
                took, status, data = _timed_request(hook, "GET", "/healthz")
                assert status == 200 and took < 1, (status, data, f"{took:.1f}s")
                # Every trickling client is cut before the API server would have given up on a review it sent.
                deadline = time.monotonic() + 3 * API_SERVER_TIMEOUT
                cut: dict[socket.socket, float] = {}
                while len(cut) < len(opened) and time.monotonic() < deadline:
                    for sock in opened.keys() - cut.keys():
                        if _closed_by_server(sock):
                            cut[sock] = time.monotonic() - opened[sock]
                    time.sleep(0.05)
                assert len(cut) == len(opened), f"{len(opened) - len(cut)} trickling clients still held"
                assert max(cut.values()) < API_SERVER_TIMEOUT, f"a trickling client held {max(cut.values()):.1f}s"
            finally:
                done.set()
    finally:
        hook.stop()
