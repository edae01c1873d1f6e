"""Bringing the node in line with the checkpoint at start-up, and rebuilding prepared claims from their CDI specs
when the checkpoint was lost.

At start (``recover_at_start``): temporary files of writes a crash cut short are deleted in every state
directory (checkpoint, CDI specs, MPS daemon records); claims of an earlier boot are forgotten (their CDI specs
deleted); an exclusive device that two records hold (a damaged or edited checkpoint) goes to the claim the API
server allocates it to, or to neither (``resolve_double_bookings``); completed claims are adopted (their
time-slice settings, MPS daemons and MIG devices registered again, before any rollback releases a GPU setting
they share); half-done prepares, and records that lost every device to another claim, are rolled back; MIG
devices and CDI specs nobody owns are removed — unless state was lost, in which case nothing is destroyed and
claims are adopted from their CDI specs instead.

Rebuilding from CDI specs (``recover_claims``) — for when the checkpoint was moved aside as unreadable:

A prepared claim leaves two traces the checkpoint does not hold alone:

* its CDI spec, named after the claim UID, with one CDI device per prepared device named
  ``<claim uid>-<device name>`` (``-<share id>`` added for a memory share);
* for a dynamic MIG device, the MIG device itself at the allocated placement (GI profile and start are in the
  device name, so exactly one live MIG device can be it).

That is enough to know which devices each claim holds (so they are not handed out twice), to answer the
kubelet, and to undo the claim on unprepare: destroy its MIG devices and delete its spec. What the spec does not
say is not invented: request names, namespace and name (filled in from the claim when it is prepared again),
and time-slice settings (left as they are). MPS daemons are found by the pipe directories the spec mounts. A dynamic
MIG placement named by more than one claim (an admin-access claim watching it) is given to none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from api.config.errors import printable
from dra.model.devices import KIND_MIG, Device
from dra.node import migdevices as mig
from dra.node.cdi import CdiSpecWriter, load_spec
from dra.node.checkpoint import (
    PREPARE_COMPLETED,
    BookingConflict,
    CheckpointStore,
    ClaimRecord,
    LoadResult,
    MpsUse,
    UndoInfo,
)
from dra.node.checkpoint import PreparedDevice as CheckpointDevice
from dra.node.sharing import MpsPaths, read_record
from kubeletplugin.claims import ClaimError, ClaimSource, allocation_for
from kubeletplugin.deviceactions import ClaimActions, mig_undo


@dataclass(frozen=True)
class StartupReport:
    checkpoint: LoadResult
    rolled_back: tuple[str, ...]          # claims whose half-done prepare was undone
    rollback_failed: tuple[str, ...]      # claims whose rollback failed (retried on their next prepare/unprepare)
    mig_destroyed: tuple[str, ...]        # "<parent uuid>/gi<g>/ci<c>" of MIG devices nobody owned
    cdi_removed: tuple[str, ...]          # claim UIDs whose orphaned CDI specs were removed
    mps_adopted: int
    adopted_from_cdi: tuple[str, ...] = ()   # claims rebuilt from their CDI specs (the checkpoint was lost)
    conservative: bool = False            # state was lost: nothing was destroyed or deleted at this start
    temp_files_removed: tuple[str, ...] = ()  # temporary files of writes a crash cut short


def recover_at_start(*, checkpoint: CheckpointStore, cdi: CdiSpecWriter, actions: ClaimActions,
                     rollback: Callable[[ClaimRecord], None], devices: Mapping[str, Device], nvml: Any,
                     pool_name: str, log: Any, claims: ClaimSource, driver_name: str) -> StartupReport:
    """Load the checkpoint and bring the node in line with it (module docstring)."""
    loaded = checkpoint.load()
    temp_removed = [str(p) for p in (*loaded.temp_files_removed, *cdi.remove_leftover_temp_files(),
                                     *actions.mps.remove_leftover_temp_files())]
    if temp_removed:
        log.warning("removed temporary files of writes a crash cut short", files=temp_removed)
    emptied = resolve_double_bookings(checkpoint, claims, driver_name, log)
    for record in loaded.dropped_claims:
        # State from before a reboot: the hardware state is gone; the CDI file may remain on a
        # persistent spec directory.
        cdi.delete_claim_spec(record.uid)
    adopted_from_cdi: list[str] = []
    if loaded.state_lost:
        adopted_from_cdi = _adopt_from_cdi_specs(checkpoint, cdi, devices, nvml, pool_name, log,
                                                 mps_root=actions.mps.root)
    # Completed claims first: their time-slice settings are registered before any rollback releases a GPU
    # setting they share.
    for record in checkpoint.claims().values():
        if record.completed:
            actions.adopt(record)
    rolled_back, failed = [], []
    for uid, record in sorted(checkpoint.claims().items()):
        if record.completed and uid not in emptied:
            continue
        try:
            rollback(record)
            rolled_back.append(uid)
        except Exception as err:  # noqa: BLE001 - keep starting; the record stays for a retry
            log.error("rolling back half-done prepare failed", claim_uid=uid, error=str(err))
            failed.append(uid)
    destroyed: list[mig.MigLive] = []
    cdi_removed: list[str] = []
    prepared = checkpoint.claims()
    if loaded.state_lost:
        _log_conservative_start(loaded, adopted_from_cdi, checkpoint, cdi, actions, nvml, log)
    else:
        destroyed = _destroy_unowned_mig(checkpoint, actions, nvml, log)
        for uid in cdi.list_claim_specs():
            if uid not in prepared:
                cdi.delete_claim_spec(uid)
                cdi_removed.append(uid)
    in_use = actions.mps_devices_in_use()
    if not loaded.state_lost:
        _stop_unused_mps_daemons(actions, in_use, log)
    # Daemons outlive the plugin; one that died meanwhile (or a node's first start after an upgrade) is
    # started again for the claims that use it.
    actions.mps.supervise(in_use)
    adopted = len(in_use)
    report = StartupReport(loaded, tuple(rolled_back), tuple(failed),
                           tuple(f"{d.parent_uuid}/gi{d.gi_id}/ci{d.ci_id}" for d in destroyed),
                           tuple(cdi_removed), adopted, tuple(adopted_from_cdi), loaded.state_lost,
                           tuple(temp_removed))
    log.info("driver state recovered", prepared_claims=len(prepared), rolled_back=list(rolled_back),
             rollback_failed=list(failed), mig_destroyed=list(report.mig_destroyed),
             cdi_removed=cdi_removed, mps_daemons=adopted,
             dropped_after_reboot=[r.uid for r in loaded.dropped_claims], adopted_from_cdi=adopted_from_cdi,
             corrupt_checkpoint=str(loaded.corrupt_file) if loaded.corrupt_file else None)
    return report


def resolve_double_bookings(checkpoint: CheckpointStore, claims: ClaimSource, driver_name: str,
                            log: Any) -> set[str]:
    """Each exclusive device that more than one record holds goes to the one claim the API server allocates it to
    on this node; the other records lose their booking of it. When the API server allocates it to none of them,
    to several, or cannot be asked, both bookings stand, so the device stays out of use, and the prepare of
    either claim fails naming the conflict (``CheckpointStore.conflict_of``). One log line per conflict. Returns
    the claims whose records hold no device any more: nothing the kubelet asked for is prepared for them, so the
    caller rolls them back (what else they recorded is undone, and they are forgotten)."""
    emptied: set[str] = set()
    for conflict in checkpoint.conflicts():
        allocated, unknown = _allocated_to(conflict, checkpoint, claims, driver_name)
        if len(allocated) == 1 and not unknown:
            checkpoint.resolve(conflict, allocated[0])
            losers = [uid for uid in conflict.claims if uid != allocated[0]]
            gone = [uid for uid in losers if (r := checkpoint.get(uid)) is not None and not r.devices]
            emptied.update(gone)
            log.error(printable(f"checkpoint: {conflict.describe()}; the API server allocates it to claim "
                                f"{allocated[0]} only, which keeps it: the other record(s) no longer list the device "
                                "or a MIG device made for it, so unpreparing those claims leaves them alone"
                                + (f"; record(s) left with no device are rolled back now: {', '.join(gone)}"
                                   if gone else "")),
                      device=conflict.device, claims=list(conflict.claims), keeper=allocated[0])
            continue
        if unknown:
            why = f"the API server could not be asked about every one ({'; '.join(unknown)})"
        elif allocated:
            why = f"the API server allocates it to each of {', '.join(allocated)}"
        else:
            why = "the API server allocates it to none of them"
        log.error(printable(f"checkpoint: {conflict.describe()} and {why}: both bookings stand, the device stays out "
                            "of use and the prepare of either claim fails naming this conflict until the next start "
                            "resolves it or one of them is unprepared"),
                  device=conflict.device, claims=list(conflict.claims))
    return emptied


def _allocated_to(conflict: BookingConflict, checkpoint: CheckpointStore, claims: ClaimSource,
                  driver_name: str) -> tuple[list[str], list[str]]:
    """(the conflict's claims whose allocation on this node holds the device, why a claim could not be asked)."""
    allocated, unknown = [], []
    for uid in conflict.claims:
        record = checkpoint.get(uid)
        if record is None or not record.namespace or not record.name:
            unknown.append(f"claim {uid}: its record names no ResourceClaim")
            continue
        try:
            claim = claims.get_claim(record.namespace, record.name, uid)
            results = allocation_for(claim, driver_name, conflict.pool).devices
        except ClaimError as err:
            if err.reason != "claim":        # missing, replaced or not allocated: not the device's holder
                unknown.append(str(err))
            continue
        if any(r.device == conflict.device and not r.admin_access for r in results):
            allocated.append(uid)
    return allocated, unknown


def _adopt_from_cdi_specs(checkpoint: CheckpointStore, cdi: CdiSpecWriter, devices: Mapping[str, Device],
                          nvml: Any, pool_name: str, log: Any, mps_root: Path | None = None) -> list[str]:
    """The checkpoint lost claims: take back every claim whose CDI spec is still here, so its devices stay
    booked and its unprepare undoes it. Claims whose own record could not be read are adopted the same way."""
    try:
        found = recover_claims(cdi, devices, nvml, pool_name, skip=list(checkpoint.claims()), mps_root=mps_root)
    except Exception as err:  # noqa: BLE001 - adopting is a bonus; the start stays conservative anyway
        log.error("adopting claims from their CDI specs failed", error=str(err))
        return []
    for problem in found.problems:
        log.warning("claim not adopted from its CDI spec", detail=problem)
    adopted = []
    for record in found.records:
        try:
            checkpoint.put(record)
        except OSError as err:
            log.error("recording an adopted claim failed", claim_uid=record.uid, error=str(err))
            continue
        adopted.append(record.uid)
    return adopted


def _log_conservative_start(loaded: LoadResult, adopted: list[str], checkpoint: CheckpointStore,
                            cdi: CdiSpecWriter, actions: ClaimActions, nvml: Any, log: Any) -> None:
    """One line: why this start destroys nothing, and what it keeps that it would otherwise remove."""
    claims = checkpoint.claims()
    owned = {(m.parent_uuid, m.gi_id, m.ci_id) for r in claims.values() for m in r.undo.mig_devices}
    mig_kept: list[str] = []
    try:
        for gpu in sorted(actions.dynamic_mig_gpus()):
            mig_kept += [f"{m.parent_uuid}/gi{m.gi_id}/ci{m.ci_id}" for m in mig.list_mig_devices(nvml, gpu)
                         if m.key not in owned]
    except (mig.MigError, nvml.NVMLError) as err:
        mig_kept.append(f"(listing failed: {err})")
    cdi_kept = sorted(uid for uid in cdi.list_claim_specs() if uid not in claims)
    if loaded.damage:
        reason = f"{loaded.damage}; the checkpoint was set aside"
    elif loaded.corrupt:
        reason = (f"the checkpoint could not be read and was moved to {loaded.corrupt_file}"
                  if loaded.corrupt_file else "the checkpoint could not be read")
    else:
        reason = f"the records of claims {', '.join(loaded.unreadable_claims)} could not be read"
    log.warning(
        f"prepared-claim state was lost ({reason}): this start destroys no MIG device and deletes no CDI spec; "
        f"{len(adopted)} claim(s) adopted from their CDI specs (with the MPS daemons their specs mount; their "
        "time-slice settings are not known and stay as they are)",
        adopted_claims=adopted, unowned_mig_kept=mig_kept, cdi_specs_kept=cdi_kept)


def _destroy_unowned_mig(checkpoint: CheckpointStore, actions: ClaimActions, nvml: Any, log: Any) -> list[mig.MigLive]:
    """MIG devices on dynamic-MIG GPUs that no prepared claim owns are leftovers of a crash (or made by hand,
    which dynamic MIG forbids): destroy them so the published placements are really free."""
    gpus = sorted(actions.dynamic_mig_gpus())
    if not gpus:
        return []
    keep = {(m.parent_uuid, m.gi_id, m.ci_id) for r in checkpoint.claims().values() for m in r.undo.mig_devices}
    try:
        return mig.destroy_unknown_mig_devices(nvml, keep, gpus=gpus)
    except (mig.MigError, nvml.NVMLError) as err:
        log.error("cleaning up unowned MIG devices failed", error=str(err))
        return []


@dataclass(frozen=True)
class Recovery:
    """What ``recover_claims`` found."""

    records: tuple[ClaimRecord, ...]
    problems: tuple[str, ...]          # specs that could not be used, each naming its file and the reason


def split_cdi_device_name(claim_uid: str, cdi_name: str, devices: Mapping[str, Device]) -> tuple[str, str | None]:
    """(device name, share id) of one CDI device of a claim's spec. The longest published device name wins;
    a share id is accepted only on a device that takes several allocations. A name this node does not publish
    (any more) is returned whole."""
    prefix = f"{claim_uid}-"
    if not cdi_name.startswith(prefix):
        raise ValueError(f"CDI device {cdi_name!r} does not start with the claim UID")
    rest = cdi_name[len(prefix):]
    if rest in devices:
        return rest, None
    for name in sorted(devices, key=len, reverse=True):
        if rest.startswith(name + "-") and devices[name].allow_multiple_allocations:
            return name, rest[len(name) + 1:]
    return rest, None


def _live_placements(nvml: Any, gpus: Sequence[str]) -> dict[tuple[str, int, int], mig.MigLive]:
    """(parent uuid, GI profile, start) -> the MIG device there now, on the given GPUs."""
    out: dict[tuple[str, int, int], mig.MigLive] = {}
    for gpu in gpus:
        for live in mig.list_mig_devices(nvml, gpu):
            if live.ci_id >= 0:
                out[(gpu, live.profile_id, live.start)] = live
    return out


def _daemon_device(base: Path) -> str | None:
    """The device a daemon directory serves, from its record when that checks out (``read_record``: a regular
    file of the plugin's naming the device of its own directory)."""
    record, _ = read_record(MpsPaths(base))
    return record.device if record is not None else None


def _mps_uses(spec: Mapping[str, Any], mps_root: Path | None, devices: Mapping[str, Device],
              names: Sequence[str]) -> list[MpsUse]:
    """The MPS daemons a claim's spec mounts (their pipe directories are ``<mps root>/<daemon dir>/pipe``)."""
    if mps_root is None:
        return []
    named = [d for n in names if (d := devices.get(n)) is not None]
    gpus = {d.mig_uuid or d.gpu_uuid: d.gpu_uuid for d in named} | {d.gpu_uuid: d.gpu_uuid for d in named}
    fallback = named[0].gpu_uuid if named else None       # a dynamic MIG device's UUID is only known live
    uses: dict[str, MpsUse] = {}
    for d in spec.get("devices") or []:
        for mount in ((d.get("containerEdits") or {}).get("mounts") or []):
            host = Path(str(mount.get("hostPath", "")))
            if host.name == "pipe" and host.parent.parent == mps_root:
                device = _daemon_device(host.parent)
                if device is not None:
                    uses[device] = MpsUse(device=device, gpu=gpus.get(device, fallback or device))
    return list(uses.values())


def _visible_uuids(cdi_device: Mapping[str, Any]) -> set[str]:
    """The UUIDs a CDI device of a claim spec shows its container (``NVIDIA_VISIBLE_DEVICES``)."""
    for entry in ((cdi_device.get("containerEdits") or {}).get("env") or []):
        key, _, value = str(entry).partition("=")
        if key == "NVIDIA_VISIBLE_DEVICES":
            return {u for u in value.split(",") if u}
    return set()


def _placements_of(d: Device, live: Mapping[tuple[str, int, int], mig.MigLive],
                   visible: set[str]) -> list[tuple[str, int, int]]:
    """The live MIG devices a claim's dynamic MIG device stands for: the one at its placement, or for a share of
    a one-profile MIG device (no placement in its name) those of its profile its container sees."""
    if d.mig_start is not None:
        placement = (d.gpu_uuid, d.mig_profile_id or 0, d.mig_start)
        return [placement] if placement in live else []
    return [key for key, m in sorted(live.items())
            if key[:2] == (d.gpu_uuid, d.mig_profile_id) and m.uuid and m.uuid in visible]


def recover_claims(cdi: CdiSpecWriter, devices: Mapping[str, Device], nvml: Any, pool: str,
                   skip: Sequence[str] = (), mps_root: Path | None = None) -> Recovery:
    """One ``PrepareCompleted`` record (``recovered=True``) per claim CDI spec whose UID is not in ``skip``."""
    problems: list[str] = []
    parsed: dict[str, list[tuple[str, str | None, str]]] = {}     # uid -> [(device, share id, cdi id)]
    visible: dict[tuple[str, str], set[str]] = {}                  # (uid, cdi id) -> UUIDs its container sees
    mps: dict[str, list[MpsUse]] = {}
    for uid, path in sorted(cdi.list_claim_specs().items()):
        if uid in skip:
            continue
        try:
            spec = load_spec(path)
            entries = []
            for d in spec.get("devices") or []:
                name, share = split_cdi_device_name(uid, str(d["name"]), devices)
                entries.append((name, share, f"{spec['kind']}={d['name']}"))
                visible[(uid, entries[-1][2])] = _visible_uuids(d)
        except (OSError, ValueError, KeyError, TypeError) as err:
            problems.append(f"{path}: {err}")
            continue
        if not entries:
            problems.append(f"{path}: no devices")
            continue
        parsed[uid] = entries
        mps[uid] = _mps_uses(spec, mps_root, devices, [name for name, _, _ in entries])

    dynamic_gpus = sorted({devices[n].gpu_uuid for e in parsed.values() for n, _, _ in e
                           if n in devices and devices[n].kind == KIND_MIG and devices[n].mig_dynamic})
    try:
        live = _live_placements(nvml, dynamic_gpus)
    except (mig.MigError, nvml.NVMLError) as err:
        problems.append(f"listing MIG devices failed, none adopted: {err}")
        live = {}
    owners: dict[tuple[str, int, int], list[str]] = {}
    for uid, entries in parsed.items():
        for name, _, cdi_id in entries:
            d = devices.get(name)
            if d is not None and d.kind == KIND_MIG and d.mig_dynamic:
                for placement in _placements_of(d, live, visible[(uid, cdi_id)]):
                    owners.setdefault(placement, []).append(uid)

    records = []
    for uid, entries in parsed.items():
        stored, undo = [], []
        for name, share, cdi_id in entries:
            d = devices.get(name)
            uuid = None
            if d is not None and d.kind == KIND_MIG and d.mig_dynamic:
                for placement in _placements_of(d, live, visible[(uid, cdi_id)]):
                    m = live[placement]
                    uuid = uuid or m.uuid or None
                    if len(owners[placement]) == 1:
                        undo.append(mig_undo(name, m, share if d.mig_start is None else None))
                    else:
                        problems.append(f"claim {uid}: MIG device {name} is named by claims "
                                        f"{', '.join(owners[placement])}; not destroyed on their unprepare")
            elif d is not None:
                uuid = d.mig_uuid if d.kind == KIND_MIG else d.gpu_uuid
            stored.append(CheckpointDevice(device=name, pool=pool, cdi_device_ids=(cdi_id,), share_id=share,
                                           uuid=uuid))
        records.append(ClaimRecord(uid=uid, state=PREPARE_COMPLETED, devices=tuple(stored),
                                   undo=UndoInfo(mig_devices=tuple(undo), mps_devices=tuple(mps.get(uid, ()))),
                                   recovered=True))
    return Recovery(tuple(records), tuple(problems))


def _stop_unused_mps_daemons(actions: ClaimActions, in_use: Mapping[str, str], log: Any) -> None:
    """A daemon no claim uses is a leftover of a crash between its last claim's undo steps: stop it."""
    records = actions.mps.records()
    for device in sorted(set(records) - set(in_use)):
        try:
            actions.mps.release(device, records[device].gpu)
            log.warning("stopped an MPS daemon no prepared claim uses", device=device)
        except Exception as err:  # noqa: BLE001 - keep starting; the next start tries again
            log.error("stopping an unused MPS daemon failed", device=device, error=str(err))
    actions.mps.remove_unknown(in_use)
