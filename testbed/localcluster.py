"""A real, throw-away Kubernetes control plane on loopback: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager as local processes (no containers, no kubelet).

Used by the end-to-end tests and by the demo. Nodes are plain Node objects registered through the API
(`add_node`); the scheduler binds pods to them and allocates DRA devices from our ResourceSlices, which is
everything a kubelet-less cluster can do. The node-lifecycle controller is disabled so that nodes without
heartbeats are not tainted.

Three opt-in options bring it closer to a real cluster, for pods that run on a real node (`testbed.localnode`):
`service_accounts` turns the ServiceAccount admission plugin on, so pods get projected service-account tokens
through TokenRequest (the controller-manager's service-account and token controllers run either way);
`node_authorization` adds the Node authorizer and the NodeRestriction admission plugin, with client
certificates for kubelets (`node_kubeconfig`: user system:node:<name>, group system:nodes);
`endpoint_routing` makes the API server call webhooks at their Service's endpoints, since nothing routes
ClusterIPs here (no kube-proxy).

For measuring the control plane itself: `client_qps`/`client_burst` set the API client limits of the scheduler and
the controller-manager (their defaults, 50/100 and 20/30, throttle a burst of pods with claims), and `debug_access`
serves the scheduler's /metrics and /debug/pprof to the admin token (`scheduler_get`).

    with LocalCluster() as cluster:
        cluster.add_node("node-a")
        api = cluster.api_client()
"""
from __future__ import annotations

import base64
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

log = logging.getLogger(__name__)

BIN_ENV = "GPU_DRA_K8S_BIN"
CACHE_ENV = "GPU_DRA_CACHE"
AUDITED_USER = "gpu-dra-audited"
COMPONENTS = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")
_REPO_ROOT = Path(__file__).resolve().parents[1]
_BUILD_SCRIPT = _REPO_ROOT / "hack" / "build-control-plane.sh"
VERSIONS_FILE = _REPO_ROOT / "hack" / "versions.env"
_LOG_TAIL_LINES = 25


class ClusterError(RuntimeError):
    """The control plane could not be found, built or started; the message says which part and why."""


def _missing_components(bin_dir: Path) -> list[str]:
    return [c for c in COMPONENTS if not os.access(bin_dir / c, os.X_OK)]


def pinned_version(key: str = "K8S_VERSION") -> str:
    """A version pinned in hack/versions.env: K8S_VERSION (the target release), K8S_SKEW_VERSION (the oldest
    supported release) or ETCD_VERSION."""
    try:
        lines = VERSIONS_FILE.read_text().splitlines()
    except OSError as exc:
        raise ClusterError(f"cannot read the pinned versions: {exc}") from exc
    values = dict(line.split("=", 1) for line in lines if "=" in line and not line.lstrip().startswith("#"))
    value = values.get(key, "").strip()
    if not value:
        raise ClusterError(f"{VERSIONS_FILE}: no {key}=... line")
    return value


def k8s_bin_dir(version: str) -> Path:
    """Where hack/build-control-plane.sh keeps the binaries of Kubernetes `version` (e.g. v1.34.4)."""
    root = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "gpu-dra")
    return Path(root).expanduser() / "k8s" / version / "bin"


def find_binaries(build: bool = True, version: str | None = None) -> Path:
    """The directory holding etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kubectl of
    Kubernetes `version` (default: the pinned target release).

    Order: $GPU_DRA_K8S_BIN (target release only), else hack/build-control-plane.sh, which reuses its cache
    or builds from the Go module proxy and prints the bin directory on its last line. Without `build`, only
    a complete cache directory is used."""
    env = os.environ.get(BIN_ENV)
    if env and (version is None or version == pinned_version()):
        bin_dir = Path(env).expanduser()
        missing = _missing_components(bin_dir)
        if missing:
            raise ClusterError(f"${BIN_ENV}={env} lacks executables: {', '.join(missing)}")
        return bin_dir
    target = pinned_version()
    version = version or target
    if not build:
        cached = k8s_bin_dir(version)
        if not _missing_components(cached) and (cached.parent / ".complete").is_file():
            return cached
        raise ClusterError(f"no Kubernetes {version} binaries in {cached}; build them with "
                           f"K8S_VERSION={version} bash hack/build-control-plane.sh"
                           + (f", or set ${BIN_ENV} to a directory with {', '.join(COMPONENTS)}"
                              if version == target else ""))
    if not _BUILD_SCRIPT.is_file():
        raise ClusterError(f"no ${BIN_ENV} set and no build script at {_BUILD_SCRIPT}")
    return bin_dir_from_script(_BUILD_SCRIPT, {**os.environ, "K8S_VERSION": version}, _missing_components,
                               ClusterError, failed=f"failed for Kubernetes {version}", tail_lines=_LOG_TAIL_LINES)


