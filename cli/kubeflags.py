"""kubectl's connection flags and output conventions for the commands that read the cluster (`explain`,
`status`, and so `kubectl gpu`): --kubeconfig, --context, -n defaulting to the context's namespace, and JSON
or YAML documents with camelCase keys."""
from __future__ import annotations

import argparse
import json
import re
from typing import Any

_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)+$")


def add_connection_arguments(parser: argparse.ArgumentParser, namespaced: bool = False) -> None:
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG / ~/.kube/config)")
    parser.add_argument("--context", help="the kubeconfig context to use (default: its current context)")
    if namespaced:
        parser.add_argument("-n", "--namespace",
                            help="namespace of the target (default: the context's namespace, else default)")


def namespace_of(args: argparse.Namespace) -> str:
    """-n if given, else the namespace kubectl would use (kube.connect.default_namespace)."""
    from kube.connect import default_namespace

    return str(args.namespace) if args.namespace else default_namespace(args.kubeconfig, args.context)


def camel_keys(value: Any) -> Any:
    """Every snake_case key of a document in camelCase (as Kubernetes writes JSON); other keys (names of
    claims, profiles, namespaces) stay as they are."""
    if isinstance(value, dict):
        return {(_camel(k) if isinstance(k, str) and _SNAKE.match(k) else k): camel_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [camel_keys(v) for v in value]
    return value


def _camel(key: str) -> str:
    first, *rest = key.split("_")
    return first + "".join(p[:1].upper() + p[1:] for p in rest)


def dump(doc: Any, output: str) -> str:
    """The document as JSON or YAML, keys in camelCase."""
    doc = camel_keys(doc)
    if output == "json":
        return json.dumps(doc, indent=2) + "\n"
    import yaml

    return str(yaml.safe_dump(doc, sort_keys=False))
