"""`gpu-dra advise` as a whole, against a scripted API server and a scripted Prometheus: the table, the document and
the templates it prints for a Deployment on a whole GPU and a finished Job's pod on a MIG device, a snapshot of a
plugin's /metrics, and one line and one exit status for each bad input (no series, a gap, Prometheus unreachable
or not there, bad flags)."""
from __future__ import annotations

import json
import os
import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpu_fixtures import from_catalog, inventory
from scripted_http import Request, Scripted, response

from cli.kubectl_gpu import command_and_rest
from cli.main import main
from dra.model.policy import parse_node_policy
from dra.model.slices import ApiFeatures, plan_pool
from ops.advise.history import queries

D = "gpu.dra-driver.io"
PRODUCT = "NVIDIA H100 80GB HBM3"
MIB = 1 << 20
NB_POD, JOB_POD = "nb-7d4f9c8b6-x7k2p", "train-q8z4w"
POD_SPEC = {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "nb-gpu"}], "containers": []}


def slices() -> list[dict[str, Any]]:
    policy = parse_node_policy({"default": {"wholeGpu": True, "mig": "dynamic"}, "rules": [
        {"match": {"index": 1}, "slots": {"count": 4, "strategy": "mps"}},
        {"match": {"index": 2}, "memoryShares": {"minimum": "1Gi", "step": "1Gi"}}]}, "test")
    plan = plan_pool(inventory(*(from_catalog("H100-80GB", i) for i in range(3))), policy, D, "node-a",
                     ApiFeatures.for_server(37))
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"s{i}"}, "spec": s}
            for i, s in enumerate(plan.slices)]


def owner(kind: str, name: str) -> list[dict[str, Any]]:
    return [{"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": "u", "controller": True}]


OBJECTS: dict[str, dict[str, Any]] = {
    f"/api/v1/namespaces/ml/pods/{NB_POD}": {
        "metadata": {"name": NB_POD, "namespace": "ml", "ownerReferences": owner("ReplicaSet", "nb-7d4f9c8b6")},
        "spec": POD_SPEC, "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "nb-claim"}]}},
    "/apis/apps/v1/namespaces/ml/replicasets/nb-7d4f9c8b6": {
        "metadata": {"name": "nb-7d4f9c8b6", "ownerReferences": owner("Deployment", "nb")}},
    "/apis/apps/v1/namespaces/ml/deployments/nb": {"metadata": {"name": "nb"},
                                                   "spec": {"template": {"spec": POD_SPEC}}},
    "/apis/batch/v1/namespaces/ml/jobs/train": {"metadata": {"name": "train"}, "spec": {"template": {"spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "train-gpu"}]}}}},
    "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaimtemplates/nb-gpu": {
        "metadata": {"name": "nb-gpu", "namespace": "ml"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": D}}]}}}},
}
LISTS = {"/apis/batch/v1/namespaces/ml/jobs": ["train"]}


PLUGIN_POD = {"metadata": {"name": "gpu-dra-kubelet-plugin-x7k2p", "namespace": "gpu-dra"},
              "status": {"phase": "Running"}}
PROXY = "/api/v1/namespaces/gpu-dra/pods/gpu-dra-kubelet-plugin-x7k2p:metrics/proxy/metrics"


def exposition(series: list[tuple[dict[str, str], float]]) -> str:
    return "".join(f"gpu_dra_claim_gpu_memory_used_bytes{{{','.join(f'{k}={json.dumps(v)}' for k, v in m.items())}}} "
                   f"{v}\n" for m, v in series)


def text_response(text: str) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(text)}\r\n\r\n{text}".encode()


def api_answer(req: Request) -> bytes:
    path = urllib.parse.urlsplit(req.target).path
    if path == "/api/v1/pods":
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(req.target).query)
        on_node_a = query.get("fieldSelector") == ["spec.nodeName=node-a"] and query.get("labelSelector") == [
            "app.kubernetes.io/name=gpu-dra-driver,app.kubernetes.io/component=kubelet-plugin"]
        return response({"metadata": {}, "items": [PLUGIN_POD] if on_node_a else []})
    if path == PROXY:
        return text_response(exposition(SERIES))
    if path == "/apis/resource.k8s.io/v1/resourceslices":
        return response({"kind": "ResourceSliceList", "metadata": {}, "items": slices()})
    if path in OBJECTS:
        return response(OBJECTS[path])
    if path.startswith(("/apis/apps/v1/namespaces/ml/", "/apis/batch/v1/namespaces/ml/")) and path.count("/") == 6:
        return response({"metadata": {}, "items": [{"metadata": {"name": n}} for n in LISTS.get(path, [])]})
    return response({"kind": "Status", "reason": "NotFound", "message": f"{path} not found", "code": 404}, 404)


def labels(pod: str, claim: str, device: str, profile: str = "") -> dict[str, str]:
    return {"namespace": "ml", "pod": pod, "container": "main", "claim": claim, "request": "gpu", "device": device,
            "gpu_uuid": "GPU-0", "mig_profile": profile, "sharing": "none", "Hostname": "node-a", "gpu": "0",
            "UUID": "GPU-0", "modelName": PRODUCT, "instance": "10.0.0.1:8080"}


SERIES = [(labels(NB_POD, "nb-claim", "gpu-0"), 6000 * MIB),
          (labels(JOB_POD, f"{JOB_POD}-gpu-bbbbb", "gpu-0-mig-3g40gb-9-4", "3g.40gb"), 3000 * MIB)]


def prometheus_answer(series: list[tuple[dict[str, str], float]], gap: bool = False) -> Any:
    def answer(req: Request) -> bytes:
        form = {k: v[0] for k, v in urllib.parse.parse_qs(req.body.decode()).items()}
        if req.target.endswith("query_range"):
            start, end, step = float(form["start"]), float(form["end"]), float(form["step"])
            n = int((end - start) / step) + 1
            values = [[start + i * step, "2"] for i in range(n) if not (gap and n // 3 < i < n // 2)]
            return response({"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": {"instance": "10.0.0.1:8080"}, "values": values}]}})
        figure = next((f for f, q in queries(7 * 86400, "").items() if q == form["query"]), "")
        value = {"samples": 20000, "first": float(form["time"]) - 7 * 86400 + 60, "last": float(form["time"]),
                 "sm_peak": 0, "sm_p95": 0}
        result = [{"metric": m, "value": [1, str(value.get(figure, peak if figure == "peak" else peak * 0.9))]}
                  for m, peak in series] if figure else []
        return response({"status": "success", "data": {"resultType": "vector", "result": result}})
    return answer


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    server = Scripted(api_answer)
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": server.url}}],
        "users": [{"name": "ann", "user": {"token": "t"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "ann"}}]}))
    monkeypatch.setitem(os.environ, "KUBERNETES_SERVICE_HOST", "")
    yield config
    server.stop()


