"""PCIe topology facts NVML does not report, read from sysfs.

The standard attribute ``resource.kubernetes.io/pcieRoot`` names the root complex a device sits below
(``pci<domain>:<bus>``), so that a claim can ask for a GPU and a NIC under the same root with
``matchAttribute``. sysfs encodes it in the device's canonical path:
``/sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0`` -> ``pci0000:17``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_ROOT_COMPONENT = re.compile(r"^pci([0-9a-f]{4,8}):([0-9a-f]{2})$")


def pcie_root_of(pci_bus_id: str, sysfs_root: str | Path = "/sys") -> str | None:
    """The root complex of ``pci_bus_id`` (extended BDF, lower case), or None when sysfs does not know it."""
    link = Path(sysfs_root) / "bus" / "pci" / "devices" / pci_bus_id
    try:
        target = os.path.realpath(link, strict=True)
    except OSError:
        return None
    for part in Path(target).parts:
        m = _ROOT_COMPONENT.fullmatch(part)
        if m:
            return f"pci{m.group(1)[-4:]}:{m.group(2)}"
    return None
