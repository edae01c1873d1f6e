"""Prepared claims rebuilt from their CDI specs, for when the checkpoint was lost (moved aside as unreadable).

A prepared claim leaves two traces the checkpoint does not hold alone:

* its CDI spec, named after the claim UID, with one CDI device per prepared device named
  ``<claim uid>-<device name>`` (``-<share id>`` added for a memory share);
* for a dynamic MIG device, the MIG device itself at the allocated placement (GI profile and start are in the
  device name, so exactly one live MIG device can be it).

That is enough to know which devices each claim holds (so they are not handed out twice), to answer the
kubelet, and to undo the claim on unprepare: destroy its MIG devices and delete its spec. What the spec does not
say is not invented: request names, namespace and name (filled in from the claim when it is prepared again),
MPS daemons (their limits were only in the checkpoint) and time-slice settings (left as they are). A dynamic
MIG placement named by more than one claim (an admin-access claim watching it) is given to none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dra.node import migdevices as mig
from dra.node.cdi import CdiSpecWriter, load_spec
from dra.node.checkpoint import PREPARE_COMPLETED, ClaimRecord, MigUndo, UndoInfo
from dra.node.checkpoint import PreparedDevice as CheckpointDevice
from dra.model.devices import KIND_MIG, Device


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


def recover_claims(cdi: CdiSpecWriter, devices: Mapping[str, Device], nvml: Any, pool: str,
                   skip: Sequence[str] = ()) -> Recovery:
    """One ``PrepareCompleted`` record (``recovered=True``) per claim CDI spec whose UID is not in ``skip``."""
    problems: list[str] = []
    parsed: dict[str, list[tuple[str, str | None, str]]] = {}     # uid -> [(device, share id, cdi id)]
    for uid, path in sorted(cdi.list_claim_specs().items()):
        if uid in skip:
            continue
        try:
            spec = load_spec(path)
            entries = []
            for d in spec.get("devices") or []:
                name, share = split_cdi_device_name(uid, str(d["name"]), devices)
                entries.append((name, share, f"{spec['kind']}={d['name']}"))
        except (OSError, ValueError, KeyError, TypeError) as err:
            problems.append(f"{path}: {err}")
            continue
        if not entries:
            problems.append(f"{path}: no devices")
            continue
        parsed[uid] = entries

    dynamic_gpus = sorted({devices[n].gpu_uuid for e in parsed.values() for n, _, _ in e
                           if n in devices and devices[n].kind == KIND_MIG and devices[n].mig_dynamic})
    try:
        live = _live_placements(nvml, dynamic_gpus)
    except (mig.MigError, nvml.NVMLError) as err:
        problems.append(f"listing MIG devices failed, none adopted: {err}")
        live = {}
    owners: dict[tuple[str, int, int], list[str]] = {}
    for uid, entries in parsed.items():
        for name, _, _ in entries:
            d = devices.get(name)
            if d is not None and d.kind == KIND_MIG and d.mig_dynamic:
                owners.setdefault((d.gpu_uuid, d.mig_profile_id or 0, d.mig_start or 0), []).append(uid)

    records = []
    for uid, entries in parsed.items():
        stored, undo = [], []
        for name, share, cdi_id in entries:
            d = devices.get(name)
            uuid = None
            if d is not None and d.kind == KIND_MIG and d.mig_dynamic:
                placement = (d.gpu_uuid, d.mig_profile_id or 0, d.mig_start or 0)
                m = live.get(placement)
                if m is not None:
                    uuid = m.uuid or None
                    if len(owners[placement]) == 1:
                        undo.append(MigUndo(device=name, parent_uuid=m.parent_uuid, gi_id=m.gi_id, ci_id=m.ci_id,
                                            mig_uuid=m.uuid or None, profile_id=m.profile_id, start=m.start))
                    else:
                        problems.append(f"claim {uid}: MIG device {name} is named by claims "
                                        f"{', '.join(owners[placement])}; not destroyed on their unprepare")
            elif d is not None:
                uuid = d.mig_uuid if d.kind == KIND_MIG else d.gpu_uuid
            stored.append(CheckpointDevice(device=name, pool=pool, cdi_device_ids=(cdi_id,), share_id=share,
                                           uuid=uuid))
        records.append(ClaimRecord(uid=uid, state=PREPARE_COMPLETED, devices=tuple(stored),
                                   undo=UndoInfo(mig_devices=tuple(undo)), recovered=True))
    return Recovery(tuple(records), tuple(problems))
