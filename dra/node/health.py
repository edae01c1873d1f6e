"""Device health from NVML events, as device taints.

The monitor registers XID, double-bit and single-bit ECC events on every GPU, waits for them in a stoppable
loop and keeps the current taints of every published device:

* An XID on a whole GPU (no GPU/compute instance in the event) taints every device of that GPU (the GPU,
  its MIG devices, slots and shares); an XID naming a GPU instance (and compute instance) taints only the
  MIG device(s) there.
* Application-error XIDs (13, 31, 43, 45, 68, 109 and any configured extra) are informational: effect
  ``None``. Every other XID, and double-bit ECC errors, get ``NoSchedule``. Single-bit ECC errors are
  corrected by the hardware and only logged. The driver never uses NoExecute: eviction is the
  administrator's call (DeviceTaintRule).
* A lost GPU (``NVML_ERROR_GPU_IS_LOST``) taints all of its devices with ``<driver>/gpu-lost`` (NoSchedule).
* A GPU whose events cannot be registered is tainted ``<driver>/unmonitored`` (None).

Recovery: a lost GPU that answers again loses all its taints (it came back through a reset); XID and ECC
taints disappear after ``quiet_period_s`` without a new event on the device (None: only ``recover``
clears them). With a ``store`` (``dra.node.taintstore.TaintStore``) XID and ECC taints outlive a restart of the
plugin, their quiet-period clock included. ``recover`` is the operator's word that a GPU is healthy again;
``recoveries``, when given, is asked every round for GPUs so declared (a simulated node's ``gpu-dra simulate
recover``). ``on_change`` receives the complete taint map (device name → wire-format taint dicts, empty for
healthy devices) whenever it changes, once per monitor round at most.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from dra.node.taintstore import SavedTaint, TaintStore

log = logging.getLogger(__name__)

APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
NO_INSTANCE = 0xFFFFFFFF          # gpuInstanceId / computeInstanceId of an event about the whole GPU
EFFECT_NONE = "None"
EFFECT_NO_SCHEDULE = "NoSchedule"
_SEVERITY = {EFFECT_NONE: 0, EFFECT_NO_SCHEDULE: 1}

TaintMap = dict[str, list[dict[str, str]]]


@dataclass(frozen=True)
class HealthDevice:
    """A published device and where it lives: a whole-GPU device has no GI/CI."""

    name: str
    gpu_uuid: str
    gi_id: int | None = None
    ci_id: int | None = None


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str
    since: float          # wall-clock time the taint was first set (unix seconds)
    last_seen: float      # monotonic time of the latest event behind it (for the quiet period)
    last_event: float = 0.0   # the same moment in wall-clock time, for the taint file (outlives the process)

    def to_wire(self) -> dict[str, str]:
        wire = {"key": self.key, "effect": self.effect}
        if self.value:
            wire["value"] = self.value
        # Sent, so that rewriting a slice for another device's sake does not make the server stamp it anew.
        wire["timeAdded"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return wire


class HealthMonitor:
    """Turns NVML events into per-device taints. Thread-safe; ``run`` loops until stopped."""

    def __init__(
        self,
        nvml: Any,
        driver_name: str,
        devices: Iterable[HealthDevice],
        on_change: Callable[[TaintMap], None] | None = None,
        *,
        ignored_xids: Iterable[int] = (),
        quiet_period_s: float | None = 300.0,
        probe_interval_s: float = 10.0,
        wait_timeout_ms: int = 10_000,
        recoveries: Callable[[], Iterable[str]] | None = None,
        store: TaintStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.nvml = nvml
        self.driver = driver_name
        self.on_change = on_change
        self.info_xids = APPLICATION_XIDS | frozenset(ignored_xids)
        self.quiet_period_s = quiet_period_s
        self.probe_interval_s = probe_interval_s
        self.wait_timeout_ms = wait_timeout_ms
        self.recoveries = recoveries
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.RLock()
        self._devices: dict[str, HealthDevice] = {}
        self._taints: dict[str, dict[str, Taint]] = {}
        self._event_set: Any = None
        self._registered: set[str] = set()
        self._lost: set[str] = set()
        self._last_probe = float("-inf")
        self._last_sent: TaintMap | None = None
        self.store = store
        self._save_lock = threading.Lock()
        self._last_saved: list[SavedTaint] | None = None
        self.set_devices(devices, notify=False)
        if store is not None:
            self._restore(store.load())

    # ----- keys ----------------------------------------------------------------------------------------------
    @property
    def xid_key(self) -> str:
        return f"{self.driver}/xid"

    @property
    def ecc_key(self) -> str:
        return f"{self.driver}/ecc"

    @property
    def lost_key(self) -> str:
        return f"{self.driver}/gpu-lost"

    @property
    def unmonitored_key(self) -> str:
        return f"{self.driver}/unmonitored"

    # ----- device mapping ------------------------------------------------------------------------------------
    def set_devices(self, devices: Iterable[HealthDevice], notify: bool = True) -> None:
        """Replace the published devices (e.g. after a MIG device was created or a slice republished)."""
        with self._lock:
            self._devices = {d.name: d for d in devices}
            self._taints = {name: taints for name, taints in self._taints.items() if name in self._devices}
            for name, device in self._devices.items():
                self._taints.setdefault(name, {})
                if device.gpu_uuid in self._lost:
                    self._set(name, self.lost_key, "", EFFECT_NO_SCHEDULE)
            if self._event_set is not None:
                self._register_all()
        if notify:
            self._notify()

    def bind_mig(self, name: str, gpu_uuid: str, gi_id: int, ci_id: int) -> None:
        """A dynamic MIG device now exists at GI/CI: route its events to it."""
        with self._lock:
            devices = dict(self._devices)
        devices[name] = HealthDevice(name, gpu_uuid, gi_id, ci_id)
        self.set_devices(devices.values())

    def unbind_mig(self, name: str) -> None:
        """The dynamic MIG device is gone; it stays published as an abstract placement on its GPU."""
        with self._lock:
            devices = dict(self._devices)
            if name not in devices:
                return
            old = devices[name]
            devices[name] = HealthDevice(name, old.gpu_uuid, None, None) if old.gi_id is not None else old
            mig_taints = self._taints.get(name, {})
            for key in (self.xid_key, self.ecc_key):
                mig_taints.pop(key, None)  # they were about the destroyed instance
        self.set_devices(devices.values())

    def _affected(self, gpu_uuid: str, gi: int | None, ci: int | None) -> list[str]:
        on_gpu = [d for d in self._devices.values() if d.gpu_uuid == gpu_uuid]
        if gi is None:
            return sorted(d.name for d in on_gpu)
        return sorted(d.name for d in on_gpu
                      if d.gi_id == gi and (ci is None or d.ci_id is None or d.ci_id == ci))

    # ----- taints --------------------------------------------------------------------------------------------
    def taints(self) -> TaintMap:
        """Device name → wire-format taints (empty list for a healthy device)."""
        with self._lock:
            return {name: [t.to_wire() for _, t in sorted(self._taints.get(name, {}).items())]
                    for name in sorted(self._devices)}

    def _set(self, device: str, key: str, value: str, effect: str) -> None:
        now, wall = self._clock(), self._wall()
        current = self._taints.setdefault(device, {}).get(key)
        if current is not None and _SEVERITY[current.effect] > _SEVERITY[effect]:
            # A harmless XID after a serious one must not make the device schedulable again.
            self._taints[device][key] = replace(current, last_seen=now, last_event=wall)
            return
        since = current.since if current is not None else wall
        self._taints[device][key] = Taint(key, value, effect, since, now, wall)

    # ----- persistence ---------------------------------------------------------------------------------------
    def _saved(self) -> list[SavedTaint]:
        """The taints the file keeps: the event-based ones (lost and unmonitored GPUs are found again)."""
        return sorted(SavedTaint(name, t.key, t.value, t.effect, t.since, t.last_event)
                      for name, taints in self._taints.items() for t in taints.values()
                      if t.key in (self.xid_key, self.ecc_key))

    def _restore(self, saved: Iterable[SavedTaint]) -> None:
        """Taints from before a restart; the quiet period counts from their last event, downtime included."""
        now, wall = self._clock(), self._wall()
        restored, skipped = [], 0
        with self._lock:
            for t in saved:
                if t.device not in self._devices or t.key not in (self.xid_key, self.ecc_key) \
                        or t.effect not in _SEVERITY:
                    skipped += 1    # the device is not published any more, or the entry is not ours
                    continue
                age = max(0.0, wall - t.last_event)
                self._taints.setdefault(t.device, {})[t.key] = Taint(t.key, t.value, t.effect, t.time_added,
                                                                     now - age, t.last_event)
                restored.append(f"{t.device} {t.key}={t.value}:{t.effect}")
            # Dropped entries leave the file at the next save.
            self._last_saved = None if skipped else self._saved()
        if restored or skipped:
            log.warning("restored %d device taint(s) from %s: %s%s", len(restored), self.store.path if self.store
                        else "", ", ".join(restored) or "none",
                        f" ({skipped} for devices no longer published dropped)" if skipped else "")

    def _save(self) -> None:
        if self.store is None:
            return
        with self._save_lock:   # one writer at a time, so an older state never overwrites a newer one
            with self._lock:
                saved = self._saved()
                if saved == self._last_saved:
                    return
            if self.store.save(saved):
                self._last_saved = saved

    def recover(self, gpu_uuid: str) -> None:
        """Clear every taint of a GPU's devices (an operator confirmed it is healthy, or it was reset)."""
        with self._lock:
            self._recover_locked(gpu_uuid)
        self._notify()

    def _recover_locked(self, gpu_uuid: str) -> None:
        log.info("GPU %s declared healthy: clearing the taints of its devices", gpu_uuid)
        self._lost.discard(gpu_uuid)
        for device in self._devices.values():
            if device.gpu_uuid == gpu_uuid:
                self._taints[device.name] = {}
        self._registered.discard(gpu_uuid)
        if self._event_set is not None:
            self._register_gpu(gpu_uuid)

    # ----- events --------------------------------------------------------------------------------------------
    def _gpus(self) -> list[str]:
        return sorted({d.gpu_uuid for d in self._devices.values()})

    def start(self) -> None:
        """Create the event set and register every GPU (idempotent)."""
        with self._lock:
            if self._event_set is None:
                self._event_set = self.nvml.nvmlEventSetCreate()
            self._register_all()
        self._notify()

    def _register_all(self) -> None:
        for uuid in self._gpus():
            if uuid not in self._registered and uuid not in self._lost:
                self._register_gpu(uuid)

    def _register_gpu(self, uuid: str) -> None:
        nvml = self.nvml
        wanted = (nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
                  | nvml.nvmlEventTypeSingleBitEccError)
        names = [d.name for d in self._devices.values() if d.gpu_uuid == uuid]
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            mask = wanted & nvml.nvmlDeviceGetSupportedEventTypes(handle)
            if not mask & nvml.nvmlEventTypeXidCriticalError:
                raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
            nvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
        except nvml.NVMLError as err:
            if getattr(err, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST:
                self._mark_lost(uuid)
                return
            log.warning("cannot register health events on GPU %s (%s): its devices are unmonitored", uuid, err)
            for name in names:
                self._set(name, self.unmonitored_key, "", EFFECT_NONE)
            return
        self._registered.add(uuid)
        for name in names:
            self._taints.setdefault(name, {}).pop(self.unmonitored_key, None)

    def _mark_lost(self, uuid: str) -> None:
        if uuid not in self._lost:
            log.error("GPU %s is lost: tainting all of its devices", uuid)
        self._lost.add(uuid)
        self._registered.discard(uuid)
        for name in self._affected(uuid, None, None):
            self._set(name, self.lost_key, "", EFFECT_NO_SCHEDULE)

    def _handle_event(self, data: Any) -> None:
        nvml = self.nvml
        try:
            uuid = nvml.nvmlDeviceGetUUID(data.device)
        except nvml.NVMLError as err:
            log.warning("dropping an NVML event (type 0x%x, data %d) from a device that cannot be named: %s",
                        data.eventType, data.eventData, err)
            return
        gi = None if data.gpuInstanceId == NO_INSTANCE else int(data.gpuInstanceId)
        ci = None if gi is None or data.computeInstanceId == NO_INSTANCE else int(data.computeInstanceId)
        where = f"GPU {uuid}" + (f" GI {gi}" if gi is not None else "") + (f" CI {ci}" if ci is not None else "")
        if data.eventType & nvml.nvmlEventTypeXidCriticalError:
            xid = int(data.eventData)
            effect = EFFECT_NONE if xid in self.info_xids else EFFECT_NO_SCHEDULE
            names = self._affected(uuid, gi, ci)
            log.warning("XID %d on %s (effect %s) affects %s", xid, where, effect, ", ".join(names) or "no device")
            for name in names:
                self._set(name, self.xid_key, str(xid), effect)
        elif data.eventType & nvml.nvmlEventTypeDoubleBitEccError:
            names = self._affected(uuid, gi, ci)
            log.error("double-bit ECC error on %s affects %s", where, ", ".join(names) or "no device")
            for name in names:
                self._set(name, self.ecc_key, "double-bit", EFFECT_NO_SCHEDULE)
        elif data.eventType & nvml.nvmlEventTypeSingleBitEccError:
            log.info("single-bit ECC error (corrected) on %s", where)

    def _probe(self) -> list[str]:
        """Find lost GPUs and recover the ones that answer again. Returns the GPUs now lost."""
        nvml = self.nvml
        lost = []
        for uuid in self._gpus():
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError as err:
                if getattr(err, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST:
                    lost.append(uuid)
                    self._mark_lost(uuid)
                continue
            if uuid in self._lost:
                log.info("GPU %s answers again: clearing its taints", uuid)
                self._lost.discard(uuid)
                for name in self._affected(uuid, None, None):
                    self._taints[name] = {}
                if self._event_set is not None:
                    self._register_gpu(uuid)
        self._last_probe = self._clock()
        return lost

    def _expire(self) -> bool:
        """Drop XID/ECC taints quiet for ``quiet_period_s``. Returns whether any went."""
        if self.quiet_period_s is None:
            return False
        now = self._clock()
        expired = False
        for name, taints in self._taints.items():
            for key in (self.xid_key, self.ecc_key):
                taint = taints.get(key)
                if taint is not None and now - taint.last_seen >= self.quiet_period_s:
                    log.info("device %s: no new %s event for %.0f s, removing the taint", name, key,
                             self.quiet_period_s)
                    del taints[key]
                    expired = True
        return expired

    def _wait_ms(self) -> int:
        """How long the next NVML wait may last: until the next probe or taint expiry is due, at most
        ``wait_timeout_ms``. Every end of a wait costs a round, so an idle monitor wakes only when there is
        something to do (a probe every ``probe_interval_s``), never on a short fixed beat."""
        due = self._last_probe + self.probe_interval_s
        if self.quiet_period_s is not None:
            with self._lock:
                for taints in self._taints.values():
                    for key in (self.xid_key, self.ecc_key):
                        taint = taints.get(key)
                        if taint is not None:
                            due = min(due, taint.last_seen + self.quiet_period_s)
        return max(1, min(self.wait_timeout_ms, math.ceil(max(0.0, due - self._clock()) * 1000)))

    def poll_once(self, timeout_ms: int | None = None) -> bool:
        """Wait for one event (or the timeout: by default until the next probe or expiry), then probe and
        expire. Returns whether the taints changed."""
        if self._event_set is None:
            self.start()
        nvml = self.nvml
        timeout = self._wait_ms() if timeout_ms is None else timeout_ms
        data = None
        gpu_lost = False
        try:
            data = nvml.nvmlEventSetWait(self._event_set, timeout)
        except nvml.NVMLError as err:
            code = getattr(err, "value", None)
            if code == nvml.NVML_ERROR_GPU_IS_LOST:
                gpu_lost = True
            elif code != nvml.NVML_ERROR_TIMEOUT:
                log.warning("waiting for NVML events failed: %s", err)
        # Asked outside our lock: the source may take the NVML library's lock, which is taken after ours.
        recovered = list(self.recoveries()) if self.recoveries is not None else []
        with self._lock:
            # A round in which nothing happened (no event, recovery, lost or returning GPU, expiry) changes
            # nothing: the taint map is not rebuilt, compared and saved for it, so an idle monitor costs ~no CPU.
            changed = data is not None or gpu_lost
            if data is not None:
                self._handle_event(data)
            for uuid in recovered:
                if uuid in self._gpus():
                    self._recover_locked(uuid)
                    changed = True
            lost_before = set(self._lost)
            if gpu_lost:
                if not self._probe():
                    # NVML did not say which GPU: without a culprit, every GPU is suspect.
                    log.error("NVML reports a lost GPU but no GPU fails a probe: tainting all devices")
                    for uuid in self._gpus():
                        self._mark_lost(uuid)
            elif self._clock() - self._last_probe >= self.probe_interval_s:
                self._probe()
            changed = self._expire() or changed or self._lost != lost_before
        return self._notify() if changed else False

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set; ``wait_timeout_ms`` bounds how long stopping takes (an NVML wait cannot
        be interrupted)."""
        self.start()
        while not stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the monitor must survive one bad event
                log.exception("health monitor round failed")
                stop.wait(1.0)

    def close(self) -> None:
        with self._lock:
            if self._event_set is not None:
                try:
                    self.nvml.nvmlEventSetFree(self._event_set)
                except self.nvml.NVMLError as err:
                    log.warning("freeing the NVML event set failed: %s", err)
                self._event_set = None
                self._registered.clear()

    def _notify(self) -> bool:
        self._save()   # also when only the time of the latest event changed
        current = self.taints()
        with self._lock:
            if current == self._last_sent:
                return False
            self._last_sent = current
        if self.on_change is not None:
            try:
                self.on_change(current)
            except Exception:  # noqa: BLE001 - a failing consumer must not stop monitoring
                log.exception("health change callback failed")
        return True
