"""kube.connect: a named --context and the default namespace as kubectl finds it."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kube.connect import ConnectError, api_client_from, default_namespace


def kubeconfig(tmp_path: Path) -> str:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "dev",
           "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
           "users": [{"name": "u", "user": {"token": "t"}}],
           "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u", "namespace": "ml"}},
                        {"name": "prod", "context": {"cluster": "c", "user": "u", "namespace": "serving"}},
                        {"name": "bare", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_the_default_namespace_is_the_contexts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = kubeconfig(tmp_path)
    assert default_namespace(config) == "ml"
    assert default_namespace(config, "prod") == "serving"
    assert default_namespace(config, "bare") == "default"
    monkeypatch.setenv("KUBECONFIG", config)
    assert default_namespace() == "ml" and default_namespace(context="prod") == "serving"
    with pytest.raises(ConnectError, match="--context nosuch: no such context"):
        default_namespace(config, "nosuch")


def test_a_named_context_is_used_or_refused(tmp_path: Path) -> None:
    config = kubeconfig(tmp_path)
    assert api_client_from(config, "prod").configuration.host == "https://127.0.0.1:1"
    with pytest.raises(ConnectError, match="--context nosuch: no such context"):
        api_client_from(config, "nosuch")


def test_explain_takes_the_namespace_from_the_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpu-dra explain NAME` without -n looks in the context's namespace, with -n in that one."""
    import cli.explain_cmd as explain_cmd
    import ops.explain.reads as reads
    from cli.main import main

    seen: list[str] = []

    def target(kube: object, name: str, namespace: str) -> object:
        seen.append(namespace)
        raise reads.ExplainTargetError(f"no claim named {name} in namespace {namespace}")

    monkeypatch.setattr(reads, "explain_target", target)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = kubeconfig(tmp_path)
    assert main(["explain", "c", "--kubeconfig", config]) == 2
    assert main(["explain", "c", "--kubeconfig", config, "--context", "prod"]) == 2
    assert main(["explain", "c", "--kubeconfig", config, "--context", "prod", "-n", "other"]) == 2
    assert seen == ["ml", "serving", "other"]
    assert explain_cmd.PROG == "gpu-dra explain"
