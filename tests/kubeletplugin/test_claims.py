"""Reading a claim from the API server: every way it can fail is a per-claim error of a kind (metric reason)
with one line, never an internal error with a traceback."""
from __future__ import annotations

import json

import pytest
from driver_node import Node, gpu_config, opaque

from kube.client import ApiError, ApiUnavailable, KubeApi
from kubeletplugin.claims import ClaimError, KubernetesClaimSource


class _Api:
    configuration = type("C", (), {"host": "https://127.0.0.1:1"})()


@pytest.mark.parametrize("error, reason, words", [
    (ApiUnavailable("GET https://127.0.0.1:1/apis/...: MaxRetryError: Connection refused"), "unavailable",
     "the API server is unavailable"),
    (ApiError("GET", "/x", 403, json.dumps({"reason": "Forbidden", "message": "user cannot get"})), "forbidden",
     "check the plugin's RBAC"),
    (ApiError("GET", "/x", 404, json.dumps({"reason": "NotFound", "details": {"name": "c"}})), "claim", "not found"),
    (ApiError("GET", "/x", 500, json.dumps({"reason": "InternalError", "message": "etcd"})), "api", "HTTP 500"),
])
def test_api_errors_become_claim_errors_by_kind(monkeypatch, error, reason, words):
    def fail(self, path, **query):
        raise error

    monkeypatch.setattr(KubeApi, "get", fail)
    with pytest.raises(ClaimError) as err:
        KubernetesClaimSource(_Api()).get_claim("ns", "c", "uid-1")
    assert err.value.reason == reason and words in str(err.value) and "\n" not in str(err.value)


def test_an_unreachable_api_server_fails_the_claim_cleanly_and_is_counted(tmp_path, monkeypatch):
    node = Node(tmp_path, {"default": {"wholeGpu": True}})
    ref = node.add_claim("c", [{"request": "g", "device": "gpu-0"}])

    def away(namespace, name, uid):
        raise ClaimError(f"reading ResourceClaim {namespace}/{name}: the API server is unavailable "
                         "(Connection refused); the kubelet retries", reason="unavailable")

    monkeypatch.setattr(node.claims, "get_claim", away)
    error = node.driver.prepare([ref])[ref.uid].error
    assert "the API server is unavailable" in error and "internal error" not in error
    value = node.metrics.prepare_errors.labels(reason="unavailable")._value.get()
    assert value == 1 and node.driver.checkpoint.get(ref.uid) is None


def test_a_config_for_all_requests_with_a_bad_kind_fails_the_claim(tmp_path):
    """An entry naming no requests used to be skipped in silence when its kind was wrong (the claim ran with
    the defaults: 25 % instead of the 10 % asked for)."""
    node = Node(tmp_path, {"default": {"wholeGpu": False, "slots": {"count": 4, "strategy": "mps"}}})
    for parameters, words in [
        ({**gpu_config(strategy="MPS", mps={"activeThreadPercentage": 10}), "kind": "GPUConfig"}, "unsupported 'GPUConfig'"),
        ({k: v for k, v in gpu_config(strategy="MPS").items() if k != "kind"}, "kind: missing"),
        ({**gpu_config(strategy="MPS"), "kind": 7}, "kind: unsupported 7"),
        ("not an object", "parameters must be an object"),
    ]:
        ref = node.add_claim("c", [{"request": "s", "device": "gpu-0-slot-0"}], [opaque(parameters)])
        error = node.driver.prepare([ref])[ref.uid].error
        assert "status.allocation.devices.config[0].opaque.parameters" in error and words in error, error
        assert node.driver.checkpoint.get(ref.uid) is None
