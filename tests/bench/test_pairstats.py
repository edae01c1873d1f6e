"""The pure parts of the side-by-side benchmark: paired ratios and their intervals, the kubelet's metrics text."""
from __future__ import annotations

import statistics

import pytest

from bench.pairstats import (
    HistogramTotals,
    MetricsFormatError,
    grpc_call_totals,
    operation_totals,
    paired_difference,
    paired_ratio,
    parse_samples,
    percentile,
)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert percentile([7.0], 0.9) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match="within 0..1"):
        percentile([1.0], 1.5)


def test_paired_ratio_of_medians_with_an_interval_around_it() -> None:
    peer = [1.0 + 0.01 * i for i in range(20)]
    ours = [2.0 * p for p in peer]
    r = paired_ratio(ours, peer)
    assert r.ratio == pytest.approx(2.0)
    assert r.low == pytest.approx(2.0) and r.high == pytest.approx(2.0)   # every pair is exactly 2×
    assert r.ours_higher == 20 and r.rounds == 20
    assert r.ours == pytest.approx(statistics.median(ours))


def test_paired_ratio_interval_contains_the_ratio_and_widens_with_noise() -> None:
    peer = [10.0] * 20
    steady = paired_ratio([10.0 + (i % 2) for i in range(20)], peer)
    noisy = paired_ratio([5.0 + 3 * (i % 5) for i in range(20)], peer)
    for r in (steady, noisy):
        assert r.low <= r.ratio <= r.high
    assert noisy.high - noisy.low > steady.high - steady.low


def test_paired_ratio_is_the_same_for_the_same_rounds() -> None:
    ours, peer = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0], [2.0, 6.0, 5.0, 3.0, 5.0, 8.0]
    assert paired_ratio(ours, peer) == paired_ratio(ours, peer)


def test_paired_ratio_with_another_statistic() -> None:
    ours, peer = [1.0] * 9 + [10.0], [1.0] * 10
    assert paired_ratio(ours, peer).ratio == pytest.approx(1.0)
    assert paired_ratio(ours, peer, lambda v: percentile(v, 0.95)).ratio > 1.0


def test_paired_ratio_refuses_unpaired_or_empty_rounds_and_a_zero_peer() -> None:
    with pytest.raises(ValueError, match="differ in number: 2 of ours, 1"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="no rounds"):
        paired_ratio([], [])
    with pytest.raises(ValueError, match="peer's statistic is 0"):
        paired_ratio([1.0, 1.0], [0.0, 0.0])


def test_paired_difference_of_means() -> None:
    d = paired_difference([1.5, 1.7, 1.6, 1.4], [1.0, 1.2, 1.1, 0.9])
    assert d.difference == pytest.approx(0.5)
    assert d.low == pytest.approx(0.5) and d.high == pytest.approx(0.5) and d.samples == 4
    with pytest.raises(ValueError, match="differ in number"):
        paired_difference([1.0], [])


KUBELET_METRICS = """\
# HELP dra_grpc_operations_duration_seconds [ALPHA] Duration in seconds of the DRA gRPC operations
# TYPE dra_grpc_operations_duration_seconds histogram
dra_grpc_operations_duration_seconds_bucket{driver_name="gpu.example.com",grpc_status_code="OK",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",le="0.1"} 3
dra_grpc_operations_duration_seconds_sum{driver_name="gpu.example.com",grpc_status_code="OK",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 0.0183
dra_grpc_operations_duration_seconds_count{driver_name="gpu.example.com",grpc_status_code="OK",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 3
dra_grpc_operations_duration_seconds_sum{driver_name="gpu.example.com",grpc_status_code="Unavailable",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 0.5
dra_grpc_operations_duration_seconds_count{driver_name="gpu.example.com",grpc_status_code="Unavailable",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 1
dra_grpc_operations_duration_seconds_sum{driver_name="gpu.dra-driver.io",grpc_status_code="OK",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 0.0301
dra_grpc_operations_duration_seconds_count{driver_name="gpu.dra-driver.io",grpc_status_code="OK",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"} 3
dra_grpc_operations_duration_seconds_sum{driver_name="gpu.dra-driver.io",grpc_status_code="OK",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"} 0.012
dra_grpc_operations_duration_seconds_count{driver_name="gpu.dra-driver.io",grpc_status_code="OK",method_name="/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"} 2
# TYPE dra_operations_duration_seconds histogram
dra_operations_duration_seconds_sum{is_error="false",operation_name="PrepareResources"} 0.061
dra_operations_duration_seconds_count{is_error="false",operation_name="PrepareResources"} 6
dra_operations_duration_seconds_sum{is_error="true",operation_name="PrepareResources"} 0.5
dra_operations_duration_seconds_count{is_error="true",operation_name="PrepareResources"} 1
kubelet_running_pods 2
process_start_time_seconds 1.7e+09
weird_label{path="a \\"quoted\\" \\\\ one"} 1 1700000000000
"""


def test_parse_samples_reads_names_labels_and_values() -> None:
    samples = parse_samples(KUBELET_METRICS)
    assert samples[("kubelet_running_pods", ())] == 2.0
    assert samples[("process_start_time_seconds", ())] == 1.7e9
    key = ("dra_operations_duration_seconds_count", (("is_error", "false"), ("operation_name", "PrepareResources")))
    assert samples[key] == 6.0
    assert samples[("weird_label", (("path", 'a \\"quoted\\" \\\\ one'),))] == 1.0   # a timestamp is ignored


def test_parse_samples_names_a_line_it_cannot_read() -> None:
    with pytest.raises(MetricsFormatError, match="line 2 is not a metric sample"):
        parse_samples("ok 1\n{broken\n")
    with pytest.raises(MetricsFormatError, match="line 1: value 'abc' is not a number"):
        parse_samples("x abc\n")


def test_grpc_totals_per_driver_and_method_over_every_status() -> None:
    samples = parse_samples(KUBELET_METRICS)
    peer = grpc_call_totals(samples, "gpu.example.com", "NodePrepareResources")
    assert peer == HistogramTotals(pytest.approx(0.5183), 4.0)
    ours = grpc_call_totals(samples, "gpu.dra-driver.io", "NodeUnprepareResources")
    assert ours == HistogramTotals(pytest.approx(0.012), 2.0)
    assert grpc_call_totals(samples, "gpu.example.com", "NodeUnprepareResources") == HistogramTotals(0.0, 0.0)
    assert grpc_call_totals(samples, "other", "NodePrepareResources").count == 0


def test_operation_totals_and_the_delta_over_one_call() -> None:
    before = parse_samples(KUBELET_METRICS)
    after = parse_samples(KUBELET_METRICS.replace(
        'operation_name="PrepareResources"} 0.061', 'operation_name="PrepareResources"} 0.0681').replace(
        'is_error="false",operation_name="PrepareResources"} 6', 'is_error="false",operation_name="PrepareResources"} 7'))
    delta = operation_totals(after, "PrepareResources") - operation_totals(before, "PrepareResources")
    assert delta.count == 1 and delta.sum == pytest.approx(0.0071)
    assert operation_totals(before, "UnprepareResources") == HistogramTotals()

