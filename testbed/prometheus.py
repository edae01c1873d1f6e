"""Prometheus for the tests: the prometheus and promtool that hack/build-prometheus.sh builds (or reuses) from the
pin in hack/versions.env, a server run on a scrape config with a throw-away TSDB, and its HTTP API."""
from __future__ import annotations

import functools
import json
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from testbed.localcluster import free_port

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def prometheus_bin_dir() -> Path:
    """Where the pinned prometheus and promtool are; built on first use, then reused from ~/.cache/gpu-dra."""
    proc = subprocess.run(["bash", str(ROOT / "hack" / "build-prometheus.sh")], capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, f"hack/build-prometheus.sh failed:\n{proc.stderr[-3000:]}"
    return Path(proc.stdout.strip().splitlines()[-1])


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(prometheus_bin_dir() / "promtool"), *args], capture_output=True, text=True,
                          timeout=120)


class PrometheusError(Exception):
    """The server did not start, or its API answered with an error."""


class Prometheus:
    """A running server's HTTP API (``/api/v1``)."""

    def __init__(self, port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def api(self, path: str, **params: str | list[str]) -> Any:
        """The ``data`` of an API answer; PrometheusError with the server's error otherwise."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            body = json.loads(err.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": labels, "value": [time, "value"]}, ...]."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr}: a {data['resultType']}, not a vector")
        result: list[dict[str, Any]] = data["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        values: list[str] = self.api(f"label/{label}/values", **{"match[]": [match]})
        return values

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return active

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


def check_config(config: dict[str, Any], directory: Path) -> None:
    """promtool's verdict on a scrape config (AssertionError with its output when it refuses it)."""
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = promtool("check", "config", str(path))
    assert proc.returncode == 0, f"promtool check config refused it:\n{proc.stdout}{proc.stderr}"


@contextmanager
def running(config: dict[str, Any], timeout: float = 120.0) -> Iterator[Prometheus]:
    """A Prometheus on `config` (checked by promtool first) with a TSDB in a temporary directory, stopped after."""
    bin_dir = prometheus_bin_dir()
    with tempfile.TemporaryDirectory(prefix="gpu-dra-prometheus-") as tmp:
        work = Path(tmp)
        check_config(config, work)
        port = free_port()
        log = work / "prometheus.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([str(bin_dir / "prometheus"), f"--config.file={work / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={work / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=out, stderr=subprocess.STDOUT)
        server = Prometheus(port, log)
        try:
            deadline = time.monotonic() + timeout
            while True:          # ready: the TSDB is open and the scrape loops run
                if proc.poll() is not None:
                    raise PrometheusError(f"prometheus exited with {proc.returncode}:\n{server.log_tail()}")
                try:
                    with urllib.request.urlopen(f"{server.url}/-/ready", timeout=5) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise PrometheusError(f"prometheus not ready after {timeout}s:\n{server.log_tail()}")
                time.sleep(0.2)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
