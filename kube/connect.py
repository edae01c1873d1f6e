"""How the controllers and commands reach the API server: a `kubernetes.client.ApiClient` from a kubeconfig file, the
in-cluster service account, or the default kubeconfig ($KUBECONFIG, ~/.kube/config), in that order; a named
context instead of the current one; and the default namespace as kubectl finds it (the context's namespace, the
service account's, "default").

The kubernetes package reads the kubeconfig (a $KUBECONFIG list merged as kubectl merges it; tokens and token
files, client certificates, basic auth, exec credential plugins, auth-providers, tls-server-name, proxy-url) and the
service account (its token re-read once a minute). Added here, so that a kubeconfig works exactly as with kubectl:
the current-context of a list is the first file's that names one; what kubectl refuses is refused
(kube.kubeconfigcheck), naming the file; a proxy URL's credentials go into a Proxy-Authorization header (urllib3
sends none from the URL); and after a 401 the credentials' source is read again (kube.client.Credentials).
"""
from __future__ import annotations

import os
import urllib.parse
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kube.client import credentials_of
from kube.kubeconfigcheck import cluster_problems, user_problems

__all__ = ["ConnectError", "api_client_from", "default_namespace", "source_of"]


class ConnectError(RuntimeError):
    """No usable cluster credentials; the message says what was tried and what was wrong."""


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
IN_CLUSTER = "in-cluster service account"
# Where each client's server and credentials came from, for messages that say what to check.
_sources: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def source_of(api_client: Any) -> str:
    """"kubeconfig FILE, context NAME" or "in-cluster service account"; "" for a client not made here."""
    try:
        return _sources.get(api_client, "")
    except TypeError:           # not weakly referenceable: not one of ours
        return ""


