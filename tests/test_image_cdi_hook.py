"""The driver image carries the driver's nvidia-cdi-hook where the chart's init container takes it from, and that
init container's command installs it with the image's own Python."""
from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

from test_image import ROOT, archive, blobs, image_run, rootfs  # noqa: F401 - module fixtures of the image

HOOK = "usr/local/bin/nvidia-cdi-hook"


def pinned_version() -> str:
    match = re.search(r"^NVIDIA_CTK_VERSION=v(\S+)$", (ROOT / "hack/versions.env").read_text(), re.M)
    assert match, "NVIDIA_CTK_VERSION is not pinned in hack/versions.env"
    return match.group(1)


def test_the_image_has_the_pinned_static_hook(rootfs: Path) -> None:  # noqa: F811 - the fixture imported above
    hook = rootfs / HOOK
    assert stat.S_IMODE(hook.stat().st_mode) == 0o755
    head = hook.read_bytes()[:4096]
    assert head[:4] == b"\x7fELF" and b"ld-linux" not in head, "the hook must not need the host's loader"
    # Static: it runs here as it does from any host's file system.
    proc = subprocess.run([str(hook), "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == f"NVIDIA CDI Hook version {pinned_version()}", proc
    for sub in ("create-symlinks", "update-ldcache", "disable-device-node-modification"):
        assert subprocess.run([str(hook), sub, "--help"], capture_output=True, timeout=30).returncode == 0, sub


def test_the_init_containers_command_installs_it(rootfs: Path) -> None:  # noqa: F811 - the fixture imported above
    target = "/tmp/plugins/gpu.dra-driver.io/bin/nvidia-cdi-hook"
    proc = image_run(rootfs, "/usr/bin/python3", "-m", "dra.node.hookinstall", "/" + HOOK, target)
    assert isinstance(proc, subprocess.CompletedProcess)
    assert proc.returncode == 0 and proc.stdout == f"installed: {target}\n", proc.stderr
    installed = rootfs / target.lstrip("/")
    assert installed.read_bytes() == (rootfs / HOOK).read_bytes()
    assert stat.S_IMODE(installed.stat().st_mode) == 0o755
