"""The kernel's per-boot random ID: state stamped with it is recognised as from before a reboot."""
from __future__ import annotations

from pathlib import Path

DEFAULT_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def read_boot_id(path: Path | str = DEFAULT_BOOT_ID_PATH) -> str:
    """The boot ID, or "" where the file does not exist (then reboots are not detected)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
