"""CDI specs checked by the CDI reference library (tags.cncf.io/container-device-interface), the parser and
validator container runtimes load specs with: hack/cdi-validate, built by `make cdi-validate` (hack/build-cdi-tools.sh)
into ~/.cache/gpu-dra. A missing binary fails the calling test with the command that builds it; nothing skips."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack" / "build-cdi-tools.sh"


@functools.cache
def validator() -> str:
    """Path of the cdi-validate binary for the current hack/cdi-validate sources (never builds it)."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), "validate"], capture_output=True, text=True,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "GPU_DRA_CDI_NO_BUILD": "1",
                               **_cache_env()}, timeout=60)
    if proc.returncode != 0:
        raise AssertionError("the CDI reference validator is not built: run `make cdi-validate` "
                             f"({proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no output'})")
    return proc.stdout.strip().splitlines()[-1]


def _cache_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("HOME", "GPU_DRA_CACHE") if k in os.environ}


def check_files(paths: Iterable[Path | str]) -> list[str]:
    """Run the validator on spec files; returns its per-file lines. A rejected file fails with the reason."""
    files = [str(p) for p in paths]
    if not files:
        raise AssertionError("no CDI spec files to validate")
    proc = subprocess.run([validator(), *files], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        bad = [line for line in proc.stdout.splitlines() if ": ok (" not in line]
        raise AssertionError("the CDI reference library rejects: " + "; ".join(bad or [proc.stderr.strip()]))
    return proc.stdout.splitlines()


def check_specs(specs: Iterable[dict[str, Any]]) -> list[str]:
    """Validate spec documents (as the driver builds them) by writing each to a JSON file first."""
    with tempfile.TemporaryDirectory(prefix="cdi-validate-") as tmp:
        paths = []
        for i, spec in enumerate(specs):
            path = Path(tmp) / f"spec-{i}.json"
            path.write_text(json.dumps(spec))
            paths.append(path)
        return check_files(paths)


def rejection(spec: dict[str, Any]) -> str:
    """The reference library's reason for refusing ``spec`` (the test fails if it accepts it)."""
    with tempfile.TemporaryDirectory(prefix="cdi-validate-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        proc = subprocess.run([validator(), str(path)], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        raise AssertionError(f"the CDI reference library accepts a spec it should refuse: {proc.stdout.strip()}")
    return proc.stdout.strip()
