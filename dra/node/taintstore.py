"""The health monitor's XID and ECC taints on disk, so that a plugin restart does not make a broken GPU
schedulable again.

One JSON file in the plugin's state directory, replaced atomically (temporary file, fsync, rename) whenever a
taint comes, goes, or gets a newer event. Per device and taint: key, value, effect, ``timeAdded`` (unix
seconds; what the ResourceSlice shows) and ``lastEvent`` (unix seconds of the latest event behind it: the
quiet-period clock, which goes on running while the plugin is down). Lost and unmonitored GPUs are not
stored: every start finds them again. The kernel boot ID is stored too: a reboot resets the GPUs, so taints
from an earlier boot are dropped (one line). A file that cannot be read is reported once and ignored; the next
change replaces it. It is read as dra.node.safefiles reads state files (no link followed, no FIFO or device
read, only a regular file of the plugin's UID, at most ``MAX_FILE_BYTES``); anything else in its place is moved
aside like an unreadable file, and writes never follow a link.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dra.node.atomicfile import remove_leftover_temp_files, set_aside
from dra.node.bootid import read_boot_id
from dra.node.safefiles import UnsafeFile, read_regular_file, write_regular_file

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_FILE_NAME = "device-taints.json"
MAX_FILE_BYTES = 16 << 20        # two taints per device of a few hundred bytes each: far below this
# The other plugin process of a rolling update saves taints whenever its GPUs' health changes, outside any lock
# shared with this one: a temporary file younger than this may be its write in progress.
TEMP_FILE_AGE_S = 60.0


@dataclass(frozen=True, order=True)
class SavedTaint:
    device: str
    key: str
    value: str
    effect: str
    time_added: float        # unix seconds the taint was first set
    last_event: float        # unix seconds of the latest event behind it


class TaintStore:
    """Reads and writes the taint file; errors are logged, never raised (health must keep running)."""

    def __init__(self, path: Path | str, boot_id_path: Path | str | None = None) -> None:
        self.path = Path(path)
        self.boot_id = read_boot_id(boot_id_path) if boot_id_path is not None else ""

    def load(self) -> list[SavedTaint]:
        removed = remove_leftover_temp_files(self.path.parent, targets=(self.path.name,), older_than_s=TEMP_FILE_AGE_S)
        if removed:
            log.warning("removed temporary file(s) of device taint writes a crash cut short: %s",
                        ", ".join(str(p) for p in removed))
        try:
            raw = read_regular_file(self.path, MAX_FILE_BYTES)
        except FileNotFoundError:
            return []
        except UnsafeFile as err:         # a link, FIFO, device or directory in its place, another owner
            self._set_aside(err.problem)
            return []
        except OSError as err:            # no permission, I/O error
            self._set_aside(f"cannot be read ({err.strerror or err})")
            return []
        try:
            doc = json.loads(raw)
            out = [SavedTaint(device=str(t["device"]), key=str(t["key"]), value=str(t.get("value", "")),
                              effect=str(t["effect"]), time_added=float(t["timeAdded"]),
                              last_event=float(t["lastEvent"]))
                   for t in doc["taints"]]
        except (ValueError, KeyError, TypeError) as err:
            self._set_aside(f"is not valid ({type(err).__name__}: {err})")
            return []
        saved_boot = str(doc.get("nodeBootId") or "")
        if out and saved_boot and self.boot_id and saved_boot != self.boot_id:
            log.warning("node rebooted since device taints %s were saved (boot ID %s, now %s): the reboot reset the "
                        "GPUs, dropping %d taint(s)", self.path, saved_boot, self.boot_id, len(out))
            return []
        return sorted(out)

    def _set_aside(self, problem: str) -> None:
        try:
            moved = f"moved them to {set_aside(self.path)}"
        except OSError as err:
            moved = f"and they cannot be moved aside ({err.strerror or err})"
        log.error("device taints file %s %s; %s and starting without its taints", self.path, problem, moved)

    def save(self, taints: Iterable[SavedTaint]) -> bool:
        """Replace the file; returns whether it was written."""
        doc = {"schemaVersion": SCHEMA_VERSION, "nodeBootId": self.boot_id, "taints": [
            {"device": t.device, "key": t.key, "value": t.value, "effect": t.effect, "timeAdded": t.time_added,
             "lastEvent": t.last_event} for t in sorted(taints)]}
        try:
            write_regular_file(self.path, json.dumps(doc, indent=2).encode() + b"\n", mode=0o600)
        except OSError as err:
            log.error("writing device taints to %s failed (%s); a restart now would forget them", self.path, err)
            return False
        return True
