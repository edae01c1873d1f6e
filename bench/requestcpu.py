"""CPU per API request as the kubelet plugin makes them: ``python -m bench.requestcpu [TREE ...]``.

Not part of ``make bench`` (it compares source trees): starts a LocalCluster (run it under the e2e lock, as
other LocalCluster runs), creates one ResourceClaim and, for each source tree given (default: this one), runs a
fresh interpreter in that tree that connects as the plugin does (``kube.connect.api_client_from`` with the
admin kubeconfig: HTTPS with the cluster's CA, a bearer token) and times, with ``time.thread_time()``, N GETs of
the claim and N server-side-apply PATCHes of its status (the claim-status writer's request); ``--rounds`` rounds,
the trees taking turns. Prints, per tree, the median and range of CPU µs per request and the interpreter's VmRSS
after the requests.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kube.client import KubeApi
from testbed.localcluster import LocalCluster

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "bench-requests"
CLAIM = "claim"

_MEASURE = """
import json, sys, time
from kube.client import KubeApi
from kube.connect import api_client_from

kubeconfig, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
kube = KubeApi(api_client_from(kubeconfig), timeout=30)
body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": path.rsplit("/", 1)[1], "namespace": path.split("/")[5]}, "status": {}}
query = {"fieldManager": "bench.requestcpu", "force": True}

def get():
    kube.get(path)

def patch():
    kube.request("PATCH", path + "/status", query=query, body=body, content_type="application/apply-patch+yaml")

out = {}
for name, call in (("get", get), ("patch", patch)):
    call()                                   # warm: connection, TLS, credentials
    start = time.thread_time()
    for _ in range(n):
        call()
    out[name] = (time.thread_time() - start) / n * 1e6
status = open("/proc/self/status").read()
out["rss_mib"] = int(next(l.split()[1] for l in status.splitlines() if l.startswith("VmRSS:"))) / 1024
print(json.dumps(out))
"""


def measure(tree: Path, kubeconfig: Path, path: str, n: int) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(kubeconfig), path, str(n)], cwd=tree,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring in {tree} failed: {proc.stderr[-2000:]}")
    result: dict[str, float] = json.loads(proc.stdout.splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.requestcpu", description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="*", type=Path, default=[REPO], help="source trees to compare (default: this one)")
    p.add_argument("-n", type=int, default=2000, help="requests of each kind per round (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per tree (default 3)")
    args = p.parse_args(argv)
    with LocalCluster(workdir=Path(tempfile.mkdtemp(prefix="bench-requestcpu-"))) as cluster:
        kube = KubeApi(cluster.api_client())
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        base = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
        kube.create(base, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": CLAIM, "namespace": NAMESPACE},
                           "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                               "deviceClassName": "gpu.example.com"}}]}}})
        results: dict[Path, list[dict[str, float]]] = {t: [] for t in args.trees}
        for _ in range(args.rounds):
            for tree in args.trees:
                results[tree].append(measure(tree, cluster.kubeconfig, f"{base}/{CLAIM}", args.n))
    for tree, rounds in results.items():
        cells = []
        for key, unit in (("get", "µs/GET"), ("patch", "µs/PATCH"), ("rss_mib", "MiB VmRSS")):
            values = sorted(r[key] for r in rounds)
            cells.append(f"{statistics.median(values):.0f} {unit} ({values[0]:.0f}-{values[-1]:.0f})")
        print(f"{tree}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
