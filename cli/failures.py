"""What a command says when it cannot use the cluster, and its exit status: one line in kubectl's words (what went
wrong, where, what to check) and one status per kind of failure, the same in every command and listed in each
one's --help (cli.main).

kubectl says "The connection to the server 10.0.0.1:6443 was refused - did you specify the right host or port?",
"Unable to connect to the server: tls: failed to verify certificate: x509: certificate signed by unknown
authority", "error: You must be logged in to the server (Unauthorized)" and "Error from server (Forbidden): …";
these say the same, and name the kubeconfig and context the server came from. The library's own text (errno
numbers, urllib3's connection objects, OpenSSL's source lines) never reaches the terminal.
"""
from __future__ import annotations

import socket
import ssl
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

EXIT_USAGE = 2          # bad arguments or input files (argparse's own status)
EXIT_KUBECONFIG = 5     # no usable kubeconfig, in-cluster service account or credentials
EXIT_UNREACHABLE = 6    # no answer from the API server: refused, timed out, TLS, name lookup
EXIT_REFUSED = 7        # the API server answered with an error: unauthorized, forbidden, not found, invalid
EXIT_PROMETHEUS = 8     # Prometheus (or a plugin's /metrics) unreachable, refused, or not a Prometheus API there

# For --help, beside each command's own statuses.
CLUSTER_EXIT_STATUS = {
    EXIT_KUBECONFIG: "no usable kubeconfig or credentials",
    EXIT_UNREACHABLE: "API server unreachable (refused, timed out, TLS, unknown host)",
    EXIT_REFUSED: "API server refused the request (unauthorized, forbidden, not found, invalid)",
}
# For --help of the commands that read Prometheus or a plugin's /metrics.
PROMETHEUS_EXIT_STATUS = {
    EXIT_PROMETHEUS: "Prometheus or the plugin's /metrics unreachable (refused, timed out, TLS, unknown host), "
                     "credentials refused, or no Prometheus API at that URL",
}

# OpenSSL's verify codes as Go's x509 words them (what kubectl prints).
_X509 = {2: "certificate signed by unknown authority", 18: "certificate signed by unknown authority",
         19: "certificate signed by unknown authority", 20: "certificate signed by unknown authority",
         21: "certificate signed by unknown authority", 9: "certificate has expired or is not yet valid",
         10: "certificate has expired or is not yet valid"}


@dataclass(frozen=True)
class Failure:
    code: int
    line: str


def describe(exc: BaseException, api_client: Any = None, needs: str = "") -> Failure | None:
    """The kind of cluster failure ``exc`` is (or was raised from) and its one line; None when it is none.
    ``api_client``: the client of the failed request, for the server's address and the kubeconfig behind it;
    ``needs``: the grants the command needs, said after a refusal for want of them."""
    from kube.client import ApiError, ApiUnavailable, CredentialsUnavailable
    from kube.connect import ConnectError

    for err in _chain(exc):
        if isinstance(err, ConnectError):
            return Failure(EXIT_KUBECONFIG, str(err))
        if isinstance(err, CredentialsUnavailable):
            return Failure(EXIT_KUBECONFIG, f"cannot read the credentials: {_plain(_root(err))} ({_source(api_client)})")
        if isinstance(err, ApiError):
            line = _answered(err, api_client)
            return Failure(EXIT_REFUSED, f"{line}; {needs}" if needs and err.status == 403 else line)
        if isinstance(err, ApiUnavailable):
            return Failure(EXIT_UNREACHABLE, _unreachable(err, api_client))
    return None


def report(prog: str, exc: BaseException, api_client: Any = None, default: int = EXIT_USAGE, needs: str = "") -> int:
    """Prints the failure's line under ``prog`` and returns its exit status; any other error is printed as it is,
    with ``default``."""
    failure = describe(exc, api_client, needs)
    print(f"{prog}: {failure.line if failure else exc}", file=sys.stderr)
    return failure.code if failure else default


def no_answer(api_client: Any, seconds: float) -> Failure:
    """A wait for the API server that ended before any answer (`--once` against a server that never answers)."""
    return Failure(EXIT_UNREACHABLE, f"unable to connect to the server {_server(api_client)}: no answer within "
                                     f"{seconds:g}s - is the API server up and reachable from here? "
                                     f"({_source(api_client)})")


def _answered(err: Any, api_client: Any) -> str:
    reason = err.reason or f"HTTP {err.status}"
    if err.status == 401:
        return (f"you must be logged in to the server {_server(api_client)} ({reason}) - check the user's "
                f"credentials ({_source(api_client)})")
    return f"error from server ({reason}): {err.message}"


def _unreachable(err: BaseException, api_client: Any) -> str:
    server, source = _server(api_client), _source(api_client)
    root = _root(err)
    if isinstance(root, ssl.SSLCertVerificationError):
        words = _X509.get(root.verify_code, root.verify_message or "certificate verify failed")
        return (f"unable to connect to the server {server}: tls: failed to verify certificate: x509: {words} - "
                f"check the cluster's certificate-authority ({source})")
    if isinstance(root, ConnectionRefusedError):
        return f"the connection to the server {server} was refused - did you specify the right host or port? ({source})"
    if isinstance(root, socket.gaierror):
        return f"unable to connect to the server {server}: no such host - check the cluster's server ({source})"
    if isinstance(root, (TimeoutError, socket.timeout)) or "timed out" in str(root).lower():
        return (f"unable to connect to the server {server}: i/o timeout - is the API server up and reachable from "
                f"here? ({source})")
    if isinstance(root, ssl.SSLError):
        return (f"unable to connect to the server {server}: tls: {root.reason or 'handshake failed'} - is that the "
                f"API server's HTTPS address? ({source})")
    if isinstance(root, ConnectionError):
        return (f"unable to connect to the server {server}: the connection was closed - is that the API server's "
                f"address? ({source})")
    return f"unable to connect to the server {server}: {_text(err)} ({source})"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors it was raised from, outermost first."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)


def _root(exc: BaseException) -> BaseException:
    *_, last = _chain(exc)
    return last


def _plain(err: BaseException) -> str:
    """An OS error without its errno: "no such file or directory: /var/run/.../token"."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower() + (f": {err.filename}" if err.filename else "")
    return str(err)


def _text(err: BaseException) -> str:
    """An error of ours without a library cause: its message, after the request it names."""
    text = str(err)
    return text.split(": ", 1)[1] if text.startswith(("GET ", "POST ", "PUT ", "PATCH ", "DELETE ")) else text


def _server(api_client: Any) -> str:
    host = str(getattr(getattr(api_client, "configuration", None), "host", "") or "")
    return urllib.parse.urlsplit(host).netloc or host or "(unknown)"


def _source(api_client: Any) -> str:
    from kube.connect import source_of

    return source_of(api_client) or "the kubeconfig"
