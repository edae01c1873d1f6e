"""Random SIGKILLs of the plugin process under load, at whatever point a prepare or unprepare happens to be
(not only at the fault hook's steps): pods on dynamic MIG partitions and MPS slots are prepared and unprepared
by the kubelet stand-in in a loop while the plugin is killed and restarted at random moments. Afterwards every
pod is unprepared and nothing may be left: no MIG device, MPS daemon, CDI spec or checkpoint record. Seeded and
bounded in time; prints tried / survived / leaked."""
from __future__ import annotations

import random
import threading
import time
from typing import Any

from plugin_helpers import assert_nothing_left, run_example
from standin import PodPrepareError
from standin.dra_client import DraCallError

from kube.client import KubeApi

SEED = 4242
KILLS = 6
POLICY = {"default": {"mig": "dynamic"},
          "rules": [{"match": {"index": 1}, "wholeGpu": False, "slots": {"count": 4, "strategy": "mps"}}]}


def test_random_sigkills_under_load_leak_nothing(kube: KubeApi, namespace: str, make_node: Any) -> None:
    node = make_node([{"model": "H100-80GB", "count": 2}], POLICY)
    pods = run_example(kube, node, namespace, "mig-partition") + run_example(kube, node, namespace, "mps-slot")
    rng = random.Random(SEED)
    counts = {"tried": 0, "survived": 0, "refused": 0, "kills": 0}
    stop = threading.Event()
    lock = threading.Lock()

    def load() -> None:
        r = random.Random(SEED + 1)
        while not stop.is_set():
            pod = r.choice(pods)
            op = r.choice(("prepare", "prepare", "unprepare"))
            try:
                (node.kubelet.prepare_pod if op == "prepare" else node.kubelet.unprepare_pod)(pod)
                outcome = "survived"
            except (PodPrepareError, DraCallError, Exception):  # noqa: BLE001 - a dead plugin, or a clean refusal
                outcome = "refused"
            with lock:
                counts["tried"] += 1
                counts[outcome] += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.2, 1.5))
            node.restart_plugin(crash=True)                 # SIGKILL wherever it is, then start again
            counts["kills"] += 1
    finally:
        stop.set()
        worker.join(60)
    for pod in pods:                                        # the kubelet's last word: every pod goes
        deadline = time.monotonic() + 30
        while True:
            try:
                node.kubelet.unprepare_pod(pod)
                break
            except Exception:  # noqa: BLE001 - retried as the kubelet would
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    leaked = []
    try:
        assert_nothing_left(node)
    except AssertionError as err:
        leaked.append(str(err))
    print(f"\nkills: tried {counts['tried']} calls under {counts['kills']} SIGKILLs, survived {counts['survived']}, "
          f"refused {counts['refused']}, leaked {len(leaked)}")
    assert counts["survived"] > 0 and counts["kills"] == KILLS
    assert leaked == [], leaked