def api_client_from(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """`context`: a context of the kubeconfig instead of its current one (never the in-cluster account then)."""
    if kubeconfig:
        if not Path(kubeconfig).is_file():
            raise ConnectError(f"--kubeconfig {kubeconfig}: no such file")
        return _from_kubeconfig([kubeconfig], context)
    if context:
        return _from_kubeconfig(kubeconfig_files(), context)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return _in_cluster()
    try:
        return _from_kubeconfig(kubeconfig_files(), None)
    except ConnectError as exc:
        raise ConnectError(f"no --kubeconfig given, not running in a cluster, and the default kubeconfig "
                           f"is unusable: {exc}") from exc


def kubeconfig_files(kubeconfig: str | None = None) -> list[str]:
    """The files a kubeconfig argument names: the file itself, else $KUBECONFIG (a list), else ~/.kube/config."""
    if kubeconfig:
        return [kubeconfig]
    listed = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    return listed or [os.path.expanduser("~/.kube/config")]


@dataclass
class _Kubeconfig:
    """Kubeconfig files merged by the kubernetes package (the first definition of a name wins)."""

    merger: Any                  # kubernetes.config.kube_config.KubeConfigMerger
    where: str                   # the files read, for messages
    current: str                 # the current-context kubectl uses: the first file's that names one

    def named(self, kind: str, name: str) -> tuple[dict[str, Any], str] | None:
        """The `kind` ("contexts", "clusters", "users") entry `name` and the file it came from."""
        for node in self.merger.config.value[kind]:
            if node.value.get("name") == name:
                return node.value, str(node.path)
        return None


def _read(files: list[str]) -> _Kubeconfig:
    from kubernetes.config import kube_config

    present = [os.path.expanduser(f) for f in files if os.path.exists(os.path.expanduser(f))]
    if not present:          # kubectl skips the missing files of a list
        raise ConnectError(f"kubeconfig {os.pathsep.join(files)}: no such file")
    try:
        merger = kube_config.KubeConfigMerger(kube_config.ENV_KUBECONFIG_PATH_SEPARATOR.join(present))
    except Exception as exc:  # noqa: BLE001 - what a malformed file makes the merger raise is not ours to list
        raise ConnectError(_unreadable(present, exc)) from exc
    current = next((str(merger.config_files[p].get("current-context") or "") for p in merger.paths
                    if merger.config_files[p].get("current-context")), "")
    return _Kubeconfig(merger, os.pathsep.join(present), current)


def _unreadable(files: list[str], exc: Exception) -> str:
    """Which of `files` the kubernetes package cannot read, and why."""
    import yaml
    from kubernetes.config import kube_config

    path = os.pathsep.join(files)
    for one in files if len(files) > 1 else []:
        try:
            kube_config.KubeConfigMerger(one)
        except Exception as own:  # noqa: BLE001 - as in _read
            path, exc = one, own
            break
    # kubectl's words: error loading config file "<file>": yaml: line 2: <problem>
    what = f'error loading config file "{path}"'
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{what}: yaml: line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    if isinstance(exc, yaml.YAMLError):
        return f"{what}: yaml: {' '.join(str(exc).split())}"
    if isinstance(exc, UnicodeDecodeError):
        return f"{what}: not a text file (byte {exc.object[exc.start]:#04x} at offset {exc.start} is not UTF-8)"
    if isinstance(exc, OSError):
        return f"{what}: {(exc.strerror or str(exc)).lower()}"
    return f"{what}: not a kubeconfig (a mapping with clusters, contexts and users)"


def _from_kubeconfig(files: list[str], context: str | None) -> Any:
    from kubernetes import client as kclient
    from kubernetes.config import kube_config

    config = _read(files)
    name = context or config.current
    if not name:
        raise ConnectError(f"kubeconfig {config.where}: no current-context and no --context given")
    chosen = config.named("contexts", name)
    if chosen is None:
        what = f"--context {name}" if context else f"kubeconfig {config.where}: current-context {name}"
        raise ConnectError(f"{what}: no such context in kubeconfig {config.where}")
    ctx = chosen[0].get("context") or {}
    cluster = config.named("clusters", str(ctx.get("cluster", "")))
    user = config.named("users", str(ctx.get("user", ""))) if ctx.get("user") else None
    if cluster is None:
        raise ConnectError(f"kubeconfig {chosen[1]}: context {name}: cluster {ctx.get('cluster')!r} is not defined")
    problems = [f"kubeconfig {cluster[1]}: {p}"
                for p in cluster_problems(cluster[0]["name"], cluster[0].get("cluster") or {})]
    if user is not None:
        problems += [f"kubeconfig {user[1]}: {p}" for p in user_problems(user[0]["name"], user[0].get("user") or {})]
    if problems:
        raise ConnectError("; ".join(problems))

    cfg = type.__call__(kclient.Configuration)       # a fresh one, not a copy of the package's default
    loader = kube_config.KubeConfigLoader(config_dict=config.merger.config, active_context=name,
                                          config_base_path=None, config_persister=config.merger.save_changes)
    proxy_url = (cluster[0].get("cluster") or {}).get("proxy-url")

    def load() -> None:
        loader.load_and_set(cfg)
        if proxy_url:
            cfg.no_proxy = None       # kubectl sends everything to a kubeconfig's proxy-url, whatever $NO_PROXY says
        _proxy_credentials(cfg)

    where = f"kubeconfig {config.where} context {name}"
    _load(load, where)
    if user is not None and (user[0].get("user") or {}).get("exec") and not _has_credentials(cfg):
        raise ConnectError(f"kubeconfig {user[1]}: user {user[0]['name']}: the exec credential plugin gave no "
                           f"credentials: {_exec_failure(config, user[0]['name'], cluster[0]['name'])}")
    return _api_client(cfg, load, where, f"kubeconfig {config.where}, context {name}")


def _in_cluster() -> Any:
    """The pod's service account: KUBERNETES_SERVICE_HOST/PORT, its token (re-read) and CA, from where
    kubernetes.config.incluster_config looks for them."""
    from kubernetes import client as kclient
    from kubernetes.config import incluster_config

    cfg = type.__call__(kclient.Configuration)
    loader = incluster_config.InClusterConfigLoader(token_filename=incluster_config.SERVICE_TOKEN_FILENAME,
                                                    cert_filename=incluster_config.SERVICE_CERT_FILENAME)

    def load() -> None:
        loader.load_and_set(cfg)
        _proxy_credentials(cfg)

    _load(load, "in-cluster configuration")
    return _api_client(cfg, load, "in-cluster configuration", IN_CLUSTER)


def _load(load: Callable[[], None], where: str) -> None:
    from kubernetes.config import ConfigException

    try:
        load()
    except (ConfigException, OSError, ValueError) as exc:
        raise ConnectError(f"{where}: {exc}") from exc


def _api_client(cfg: Any, reload: Callable[[], None], where: str, source: str) -> Any:
    from kubernetes import client as kclient

    cfg.keep_alive = True        # TCP keep-alive as client-go dials: a watch through a silent drop ends
    try:
        api_client = kclient.ApiClient(configuration=cfg)
    except (ImportError, ValueError) as exc:     # a socks5 proxy without PySocks, say
        raise ConnectError(f"{where}: {exc}") from exc
    credentials_of(api_client).reload = reload
    _sources[api_client] = source
    return api_client


def _proxy_credentials(cfg: Any) -> None:
    """A proxy URL's user:password as the Proxy-Authorization header kubectl sends, and the URL without them."""
    import urllib3

    proxy = cfg.proxy
    parts = urllib.parse.urlsplit(proxy) if proxy else None
    if parts is None or (parts.username is None and parts.password is None):
        return
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    pair = f"{urllib.parse.unquote(parts.username or '')}:{urllib.parse.unquote(parts.password or '')}"
    cfg.proxy = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    cfg.proxy_headers = {**(cfg.proxy_headers or {}), **urllib3.make_headers(proxy_basic_auth=pair)}


def _has_credentials(cfg: Any) -> bool:
    return bool(cfg.api_key.get("BearerToken") or cfg.cert_file)


def _exec_failure(config: _Kubeconfig, user: str, cluster: str) -> str:
    """Why the exec plugin gave nothing (the kubernetes package only logs it): the plugin run once more, as the
    package runs it (in the directory of the cluster's kubeconfig)."""
    from kubernetes.config import ConfigException
    from kubernetes.config.exec_provider import ExecProvider

    merged = config.merger.config
    try:
        node = merged["clusters"].get_with_name(cluster)["cluster"]
        status = ExecProvider(merged["users"].get_with_name(user)["user"]["exec"],
                              os.path.dirname(os.path.abspath(str(node.path))), node).run()
    except ConfigException as exc:
        return str(exc)
    return f"no token and no client certificate in its answer (only {', '.join(sorted(status)) or 'nothing'})"


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
        config = _read(kubeconfig_files(kubeconfig))
    except ConnectError:
        if kubeconfig or context:
            raise
        return "default"            # no kubeconfig at all: connecting will say so
    chosen = config.named("contexts", context or config.current)
    if context and chosen is None:
        raise ConnectError(f"--context {context}: no such context in kubeconfig {config.where}")
    return str(((chosen[0] if chosen else {}).get("context") or {}).get("namespace") or "default")
