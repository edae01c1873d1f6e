"""The side-by-side benchmark's argument handling and its table, without running anything: the binary check,
which benchmarks run, and the figures built from measured rounds."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import BENCHMARKS
from bench.__main__ import main, selected
from bench.core import check, load_targets
from bench.peer import NAME, PeerBinaryError, Side, check_peer_bin, figures


def test_check_peer_bin_names_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(PeerBinaryError, match="no --peer-bin given; build it with hack/build-peer-driver.sh"):
        check_peer_bin(None)
    with pytest.raises(PeerBinaryError, match=f"--peer-bin {tmp_path}/absent: no such file"):
        check_peer_bin(tmp_path / "absent")
    with pytest.raises(PeerBinaryError, match="not a regular file"):
        check_peer_bin(tmp_path)
    plain = tmp_path / "plugin"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o644)
    if os.access(plain, os.X_OK):      # root may execute a file without x bits only if some x bit is set
        pytest.fail("a 0644 file reads as executable")
    with pytest.raises(PeerBinaryError, match="not executable"):
        check_peer_bin(plain)
    plain.chmod(0o755)
    assert check_peer_bin(plain) == plain.resolve()


def test_peer_runs_only_with_its_binary() -> None:
    assert "peer" not in selected([])
    assert selected([]) == list(BENCHMARKS)
    assert selected([], "/bin/true") == ["peer"]
    assert selected(["slices"], "/bin/true") == ["slices", "peer"]
    assert selected(["peer"], "/bin/true") == ["peer"]
    with pytest.raises(SystemExit, match="peer needs --peer-bin PATH"):
        selected(["peer"])
    with pytest.raises(SystemExit, match="unknown benchmark"):
        selected(["nope"], "/bin/true")


def test_main_refuses_a_missing_peer_binary_before_running_anything(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--peer-bin", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "absent: no such file" in err and "hack/build-peer-driver.sh" in err


def _side(driver: str, tag: str, scale: float) -> Side:
    s = Side(driver, tag, lambda: 1, lambda: Path())
    rounds = range(10)
    s.idle_cpu = [0.0005 * scale + 0.00001 * i for i in range(6)]
    s.idle_rss = 40.0 * scale
    s.startup = [0.05 * scale + 0.001 * i for i in range(5)]
    s.prepare = [0.006 * scale + 0.0001 * i for i in rounds]
    s.unprepare = [0.003 * scale + 0.0001 * i for i in rounds]
    s.prepare_op = [0.008 * scale + 0.0001 * i for i in rounds]
    s.unprepare_op = [0.004 * scale + 0.0001 * i for i in rounds]
    s.pod_cpu = [0.002 * scale + 0.0001 * i for i in rounds]
    s.running = [0.2 * scale + 0.001 * i for i in rounds]
    s.start_container = [0.05 * scale + 0.001 * i for i in rounds]
    s.b2b_prepare = [0.005 * scale + 0.0001 * i for i in rounds]
    s.b2b_unprepare = [0.002 * scale + 0.0001 * i for i in rounds]
    s.b2b_cpu = [0.003 * scale + 0.0001 * i for i in rounds]
    return s


def test_figures_answer_every_peer_target_and_judge_ratios() -> None:
    targets = load_targets()
    equal = figures(_side("ours", "ours", 1.0), _side("peer", "peer", 1.0))
    result = check(equal, targets, [NAME])
    assert result.problems == ()
    by_key = {v.figure.key: v for v in result.verdicts}
    assert by_key["peer.prepare.p50_ratio"].figure.value == pytest.approx(1.0)
    assert by_key["peer.prepare.p50_ratio"].ok
    assert by_key["peer.idle.cpu_excess_ms_per_s"].figure.value == pytest.approx(0.0)
    assert "95 % CI" in by_key["peer.prepare.p50_ratio"].figure.detail
    slower = {v.figure.key: v for v in check(figures(_side("ours", "ours", 2.0), _side("peer", "peer", 1.0)),
                                             targets, [NAME]).verdicts}
    assert slower["peer.prepare.p50_ratio"].figure.value == pytest.approx(2.0, rel=0.05)
    assert not slower["peer.prepare.p50_ratio"].ok and not slower["peer.unprepare.p50_ratio"].ok
    assert slower["peer.cpu_per_pod_ratio"].ok                    # 2× passes (≤ 2.5×)
    assert slower["peer.idle.rss_mib"].ok                         # 80 MiB against 90
    assert slower["peer.idle.cpu_excess_ms_per_s"].figure.value == pytest.approx(0.5, rel=0.05)   # context
    assert slower["peer.idle.cpu_ms_per_s"].figure.value == pytest.approx(1.0, rel=0.05)
    assert not slower["peer.idle.cpu_ms_per_s"].ok                # just over 1 ms/s
