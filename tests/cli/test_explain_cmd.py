"""`gpu-dra explain`'s exit status is what a pre-flight script gates on: a claim that cannot run never exits 0,
also when the scheduler would allocate it and the node plugin then refuses to prepare it (an opaque config
with a typo)."""
from __future__ import annotations

from typing import Any

import pytest

from ops.explain.verdict import ALLOCATABLE, Explanation

TYPO = ("ml/c: gpu.dra-driver.io/v1alpha1 GpuConfig: spec.devices.config[0].opaque.parameters.sharing.mps."
        "activeThreadPercentge: unknown field (known fields: activeThreadPercentage, pinnedMemoryLimit, "
        "perDevicePinnedMemoryLimit)")


def explain_with(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], result: Explanation,
                 *flags: str) -> tuple[int, str]:
    import kube.connect
    import ops.explain.reads
    from cli.main import main

    monkeypatch.setattr(kube.connect, "api_client_from", lambda *a, **k: object())
    monkeypatch.setattr(ops.explain.reads, "explain_target", lambda *a, **k: result)
    code = main(["explain", "claim/c", "-n", "ml", *flags])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("output", ["text", "json"])
def test_an_allocatable_claim_the_plugin_will_not_prepare_does_not_exit_0(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], output: str) -> None:
    refused = Explanation(ALLOCATABLE, f"allocatable on node-a, but the node plugin will not prepare it: {TYPO}",
                          ["ml/c"], config_problems=[TYPO])
    code, out = explain_with(monkeypatch, capsys, refused, "-o", output)
    assert code == 1, out
    assert "will not prepare it" in out


def test_an_allocatable_claim_exits_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fine: Any = Explanation(ALLOCATABLE, "allocatable on node-a", ["ml/c"])
    assert explain_with(monkeypatch, capsys, fine)[0] == 0
