"""Device health as the kubelet's DRAResourceHealth stream reports it.

``HealthBoard`` keeps the current health of every device this plugin publishes. Watchers get the complete
list whenever something changes and again every ``resend_interval`` seconds: the kubelet marks devices
it has not heard about within its timeout (30 s by default) as Unknown, so silence is not an option.
Watchers are blocking generators, each in its stream's thread: between changes and resends they wait on the
board's condition variable, and a kubelet that goes away ends its watch through ``wake`` (no polling).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Literal, Mapping, Sequence

HealthStatus = Literal["Healthy", "Unhealthy", "Unknown"]

MAX_MESSAGE = 1024
DEFAULT_RESEND_INTERVAL = 10.0
# Taint effects that make a device unusable for new work; "None" taints are informational.
UNHEALTHY_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    status: HealthStatus
    message: str = ""
    updated: float = 0.0          # unix seconds when the status was determined


def health_from_taints(taints: Sequence[Mapping[str, object]]) -> tuple[HealthStatus, str]:
    """A device with a NoSchedule/NoExecute taint is unhealthy; the message names the taints."""
    bad = [t for t in taints if t.get("effect") in UNHEALTHY_EFFECTS]
    if not bad:
        return "Healthy", ""
    parts = []
    for t in bad:
        value = t.get("value")
        parts.append(f"{t.get('key')}={value}:{t.get('effect')}" if value else f"{t.get('key')}:{t.get('effect')}")
    return "Unhealthy", "; ".join(parts)[:MAX_MESSAGE]


class HealthBoard:
    def __init__(self, resend_interval: float = DEFAULT_RESEND_INTERVAL, timeout_seconds: int = 0):
        self.resend_interval = resend_interval
        self.timeout_seconds = timeout_seconds   # per-device staleness hint; 0 = kubelet default
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)   # notified on every change, close and wake
        self._devices: dict[tuple[str, str], DeviceHealth] = {}
        self._version = 0
        self._closed = False

    def replace(self, devices: Iterable[DeviceHealth]) -> None:
        """Set the complete device list (devices not listed are no longer reported)."""
        new = {(d.pool, d.device): d for d in devices}
        with self._changed:
            if self._same(new):
                return
            self._devices = new
            self._version += 1
            self._changed.notify_all()

    def set_from_taints(self, pool: str, devices: Iterable[str],
                        taints: Mapping[str, Sequence[Mapping[str, object]]]) -> None:
        """Health of every published device of ``pool``: healthy unless ``taints[device]`` says otherwise.
        Status times only change when the status does, so an unchanged board does not wake watchers."""
        now = time.time()
        with self._lock:
            old = dict(self._devices)
        out = []
        for name in devices:
            status, message = health_from_taints(taints.get(name, ()))
            prev = old.get((pool, name))
            if prev is not None and prev.status == status and prev.message == message:
                out.append(prev)
            else:
                out.append(DeviceHealth(pool, name, status, message, now))
        self.replace(out)

    def _same(self, new: dict[tuple[str, str], DeviceHealth]) -> bool:
        return new == self._devices

    def snapshot(self) -> tuple[int, list[DeviceHealth]]:
        with self._lock:
            return self._version, sorted(self._devices.values(), key=lambda d: (d.pool, d.device))

    def close(self) -> None:
        """End every watch (server shutdown)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wake(self) -> None:
        """Make every watch look at its ``stop`` event (one of them was cancelled)."""
        with self._changed:
            self._changed.notify_all()

    def watch(self, stop: threading.Event | None = None) -> Iterator[list[DeviceHealth]]:
        """Yield the full list now, on every change, and every ``resend_interval`` seconds, until the board is
        closed or ``stop`` is set (then call ``wake`` so the watch sees it)."""
        seen, last_sent = -1, float("-inf")
        while True:
            with self._changed:
                while True:
                    if self._closed or (stop is not None and stop.is_set()):
                        return
                    if self._version != seen:
                        break
                    remaining = self.resend_interval - (time.monotonic() - last_sent)
                    if remaining <= 0:
                        break
                    self._changed.wait(remaining)
                seen = self._version
                devices = sorted(self._devices.values(), key=lambda d: (d.pool, d.device))
            last_sent = time.monotonic()
            yield devices
