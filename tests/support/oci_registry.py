"""The CNCF distribution registry (hack/build-oci-tools.sh) as users run it, for the release tests: HTTPS with a
CA of its own, htpasswd (bcrypt) basic authentication, storage in a directory, on a free loopback port."""
from __future__ import annotations

import base64
import json
import secrets
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from tlscerts import make_serving_cert

from testbed.helmchart import helm_binary
from testbed.localcluster import free_port

ROOT = Path(__file__).resolve().parents[2]
USER = "release"


def registry_binary() -> str:
    """The pinned registry; built on first use (a few minutes), then reused from ~/.cache/gpu-dra/registry."""
    proc = subprocess.run(["bash", str(ROOT / "hack" / "build-oci-tools.sh"), "registry"], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, f"hack/build-oci-tools.sh registry failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def bcrypt_htpasswd(user: str, password: str, workdir: Path) -> str:
    """`user:<bcrypt hash>`, the only form the registry's htpasswd accepts: Helm's htpasswd template function
    (Sprig's, bcrypt), as registry charts make their htpasswd Secrets; Python has no bcrypt of its own."""
    chart = workdir / "htpasswd-chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: htpasswd\nversion: 0.1.0\n")
    (chart / "templates" / "secret.yaml").write_text(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: htpasswd\n"
        "stringData:\n  htpasswd: {{ htpasswd .Values.user .Values.password | quote }}\n")
    proc = subprocess.run([helm_binary(), "template", "x", str(chart), "--set-string", f"user={user}",
                           "--set-string", f"password={password}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = str(yaml.safe_load(proc.stdout)["stringData"]["htpasswd"])
    assert line.startswith(f"{user}:$2"), line
    return line


class LocalRegistry:
    """Started with `start`, stopped with `stop`; everything lives under `workdir`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.password = secrets.token_urlsafe(18)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.ca = workdir / "tls" / "registry-ca.crt"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "registry.log"

    def start(self) -> "LocalRegistry":
        binary = registry_binary()
        cert = make_serving_cert(self.workdir / "tls", "registry", ips=("127.0.0.1",), dns=("localhost",))
        htpasswd = self.workdir / "htpasswd"
        htpasswd.write_text(bcrypt_htpasswd(USER, self.password, self.workdir) + "\n")
        self.port = free_port()
        config = self.workdir / "config.yml"
        config.write_text(yaml.safe_dump({
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.workdir / "data")}},
            "http": {"addr": self.host, "secret": secrets.token_hex(16),
                     "tls": {"certificate": str(cert.cert), "key": str(cert.key)}},
            "auth": {"htpasswd": {"realm": "gpu-dra-release-test", "path": str(htpasswd)}},
        }))
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_up()
        return self

    def _wait_up(self, timeout: float = 30.0) -> None:
        """Up: /v2/ answers 401 without credentials and 200 with them, over TLS with our CA."""
        context = ssl.create_default_context(cafile=str(self.ca))
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the registry exited ({self.proc.returncode}):\n{self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"https://{self.host}/v2/", context=context, timeout=5)
                raise AssertionError("the registry answered /v2/ without credentials")
            except urllib.error.HTTPError as err:
                if err.code == 401:
                    request = urllib.request.Request(f"https://{self.host}/v2/",
                                                     headers={"Authorization": f"Basic {self._basic()}"})
                    with urllib.request.urlopen(request, context=context, timeout=5) as resp:
                        assert resp.status == 200
                    return
                last = str(err)
            except (urllib.error.URLError, OSError) as err:
                last = str(err)
            time.sleep(0.2)
        raise AssertionError(f"the registry did not answer on {self.host}: {last}\n{self.log.read_text()[-2000:]}")

    def _basic(self) -> str:
        return base64.b64encode(f"{USER}:{self.password}".encode()).decode()

    def docker_config(self) -> dict[str, object]:
        """Docker's config.json with this registry's credentials: what crane and helm read, and the content of a
        kubernetes.io/dockerconfigjson Secret."""
        return {"auths": {self.host: {"auth": self._basic()}}}

    def client_env(self) -> dict[str, str]:
        """Environment for crane and helm: the credentials (DOCKER_CONFIG) and the CA (SSL_CERT_FILE)."""
        config_dir = self.workdir / "docker"
        config_dir.mkdir(exist_ok=True)
        (config_dir / "config.json").write_text(json.dumps(self.docker_config()))
        return {"DOCKER_CONFIG": str(config_dir), "SSL_CERT_FILE": str(self.ca)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
