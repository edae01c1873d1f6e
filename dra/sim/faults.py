"""Fault injection into simulated GPUs from outside the process that simulates them.

A simulated node's plugin keeps its GPUs' state in a state file (dra/sim/state.py). These functions
change that file under its cross-process lock, so the running plugin sees the change on its next NVML call
(``nvmlEventSetWait`` re-checks the file while it waits):

* ``inject_xid``: an XID critical error on a GPU, or on one of its GPU/compute instances (MIG device);
* ``lose_gpu``: the GPU falls off the bus (every NVML call on it fails with GPU_IS_LOST);
* ``recover_gpu``: the GPU answers again and an operator confirms it healthy (its health taints go).

A GPU is named by UUID or by index (its position in the node, as ``nvmlDeviceGetHandleByIndex`` counts).
Every problem raises SimulatedStateError naming the file and what was wrong.
"""
from __future__ import annotations

from dra.sim.state import (
    EVENT_RECOVER,
    EVENT_XID,
    MAX_XID,
    GpuState,
    HardwareDoc,
    SimulatedEvent,
    SimulatedHardwareState,
    SimulatedStateError,
)

DEFAULT_LOST_REASON = "GPU has fallen off the bus (injected)"


def find_gpu(doc: HardwareDoc, ref: str, where: str) -> GpuState:
    """The GPU named by UUID or index; the error lists the GPUs there are."""
    ref = ref.strip()
    for gpu in doc.gpus:
        if gpu.uuid == ref:
            return gpu
    if ref.isdigit():
        index = int(ref)
        if index < len(doc.gpus):
            return doc.gpus[index]
    known = ", ".join(f"{i}={g.uuid}" for i, g in enumerate(doc.gpus))
    raise SimulatedStateError(f"{where}: no GPU {ref!r}; give a UUID or an index (this node has {known})")


def _read(state: SimulatedHardwareState) -> HardwareDoc:
    """The document (call with the lock held); a missing file is an error: nothing simulates these GPUs yet."""
    doc = state.read()
    if doc is None:
        raise SimulatedStateError(f"simulated GPU state {state.path}: no such file; it is written when the "
                                  "simulated node's plugin starts (check --sim-state)")
    return doc


def inject_xid(state: SimulatedHardwareState, gpu_ref: str, xid: int, gi: int | None = None,
               ci: int | None = None) -> SimulatedEvent:
    """Record an XID event for every simulator over ``state``; returns the recorded event."""
    where = f"simulated GPU state {state.path}"
    if not 1 <= xid <= MAX_XID:
        raise SimulatedStateError(f"{where}: XID {xid} is out of range 1..{MAX_XID}")
    if ci is not None and gi is None:
        raise SimulatedStateError(f"{where}: a compute instance ({ci}) needs its GPU instance (--gi)")
    with state.locked():
        doc = _read(state)
        gpu = find_gpu(doc, gpu_ref, where)
        if gi is not None:
            instance = next((g for g in gpu.gpu_instances if g.id == gi), None)
            if instance is None:
                have = sorted(g.id for g in gpu.gpu_instances)
                raise SimulatedStateError(f"{where}: GPU {gpu.uuid} has no GPU instance {gi} (it has "
                                          f"{have or 'none'})")
            if ci is not None and all(c.id != ci for c in instance.compute_instances):
                have = sorted(c.id for c in instance.compute_instances)
                raise SimulatedStateError(f"{where}: GPU instance {gi} of GPU {gpu.uuid} has no compute instance "
                                          f"{ci} (it has {have or 'none'})")
        doc = doc.with_event(gpu.uuid, EVENT_XID, xid=xid, gpu_instance_id=gi, compute_instance_id=ci)
        state.write(doc)
    return doc.events[-1]


def lose_gpu(state: SimulatedHardwareState, gpu_ref: str, reason: str = DEFAULT_LOST_REASON) -> GpuState:
    """Mark the GPU lost; returns its new state."""
    where = f"simulated GPU state {state.path}"
    if not reason.strip():
        raise SimulatedStateError(f"{where}: give a reason for the lost GPU")
    with state.locked():
        doc = _read(state)
        gpu = find_gpu(doc, gpu_ref, where).model_copy(update={"lost": reason})
        state.write(doc.with_gpu(gpu))
    return gpu


def recover_gpu(state: SimulatedHardwareState, gpu_ref: str) -> GpuState:
    """The GPU answers again (if it was lost) and is declared healthy: a recovery event clears its taints."""
    where = f"simulated GPU state {state.path}"
    with state.locked():
        doc = _read(state)
        gpu = find_gpu(doc, gpu_ref, where).model_copy(update={"lost": None})
        state.write(doc.with_gpu(gpu).with_event(gpu.uuid, EVENT_RECOVER))
    return gpu


__all__ = ["DEFAULT_LOST_REASON", "find_gpu", "inject_xid", "lose_gpu", "recover_gpu"]
