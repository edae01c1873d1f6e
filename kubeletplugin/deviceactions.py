"""What preparing a claim does to the node besides its CDI spec, and how it is undone.

The steps, in order: create dynamic MIG devices at the allocated placement (or make sure a whole GPU is out of
MIG mode), apply time-slice intervals, start MPS daemons. Each step's undo information goes into the claim's
checkpoint record as soon as the step is done — before it, where a crash right after the change would
otherwise leave a change nobody knows of (time-slices and MPS) — so that a failure or a crash at any point is
rolled back exactly. ``undo`` works from a checkpoint record alone and drops each undo entry as it completes,
so an undo that fails half-way resumes where it stopped.

The caller holds the GPU locks of the claim around ``apply`` and ``undo``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from api.quantity import MIB
from dra.model.devices import KIND_MIG, Device
from dra.model.mig import free_starts
from dra.node import migdevices as mig
from dra.node.cdi import MpsMounts
from dra.node.checkpoint import CheckpointStore, ClaimRecord, MigUndo, MpsUse, TimeSliceUndo, UndoInfo
from dra.node.sharing import MpsDaemons, TimeSlicing
from kubeletplugin.plan import DevicePlan
from kubeletplugin.transport.nodedriver import ClaimRef

DeviceCatalog = Callable[[], Mapping[str, Device]]
MigIdentity = tuple[str, int, int]         # (MIG uuid, GI id, CI id)


class PrepareError(Exception):
    """Preparing a claim failed; the message is what the kubelet shows in the pod's events."""


class MigListener(Protocol):
    """Told when a dynamic MIG device comes into existence or goes away (the health monitor routes its
    events by GPU-instance id)."""

    def bind_mig(self, name: str, gpu_uuid: str, gi_id: int, ci_id: int) -> None: ...

    def unbind_mig(self, name: str) -> None: ...


@dataclass(frozen=True)
class Applied:
    """What the hardware steps produced, for the CDI spec: MIG identities by plan index (the first MIG device;
    a share of k instances of a one-profile MIG device has its other k-1 in ``more_mig_ids``), MPS directories
    by device UUID, and the claim's MPS client limits (environment of every MPS device of the claim)."""

    mig_ids: dict[int, MigIdentity] = field(default_factory=dict)
    more_mig_ids: dict[int, tuple[MigIdentity, ...]] = field(default_factory=dict)
    mps_mounts: dict[str, MpsMounts] = field(default_factory=dict)
    mps_env: tuple[str, ...] = ()


def mig_undo(device: str, live: mig.MigLive, share_id: str | None = None) -> MigUndo:
    """The undo record of a MIG device that realises ``device`` (for a share: one of its instances)."""
    return MigUndo(device=device, parent_uuid=live.parent_uuid, gi_id=live.gi_id, ci_id=live.ci_id,
                   mig_uuid=live.uuid or None, profile_id=live.profile_id, start=live.start, share_id=share_id)


