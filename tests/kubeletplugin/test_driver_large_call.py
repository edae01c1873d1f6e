"""One kubelet call with thousands of claims: answered well inside the kubelet's 45 s deadline, claims in
parallel; and when a call is too large for its time budget, the claims not started get a per-claim error the
kubelet retries, with nothing half done."""
from __future__ import annotations

import time

from driver_node import Node

SHARES = {"default": {"memoryShares": {"minimum": "1Gi", "step": "1Gi", "strategy": "time-slicing"}}}


def _share_claims(node: Node, n: int) -> list:
    return [node.add_claim(f"c{i}", [{"request": "mem", "device": f"gpu-{i % 2}-shared", "shareID": f"s-{i}",
                                      "consumedCapacity": {"memory": "1Gi"}}]) for i in range(n)]


def test_a_call_with_thousands_of_claims_is_answered_well_inside_the_deadline(tmp_path) -> None:
    node = Node(tmp_path, SHARES)
    refs = _share_claims(node, 3000)
    started = time.monotonic()
    results = node.driver.prepare(refs)
    prepared_in = time.monotonic() - started
    started = time.monotonic()
    undone = node.driver.unprepare(refs)
    unprepared_in = time.monotonic() - started
    print(f"\nlarge call: 3000 claims prepared in {prepared_in:.1f} s, unprepared in {unprepared_in:.1f} s")
    assert [r.error for r in results.values() if r.error] == []
    assert [r.error for r in undone.values() if r.error] == []
    assert prepared_in < 30 and unprepared_in < 30
    assert node.driver.checkpoint.claims() == {} and node.driver.cdi.list_claim_specs() == {}


def test_claims_past_the_call_budget_fail_cleanly_and_the_retry_prepares_them(tmp_path) -> None:
    node = Node(tmp_path, SHARES)
    node.driver.call_budget_s = 0.3
    refs = _share_claims(node, 1500)
    results = node.driver.prepare(refs)
    late = [uid for uid, r in results.items() if r.error]
    assert late and len(late) < len(refs)
    assert all("budget; the kubelet retries it" in results[uid].error for uid in late)
    assert set(node.driver.checkpoint.claims()) == {uid for uid, r in results.items() if not r.error}
    node.driver.call_budget_s = 60.0
    retry = node.driver.prepare([r for r in refs if r.uid in late])
    assert [r.error for r in retry.values() if r.error] == []
    assert len(node.driver.checkpoint.claims()) == len(refs)
