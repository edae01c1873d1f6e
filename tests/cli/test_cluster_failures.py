"""The commands that talk to the cluster, when the API server is away, answers with an error or the kubeconfig is
wrong: one line in kubectl's words (what, where, what to check), never a library's error text, and one exit
status per kind of failure, the same in every command and listed in its --help. `controller --once` gives up
after its --timeout against a server that never answers."""
from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from scripted_http import Scripted
from tlscerts import make_serving_cert

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "examples" / "fleets" / "demo.yaml"
# Each command in the form that needs the API server, given --kubeconfig last.
COMMANDS = {"status": ["status"], "explain": ["explain", "claim/x", "-n", "ml"],
            "publish": ["publish", "--once", "--fleet", str(FLEET), "--timeout", "5"],
            "controller": ["controller", "--once", "--timeout", "5", "--metrics-port", "0"],
            "advise": ["advise", "--prometheus", "http://127.0.0.1:9"]}
# The exit status of each kind of failure, as every command's --help lists it.
EXIT_KUBECONFIG, EXIT_UNREACHABLE, EXIT_REFUSED = 5, 6, 7
CRASH_WORDS = ("Errno", "Error:", "_ssl.c", "urllib3", "HTTPSConnection", "Traceback", "while parsing")


def kubeconfig(path: Path, server: str, cluster: dict[str, object] | None = None) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "ann", "user": {"token": "t"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "ann"}}]}))
    return path


def run(command: str, config: Path) -> tuple[int, str]:
    """Exit status and the last line on stderr (the controller's log lines come before it)."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", *COMMANDS[command], "--kubeconfig", str(config)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "KUBERNETES_SERVICE_HOST": ""})
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines, f"{command}: exit {proc.returncode} and nothing said"
    return proc.returncode, lines[-1]


def plain(line: str) -> None:
    assert not any(w in line for w in CRASH_WORDS), line


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_refused_connection_is_kubectls_line_and_one_status(command: str, closed_port: int, tmp_path: Path) -> None:
    config = kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{closed_port}", {"insecure-skip-tls-verify": True})
    code, line = run(command, config)
    assert code == EXIT_UNREACHABLE, line
    assert line == (f"gpu-dra {command}: the connection to the server 127.0.0.1:{closed_port} was refused - did you "
                    f"specify the right host or port? (kubeconfig {config}, context lab)")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_server_certificate_of_another_ca_names_the_kubeconfigs_ca(command: str, tmp_path: Path) -> None:
    served, other = make_serving_cert(tmp_path / "srv", "apiserver"), make_serving_cert(tmp_path / "other", "other")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(served.cert, served.key)
    server = Scripted(lambda r: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", tls=context)
    try:
        config = kubeconfig(tmp_path / "kc", server.url, {"certificate-authority": str(other.ca)})
        code, line = run(command, config)
    finally:
        server.stop()
    assert code == EXIT_UNREACHABLE, line
    assert line == (f"gpu-dra {command}: unable to connect to the server 127.0.0.1:{server.port}: tls: failed to "
                    "verify certificate: x509: certificate signed by unknown authority - check the cluster's "
                    f"certificate-authority (kubeconfig {config}, context lab)")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_kubeconfig_that_is_not_yaml_is_one_line(command: str, tmp_path: Path) -> None:
    config = tmp_path / "kc"
    config.write_text("clusters: [\n  - name: k\n    cluster: {server: x\n")
    code, line = run(command, config)
    assert code == EXIT_KUBECONFIG, line
    assert line.startswith(f'gpu-dra {command}: error loading config file "{config}": yaml: line '), line
    plain(line)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_request_the_server_refuses_is_its_answer_in_kubectls_words(command: str, tmp_path: Path) -> None:
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
              "message": 'resourceslices.resource.k8s.io is forbidden: User "ann" cannot list resource '
                         '"resourceslices" in API group "resource.k8s.io" at the cluster scope'}
    version = {"major": "1", "minor": "37", "gitVersion": "v1.37.2"}

    def answer(request: object) -> bytes:
        body, code = (version, "200 OK") if getattr(request, "target", "") == "/version" else (status, "403 Forbidden")
        data = json.dumps(body).encode()
        return (f"HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data

    server = Scripted(answer)
    try:
        code, line = run(command, kubeconfig(tmp_path / "kc", server.url))
    finally:
        server.stop()
    assert code == EXIT_REFUSED, line
    assert line.startswith(f"gpu-dra {command}: error from server (Forbidden): "), line
    assert 'is forbidden: User "ann" cannot' in line
    plain(line)


def test_controller_once_gives_up_after_its_timeout(silent_port: int, tmp_path: Path) -> None:
    config = kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{silent_port}", {"insecure-skip-tls-verify": True})
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "cli.main", "controller", "--once", "--timeout", "3",
                           "--kubeconfig", str(config)], capture_output=True, text=True, timeout=120, cwd=REPO)
    took = time.monotonic() - started
    assert proc.returncode == EXIT_UNREACHABLE, proc.stderr
    assert took < 3 + 5, took          # the timeout, and the interpreter's start
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"gpu-dra controller: unable to connect to the server 127.0.0.1:{silent_port}: "), line
    assert f"(kubeconfig {config}, context lab)" in line
    plain(line)


@pytest.mark.parametrize("command", [*COMMANDS, "kubelet-plugin"])
def test_help_lists_the_exit_status_of_each_kind_of_failure(command: str) -> None:
    import argparse

    from cli.main import build_parser

    [sub] = [a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)]
    text = sub.choices[command].format_help()
    block = text[text.index("exit status:"):]
    for code, words in ((EXIT_KUBECONFIG, "kubeconfig"), (EXIT_UNREACHABLE, "unreachable"),
                        (EXIT_REFUSED, "refused")):
        assert any(line.split()[:1] == [str(code)] and words in line for line in block.splitlines()), block


def test_unauthorized_and_an_unknown_host(tmp_path: Path) -> None:
    denied = json.dumps({"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401}).encode()
    server = Scripted(lambda r: b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
                                + f"Content-Length: {len(denied)}\r\n\r\n".encode() + denied)
    try:
        config = kubeconfig(tmp_path / "kc", server.url)
        code, line = run("status", config)
    finally:
        server.stop()
    assert (code, line) == (EXIT_REFUSED, f"gpu-dra status: you must be logged in to the server 127.0.0.1:{server.port} "
                                          f"(Unauthorized) - check the user's credentials (kubeconfig {config}, context lab)")
    config = kubeconfig(tmp_path / "kc", "https://api.nonexistent.invalid:6443")
    assert run("status", config) == (EXIT_UNREACHABLE, "gpu-dra status: unable to connect to the server "
                                     "api.nonexistent.invalid:6443: no such host - check the cluster's server "
                                     f"(kubeconfig {config}, context lab)")


def test_credentials_that_cannot_be_read_are_a_kubeconfig_failure() -> None:
    """A token file gone or an exec plugin that fails: nothing was sent, the kubeconfig's user is to check."""
    from cli.failures import describe
    from kube.client import CredentialsUnavailable

    try:
        try:
            Path("/nonexistent/token").read_text()
        except OSError as exc:
            raise CredentialsUnavailable(f"credentials: {exc}") from exc
    except CredentialsUnavailable as exc:
        failure = describe(exc)
    assert failure is not None and failure.code == EXIT_KUBECONFIG
    assert failure.line == "cannot read the credentials: no such file or directory: /nonexistent/token (the kubeconfig)"
