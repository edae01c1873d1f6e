"""The validating admission webhook (controller/webhook.py): review answers and the TLS server."""
from __future__ import annotations

import copy
import json
import os
import shutil
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from claims import admission_review, request, resource_claim
from tlscerts import ServingCert, make_serving_cert

from api.config import ConfigError, decode_opaque_config
from api.names import CONFIG_API_VERSION, DEFAULT_DRIVER_NAME, NVIDIA_CONFIG_API_VERSION, NVIDIA_DRIVER_NAME
from controller.webhook import review, serve

ROOT = Path(__file__).resolve().parents[2]
DRIVER = DEFAULT_DRIVER_NAME
BAD_MPS = {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig",
           "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 150}}}
GOOD_MPS = {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}


def claim(*configs: tuple[str, Any], api_version: str = "resource.k8s.io/v1") -> dict[str, Any]:
    return resource_claim("c", "ns", api_version=api_version, requests=[request("gpu", DRIVER)],
                          config=[{"requests": ["gpu"], "opaque": {"driver": d, "parameters": p}} for d, p in configs])


def template(*configs: tuple[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t", "namespace": "ns"}, "spec": {"spec": claim(*configs)["spec"]}}


def answer(obj: dict[str, Any], *, compat_nvidia: bool = False, driver: str = DRIVER, **kw: Any) -> dict[str, Any]:
    out = review(admission_review(obj, **kw), driver_name=driver, compat_nvidia=compat_nvidia)
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == "0b8a0d6e-2f5e-4c1e-9f0e-1b2c3d4e5f60"
    return out["response"]


def plugin_message(parameters: Any, prefix: str, *, compat_nvidia: bool = False) -> str:
    """What the plugin's decoder says about these parameters, placed at `prefix`."""
    with pytest.raises(ConfigError) as err:
        decode_opaque_config(parameters, compat_nvidia=compat_nvidia)
    return str(err.value.with_prefix(prefix))


# --- review answers ----------------------------------------------------------------------------------------

def test_a_bad_config_is_denied_with_the_plugins_message_at_the_claims_field() -> None:
    response = answer(claim((DRIVER, BAD_MPS)))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert ("spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentage: "
            "must be between 1 and 100, got 150") in message
    assert message == plugin_message(BAD_MPS, "spec.devices.config[0].opaque.parameters")
    assert (response["status"]["code"], response["status"]["reason"]) == (422, "Invalid")


def test_a_template_names_the_field_under_spec_spec_and_the_entrys_index() -> None:
    response = answer(template((DRIVER, GOOD_MPS), (DRIVER, {**GOOD_MPS, "kind": "GpuConfg"})))
    assert response["allowed"] is False
    assert response["status"]["message"].startswith(f"{CONFIG_API_VERSION}: spec.spec.devices.config[1].opaque"
                                                    ".parameters.kind: unsupported 'GpuConfg'")


def test_every_bad_entry_is_reported() -> None:
    unknown = {**GOOD_MPS, "sharing": {"strategy": "MPS", "mps": {"activeThreads": 5}}}
    response = answer(claim((DRIVER, BAD_MPS), (DRIVER, GOOD_MPS), (DRIVER, unknown), (DRIVER, "not an object")))
    message = response["status"]["message"]
    for i in (0, 2, 3):
        assert f"spec.devices.config[{i}].opaque.parameters" in message
    assert "config[1]" not in message
    assert "spec.devices.config[2].opaque.parameters.sharing.mps.activeThreads: unknown field" in message
    assert "spec.devices.config[3].opaque.parameters: parameters must be an object" in message


def test_good_configs_and_other_drivers_configs_are_allowed() -> None:
    assert answer(claim((DRIVER, GOOD_MPS))) == {"uid": answer(claim())["uid"], "allowed": True}
    # Another driver's parameters are its business, whatever they hold.
    assert answer(claim(("other.example.com", BAD_MPS), ("other.example.com", {"anything": 1})))["allowed"]
    # A claim without configs, and one whose driver differs only in case.
    assert answer(claim())["allowed"]
    assert answer(claim((DRIVER.upper(), BAD_MPS)))["allowed"]


def test_compat_mode_checks_nvidias_types_under_nvidias_driver_name() -> None:
    nvidia_bad = {"apiVersion": NVIDIA_CONFIG_API_VERSION, "kind": "GpuConfig",
                  "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}}
    nvidia_good = {"apiVersion": NVIDIA_CONFIG_API_VERSION, "kind": "GpuConfig",
                   "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}
    compat = {"compat_nvidia": True, "driver": NVIDIA_DRIVER_NAME}
    assert answer(claim((NVIDIA_DRIVER_NAME, nvidia_good)), **compat)["allowed"]
    response = answer(claim((NVIDIA_DRIVER_NAME, nvidia_bad)), **compat)
    assert ("spec.devices.config[0].opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage: "
            "must be between 1 and 100, got 0") in response["status"]["message"]
    assert response["status"]["message"] == plugin_message(nvidia_bad, "spec.devices.config[0].opaque.parameters",
                                                           compat_nvidia=True)
    # Our own types stay valid in compat mode; NVIDIA's are refused outside it, saying why.
    assert answer(claim((NVIDIA_DRIVER_NAME, GOOD_MPS)), **compat)["allowed"]
    outside = answer(claim((DRIVER, nvidia_good)))
    assert "accepted only in NVIDIA compatibility mode" in outside["status"]["message"]


@pytest.mark.parametrize("version", ["v1beta1", "v1beta2"])
def test_older_api_versions_have_the_same_config_shape(version: str) -> None:
    obj = claim((DRIVER, BAD_MPS), api_version=f"resource.k8s.io/{version}")
    response = answer(obj, version=version)
    assert "spec.devices.config[0].opaque.parameters.sharing.mps.activeThreadPercentage" in response["status"]["message"]


def test_deletes_and_subresources_are_not_checked() -> None:
    assert answer(claim((DRIVER, BAD_MPS)), operation="DELETE")["allowed"]
    assert answer(claim((DRIVER, BAD_MPS)), operation="UPDATE", sub_resource="status")["allowed"]
    # A spec update (immutable; the API server refuses it anyway) is checked like a creation.
    assert not answer(claim((DRIVER, BAD_MPS)), operation="UPDATE")["allowed"]


@pytest.mark.parametrize("body", [None, [], {}, {"request": {}}, {"request": {"uid": 7}}])
def test_a_body_that_is_no_admission_review_is_an_error(body: Any) -> None:
    with pytest.raises(ValueError, match="not an AdmissionReview request"):
        review(body, driver_name=DRIVER, compat_nvidia=False)


def test_malformed_objects_are_allowed_and_left_to_the_api_servers_validation() -> None:
    # The API server validates the object's schema before validating webhooks run; these never get here intact,
    # but must not crash the webhook.
    for spec in (None, [], {"devices": None}, {"devices": {"config": {"x": 1}}}, {"devices": {"config": [None, 3]}},
                 {"devices": {"config": [{"opaque": None}, {"opaque": {"parameters": BAD_MPS}}]}}):
        obj = {"kind": "ResourceClaim", "spec": spec}
        assert answer(obj)["allowed"], spec


def _example_objects() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((ROOT / "examples").glob("*/*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") in ("ResourceClaim", "ResourceClaimTemplate"):
                yield f"{path.parent.name}/{path.name}", doc


def test_every_example_claim_is_admitted() -> None:
    objects = list(_example_objects())
    assert len(objects) >= 8
    configured = 0
    for where, obj in objects:
        compat = "nvidia" in where
        driver = NVIDIA_DRIVER_NAME if compat else DRIVER
        configured += str(obj).count(f"'driver': '{driver}'")
        response = answer(obj, compat_nvidia=compat, driver=driver)
        assert response["allowed"], (where, response)
    assert configured >= 2, "no example carries an opaque config for the driver"


# --- the TLS server ----------------------------------------------------------------------------------------

@pytest.fixture
def certs(tmp_path: Path) -> ServingCert:
    return make_serving_cert(tmp_path / "tls")


@pytest.fixture
def server(certs: ServingCert) -> Iterator[str]:
    srv = serve("127.0.0.1", 0, str(certs.cert), str(certs.key), driver_name=DRIVER, compat_nvidia=False)
    yield f"https://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _call(url: str, ca: Path, body: bytes | None = None) -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_server_answers_reviews_and_health_over_tls(server: str, certs: ServingCert) -> None:
    status, body = _call(f"{server}/validate", certs.ca, json.dumps(admission_review(claim((DRIVER, BAD_MPS)))).encode())
    assert status == 200
    response = json.loads(body)["response"]
    assert response["allowed"] is False and "activeThreadPercentage" in response["status"]["message"]
    assert _call(f"{server}/healthz", certs.ca) == (200, b"ok\n")
    assert _call(f"{server}/readyz", certs.ca) == (200, b"ok\n")
    assert _call(f"{server}/validate", certs.ca, b"{not json")[0] == 400
    assert _call(f"{server}/validate", certs.ca, b"{}")[0] == 400
    assert _call(f"{server}/other", certs.ca, b"{}")[0] == 404
    status, metrics = _call(f"{server}/metrics", certs.ca)
    assert status == 200 and b'gpu_dra_webhook_reviews_total{resource="resourceclaims",result="denied"}' in metrics


def test_a_rotated_certificate_is_served_to_new_connections(server: str, certs: ServingCert, tmp_path: Path) -> None:
    assert _call(f"{server}/healthz", certs.ca)[0] == 200
    new = make_serving_cert(tmp_path / "rotated", name="rotated")
    # As the kubelet updates a Secret volume: new files put in place by rename.
    for src, dest in ((new.cert, certs.cert), (new.key, certs.key)):
        shutil.copy(src, str(dest) + ".new")
        os.replace(str(dest) + ".new", dest)
    assert _call(f"{server}/healthz", new.ca)[0] == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _call(f"{server}/healthz", certs.ca)


def test_a_broken_certificate_file_keeps_the_loaded_one(server: str, certs: ServingCert) -> None:
    certs.cert.write_text("not a certificate\n")
    assert _call(f"{server}/healthz", certs.ca)[0] == 200


def test_an_unusable_certificate_fails_the_start(tmp_path: Path, certs: ServingCert) -> None:
    from cli.main import main

    bad = tmp_path / "bad.crt"
    bad.write_text("nope\n")
    assert main(["webhook", "--port", "0", "--tls-cert-file", str(bad), "--tls-private-key-file",
                 str(certs.key)]) == 2
    with pytest.raises(ssl.SSLError):
        serve("127.0.0.1", 0, str(bad), str(certs.key), driver_name=DRIVER, compat_nvidia=False)


def test_a_claim_copy_is_not_modified() -> None:
    obj = claim((DRIVER, BAD_MPS))
    before = copy.deepcopy(obj)
    answer(obj)
    assert obj == before


# --- hostile input: line breaks in names, deep nesting, made-up resources -------------------------------------

def test_a_newline_in_a_map_key_is_escaped_in_the_denial_and_the_log(caplog: pytest.LogCaptureFixture) -> None:
    forged = "x\n2026-01-01 00:00:00 INFO controller.webhook: allowed everything"
    params = {**GOOD_MPS, "sharing": {"strategy": "MPS", "mps": {forged: 1, "bell\x07\u202e": 2}}}
    obj = claim((DRIVER, params))
    obj["metadata"]["name"] = "c\nforged"
    with caplog.at_level("INFO", logger="controller.webhook"):
        message = answer(obj)["status"]["message"]
    assert "\n" not in message and "\x07" not in message and "\u202e" not in message
    assert "sharing.mps.x\\n2026-01-01 00:00:00 INFO" in message and "bell\\x07\\u202e: unknown field" in message
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("denied")]
    assert "\n" not in line and "ns/c\\nforged" in line and "sharing.mps.x\\n2026" in line


def test_control_characters_are_escaped_in_every_part_of_a_config_message() -> None:
    # The kind (no apiVersion to check it against) and a string value, besides keys.
    with pytest.raises(ConfigError) as err:
        decode_opaque_config({"kind": "Gpu\nConfig"}, compat_nvidia=False)
    assert "\n" not in str(err.value) and "Gpu\\nConfig" in str(err.value)
    with pytest.raises(ConfigError) as err:
        decode_opaque_config({**GOOD_MPS, "sharing": {"strategy": "MPS\r\n"}}, compat_nvidia=False)
    assert "\r" not in str(err.value) and "\n" not in str(err.value)


def _nested(levels: int) -> dict[str, Any]:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(levels - 1):
        node["a"] = {}
        node = node["a"]
    return deep


@pytest.mark.parametrize("levels", [31, 3000])
def test_deeply_nested_parameters_get_a_clear_denial(levels: int) -> None:
    from api.config.decode import MAX_PARAMETERS_DEPTH

    params = {**GOOD_MPS, "sharing": {"strategy": "MPS", "mps": _nested(levels)}}  # parameters are 2 levels more
    response = answer(claim((DRIVER, params)))
    assert response["status"]["message"] == \
        f"spec.devices.config[0].opaque.parameters: parameters nested deeper than {MAX_PARAMETERS_DEPTH} levels"
    # One level less is read, and refused for what it says.
    assert "unknown field" in answer(claim((DRIVER, {**GOOD_MPS, "sharing": {"strategy": "MPS", "mps": _nested(
        MAX_PARAMETERS_DEPTH - 2)}})))["status"]["message"]


def test_the_webhooks_json_bound_leaves_every_config_the_decoder_reads_intact() -> None:
    """Containers past MAX_JSON_DEPTH are read as null; that must only ever happen inside parameters the decoder
    refuses for depth anyway (a template's parameters sit 10 levels down in the review)."""
    from api.config.decode import MAX_PARAMETERS_DEPTH
    from controller.webhook import MAX_JSON_DEPTH
    from kube.boundedjson import loads_bounded

    assert MAX_JSON_DEPTH >= 10 + MAX_PARAMETERS_DEPTH + 1
    deepest = template((DRIVER, {**GOOD_MPS, "sharing": {"strategy": "MPS", "mps": _nested(MAX_PARAMETERS_DEPTH - 2)}}))
    review_ = admission_review(deepest)
    assert loads_bounded(json.dumps(review_).encode(), MAX_JSON_DEPTH) == review_
    too_deep = json.dumps(admission_review(claim((DRIVER, "DEEP")))).replace('"DEEP"', "[" * 2000 + "]" * 2000)
    decoded = loads_bounded(too_deep.encode(), MAX_JSON_DEPTH)
    params = decoded["request"]["object"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    depth = 0
    while isinstance(params, list):
        params, depth = (params[0] if params else None), depth + 1
    assert depth == MAX_JSON_DEPTH - 8 and params is None  # parameters of a claim sit at level 9


@pytest.mark.parametrize(("text", "depth", "expected"), [
    ('{"a": [1, {"b": "[[[["}], "c": {"d": {"e": 1}}}', 2, {"a": [1, None], "c": {"d": None}}),
    ('{"a": "]]]]}}}}", "b": [[[1]]]}', 3, {"a": "]]]]}}}}", "b": [[None]]}),
    ('{"s": "\\"{[", "t": [[]]}', 2, {"s": '"{[', "t": [None]}),
    ("[[[[]]]]", 4, [[[[]]]]),
])
def test_loads_bounded_cuts_only_containers_past_the_bound(text: str, depth: int, expected: Any) -> None:
    from kube.boundedjson import loads_bounded

    assert loads_bounded(text.encode(), depth) == expected


@pytest.mark.parametrize("text", ['{"a": [[[[', "[[[]]]]]", b"\xff[]"])
def test_loads_bounded_refuses_what_is_no_json(text: str | bytes) -> None:
    from kube.boundedjson import loads_bounded

    with pytest.raises(ValueError):
        loads_bounded(text.encode() if isinstance(text, str) else text, 2)


def test_reviews_of_other_resources_add_no_metric_series() -> None:
    from prometheus_client import REGISTRY

    body = admission_review(claim((DRIVER, GOOD_MPS)))
    body["request"]["resource"]["resource"] = "made-up-resource-7f3a"
    assert review(body, driver_name=DRIVER, compat_nvidia=False)["response"]["allowed"]
    assert REGISTRY.get_sample_value("gpu_dra_webhook_reviews_total",
                                     {"resource": "made-up-resource-7f3a", "result": "allowed"}) is None
    assert REGISTRY.get_sample_value("gpu_dra_webhook_reviews_total", {"resource": "other", "result": "allowed"})