class ClaimActions:
    """The hardware side of prepare and unprepare. ``crash_point`` is the driver's test hook."""

    def __init__(self, *, checkpoint: CheckpointStore, nvml: Any, mps: MpsDaemons, time_slicing: TimeSlicing,
                 devices: DeviceCatalog, mig_listener: MigListener | None,
                 crash_point: Callable[[str], None], log: Any) -> None:
        self.checkpoint = checkpoint
        self.nvml = nvml
        self.mps = mps
        self.time_slicing = time_slicing
        self._devices = devices
        self.mig_listener = mig_listener
        self._crash_point = crash_point
        self.log = log

    # ----- prepare -------------------------------------------------------------------------------------------
    def changes_hardware(self, plans: list[DevicePlan]) -> bool:
        """Whether ``apply`` makes a change that needs an undo record written ahead of it."""
        return any(p.mps is not None or p.timeslice is not None
                   or (p.device.kind == KIND_MIG and p.device.mig_dynamic and not p.result.admin_access)
                   for p in plans)

    def apply(self, ref: ClaimRef, plans: list[DevicePlan], log: Any) -> Applied:
        more: dict[int, tuple[MigIdentity, ...]] = {}
        mig_ids = self._realize_mig(ref.uid, plans, log, more)
        self._apply_time_slices(ref, plans, log)
        mounts = self._start_mps(ref, plans, mig_ids, log)
        return Applied(mig_ids, more, mounts, mps_client_env(ref, plans, mig_ids))

    def _realize_mig(self, uid: str, plans: list[DevicePlan], log: Any,
                     more: dict[int, tuple[MigIdentity, ...]]) -> dict[int, MigIdentity]:
        """Create dynamic MIG devices; returns the identity per plan index of every MIG device (the further
        instances of a share go into ``more``)."""
        dynamic_gpus = self.dynamic_mig_gpus()
        mig_ids: dict[int, MigIdentity] = {}
        for i, p in enumerate(plans):
            d = p.device
            if d.kind != KIND_MIG:
                if d.gpu_uuid in dynamic_gpus and not p.result.admin_access:
                    # Used whole (or by slots/shares): MIG mode must be off for CUDA to see all of the GPU.
                    self._ensure_whole_gpu(d)
                continue
            if d.mig_dynamic and d.mig_start is None:
                if p.result.admin_access:
                    raise PrepareError(f"device {d.name}: admin access to a MIG device shared by instances names "
                                       "no one MIG device; watch the GPU instead")
                made = self._create_instances(uid, p, log)
                mig_ids[i], more[i] = made[0], tuple(made[1:])
            elif d.mig_dynamic and p.result.admin_access:
                mig_ids[i] = self._existing_dynamic_mig(d)
            elif d.mig_dynamic:
                assert d.mig_profile_id is not None and d.mig_start is not None
                live = mig.create_mig_device(self.nvml, d.gpu_uuid, d.mig_profile_id, d.mig_start)
                self._crash_point("mig-created")
                self.add_undo(uid, mig_devices=[mig_undo(d.name, live)])
                log.info("created MIG device", device=d.name, mig_uuid=live.uuid, gi=live.gi_id, ci=live.ci_id)
                if self.mig_listener is not None:
                    self.mig_listener.bind_mig(d.name, d.gpu_uuid, live.gi_id, live.ci_id)
                mig_ids[i] = (live.uuid, live.gi_id, live.ci_id)
            elif d.mig_uuid is None or d.mig_gi_id is None or d.mig_ci_id is None:
                raise PrepareError(f"device {d.name}: static MIG device without GI/CI identity")
            else:
                mig_ids[i] = (d.mig_uuid, d.mig_gi_id, d.mig_ci_id)
        return mig_ids

    def _create_instances(self, uid: str, p: DevicePlan, log: Any) -> list[MigIdentity]:
        """A share of k instances of a one-profile MIG device: k MIG devices at free placements of the profile,
        chosen from what exists on the GPU now (the caller holds the GPU lock). Each is checkpointed with the
        share as it is created, so unprepare destroys exactly these and a restart finds them."""
        d = p.device
        assert d.mig_profile_id is not None and d.mig_profile_name is not None
        taken = [(m.profile_id, m.start) for m in mig.list_mig_devices(self.nvml, d.gpu_uuid)]
        starts = free_starts(d.mig_profile_name, d.mig_profile_id, d.mig_starts, d.mig_instances or 1, taken,
                             p.mig_instances)
        if isinstance(starts, str):
            raise PrepareError(f"device {d.name} (request {p.result.base_request!r}): no free placement for the "
                               f"share of {p.mig_instances} instance(s): {starts}. The scheduler counted them "
                               "free; another MIG device on the GPU that this driver did not create takes them")
        made: list[MigIdentity] = []
        for start in starts:
            live = mig.create_mig_device(self.nvml, d.gpu_uuid, d.mig_profile_id, start)
            self._crash_point("mig-created")
            self.add_undo(uid, mig_devices=[mig_undo(d.name, live, p.result.share_id)])
            log.info("created MIG device", device=d.name, share=p.result.share_id, mig_uuid=live.uuid,
                     gi=live.gi_id, ci=live.ci_id, start=start)
            made.append((live.uuid, live.gi_id, live.ci_id))
        return made

    def _apply_time_slices(self, ref: ClaimRef, plans: list[DevicePlan], log: Any) -> None:
        """One interval per GPU for this claim; the GPU-wide setting is shared with other claims on it."""
        intervals: dict[str, str] = {}
        for p in plans:
            if p.timeslice is None:
                continue
            prev = intervals.setdefault(p.device.gpu_uuid, p.timeslice)
            if prev != p.timeslice:
                raise PrepareError(f"claim {ref.describe()}: GPU {p.device.gpu_uuid} would get time-slice intervals "
                                   f"{prev} and {p.timeslice} from different requests; use one interval per GPU")
        for gpu_uuid, interval in sorted(intervals.items()):
            # Write-ahead: the undo record (with the interval to go back to) is checkpointed before the GPU is
            # changed, so a crash right after the change is rolled back at the next start. Undoing an intent
            # that never reached the GPU only sets the interval it already has.
            intent = self.time_slicing.intent(ref.uid, [gpu_uuid], interval)
            self.add_undo(ref.uid, time_slices=[intent])
            try:
                applied = self.time_slicing.apply(ref.uid, [gpu_uuid], interval)
            except BaseException:
                # apply() changes all or nothing: no intent is left for the rollback to undo.
                self._drop_undo(ref.uid, time_slice=intent.gpu_uuids)
                raise
            self._crash_point("timeslice-applied")
            if applied != intent:   # cannot happen while we hold the GPU; keep the record true if it does
                self._set_time_slice_undo(ref.uid, applied)
            log.info("time-slice applied", gpu=gpu_uuid, interval=interval)

    def _set_time_slice_undo(self, uid: str, applied: TimeSliceUndo) -> None:
        def change(r: ClaimRecord) -> ClaimRecord:
            kept = tuple(t for t in r.undo.time_slices if tuple(t.gpu_uuids) != tuple(applied.gpu_uuids))
            return r.model_copy(update={"undo": r.undo.model_copy(update={"time_slices": kept + (applied,)})})
        self.checkpoint.update(uid, change)

    def _start_mps(self, ref: ClaimRef, plans: list[DevicePlan], mig_ids: dict[int, MigIdentity],
                   log: Any) -> dict[str, MpsMounts]:
        """Join (or start) the daemon of every device the claim uses with MPS. Returns its client directories
        by device UUID."""
        uid = ref.uid
        uses: dict[str, str] = {}                     # device uuid -> physical GPU
        for i, p in enumerate(plans):
            if p.mps is not None:
                uses[mig_ids[i][0] if i in mig_ids else p.device.gpu_uuid] = p.device.gpu_uuid
        for device in sorted(uses):
            self._check_mps_tenancy(ref, device)
        mounts: dict[str, MpsMounts] = {}
        for device, gpu in sorted(uses.items()):
            # Recorded before the daemon starts: a crash right after the start must still find it to stop.
            self.add_undo(uid, mps_devices=[MpsUse(device=device, gpu=gpu)])
            self._crash_point("mps-use-recorded")
            paths = self.mps.ensure(device, gpu, step=self._crash_point)
            self._crash_point("mps-started")
            log.info("MPS daemon serves the claim", device=device)
            mounts[device] = MpsMounts(pipe_dir=paths.pipe_dir, shm_dir=paths.shm_dir)
        return mounts

    def _check_mps_tenancy(self, ref: ClaimRef, device: str) -> None:
        """A device's daemon, its control socket and its /dev/shm serve one namespace (the trust boundary,
        docs/security.md) unless the node policy shares them across namespaces. A claim of another namespace
        is refused while the device serves one; the kubelet retries it, so it runs once those claims are gone.
        A record rebuilt after a lost checkpoint has no namespace: it counts as another one."""
        if self.mps.policy.share_across_namespaces:
            return
        others = sorted({(r.namespace, r.name) for uid, r in self.checkpoint.claims().items()
                         if uid != ref.uid and any(use.device == device for use in r.undo.mps_devices)
                         and r.namespace != ref.namespace})
        if others:
            namespace, name = others[0]
            holder = f"namespace {namespace!r} (claim {name})" if namespace else "a claim whose namespace is unknown"
            raise PrepareError(f"claim {ref.describe()}: the MPS daemon of {device} serves {holder}; MPS shares a "
                               "device only among claims of one namespace (node policy mps.shareAcrossNamespaces "
                               "allows more), so this claim is prepared once those claims are gone")

    def _existing_dynamic_mig(self, d: Device) -> MigIdentity:
        """Admin access to a dynamic MIG placement: only meaningful while a claim has it created."""
        for r in self.checkpoint.claims().values():
            for m in r.undo.mig_devices:
                if m.device == d.name and m.mig_uuid:
                    return (m.mig_uuid, m.gi_id, m.ci_id)
        raise PrepareError(f"device {d.name}: admin access to a dynamic MIG placement needs a claim that has it "
                           "created; none has")

    def _ensure_whole_gpu(self, d: Device) -> None:
        try:
            mig.disable_mig_mode_if_unused(self.nvml, d.gpu_uuid)
            handle = self.nvml.nvmlDeviceGetHandleByUUID(d.gpu_uuid)
            enabled = mig.mig_enabled(self.nvml, handle)
        except self.nvml.NVMLError as err:
            raise PrepareError(f"device {d.name}: reading MIG mode of GPU {d.gpu_uuid} failed: {err}") from err
        if enabled:
            raise PrepareError(f"device {d.name}: GPU {d.gpu_uuid} is in MIG mode with MIG devices present, so it "
                               "cannot be used whole")

    # ----- undo ----------------------------------------------------------------------------------------------
    def gpus_of(self, record: ClaimRecord) -> list[str]:
        """The physical GPUs a record touches: the ones to lock while it is undone."""
        by_name = self._devices()
        uuids = {by_name[d.device].gpu_uuid for d in record.devices if d.device in by_name}
        uuids |= {m.parent_uuid for m in record.undo.mig_devices}
        uuids |= {u for t in record.undo.time_slices for u in t.gpu_uuids}
        uuids |= {use.gpu for use in record.undo.mps_devices}
        return sorted(uuids)

    def undo(self, record: ClaimRecord) -> None:
        """Stop MPS daemons (they use the MIG devices), destroy MIG devices, release time-slices; each step is
        checkpointed as it completes so a failure resumes where it stopped."""
        uid = record.uid
        for use in record.undo.mps_devices:
            if use.device not in self.mps_devices_in_use(except_claim=uid):
                self.mps.release(use.device, use.gpu)   # the daemon's last claim: it goes
            self._drop_undo(uid, mps_device=use.device)
        parents = set()
        for m in record.undo.mig_devices:
            mig.destroy_mig_device(self.nvml, m.parent_uuid, m.gi_id, m.ci_id, m.mig_uuid)
            parents.add(m.parent_uuid)
            if self.mig_listener is not None:
                self.mig_listener.unbind_mig(m.device)
            self._drop_undo(uid, mig=(m.parent_uuid, m.gi_id, m.ci_id))
        for parent in sorted(parents):
            try:
                mig.disable_mig_mode_if_unused(self.nvml, parent)
            except mig.MigError as err:
                self.log.warning("could not switch MIG mode off after the last MIG device", gpu=parent,
                                 error=str(err))
        for ts in record.undo.time_slices:
            self.time_slicing.release(uid, ts)
            self._drop_undo(uid, time_slice=tuple(ts.gpu_uuids))

    def adopt(self, record: ClaimRecord) -> None:
        """Register what a completed claim holds (from a restart or another plugin process) without touching
        the hardware: its time-slice settings and MIG devices (its MPS daemons are found by
        ``mps_devices_in_use``)."""
        for ts in record.undo.time_slices:
            self.time_slicing.adopt(record.uid, ts)
        if self.mig_listener is not None:
            for m in record.undo.mig_devices:
                self.mig_listener.bind_mig(m.device, m.parent_uuid, m.gi_id, m.ci_id)

    def mps_devices_in_use(self, except_claim: str | None = None) -> dict[str, str]:
        """Devices whose MPS daemon some claim (prepared or preparing) uses, with their GPUs."""
        return {use.device: use.gpu for uid, r in self.checkpoint.claims().items() if uid != except_claim
                for use in r.undo.mps_devices}

    def dynamic_mig_gpus(self) -> set[str]:
        return {d.gpu_uuid for d in self._devices().values() if d.kind == KIND_MIG and d.mig_dynamic}

    # ----- undo records --------------------------------------------------------------------------------------
    def add_undo(self, uid: str, **items: Any) -> None:
        def change(r: ClaimRecord) -> ClaimRecord:
            u = r.undo
            undo = UndoInfo(mig_devices=u.mig_devices + tuple(items.get("mig_devices", ())),
                            time_slices=u.time_slices + tuple(items.get("time_slices", ())),
                            mps_devices=u.mps_devices + tuple(items.get("mps_devices", ())))
            return r.model_copy(update={"undo": undo})
        self.checkpoint.update(uid, change)

    def _drop_undo(self, uid: str, *, mps_device: str | None = None, mig: tuple[str, int, int] | None = None,
                   time_slice: tuple[str, ...] | None = None) -> None:
        if self.checkpoint.get(uid) is None:
            return

        def change(r: ClaimRecord) -> ClaimRecord:
            u = r.undo
            return r.model_copy(update={"undo": UndoInfo(
                mps_devices=tuple(d for d in u.mps_devices if d.device != mps_device),
                mig_devices=tuple(m for m in u.mig_devices if (m.parent_uuid, m.gi_id, m.ci_id) != mig),
                time_slices=tuple(t for t in u.time_slices if tuple(t.gpu_uuids) != time_slice),
            )})
        self.checkpoint.update(uid, change)