# Where the build scripts' progress lines go while they run (None: nowhere; set_build_progress).
_build_progress: Callable[[str], None] | None = None
# hack/common.sh's log(): "[build-node.sh 12:34:56] building kubelet v1.37.2".
_PROGRESS_LINE = re.compile(r"^\[[\w.-]+ \d\d:\d\d:\d\d\] ")


def set_build_progress(show: Callable[[str], None] | None) -> None:
    """Have every hack/build-*.sh run from now on hand its log lines to ``show`` as they come (a cold build takes
    minutes: `gpu-dra demo` shows them), or to nothing again with None."""
    global _build_progress
    _build_progress = show


def bin_dir_from_script(script: Path, env: dict[str, str], missing: Callable[[Path], list[str]],
                        error: type[ClusterError], failed: str = "failed", tail_lines: int = _LOG_TAIL_LINES) -> Path:
    """Runs a hack/build-*.sh script, which reuses its cache or builds and prints its bin directory on its last
    line; that directory, once ``missing`` finds nothing lacking in it. Else ``error`` naming the script and what
    went wrong (its stderr's tail when it failed). The script's log lines go to set_build_progress's receiver
    while it runs."""
    show = _build_progress
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read() if proc.stdout else ""), daemon=True)
    reader.start()
    errors: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:               # as the script writes them: progress during a cold build
        errors.append(line)
        if show is not None and _PROGRESS_LINE.match(line):
            show(line.rstrip("\n"))
    returncode = proc.wait()
    reader.join()
    stderr, stdout = "".join(errors), "".join(out)
    if returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-tail_lines:])
        raise error(f"{script.name} {failed} (exit {returncode}):\n{tail}")
    lines = stdout.strip().splitlines()
    if not lines:
        raise error(f"{script.name} printed no bin directory")
    bin_dir = Path(lines[-1])
    lacking = missing(bin_dir)
    if lacking:
        raise error(f"{script.name} reported {bin_dir}, which lacks: {', '.join(lacking)}")
    return bin_dir


