"""The pure parts of `python -m bench.cdihooks`: the timing wrapper, which hooks a spec names, the report."""
from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from bench.cdihooks import VARIANTS, _hooks_in_specs, driver_name, main, report, timing_wrapper


def test_the_timing_wrapper_runs_the_hook_and_logs_its_subcommand_and_time(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.write_text("#!/bin/sh\ncat > \"$(dirname \"$0\")/stdin\"\necho \"$@\" > \"$(dirname \"$0\")/args\"\nexit 3\n")
    hook.chmod(0o755)
    log = tmp_path / "times.log"
    wrapper = timing_wrapper(tmp_path / "wrapper", hook, log)
    proc = subprocess.run([str(wrapper), "update-ldcache", "--folder", "/lib64"], input='{"pid": 1}',
                          text=True, env={})
    assert proc.returncode == 3                                  # the hook's status is the wrapper's
    assert (tmp_path / "args").read_text().strip() == "update-ldcache --folder /lib64"
    assert (tmp_path / "stdin").read_text() == '{"pid": 1}'      # the OCI state reaches the hook
    name, ns = log.read_text().split()
    assert name == "update-ldcache" and int(ns) > 0


def test_hooks_named_by_a_variants_specs(tmp_path: Path) -> None:
    vendor = f"k8s.{driver_name('host-3')}"
    hook = {"hookName": "createContainer", "path": "/h/nvidia-cdi-hook"}
    (tmp_path / "a.json").write_text(json.dumps({"kind": f"{vendor}/claim", "containerEdits": {"hooks": [
        {**hook, "args": ["nvidia-cdi-hook", "create-symlinks", "--link", "a::b"]},
        {**hook, "args": ["nvidia-cdi-hook", "disable-device-node-modification"]}]},
        "devices": [{"name": "x", "containerEdits": {}}]}))
    (tmp_path / "b.json").write_text(json.dumps({"kind": f"k8s.{driver_name('empty-1')}/claim", "containerEdits": {
        "hooks": [{**hook, "args": ["nvidia-cdi-hook", "update-ldcache"]}]}}))
    assert _hooks_in_specs(tmp_path, driver_name("host-3")) == ["create-symlinks", "disable-device-node-modification"]
    assert _hooks_in_specs(tmp_path, driver_name("host-0")) == []


def test_report_has_every_variant_the_paired_differences_and_the_hook_times() -> None:
    results: dict[str, Any] = {"running": defaultdict(list), "start": defaultdict(list),
                               "hooks": {"update-ldcache": [0.016, 0.017]}, "specs": {"host-3": ["a", "b", "c"]}}
    for i, variant in enumerate(VARIANTS):
        results["running"][variant] = [0.2 + 0.01 * i, 0.21 + 0.01 * i]
        results["start"][variant] = [0.05 + 0.01 * i, 0.052 + 0.01 * i]
    text = report(results)
    for variant in VARIANTS:
        assert f"| {variant} |" in text
    assert "| host-3 − host-0 | -10.0 ms [-10.0, -10.0] |" in text   # host-0 is listed after host-3: +10 ms
    assert "| update-ldcache | 16.5 ms (16.0–17.0) | 2 |" in text
    assert "| host-3 | a, b, c |" in text and "| host-0 | none |" in text


def test_main_refuses_too_few_rounds() -> None:
    with pytest.raises(SystemExit):
        main(["--rounds", "1"])
