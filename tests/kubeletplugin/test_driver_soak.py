"""Concurrency soak: many kubelet-like clients prepare and unprepare overlapping and disjoint claims on one
simulated node at once (dynamic MIG, MPS and time-slicing slots, whole GPUs), then everything is checked for
consistency: every MIG device, MPS daemon, time-slice setting and CDI spec is owned by exactly one prepared
claim, and after the last unprepare nothing is left. Bounded in time; prints tried / survived / leaked."""
from __future__ import annotations

import random
import threading
import time
from collections import Counter

from driver_node import Node, gpu_config, opaque

SOAK_SECONDS = 8.0
CLIENTS = 16
SEED = 20261203


def _claims(node: Node) -> list:
    """A pool of claims that contend: the same dynamic MIG placements, slots of one GPU with different
    intervals (only one interval can win a GPU), MPS slots, and whole GPUs that exclude all of it."""
    refs = []
    for k, (dev, cfg) in enumerate([
        ("gpu-0-mig-1g10gb-19-0", None), ("gpu-0-mig-1g10gb-19-0", None), ("gpu-0-mig-3g40gb-9-4", None),
        ("gpu-0-mig-2g20gb-14-4", None), ("gpu-0-mig-3g40gb-9-0", None), ("gpu-0", None),
        ("gpu-1-slot-0", gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Long"})),
        ("gpu-1-slot-1", gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Short"})),
        ("gpu-1-slot-2", gpu_config(strategy="TimeSlicing", timeSlicing={"interval": "Long"})),
        ("gpu-1", None),
        ("gpu-2-slot-0", gpu_config(strategy="MPS", mps={"activeThreadPercentage": 30})),
        ("gpu-2-slot-1", gpu_config(strategy="MPS")), ("gpu-2-slot-1", None),
        ("gpu-3", None), ("gpu-3-mig-1g10gb-19-6", None), ("gpu-3-mig-7g80gb-0-0", None),
    ]):
        config = [opaque(cfg)] if cfg else None
        refs.append(node.add_claim(f"c{k}", [{"request": "r", "device": dev}], config))
    return refs


def _consistent(node: Node) -> list[str]:
    """Problems: hardware state nobody owns, or owned twice."""
    problems = []
    records = node.driver.checkpoint.claims()
    owned = Counter((m.parent_uuid, m.gi_id, m.ci_id) for r in records.values() for m in r.undo.mig_devices)
    for gpu in range(4):
        for live in node.mig_devices(gpu):
            if owned[(live.parent_uuid, live.gi_id, live.ci_id)] != 1:
                problems.append(f"MIG device {live.uuid} on GPU {gpu} owned by {owned[live.key]} claims")
    held = Counter((d.pool, d.device) for r in records.values() for d in r.devices if not d.admin_access)
    problems += [f"device {dev} held by {n} claims" for (_, dev), n in held.items() if n > 1]
    daemons = {d.spec.pipe_dir for d in node.control.daemons.values() if d.alive}
    recorded = {node.driver.mps.paths(u.device).pipe_dir for r in records.values() for u in r.undo.mps_devices}
    problems += [f"MPS daemon {p} owned by no claim" for p in sorted(daemons - recorded)]
    specs = set(node.driver.cdi.list_claim_specs())
    problems += [f"CDI spec of {uid} without a prepared claim" for uid in sorted(specs - set(records))]
    return problems


def test_concurrent_prepare_and_unprepare_leave_one_consistent_state(tmp_path) -> None:
    node = Node(tmp_path, {"default": {"mig": "dynamic"},
                           "rules": [{"match": {"index": 1}, "slots": {"count": 3, "strategy": "time-slicing"}},
                                     {"match": {"index": 2}, "slots": {"count": 2, "strategy": "mps"}}]},
                gpus=[{"model": "H100-80GB", "count": 4}])
    refs = _claims(node)
    rng = random.Random(SEED)
    seeds = [rng.randrange(1 << 30) for _ in range(CLIENTS)]
    tried, ok, refused, internal = Counter(), Counter(), Counter(), []
    stop = time.monotonic() + SOAK_SECONDS
    lock = threading.Lock()

    def client(seed: int) -> None:
        r = random.Random(seed)
        while time.monotonic() < stop:
            batch = r.sample(refs, r.randint(1, 3))
            op = r.choice(("prepare", "prepare", "unprepare"))
            results = (node.driver.prepare if op == "prepare" else node.driver.unprepare)(batch)
            with lock:
                for ref in batch:
                    tried[op] += 1
                    error = results[ref.uid].error
                    if not error:
                        ok[op] += 1
                    elif "internal error" in error:
                        internal.append(error)
                    else:
                        refused[op] += 1

    threads = [threading.Thread(target=client, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mid = _consistent(node)
    for ref in refs:
        assert node.driver.unprepare([ref])[ref.uid].error == ""
    leaked = _consistent(node) + [f"MIG device {m.uuid} left" for g in range(4) for m in node.mig_devices(g)]
    leaked += [f"record {uid} left" for uid in node.driver.checkpoint.claims()]
    leaked += [f"time-slice of {uuid} left at {v}" for uuid, v in node.control.time_slices.items() if v != "Default"]
    print(f"\nsoak: tried {sum(tried.values())} ({dict(tried)}), survived {sum(ok.values())} "
          f"({dict(ok)}), refused cleanly {sum(refused.values())}, internal errors {len(internal)}, "
          f"leaked {len(mid) + len(leaked)}")
    assert internal == []
    assert mid == [] and leaked == []
    assert ok["prepare"] > 50 and ok["unprepare"] > 50      # the soak did real work