def free_port() -> int:
    """A currently unused loopback TCP port (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Component:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class StartupTimes:
    """Seconds spent per start-up phase; the demo and tests report them."""

    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.phases.items())
        return f"{self.total:.1f}s ({parts})"


class LocalCluster:
    """Starts and stops the control plane. Not thread-safe; one instance per test session or demo."""

    def __init__(self, bin_dir: Path | str | None = None, workdir: Path | str | None = None,
                 keep_workdir: bool = False, startup_timeout: float = 90.0, *, service_accounts: bool = False,
                 node_authorization: bool = False, endpoint_routing: bool = False, client_qps: float | None = None,
                 client_burst: int | None = None, debug_access: bool = False,
                 uncached: tuple[str, ...] = ()) -> None:
        """``uncached``: resources ("<resource>.<group>") the API server serves from etcd, not its watch cache, so
        that a watch from a compacted resourceVersion gets 410 Gone at once (compact_etcd)."""
        if (client_qps is not None and client_qps <= 0) or (client_burst is not None and client_burst < 1):
            raise ClusterError(f"client limits must be positive: client_qps={client_qps}, client_burst={client_burst}")
        self.client_qps, self.client_burst = client_qps, client_burst
        self.debug_access = debug_access
        self.uncached = uncached
        self._bin_dir = Path(bin_dir) if bin_dir else None
        self.service_accounts = service_accounts
        self.node_authorization = node_authorization
        self.endpoint_routing = endpoint_routing
        self._given_workdir = Path(workdir) if workdir else None
        self.keep_workdir = keep_workdir
        self.startup_timeout = startup_timeout
        self.workdir: Path | None = None
        self.token = secrets.token_hex(16)
        # A second cluster admin whose every request the API server's audit log records (audited_requests): what
        # a process run with audited_kubeconfig asks of the API server, counted on the server's side.
        self.audited_token = secrets.token_hex(16)
        self.ports: dict[str, int] = {}
        self.times = StartupTimes()
        self._components: dict[str, _Component] = {}

    # ---- public API -------------------------------------------------------------------------------

    @property
    def bin_dir(self) -> Path:
        if self._bin_dir is None:
            self._bin_dir = find_binaries()
        return self._bin_dir

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def kubeconfig(self) -> Path:
        return self._dir / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        """The CA that signed the apiserver's serving certificate (extracted after start-up)."""
        return self._dir / "ca.crt"

    @property
    def _serving_cert(self) -> Path:
        # With --cert-dir and no certificate given, the apiserver writes its serving certificate
        # followed by the self-signed CA that issued it.
        return self._dir / "apiserver-certs" / "apiserver.crt"

    def start(self) -> "LocalCluster":
        t0 = time.monotonic()
        bin_dir = self.bin_dir
        self.times.phases["binaries"] = time.monotonic() - t0
        if self._given_workdir:
            self._given_workdir.mkdir(parents=True, exist_ok=True)
            self.workdir = self._given_workdir
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="gpu-dra-cluster-"))
        try:
            self._prepare_files()
            self._phase("etcd", self._start_etcd, bin_dir)
            self._phase("kube-apiserver", self._start_apiserver, bin_dir)
            self._write_kubeconfig()
            self._phase("scheduler+controller-manager", self._start_scheduler_and_kcm, bin_dir)
        except BaseException:
            self.stop()
            raise
        log.info("local control plane ready at %s in %s", self.server, self.times)
        return self

    def stop(self) -> None:
        """Stops every component (process group: SIGTERM, then SIGKILL) and removes the work dir."""
        for comp in reversed(list(self._components.values())):
            _terminate(comp.proc)
        self._components.clear()
        if self.workdir and not self.keep_workdir and self._given_workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The tail of every component's log, for error messages."""
        return "\n".join(f"--- {c.name} (pid {c.proc.pid}, exit {c.proc.poll()}) ---\n{c.tail(lines)}"
                         for c in self._components.values())

    def component_pids(self) -> dict[str, int]:
        """Component name -> process id (each leads its own process group), e.g. for a stop script."""
        return {c.name: c.proc.pid for c in self._components.values()}

    def scheduler_get(self, path: str, timeout: float = 60.0) -> bytes:
        """GET `path` (e.g. /metrics, /debug/pprof/heap) from the scheduler's secure port as the admin
        (`debug_access` only: the scheduler checks the token with the API server)."""
        if not self.debug_access:
            raise ClusterError("scheduler_get needs LocalCluster(debug_access=True)")
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE   # the scheduler's self-signed serving certificate
        req = urllib.request.Request(f"https://127.0.0.1:{self.ports['scheduler']}{path}",
                                     headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
                return bytes(resp.read())
        except urllib.error.HTTPError as exc:
            raise ClusterError(f"kube-scheduler GET {path}: HTTP {exc.code}: "
                               f"{exc.read().decode(errors='replace')[:300]}") from exc

    def check_running(self) -> None:
        """Raises ClusterError naming any component that has exited."""
        dead = [c for c in self._components.values() if c.proc.poll() is not None]
        if dead:
            names = ", ".join(f"{c.name} (exit {c.proc.returncode})" for c in dead)
            raise ClusterError(f"control-plane component(s) exited: {names}\n{self.logs_tail()}")

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient authenticated as cluster admin (system:masters)."""
        from kubernetes import config as kconfig

        return kconfig.new_client_from_config(config_file=str(self.kubeconfig))

    @property
    def audited_kubeconfig(self) -> Path:
        """A kubeconfig of the audited admin (see audited_requests), written on first use."""
        path = self._dir / "audited.kubeconfig"
        if not path.exists():
            cfg = yaml.safe_load(self.kubeconfig.read_text())
            cfg["users"] = [{"name": "admin", "user": {"token": self.audited_token}}]
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            path.chmod(0o600)
        return path

    def audited_requests(self) -> list[dict[str, Any]]:
        """The audit events of the audited admin's requests so far: verb (get, list, watch, create, ...),
        requestURI, userAgent, responseStatus, ..., in the order they were answered."""
        log = self._dir / "logs" / "audit.log"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    def compact_etcd(self) -> int:
        """Compacts etcd's history up to its current revision (etcd's JSON gateway), as the API server does every
        few minutes: a watch from an older resourceVersion is then answered 410 Gone. Returns the revision."""
        base = f"http://127.0.0.1:{self.ports['etcd-client']}/v3/kv"

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            req = urllib.request.Request(f"{base}/{path}", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
            return answer

        revision = int(post("range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
        post("compaction", {"revision": revision, "physical": True})
        return revision

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Runs kubectl from the same bin dir against this cluster."""
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        return proc

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                content_type: str = "application/json", timeout: float = 10.0) -> dict[str, Any]:
        """One authenticated JSON request to the API server (used for Nodes; no client library needed)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self._ssl_context(), timeout=timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            raise ClusterError(f"{method} {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from exc
        return json.loads(payload) if payload else {}

    def add_node(self, name: str, labels: dict[str, str] | None = None, cpu: str = "64",
                 memory: str = "512Gi", pods: str = "110") -> dict[str, Any]:
        """Registers a Ready Node with allocatable pods/cpu/memory so that the scheduler can bind to it.

        Nothing runs on it (no kubelet); the node-lifecycle controller is off, so it stays untainted."""
        body = simulated_node(name, labels, cpu=cpu, memory=memory, pods=pods)
        node = self.request("POST", "/api/v1/nodes", body)
        if node.get("spec", {}).get("taints"):
            # Simulated nodes stay schedulable: nothing would ever lift a not-ready taint.
            node = self.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}},
                                content_type="application/merge-patch+json")
        if not node.get("status", {}).get("allocatable"):
            # Status on create is accepted by current API servers; set it explicitly if it was dropped.
            node = self.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": body["status"]},
                                content_type="application/merge-patch+json")
        return node

    def delete_node(self, name: str) -> None:
        self.request("DELETE", f"/api/v1/nodes/{name}")

    def node_kubeconfig(self, name: str) -> Path:
        """A kubeconfig for the kubelet of node `name`: a client certificate of user system:node:<name> in group
        system:nodes, which the Node authorizer and NodeRestriction recognise (`node_authorization` only)."""
        if not self.node_authorization:
            raise ClusterError("node_kubeconfig needs LocalCluster(node_authorization=True)")
        d = self._dir / "nodes" / name
        path = d / "kubeconfig"
        if path.is_file():
            return path
        d.mkdir(parents=True, exist_ok=True)
        key, csr, crt, ext = d / "client.key", d / "client.csr", d / "client.crt", d / "client.ext"
        ext.write_text("keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n")
        _run_checked(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                      "-nodes", "-keyout", str(key), "-out", str(csr),
                      "-subj", f"/O=system:nodes/CN=system:node:{name}"], f"make the client key of node {name}")
        ca_crt, ca_key = self._client_ca
        _run_checked(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
                      "-set_serial", str(secrets.randbits(63)), "-days", "30", "-extfile", str(ext),
                      "-out", str(crt)], f"sign the client certificate of node {name}")
        key.chmod(0o600)
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "node",
            "clusters": [{"name": "local", "cluster": {"server": self.server,
                                                        "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": f"system:node:{name}", "user": {"client-certificate": str(crt),
                                                                "client-key": str(key)}}],
            "contexts": [{"name": "node", "context": {"cluster": "local", "user": f"system:node:{name}"}}],
        }
        tmp = d / "kubeconfig.tmp"
        tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
        tmp.chmod(0o600)
        tmp.rename(path)
        return path

    # ---- start-up ---------------------------------------------------------------------------------

    @property
    def _dir(self) -> Path:
        if self.workdir is None:
            raise ClusterError("cluster is not started")
        return self.workdir

    def _phase(self, name: str, fn: Any, *args: Any) -> None:
        t = time.monotonic()
        fn(*args)
        self.times.phases[name] = time.monotonic() - t

    def _prepare_files(self) -> None:
        d = self._dir
        (d / "logs").mkdir(exist_ok=True)
        (d / "apiserver-certs").mkdir(exist_ok=True)
        for comp in ("etcd-client", "etcd-peer", "apiserver", "scheduler", "controller-manager"):
            self.ports[comp] = free_port()
        # Service-account signing key pair, made with the openssl CLI.
        key, pub = d / "sa.key", d / "sa.pub"
        _run_checked(["openssl", "genrsa", "-out", str(key), "2048"], "generate service-account key")
        _run_checked(["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(pub)], "derive service-account public key")
        (d / "tokens.csv").write_text(f'{self.token},admin,admin-uid,"system:masters"\n'
                                      f'{self.audited_token},{AUDITED_USER},audited-uid,"system:masters"\n')
        # Metadata of the audited user's requests once answered (a watch: once it ended); nothing of anyone else's.
        (d / "audit-policy.yaml").write_text(yaml.safe_dump({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived", "ResponseStarted"],
            "rules": [{"level": "Metadata", "users": [AUDITED_USER]}, {"level": "None"}]}))
        if self.node_authorization:
            # The CA that signs kubelet client certificates (node_kubeconfig).
            ca_crt, ca_key = self._client_ca
            _run_checked(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                          "-nodes", "-keyout", str(ca_key), "-out", str(ca_crt), "-days", "30",
                          "-subj", "/CN=gpu-dra-local-client-ca"], "make the client CA")

    @property
    def _client_ca(self) -> tuple[Path, Path]:
        """(certificate, key) of the CA of kubelet client certificates."""
        return self._dir / "client-ca.crt", self._dir / "client-ca.key"

    def _spawn(self, name: str, argv: list[str]) -> _Component:
        log_path = self._dir / "logs" / f"{name}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=self._dir)
        comp = _Component(name, proc, log_path)
        self._components[name] = comp
        return comp

    def _wait(self, comp: _Component, what: str, probe: Any) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if comp.proc.poll() is not None:
                raise ClusterError(f"{comp.name} exited with {comp.proc.returncode} before {what}\n{self.logs_tail()}")
            try:
                ok, last = probe()
                if ok:
                    return
            except (OSError, urllib.error.URLError, ssl.SSLError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
        raise ClusterError(f"{comp.name}: timed out after {self.startup_timeout:.0f}s waiting for {what} "
                           f"(last: {last})\n{self.logs_tail()}")

    def _start_etcd(self, bin_dir: Path) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd-client']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        comp = self._spawn("etcd", [
            str(bin_dir / "etcd"), "--name=default", f"--data-dir={self._dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}", "--unsafe-no-fsync=true", "--log-level=warn",
        ])

        def probe() -> tuple[bool, str]:
            with urllib.request.urlopen(f"{client}/health", timeout=2) as resp:
                body = resp.read().decode()
            return json.loads(body).get("health") == "true", body

        self._wait(comp, "etcd /health", probe)

    def _apiserver_access_flags(self) -> list[str]:
        """Authorization and admission flags; without the options exactly those of a kubelet-less cluster."""
        authorization = "Node,RBAC" if self.node_authorization else "RBAC"
        # Pods never run without a kubelet: nothing would mount a token, and the ServiceAccount admission plugin
        # would race the namespace's default ServiceAccount creation. TaintNodesByCondition taints every new Node
        # not-ready until the (disabled) node-lifecycle controller clears it.
        disabled = ["TaintNodesByCondition"] if self.service_accounts else ["ServiceAccount", "TaintNodesByCondition"]
        flags = [f"--authorization-mode={authorization}", f"--disable-admission-plugins={','.join(disabled)}"]
        if self.node_authorization:
            flags += ["--enable-admission-plugins=NodeRestriction", f"--client-ca-file={self._client_ca[0]}"]
        if self.endpoint_routing:
            flags.append("--enable-aggregator-routing=true")
        return flags

    def _start_apiserver(self, bin_dir: Path) -> None:
        d = self._dir
        comp = self._spawn("kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd-client']}",
            f"--secure-port={self.ports['apiserver']}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--cert-dir={d / 'apiserver-certs'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={d / 'sa.pub'}", f"--service-account-signing-key-file={d / 'sa.key'}",
            f"--token-auth-file={d / 'tokens.csv'}", *self._apiserver_access_flags(),
            f"--audit-policy-file={d / 'audit-policy.yaml'}", f"--audit-log-path={d / 'logs' / 'audit.log'}",
            "--audit-log-format=json", "--audit-log-mode=blocking",
            *([f"--watch-cache-sizes={','.join(f'{r}#0' for r in self.uncached)}"] if self.uncached else []),
            "--allow-privileged=true",
            # The 'kubernetes' Service endpoints would be 127.0.0.1, which Endpoints validation rejects.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
        ])

        def probe() -> tuple[bool, str]:
            if not self.ca_file.exists():
                if not self._serving_cert.exists():
                    return False, "no serving certificate yet"
                self._extract_ca()
            req = urllib.request.Request(self.server + "/readyz",
                                         headers={"Authorization": f"Bearer {self.token}"})
            try:
                with urllib.request.urlopen(req, context=self._ssl_context(), timeout=3) as resp:
                    return resp.status == 200, resp.read().decode(errors="replace")[-200:]
            except urllib.error.HTTPError as exc:
                return False, f"HTTP {exc.code}: {exc.read().decode(errors='replace')[-300:]}"

        self._wait(comp, "kube-apiserver /readyz", probe)

    def _extract_ca(self) -> None:
        # Only the CA belongs in kubeconfigs and --root-ca-file: the controller-manager publishes
        # the root CA file as a ClusterTrustBundle, which rejects certificates without the CA bit.
        text = self._serving_cert.read_text()
        blocks = [b + "-----END CERTIFICATE-----\n" for b in text.split("-----END CERTIFICATE-----") if "BEGIN" in b]
        for block in blocks:
            proc = subprocess.run(["openssl", "x509", "-noout", "-ext", "basicConstraints"],
                                  input=block, capture_output=True, text=True)
            if proc.returncode == 0 and "CA:TRUE" in proc.stdout:
                tmp = self._dir / "ca.crt.tmp"
                tmp.write_text(block.lstrip())
                tmp.rename(self.ca_file)
                return
        raise ValueError(f"no CA certificate in {self._serving_cert} ({len(blocks)} certificates)")

    def _write_kubeconfig(self) -> None:
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {"server": self.server,
                                                        "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def _start_scheduler_and_kcm(self, bin_dir: Path) -> None:
        d, kc = self._dir, str(self.kubeconfig)
        # No --authentication/authorization-kubeconfig unless debug_access: /healthz is always allowed.
        common = [f"--kubeconfig={kc}", "--leader-elect=false", "--bind-address=127.0.0.1"]
        if self.client_qps is not None:
            common.append(f"--kube-api-qps={self.client_qps:g}")
        if self.client_burst is not None:
            common.append(f"--kube-api-burst={self.client_burst}")
        # The admin token is checked through TokenReview and SubjectAccessReview (the static token file is all the
        # API server needs for that); the client-CA lookup finds nothing here and is tolerated.
        debug = [f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}"] if self.debug_access else []
        sched = self._spawn("kube-scheduler", [
            str(bin_dir / "kube-scheduler"), *common, f"--secure-port={self.ports['scheduler']}",
            f"--cert-dir={d / 'scheduler-certs'}", *debug])
        kcm = self._spawn("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), *common, f"--secure-port={self.ports['controller-manager']}",
            f"--cert-dir={d / 'kcm-certs'}",
            f"--service-account-private-key-file={d / 'sa.key'}", f"--root-ca-file={self.ca_file}",
            # Fake nodes send no heartbeats: the node-lifecycle controller would taint them unreachable.
            "--controllers=*,-node-lifecycle-controller",
        ])
        for comp, port in ((sched, self.ports["scheduler"]), (kcm, self.ports["controller-manager"])):
            self._wait(comp, "/healthz", lambda port=port: _https_ok(f"https://127.0.0.1:{port}/healthz"))

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


def simulated_node(name: str, labels: dict[str, str] | None = None, cpu: str = "64", memory: str = "512Gi",
                   pods: str = "110") -> dict[str, Any]:
    """A Node object for a node without kubelet: Ready, with allocatable pods/cpu/memory."""
    resources = {"cpu": cpu, "memory": memory, "pods": pods}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    node_labels.update(labels or {})
    return {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": node_labels}, "spec": {},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "simulated node", "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
        },
    }


def _https_ok(url: str) -> tuple[bool, str]:
    # Scheduler and controller-manager serve /healthz with a self-signed certificate of their own.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=3) as resp:
            body = resp.read().decode(errors="replace")
            return resp.status == 200 and body.strip() == "ok", body[-200:]
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read().decode(errors='replace')[-300:]}"


def _run_checked(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise ClusterError(f"cannot {what}: {argv[0]} is not installed") from exc
    if proc.returncode != 0:
        raise ClusterError(f"cannot {what}: {' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")


def _terminate(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=grace)
