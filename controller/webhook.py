"""Validating admission webhook: refuses ResourceClaims and ResourceClaimTemplates whose opaque device
configurations for this driver do not decode, at `kubectl apply` time instead of at prepare time.

The check is the plugin's own (`api.config.decode_opaque_config`) and so is the message; only the path prefix
says where the entry sits in the object (`spec.devices.config[0].opaque.parameters...`, or `spec.spec...` in a
template). Whether a config fits the device type it ends up on is known only after allocation; that stays with
the plugin.

Served over TLS by `serve`: POST /validate (AdmissionReview admission.k8s.io/v1), GET /healthz and /readyz.
The certificate and key are read again whenever their files change (a rotated Secret), for new connections.
Anyone who reaches the port is bounded like the API server: bodies of at most 3 MiB, JSON of at most 64 levels
(deeper parts read as null, refused by the decoder), threads, connections and their time as `kube.httpserver`
bounds them with `LIMITS`: a review reaches a worker only once it has arrived whole, within 3 s of connecting.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import sys
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from prometheus_client import Counter

from api.config import ConfigError, decode_opaque_config
from api.config.errors import printable
from kube.boundedjson import loads_bounded
from kube.httpserver import BoundedHTTPServer, ConnectionLimits, ProbeHandler, start

log = logging.getLogger(__name__)

REVIEWS = Counter("gpu_dra_webhook_reviews", "Admission reviews answered, by resource and result "
                  "(allowed, denied).", ["resource", "result"])

# resource -> where the claim spec sits in the object; the three served versions (v1, v1beta2, v1beta1) agree
# on spec.devices.config[].opaque.{driver, parameters}.
CLAIM_SPEC_PATHS: dict[str, tuple[str, ...]] = {
    "resourceclaims": ("spec",),
    "resourceclaimtemplates": ("spec", "spec"),
}
# The API server sends at most its own request limit (3 MiB) plus the review's envelope; a larger body comes from
# something else and is refused before it is read.
MAX_BODY = 3 << 20
# Deep enough for any config the decoder accepts (its own bound, MAX_PARAMETERS_DEPTH, below the ~10 levels of the
# review around the parameters); deeper containers are read as null, which the decoder then refuses for depth.
MAX_JSON_DEPTH = 64
# Bodies up to MAX_BODY are read before a worker takes the review. Every request must arrive and be answered
# within 3 s of connecting, well inside the API server's timeout (the chart's webhook.timeoutSeconds, 5 s): the
# API server sends at once, and a client that trickles is cut before it could make a review wait that long.
LIMITS = ConnectionLimits(idle_timeout=3.0, request_timeout=3.0, max_body=MAX_BODY)


def config_problems(obj: Any, resource: str, *, driver_name: str, compat_nvidia: bool) -> list[str]:
    """One message per opaque config entry of `driver_name` in the object that the plugin would refuse."""
    path = CLAIM_SPEC_PATHS.get(resource)
    if path is None or not isinstance(obj, Mapping):
        return []
    spec: Any = obj
    for key in path:
        spec = spec.get(key) if isinstance(spec, Mapping) else None
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    configs = devices.get("config") if isinstance(devices, Mapping) else None
    problems: list[str] = []
    for i, entry in enumerate(configs if isinstance(configs, list) else []):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver_name:
            continue
        try:
            decode_opaque_config(opaque.get("parameters"), compat_nvidia=compat_nvidia)
        except ConfigError as exc:
            where = ".".join(path) + f".devices.config[{i}].opaque.parameters"
            problems.append(str(exc.with_prefix(where)))
    return problems


def review(body: Any, *, driver_name: str, compat_nvidia: bool) -> dict[str, Any]:
    """The AdmissionReview answer to an AdmissionReview request. Raises ValueError for a body that is not one."""
    request = body.get("request") if isinstance(body, Mapping) else None
    if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str):
        raise ValueError("not an AdmissionReview request (admission.k8s.io/v1): no request.uid")
    resource = request.get("resource")
    if not isinstance(resource, Mapping):
        resource = {}
    name = resource.get("resource", "")
    problems: list[str] = []
    if request.get("operation") in ("CREATE", "UPDATE") and resource.get("group") == "resource.k8s.io" \
            and not request.get("subResource"):
        problems = config_problems(request.get("object"), name, driver_name=driver_name, compat_nvidia=compat_nvidia)
    response: dict[str, Any] = {"uid": request["uid"], "allowed": not problems}
    if problems:
        response["status"] = {"code": 422, "reason": "Invalid", "message": "; ".join(problems)}
        obj = request.get("object")
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        if not isinstance(meta, Mapping):
            meta = {}
        # Names as sent: the API server has validated them, anyone else who reaches the port has not.
        who = f"{name} {request.get('namespace', '')}/{meta.get('name') or meta.get('generateName', '')}"
        log.info("denied %s: %s", printable(who), response["status"]["message"])
    # Only the resources served are labels: a review of anything else must not add a series.
    REVIEWS.labels(name if name in CLAIM_SPEC_PATHS else "other", "allowed" if not problems else "denied").inc()
    return {"apiVersion": body.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview",
            "response": response}


class _CertReloader:
    """A server-side SSLContext, made again when the certificate or key file changes (mtime, size, inode)."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self._lock = threading.Lock()
        self._stamp: tuple[Any, ...] | None = None
        self._context: ssl.SSLContext | None = None
        self.context()  # a bad certificate fails the start, with the file named

    def _files_stamp(self) -> tuple[Any, ...]:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino)
                     for st in (os.stat(self.cert_file), os.stat(self.key_file)))

    def context(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._files_stamp()
            except OSError as exc:
                if self._context is None:
                    raise
                log.warning("serving certificate unreadable (%s); keeping the loaded one", exc)
                return self._context
            if stamp != self._stamp:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                try:
                    ctx.load_cert_chain(self.cert_file, self.key_file)
                except (ssl.SSLError, OSError) as exc:
                    if self._context is None:
                        raise
                    log.warning("new serving certificate unusable (%s); keeping the loaded one", exc)
                    return self._context
                if self._context is not None:
                    log.info("serving certificate reloaded from %s", self.cert_file)
                self._context, self._stamp = ctx, stamp
            assert self._context is not None
            return self._context


class _TLSServer(BoundedHTTPServer):
    reloader: _CertReloader

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        # No handshake here: the server does it without blocking, as the client's bytes arrive, under its timeouts.
        return self.reloader.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Failed handshakes (a client that does not trust the CA, a TCP probe) are routine: one line, no traceback.
        log.warning("connection from %s: %s", client_address[0], printable(str(sys.exc_info()[1])))


class _ReviewHandler(ProbeHandler):
    """POST /validate besides the probes and /metrics."""

    driver_name: str
    compat_nvidia: bool

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        if self.path.split("?", 1)[0] != "/validate":
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(411, "text/plain; charset=utf-8", b"Content-Length required\n")
            return
        if not 0 < length <= MAX_BODY:
            # Answered before the body is read; the connection is closed with the rest unread.
            self._reply(413, "text/plain; charset=utf-8", f"body must be 1 to {MAX_BODY} bytes\n".encode())
            return
        body = self.rfile.read(length)  # read by the server already: no wait on the client
        try:
            answer = review(loads_bounded(body, MAX_JSON_DEPTH), driver_name=self.driver_name,
                            compat_nvidia=self.compat_nvidia)
        except (ValueError, UnicodeDecodeError) as exc:
            self._reply(400, "text/plain; charset=utf-8", f"{printable(str(exc))}\n".encode())
            return
        self._reply(200, "application/json", json.dumps(answer).encode())


def serve(address: str, port: int, cert_file: str, key_file: str, *, driver_name: str,
          compat_nvidia: bool, limits: ConnectionLimits = LIMITS) -> BoundedHTTPServer:
    """Starts serving in a background thread; port 0 picks a free one (server.server_address). Stop with
    server.shutdown(). Raises OSError or ssl.SSLError when the certificate or key cannot be loaded."""
    reloader = _CertReloader(cert_file, key_file)
    handler = type("Handler", (_ReviewHandler,), {"driver_name": driver_name, "compat_nvidia": compat_nvidia})
    # Whatever the other limits, a review's body is read before a worker takes it (the handler reads no further).
    server = _TLSServer((address, port), handler, limits=replace(limits, max_body=MAX_BODY))
    server.reloader = reloader
    return start(server, "webhook")
