"""The chart's Grafana dashboard run on a real Prometheus (testbed.prometheus): every variable and panel query, as
Grafana would send it, answers with the series of the pods under test."""
from __future__ import annotations

import json
import re

from testbed.helmchart import CHART
from testbed.prometheus import Prometheus

DASHBOARD = CHART / "files" / "dashboards" / "gpu-dra-claims.json"
MEMORY = "gpu_dra_claim_gpu_memory_used_bytes"


def check_the_dashboard(prom: Prometheus, *, namespace: str, node: str, gpu_uuid: str, pods: set[str],
                        memory: float) -> None:
    """Every variable and panel query of the dashboard, with the variables at the pods' namespace and node: each
    answers with the `pods`' series (all of them in `namespace`, on the GPU `gpu_uuid`), or grouped by namespace
    or GPU with theirs; the memory panels add up to `memory` bytes."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = {"namespace": namespace, "pod": ".*", "node": node, "gpu": ".*"}

    def substituted(expr: str) -> str:
        out = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)
        assert "$" not in out, out
        return out

    variables = {"namespace": {namespace}, "pod": pods, "node": {node}, "gpu": {gpu_uuid}}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
        assert m, variable["query"]["query"]
        got = set(prom.label_values(m.group(2), substituted(m.group(1))))
        assert variables[variable["name"]] <= got, (variable["name"], got)
        if variable["name"] != "namespace":   # the other variables follow the namespace chosen
            assert got == variables[variable["name"]], (variable["name"], got)

    checked = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = substituted(target["expr"])
            result = prom.query(expr)
            assert result, f"panel {panel['title']!r}: no series for {expr}"
            labels = [r["metric"] for r in result]
            # Each label a panel groups by has the pods' values: both pods where it names pods.
            if any("pod" in m for m in labels):
                assert {m["pod"] for m in labels} == pods, (panel["title"], labels)
            if any("namespace" in m for m in labels):
                assert {m["namespace"] for m in labels} == {namespace}, (panel["title"], labels)
            if any("gpu_uuid" in m for m in labels):
                assert {m["gpu_uuid"] for m in labels} == {gpu_uuid}, (panel["title"], labels)
            if "source" in labels[0]:
                assert {m["source"] for m in labels} == {"podresources", "nvml", "apiserver"}, labels
                assert all(float(r["value"][1]) == 0 for r in result), result
            if MEMORY in expr:
                total = sum(float(r["value"][1]) for r in result)
                assert total == memory, (panel["title"], result)
            checked += 1
    assert checked == sum(len(p.get("targets", [])) for p in dashboard["panels"]) > 0
