"""How the controllers and commands get an ApiClient: a kubeconfig file, the in-cluster service account, or the
default kubeconfig ($KUBECONFIG, ~/.kube/config), in that order; a named context instead of the current one;
and the default namespace as kubectl finds it (the context's namespace, the service account's, "default")."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class ConnectError(RuntimeError):
    """No usable cluster credentials; the message says what was tried."""


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def api_client_from(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """`context`: a context of the kubeconfig instead of its current one (never the in-cluster account then)."""
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    if kubeconfig:
        if not Path(kubeconfig).is_file():
            raise ConnectError(f"--kubeconfig {kubeconfig}: no such file")
        _check_context(kubeconfig, context)
        try:
            return kconfig.new_client_from_config(config_file=kubeconfig, context=context)
        except kconfig.ConfigException as exc:
            raise ConnectError(f"--kubeconfig {kubeconfig}: {exc}") from exc
    if context:
        _check_context(None, context)
        try:
            return kconfig.new_client_from_config(config_file=os.environ.get("KUBECONFIG"), context=context)
        except kconfig.ConfigException as exc:
            raise ConnectError(f"--context {context}: {exc}") from exc
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = type.__call__(kclient.Configuration)
        try:
            kconfig.load_incluster_config(client_configuration=cfg)
        except kconfig.ConfigException as exc:
            raise ConnectError(f"in-cluster configuration: {exc}") from exc
        return kclient.ApiClient(configuration=cfg)
    try:
        return kconfig.new_client_from_config()
    except kconfig.ConfigException as exc:
        raise ConnectError(f"no --kubeconfig given, not running in a cluster, and the default kubeconfig "
                           f"is unusable: {exc}") from exc


def _contexts(kubeconfig: str | None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    from kubernetes import config as kconfig

    try:
        # $KUBECONFIG as it is now (the client reads it once, when imported); a list of files is merged.
        contexts, current = kconfig.list_kube_config_contexts(config_file=kubeconfig or os.environ.get("KUBECONFIG"))
    except (kconfig.ConfigException, OSError) as exc:
        raise ConnectError(f"kubeconfig {kubeconfig or '(default)'}: {exc}") from exc
    return list(contexts or []), current


def _check_context(kubeconfig: str | None, context: str | None) -> None:
    if context and not any(c.get("name") == context for c in _contexts(kubeconfig)[0]):
        raise ConnectError(f"--context {context}: no such context in kubeconfig {kubeconfig or '(default)'}")


def default_namespace(kubeconfig: str | None = None, context: str | None = None) -> str:
    """The namespace kubectl would use without -n: the namespace of the context (`context`, else the current
    one) of the kubeconfig; in a pod without a kubeconfig, the service account's; else "default"."""
    if not kubeconfig and not context and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
        except OSError:
            return "default"
    if kubeconfig and not Path(kubeconfig).is_file():
        raise ConnectError(f"--kubeconfig {kubeconfig}: no such file")
    try:
        contexts, current = _contexts(kubeconfig)
    except ConnectError:
        if kubeconfig or context:
            raise
        return "default"            # no kubeconfig at all: connecting will say so
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else current
    if context and chosen is None:
        raise ConnectError(f"--context {context}: no such context in kubeconfig {kubeconfig or '(default)'}")
    return str(((chosen or {}).get("context") or {}).get("namespace") or "default")
