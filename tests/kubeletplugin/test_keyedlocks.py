"""The claim and GPU lock table: one lock per name for as long as anyone holds or waits for it.

The fault this guards against: a table that dropped a name's lock when its holder finished, while another
thread already waited on that lock, handed the next caller a fresh lock for the same name, so two "exclusive"
holders ran at once (concurrent prepare and unprepare of one claim leaked MIG devices that way)."""
from __future__ import annotations

import random
import threading
import time

from kubeletplugin.keyedlocks import KeyedLocks


def test_a_waiter_and_a_newcomer_never_hold_one_name_together() -> None:
    locks = KeyedLocks()
    inside: dict[str, int] = {}
    overlaps: list[str] = []
    guard = threading.Lock()
    rng = random.Random(7)
    names = ["claim-a", "claim-b"]

    def worker(seed: int) -> None:
        local = random.Random(seed)
        for _ in range(300):
            name = local.choice(names)
            with locks.hold(name):
                with guard:
                    inside[name] = inside.get(name, 0) + 1
                    if inside[name] > 1:
                        overlaps.append(name)
                time.sleep(local.random() / 20000)   # let holders finish while others wait
                with guard:
                    inside[name] -= 1

    threads = [threading.Thread(target=worker, args=(rng.random(),)) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not overlaps, f"{len(overlaps)} times two threads held one name at once"
    assert len(locks) == 0, "the table keeps names nobody holds or waits for"


def test_the_holder_leaving_while_one_waits_keeps_the_waiters_lock() -> None:
    """Step by step: A holds, B waits, A leaves, C arrives. B and C must not both get in."""
    locks = KeyedLocks()
    a_in, release_a, b_in, release_b = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    c_in = threading.Event()

    def a() -> None:
        with locks.hold("uid"):
            a_in.set()
            release_a.wait(10)

    def b() -> None:
        with locks.hold("uid"):
            b_in.set()
            release_b.wait(10)

    def c() -> None:
        with locks.hold("uid"):
            c_in.set()

    ta = threading.Thread(target=a)
    ta.start()
    assert a_in.wait(5)
    tb = threading.Thread(target=b)
    tb.start()
    deadline = time.monotonic() + 5
    while locks._entries.get("uid", [None, 0])[1] < 2 and time.monotonic() < deadline:   # until B waits
        time.sleep(0.001)
    release_a.set()
    ta.join(5)
    assert b_in.wait(5)
    tc = threading.Thread(target=c)
    tc.start()
    assert not c_in.wait(0.2), "C got in while B held the name"
    release_b.set()
    tb.join(5)
    assert c_in.wait(5)
    tc.join(5)
    assert len(locks) == 0


def test_hold_all_takes_overlapping_sets_without_deadlock() -> None:
    locks = KeyedLocks()
    done = []

    def worker(names: list[str]) -> None:
        for _ in range(200):
            with locks.hold_all(names):
                pass
        done.append(names)

    sets = [["gpu-0", "gpu-1"], ["gpu-1", "gpu-0"], ["gpu-1", "gpu-2", "gpu-0"], ["gpu-2", "gpu-1"]]
    threads = [threading.Thread(target=worker, args=(s,)) for s in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(done) == len(sets), "a holder of several names deadlocked"
    assert len(locks) == 0