def advise(capsys: pytest.CaptureFixture[str], config: Path, prom: Any, *flags: str) -> tuple[int, str, str]:
    server = Scripted(prom) if callable(prom) else None
    url = server.url if server else str(prom)
    try:
        code = main(["advise", "--prometheus", url, "--kubeconfig", str(config), *flags])
    finally:
        if server:
            server.stop()
    out, err = capsys.readouterr()
    return code, out, err


def test_the_table_names_each_workload_and_its_advice(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = advise(capsys, cluster, prometheus_answer(SERIES))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("advice from Prometheus http://127.0.0.1:") and " over 7d to " in lines[0]
    head, nb, job = lines[2:5]
    assert head.split() == ["NAMESPACE", "WORKLOAD", "TEMPLATE/REQUEST", "GPU", "RAN", "ON", "PEAK", "P95",
                            "ADVICE", "FREES"]
    assert nb.split() == ["ml", "deployment/nb", "nb-gpu/gpu", "H100-80GB", "whole", "GPU", "5.86Gi", "5.27Gi",
                          "share", "8Gi", "0.90"]
    assert job.split() == ["ml", "job/train", "train-gpu/gpu", "H100-80GB", "mig", "3g.40gb", "2.93Gi", "2.64Gi",
                           "share", "4Gi", "0.45"]
    assert "ml deployment/nb nb-gpu/gpu: peak 5.86 GiB, p95 5.27 GiB, 20000 samples over 6d23h" in out


def test_json_and_the_templates_to_apply(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = advise(capsys, cluster, prometheus_answer(SERIES), "-o", "json", "--kinds", "mig")
    doc = json.loads(out)
    assert code == 0 and doc["source"]["kind"] == "prometheus" and doc["gaps"] == []
    nb, job = doc["advice"]
    assert nb["workload"] == {"kind": "Deployment", "name": "nb"} and nb["verdict"] == "resize"
    assert nb["recommendation"]["device"] == "mig 1g.10gb" and nb["freesGpuFraction"] == round(6 / 7, 4)
    assert job["workload"] == {"kind": "Job", "name": "train"} and job["recommendation"]["profile"] == "1g.10gb"
    code, out, _ = advise(capsys, cluster, prometheus_answer(SERIES), "--emit", "templates", "--kinds", "mig")
    assert code == 0 and out.startswith("# advice from Prometheus")
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert [d["metadata"]["name"] for d in docs] == ["nb-gpu-1g10gb", "train-gpu-1g10gb"]
    assert docs[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == f"mig.{D}"
    assert "# then: kubectl -n ml patch deployment/nb --type=json -p '[{\"op\": \"replace\", \"path\": " \
           "\"/spec/template/spec/resourceClaims/0/resourceClaimTemplateName\", \"value\": \"nb-gpu-1g10gb\"}]'" in out
    assert "# then create ml/job/train again with resourceClaims[0] (gpu) resourceClaimTemplateName: " \
           "train-gpu-1g10gb (its pod template cannot be changed)" in out


def test_a_snapshot_of_a_plugins_metrics(cluster: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = Scripted(lambda req: text_response(exposition(SERIES)))
    try:
        code = main(["advise", "--from-node", "node-a", "--metrics-url", f"{server.url}/metrics", "--kubeconfig",
                     str(cluster), "-o", "wide"])
    finally:
        server.stop()
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[0].startswith(f"advice from a snapshot of node node-a ({server.url}/metrics) at ")
    assert "memory now, not peaks over time" in out.splitlines()[0]
    assert "snapshot: 5.86 GiB now" in out and " now " in out.splitlines()[3]


def test_a_snapshot_through_the_api_servers_proxy_to_the_plugin_pod(cluster: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--from-node", "node-a", "--kubeconfig", str(cluster)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("advice from a snapshot of node node-a (pod gpu-dra/gpu-dra-kubelet-plugin-x7k2p) at ")
    assert main(["advise", "--from-node", "node-b", "--kubeconfig", str(cluster)]) == 1
    assert capsys.readouterr().err == ("gpu-dra advise: no running kubelet plugin pod of the driver on node node-b "
                                       "(labels app.kubernetes.io/name=gpu-dra-driver,app.kubernetes.io/component="
                                       "kubelet-plugin): is the chart installed there?\n")


def test_no_series_a_gap_and_prometheus_away_are_one_line_each(cluster: Path, capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    code, out, err = advise(capsys, cluster, prometheus_answer([]))
    assert code == 1 and out == ""
    assert err.startswith("gpu-dra advise: Prometheus at http://127.0.0.1:") and err.count("\n") == 1
    assert "has no gpu_dra_claim_gpu_memory_used_bytes series in the last 7d: does it scrape the kubelet plugins" in err
    code, out, err = advise(capsys, cluster, prometheus_answer(SERIES, gap=True))
    assert code == 3 and "share 8Gi" in out and err.count("\n") == 1
    assert err.startswith("gpu-dra advise: the window has a gap: no samples from the plugin at 10.0.0.1:8080 between ")
    assert err.rstrip().endswith(": a peak there is not seen") and "(1d3h)" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    code, out, err = advise(capsys, cluster, f"http://127.0.0.1:{closed}")
    assert (code, out) == (8, "") and err == (f"gpu-dra advise: cannot reach Prometheus at http://127.0.0.1:{closed}: "
                                              "connection refused - is the URL right and the server up?\n")
    code, out, err = advise(capsys, cluster, lambda req: b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    assert code == 8 and "is not a Prometheus HTTP API (POST /api/v1/query answered 404 with no JSON)" in err


@pytest.mark.parametrize("flags, line", [
    (["--window", "7 days"], "--window '7 days': a duration like 30m, 12h, 7d or 1h30m"),
    (["--headroom", "lots"], "--headroom 'lots': a percentage, e.g. 20%"),
    (["--kinds", "mig,vgpu"], "--kinds 'mig,vgpu': a comma-separated list of mig, slot, share, gpu"),
    (["--from-node", "node-a"], "--prometheus and --from-node/--metrics-url: one source at a time"),
    (["--prometheus-token-file", "/nonexistent/token"],
     "cannot read --prometheus-token-file /nonexistent/token: no such file or directory"),
])
def test_bad_flags(cluster: Path, capsys: pytest.CaptureFixture[str], flags: list[str], line: str) -> None:
    code, out, err = advise(capsys, cluster, "http://127.0.0.1:1", *flags)
    assert (code, out, err) == (2, "", f"gpu-dra advise: {line}\n")


def test_kubectl_gpu_advise_takes_flags_before_the_command() -> None:
    assert command_and_rest(["--prometheus", "http://p:9090", "advise", "-n", "ml"]) == \
        ("advise", ["--prometheus", "http://p:9090", "-n", "ml"])
