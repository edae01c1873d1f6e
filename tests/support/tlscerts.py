"""A CA and a serving certificate signed by it, made with the openssl command line, for the webhook tests."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServingCert:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"openssl {' '.join(args[:2])} failed: {proc.stderr[-500:]}"


def make_serving_cert(directory: Path, name: str = "webhook", ips: tuple[str, ...] = ("127.0.0.1",),
                      dns: tuple[str, ...] = ("localhost",), usage: str = "serverAuth") -> ServingCert:
    """<name>-ca.crt, <name>.crt and <name>.key in `directory`: an EC CA and a certificate for `ips` and `dns`
    (`usage` "clientAuth": a client certificate)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = directory / f"{name}-ca.key", directory / f"{name}-ca.crt"
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", f"/CN={name}-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    sans = ",".join([*(f"IP:{ip}" for ip in ips), *(f"DNS:{d}" for d in dns)])
    ext.write_text((f"subjectAltName={sans}\n" if sans else "") +
                   f"extendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return ServingCert(ca=ca, cert=cert, key=key)
