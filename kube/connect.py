"""How the controllers get an ApiClient: a kubeconfig file, the in-cluster service account, or the
default kubeconfig ($KUBECONFIG, ~/.kube/config), in that order."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class ConnectError(RuntimeError):
    """No usable cluster credentials; the message says what was tried."""


def api_client_from(kubeconfig: str | None = None) -> Any:
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    if kubeconfig:
        if not Path(kubeconfig).is_file():
            raise ConnectError(f"--kubeconfig {kubeconfig}: no such file")
        try:
            return kconfig.new_client_from_config(config_file=kubeconfig)
        except kconfig.ConfigException as exc:
            raise ConnectError(f"--kubeconfig {kubeconfig}: {exc}") from exc
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
