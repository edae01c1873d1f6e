"""Waiting for the API server at plugin start.

The plugin cannot publish or read claims without the API server, and what it may publish depends on the
server's version, so it asks for the version first and serves nothing to the kubelet until it has an
answer. An unreachable or refusing server is retried with exponential back-off (0.5 s doubling to 30 s) for
as long as it takes; each kind of failure (connection refused, host name not resolved, timeout, TLS, an HTTP
status) is logged once, in one line without a traceback, and again only when the kind changes. A stop
request (SIGTERM) ends the wait at once.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import structlog

from dra.model.slices import ApiFeatures
from kube.backoff import Backoff
from kube.client import ApiError, ApiUnavailable

INITIAL_DELAY_S = 0.5
MAX_DELAY_S = 30.0

_REASONS = (
    ("connection refused", "connection refused"),
    ("name or service not known", "host name not resolved"),
    ("nodename nor servname", "host name not resolved"),
    ("temporary failure in name resolution", "host name not resolved"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network unreachable"),
    ("timed out", "timed out"),
    ("certificate", "TLS certificate rejected"),
    ("ssl", "TLS handshake failed"),
    ("connection reset", "connection reset"),
    ("remote end closed", "connection closed by the server"),
)


class StoppedWaiting(Exception):
    """A stop was requested while waiting for the API server."""


def describe_api_failure(err: BaseException) -> str:
    """A short, stable name for why the API server did not answer: the same for every attempt that fails the
    same way (no object addresses, no ports)."""
    if isinstance(err, ApiError):
        return f"HTTP {err.status} {err.reason}".strip()
    texts: list[str] = []
    cause: BaseException | None = err
    while cause is not None and len(texts) < 6:
        texts.append(f"{type(cause).__name__}: {cause}".lower())
        reason = getattr(cause, "reason", None)
        cause = reason if isinstance(reason, BaseException) else cause.__cause__
    joined = " | ".join(texts)
    for needle, label in _REASONS:
        if needle in joined:
            return label
    return type(err.__cause__ or err).__name__


def wait_for_api_features(
    api_client: Any,
    stop: threading.Event,
    *,
    fetch: Callable[[Any], ApiFeatures] | None = None,
    on_wait: Callable[[str], None] | None = None,
    backoff: Backoff | None = None,
    log: Any = None,
) -> ApiFeatures:
    """The API server's ``ApiFeatures`` once it answers; raises StoppedWaiting when ``stop`` is set first.
    ``on_wait`` is told the current reason while waiting (for health checks)."""
    if fetch is None:
        from kube.serverversion import api_features

        def fetch(client: Any) -> ApiFeatures:
            return api_features(client, timeout=0)    # one attempt; the back-off is ours

    log = log or structlog.get_logger("kubelet-plugin")
    host = str(getattr(getattr(api_client, "configuration", None), "host", "the API server"))
    backoff = backoff or Backoff(initial=INITIAL_DELAY_S, maximum=MAX_DELAY_S)
    started = time.monotonic()
    attempt, last_kind = 0, None
    while True:
        if stop.is_set():
            raise StoppedWaiting("stopped while waiting for the API server")
        attempt += 1
        try:
            features = fetch(api_client)
        except (ApiUnavailable, ApiError) as err:
            kind = describe_api_failure(err)
            delay = backoff.failure("api")
            if on_wait is not None:
                on_wait(f"waiting for the API server {host}: {kind} (attempt {attempt})")
            if kind != last_kind:
                log.warning(f"API server {host} not usable yet ({kind}); retrying with back-off up to "
                            f"{backoff.maximum:.0f} s, serving nothing to the kubelet until it does",
                            attempt=attempt, retry_in_s=delay)
                last_kind = kind
            if stop.wait(delay):
                raise StoppedWaiting("stopped while waiting for the API server") from None
            continue
        if attempt > 1:
            log.info(f"API server {host} answers", attempts=attempt,
                     waited_s=round(time.monotonic() - started, 1))
        return features
