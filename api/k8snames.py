"""Kubernetes name rules (apimachinery validation), in one place: object and pool names, label keys and
values, qualified names. Everything that checks a name a user, the API server or the kubelet gives us asks
these functions."""
from __future__ import annotations

import re
from typing import Any

# Matched whole (re.fullmatch): "^...$" with re.match would also take a name followed by a newline ('$'
# matches before a final "\n"), and such a name reaches paths, logs and the API server.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_UID = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_]{0,126}[A-Za-z0-9])?")


def is_dns_label(v: Any, max_len: int = 63) -> bool:
    """RFC 1123 label: lower-case alphanumerics and '-', e.g. a namespace name."""
    return isinstance(v, str) and 0 < len(v) <= max_len and bool(_DNS_LABEL.fullmatch(v))


def is_dns_subdomain(v: Any, max_len: int = 253) -> bool:
    """RFC 1123 subdomain: dot-separated labels, e.g. most object names, a driver name (max 63)."""
    return isinstance(v, str) and 0 < len(v) <= max_len and bool(_DNS_SUBDOMAIN.fullmatch(v))


def is_qualified_name(v: Any) -> bool:
    """A DRA attribute or capacity name: C identifier of at most 32, optionally prefixed by a domain."""
    if not isinstance(v, str):
        return False
    if "/" in v:
        domain, _, ident = v.partition("/")
        return is_dns_subdomain(domain, 63) and len(ident) <= 32 and bool(_C_IDENT.fullmatch(ident))
    return len(v) <= 32 and bool(_C_IDENT.fullmatch(v))


def is_label_key(v: Any) -> bool:
    """A label or taint key: optional DNS-subdomain prefix and '/', then a name of at most 63 characters."""
    if not isinstance(v, str):
        return False
    prefix, _, name = v.rpartition("/")
    if prefix and not is_dns_subdomain(prefix, 253):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME.fullmatch(name))


def is_label_value(v: Any) -> bool:
    """A label or taint value: empty, or at most 63 alphanumerics with '-', '_', '.' inside."""
    return isinstance(v, str) and len(v) <= 63 and bool(_LABEL_VALUE.fullmatch(v))


def is_uid(v: Any) -> bool:
    """An object UID as the API server assigns it (a UUID), or one of the same safe shape: letters, digits,
    '-' and '_', at most 128; never '/', '.' or anything else a path could be built from."""
    return isinstance(v, str) and bool(_UID.fullmatch(v))
