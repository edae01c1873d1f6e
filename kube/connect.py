"""How the controllers and commands reach the API server: a kubeconfig file, the in-cluster service account, or
the default kubeconfig ($KUBECONFIG, ~/.kube/config), in that order; a named context instead of the current one;
and the default namespace as kubectl finds it (the context's namespace, the service account's, "default")."""
from __future__ import annotations

import os
from pathlib import Path

from kube.kubeconfig import (
    ClusterAccess,
    ConnectError,
    cluster_access,
    from_kubeconfig,
    in_cluster,
    kubeconfig_files,
    read_kubeconfigs,
)

__all__ = ["ConnectError", "api_client_from", "default_namespace"]

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def api_client_from(kubeconfig: str | None = None, context: str | None = None) -> ClusterAccess:
    """`context`: a context of the kubeconfig instead of its current one (never the in-cluster account then)."""
    if kubeconfig:
        if not Path(kubeconfig).is_file():
            raise ConnectError(f"--kubeconfig {kubeconfig}: no such file")
        return _from_kubeconfig(kubeconfig, context, f"--kubeconfig {kubeconfig}")
    if context:
        return _from_kubeconfig(None, context, f"--context {context}")
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    try:
        return _from_kubeconfig(None, None, "default kubeconfig")
    except ConnectError as exc:
        raise ConnectError(f"no --kubeconfig given, not running in a cluster, and the default kubeconfig "
                           f"is unusable: {exc}") from exc


def _from_kubeconfig(kubeconfig: str | None, context: str | None, what: str) -> ClusterAccess:
    access = from_kubeconfig(kubeconfig, context)
    if access is not None:
        return access
    # Exec credential plugins and auth-providers: the kubernetes package's machinery builds the credentials.
    from kubernetes import config as kconfig

    try:
        api_client = kconfig.new_client_from_config(config_file=kubeconfig or os.environ.get("KUBECONFIG"),
                                                    context=context)
    except kconfig.ConfigException as exc:
        raise ConnectError(f"{what}: {exc}") from exc
    return cluster_access(api_client)


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
        merged = read_kubeconfigs(kubeconfig_files(kubeconfig))
    except ConnectError:
        if kubeconfig or context:
            raise
        return "default"            # no kubeconfig at all: connecting will say so
    name = context or merged.current
    if context and name not in merged.contexts:
        raise ConnectError(f"--context {context}: no such context in kubeconfig {kubeconfig or '(default)'}")
    chosen = merged.contexts.get(name or "", ({}, None))[0]
    return str(chosen.get("namespace") or "default")
