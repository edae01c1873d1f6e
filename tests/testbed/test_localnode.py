"""LocalNode starts its kubelet again on new ports when one it was given is taken before the kubelet binds it
(free_port finds a port free now, not when the kubelet listens). Exercised with a stand-in kubelet that binds
its two ports as the real one does: it exits when its server port is taken and keeps running, without
/healthz, when its healthz port is."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import testbed.localnode as localnode
from testbed.localnode import KUBELET_PORT_ATTEMPTS, LocalNode, NodeError, port_taken

FAKE_KUBELET = f"""#!{sys.executable}
import http.server, socket, sys, threading, time, yaml
config = yaml.safe_load(open(next(a for a in sys.argv if a.startswith("--config=")).split("=", 1)[1]))

def listen(port):
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s

try:
    server = listen(config["port"])
except OSError:
    print('E0101 run.go:72] "Failed to listen and serve" err="listen tcp 127.0.0.1:%d: bind: address already in use"'
          % config["port"], flush=True)
    sys.exit(1)

class Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")

while True:
    try:
        http.server.HTTPServer(("127.0.0.1", config["healthzPort"]), Healthz).serve_forever()
    except OSError:
        print('E0101 server.go:9] "Failed to start healthz server" err="listen tcp 127.0.0.1:%d: bind: address '
              'already in use"' % config["healthzPort"], flush=True)
        time.sleep(5)
"""


class ReadyCluster:
    """As much of LocalCluster as starting a kubelet asks for: the Node reports Ready with a fresh heartbeat."""

    node_authorization = False
    kubeconfig = "/dev/null"

    def request(self, method: str, path: str) -> dict[str, Any]:
        beat = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return {"status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": beat}]}}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[LocalNode]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubelet").write_text(FAKE_KUBELET)
    (bin_dir / "kubelet").chmod(0o755)
    n = LocalNode(ReadyCluster(), name="ports-node", workdir=tmp_path / "node", bin_dir=bin_dir,  # type: ignore[arg-type]
                  startup_timeout=20.0)
    n.workdir = tmp_path / "node"
    (n.workdir / "logs").mkdir(parents=True)
    n.node_ip = "127.0.0.1"
    n._containerd = subprocess.Popen(["sleep", "120"])    # check_running asks for containerd too
    try:
        yield n
    finally:
        localnode._terminate(n._kubelet, grace=2.0)
        n._containerd.kill()
        n._containerd.wait()


@pytest.fixture
def held() -> Iterator[socket.socket]:
    """A loopback port another process took after free_port found it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def ports_handing_out(monkeypatch: pytest.MonkeyPatch, taken: list[int]) -> list[int]:
    """free_port gives the `taken` ports first, then free ones; returns every port it gave."""
    real, queue, given = localnode.free_port, list(taken), []

    def fake() -> int:
        given.append(queue.pop(0) if queue else real())
        return given[-1]

    monkeypatch.setattr(localnode, "free_port", fake)
    return given


@pytest.mark.parametrize("which", ["kubelet", "healthz"])
def test_a_taken_port_starts_the_kubelet_again_on_new_ones(node: LocalNode, held: socket.socket, which: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    port = held.getsockname()[1]
    first = [port, localnode.free_port()] if which == "kubelet" else [localnode.free_port(), port]
    given = ports_handing_out(monkeypatch, first)
    node._start_kubelet_until_ready(node.bin_dir, time.time() - 1)
    assert node.ports[which] != port and len(given) == 4
    assert node._kubelet is not None and node._kubelet.poll() is None and node._kubelet_healthy()
    assert port_taken(node.kubelet_log.read_text(), [port]) == port     # the first kubelet said why it failed


def test_a_port_taken_every_time_is_an_error_naming_it(node: LocalNode, held: socket.socket,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    port = held.getsockname()[1]
    ports_handing_out(monkeypatch, [port, localnode.free_port()] * KUBELET_PORT_ATTEMPTS)
    with pytest.raises(NodeError, match=f"port taken {KUBELET_PORT_ATTEMPTS} times in a row \\(last: {port}\\)"):
        node._start_kubelet_until_ready(node.bin_dir, time.time() - 1)


def test_port_taken_reads_only_the_kubelets_own_ports() -> None:
    log = ('E1204 run.go:72] "Failed to listen and serve" err="listen tcp 127.0.0.1:40123: bind: address already '
           'in use"\nE1204 server.go:9] "Failed to start healthz server" err="listen tcp 127.0.0.1:40124: bind: '
           'address already in use"\n')
    assert port_taken(log, [40123, 40124]) == 40123
    assert port_taken(log, [40124]) == 40124
    assert port_taken(log, [10250]) is None
    assert port_taken("I1204 server.go:1] started\n", [40123]) is None


def test_the_node_trusts_each_registry_ca_it_is_given(tmp_path: Path) -> None:
    """registry_cas: containerd's CRI image service reads a hosts.toml per registry, HTTPS with that CA."""
    import tomllib

    ca = tmp_path / "ca.crt"
    n = LocalNode(ReadyCluster(), name="registry-node", workdir=tmp_path / "node",  # type: ignore[arg-type]
                  bin_dir=tmp_path / "bin", registry_cas={"127.0.0.1:5443": ca})
    n.workdir, n.snapshotter = tmp_path / "node", "native"
    n._write_registry_hosts()
    config = tomllib.loads(n._containerd_config(tmp_path / "bin"))
    certs = Path(config["plugins"]["io.containerd.cri.v1.images"]["registry"]["config_path"])
    hosts = tomllib.loads((certs / "127.0.0.1:5443" / "hosts.toml").read_text())
    assert hosts == {"server": "https://127.0.0.1:5443",
                     "host": {"https://127.0.0.1:5443": {"capabilities": ["pull", "resolve"], "ca": str(ca)}}}