def mps_client_env(ref: ClaimRef, plans: list[DevicePlan], mig_ids: dict[int, MigIdentity]) -> tuple[str, ...]:
    """The claim's MPS limits as CUDA client environment: they bind only its own processes, whatever other
    claims share the daemon. Device ordinals are in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``) of the
    claim's MPS devices, MIG devices after their GPU in placement order."""
    mps = [(i, p, p.mps) for i, p in enumerate(plans) if p.mps is not None]
    if not mps:
        return ()
    threads = {m.thread_percentage for _, _, m in mps if m.thread_percentage is not None}
    if len(threads) > 1:
        raise PrepareError(f"claim {ref.describe()}: its MPS devices ask for different active thread percentages "
                           f"({', '.join(map(str, sorted(threads)))}); one process cannot have two, use one value")
    # Several slots or shares of one GPU in a claim are one CUDA device: their limits add up.
    keyed: dict[str, tuple[tuple[str, int], int | None]] = {}
    for i, p, m in mps:
        uuid = mig_ids[i][0] if i in mig_ids else p.device.gpu_uuid
        order = (p.device.gpu_pci_bus_id, p.device.mig_start if p.device.mig_start is not None else -1)
        limit = max(1, m.pinned_memory_limit_bytes // MIB) if m.pinned_memory_limit_bytes else None
        _, before = keyed.get(uuid, (order, None))
        keyed[uuid] = (order, limit if before is None else before + (limit or 0))
    ordered = sorted(keyed.items(), key=lambda kv: (kv[1][0], kv[0]))
    limits = {ordinal: limit for ordinal, (_, (_, limit)) in enumerate(ordered) if limit is not None}
    env = ["CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    if threads:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={threads.pop()}")
    if limits:
        env.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + ",".join(f"{o}={mib}M" for o, mib in sorted(limits.items())))
    return tuple(env)
