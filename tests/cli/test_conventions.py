"""What every `gpu-dra` command does alike: `--version`, an example at the end of each `--help` (one that parses),
and one spelling of `--log-level` (lower-case levels, any case accepted, `warn` for `warning`)."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from cli.main import EXAMPLES, SUBCOMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]


def _sub_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(name)
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub: argparse.ArgumentParser = action.choices[name]
    return sub


def test_version_is_the_project_version_and_the_chart_app_version() -> None:
    expected = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((REPO / "deploy/helm/gpu-dra-driver/Chart.yaml").read_text())
    assert chart["appVersion"] == expected
    proc = subprocess.run([sys.executable, "-m", "cli.main", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"gpu-dra {expected}", proc.stdout + proc.stderr


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_help_ends_with_an_example_that_parses(name: str) -> None:
    text = _sub_parser(name).format_help()
    assert text.rstrip().endswith(f"example:\n  {EXAMPLES[name]}"), text[-400:]
    words = shlex.split(EXAMPLES[name])
    assert words[:2] == ["gpu-dra", name]
    assert build_parser(name).parse_args(words[1:]).command == name


def test_publish_help_warns_what_it_changes() -> None:
    text = _sub_parser("publish").format_help()
    assert "changes only the ResourceSlices it created" in text and "never touched" in text and "--dry-run" in text


def _log_level_action(name: str) -> argparse.Action | None:
    found = [a for a in _sub_parser(name)._actions if "--log-level" in a.option_strings]
    return found[0] if found else None


LOGGING = [name for name in SUBCOMMANDS if _log_level_action(name) is not None]


def test_log_level_is_spelled_one_way_everywhere() -> None:
    assert {"controller", "webhook", "kubelet-plugin", "publish", "demo"} <= set(LOGGING)
    helps = {name: _log_level_action(name).help.split(" (")[0] for name in LOGGING}   # type: ignore[union-attr]
    assert set(helps.values()) == {"debug, info, warning, error"}, helps
    for name in LOGGING:
        action = _log_level_action(name)
        assert action is not None and action.choices is None and action.metavar == "LEVEL", name
        assert action.default == action.default.lower(), (name, action.default)


@pytest.mark.parametrize("name", LOGGING)
@pytest.mark.parametrize("given, level", [("INFO", "info"), ("Warning", "warning"), ("warn", "warning"),
                                          ("debug", "debug")])
def test_log_level_takes_any_case_and_the_old_spelling(name: str, given: str, level: str) -> None:
    words = shlex.split(EXAMPLES[name])[1:] + ["--log-level", given]
    assert build_parser(name).parse_args(words).log_level == level


def test_an_unknown_log_level_names_the_levels(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser("controller").parse_args(["controller", "--log-level", "verbose"])
    assert "'verbose': use one of debug, info, warning, error (any case)" in capsys.readouterr().err


def _options_with_defaults(name: str) -> list[argparse.Action]:
    return [a for a in _sub_parser(name)._actions
            if a.option_strings and a.default not in (None, False, argparse.SUPPRESS)]


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_option_with_a_default_shows_it_in_help(name: str) -> None:
    """--help is where a flag's default is looked up; docs/operations.md is not at hand on a node."""
    sub = _sub_parser(name)
    for action in _options_with_defaults(name):
        text = " ".join(sub._get_formatter()._expand_help(action).split())
        assert "default" in text, (action.option_strings, text)
