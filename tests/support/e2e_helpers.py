"""Small helpers for the end-to-end tests: hand-made slice parts, reading slices back, `gpu-dra publish` as
a process, and a TCP forwarder that lets a test decide when the API server becomes reachable."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from kube.client import SLICES, KubeApi


def gpu_devices(prefix: str, count: int, memory: str = "80Gi", product: str = "NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    """A slice part with `count` whole-GPU devices."""
    return {"devices": [{
        "name": f"{prefix}-{i}",
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": product},
                       "index": {"int": i}, "migEnabled": {"bool": False}},
        "capacity": {"memory": {"value": memory}},
    } for i in range(count)]}


def counter_sets(*names: str, memory: str = "80Gi") -> dict[str, Any]:
    """A counters-only slice part."""
    return {"sharedCounters": [{"name": n, "counters": {"memory": {"value": memory}}} for n in names]}


def consuming_device(name: str, counter_set: str, memory: str) -> dict[str, Any]:
    return {"name": name, "attributes": {"type": {"string": "mig"}},
            "capacity": {"memory": {"value": memory}},
            "consumesCounters": [{"counterSet": counter_set, "counters": {"memory": {"value": memory}}}]}


def slices_of(api_client: Any, driver: str) -> list[dict[str, Any]]:
    items = KubeApi(api_client).list(SLICES, field_selector=f"spec.driver={driver}")["items"]
    return sorted(items, key=lambda o: o["metadata"]["name"])


def pool_summary(slices: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """name -> (generation, resourceSliceCount)."""
    return {s["metadata"]["name"]: (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
            for s in slices}


def run_publish(cluster: Any, fleet: Path, driver: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpu-dra publish`` of ``fleet`` for ``driver`` against ``cluster``, as its own process."""
    return subprocess.run([sys.executable, "-m", "cli.main", "publish", "--fleet", str(fleet), "--kubeconfig",
                           str(cluster.kubeconfig), "--driver-name", driver, *args],
                          capture_output=True, text=True, timeout=120)


class TcpForwarder:
    """Forwards 127.0.0.1:<listen_port> to 127.0.0.1:<target_port> once started; until then the port is closed."""

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.listen_port, self.target_port = listen_port, target_port
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self.connections = 0

    def start(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.listen_port))
        s.listen(16)
        s.settimeout(0.2)
        self._sock = s
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
