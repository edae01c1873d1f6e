"""What kubectl refuses in the cluster and user of the context it would use, where the kubernetes package would go
on: client-go's rules (clientcmd's validation of the context in use, and its transport's refusal of a CA together
with insecure-skip-tls-verify), in client-go's words. Plain kubeconfig mappings in, problems out; reading the
files is the kubernetes package's work."""
from __future__ import annotations

import urllib.parse
from typing import Any

PROXY_SCHEMES = ("http", "https", "socks5")


def cluster_problems(name: str, cluster: dict[str, Any]) -> list[str]:
    problems = []
    if not cluster.get("server"):
        problems.append(f'no server found for cluster "{name}"')
    proxy = cluster.get("proxy-url")
    if proxy:
        scheme = urllib.parse.urlsplit(str(proxy)).scheme
        if scheme not in PROXY_SCHEMES:
            problems.append(f"invalid 'proxy-url' \"{proxy}\" for cluster \"{name}\": unsupported scheme "
                            f"\"{scheme}\", must be {', '.join(PROXY_SCHEMES[:-1])}, or {PROXY_SCHEMES[-1]}")
    has_file, has_data = bool(cluster.get("certificate-authority")), bool(cluster.get("certificate-authority-data"))
    if has_file and has_data:
        problems.append(f"certificate-authority-data and certificate-authority are both specified for {name}. "
                        f"certificate-authority-data will override.")
    if cluster.get("insecure-skip-tls-verify") is True and (has_file or has_data):
        problems.append("specifying a root certificates file with the insecure flag is not allowed "
                        f"(cluster {name}: insecure-skip-tls-verify together with certificate-authority"
                        f"{'-data' if has_data and not has_file else ''})")
    return problems


def user_problems(name: str, user: dict[str, Any]) -> list[str]:
    problems = []
    methods = (["token"] if user.get("token") else []) + \
        (["basicAuth"] if user.get("username") or user.get("password") else [])
    if len(methods) > 1:
        problems.append(f"more than one authentication method found for {name}; found [{' '.join(methods)}], "
                        f"only one is allowed")
    if user.get("client-certificate") or user.get("client-certificate-data"):
        if user.get("client-certificate") and user.get("client-certificate-data"):
            problems.append(f"client-cert-data and client-cert are both specified for {name}. "
                            f"client-cert-data will override.")
        if user.get("client-key") and user.get("client-key-data"):
            problems.append(f"client-key-data and client-key are both specified for {name}; "
                            f"client-key-data will override")
        if not user.get("client-key") and not user.get("client-key-data"):
            problems.append(f"client-key-data or client-key must be specified for {name} to use the clientCert "
                            f"authentication method.")
    exec_ = user.get("exec")
    if isinstance(exec_, dict):
        if user.get("auth-provider"):
            problems.append(f"authProvider cannot be provided in combination with an exec plugin for {name}")
        for key in ("command", "apiVersion"):
            if not exec_.get(key):
                problems.append(f"{key} must be specified for {name} to use exec authentication plugin")
        mode = exec_.get("interactiveMode")
        if not mode and exec_.get("apiVersion") == "client.authentication.k8s.io/v1":   # v1beta1 defaults it
            problems.append(f"interactiveMode must be specified for {name} to use exec authentication plugin")
        elif mode and mode not in ("Never", "IfAvailable", "Always"):
            problems.append(f'invalid interactiveMode for {name}: "{mode}"')
        if any(not (isinstance(v, dict) and v.get("name")) for v in exec_.get("env") or []):
            problems.append(f"env variable name must be specified for {name} to use exec authentication plugin")
    return problems
