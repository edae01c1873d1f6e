"""The docs' tables stay equal to the code: README's command table and docs/operations.md's flag tables name only
flags the commands have, and the flag tables every flag; the kubelet plugin's environment column and
deploy/README.md's list name the variables the code reads and the chart sets; docs/operations.md's values
table covers every key of the chart's values.yaml, and names no key it lacks."""
from __future__ import annotations

import argparse
import re
from typing import Any

import pytest
import yaml

from cli.main import SUBCOMMANDS, build_parser
from testbed.helmchart import CHART, ROOT, render

OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
README = (ROOT / "README.md").read_text()
DEPLOY_README = (ROOT / "deploy" / "README.md").read_text()
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _all_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long options of a parser and of its sub-commands' parsers (simulate xid|lose|recover)."""
    out = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _all_flags(sub)
    return out


def flags_of(command: str) -> set[str]:
    parser = build_parser(command)
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return _all_flags(action.choices[command])


def section(title: str) -> str:
    """The text of docs/operations.md's section `## title` up to the next `## ` heading."""
    start = OPERATIONS.index(f"\n## {title}\n")
    end = OPERATIONS.find("\n## ", start + 1)
    return OPERATIONS[start:end if end > 0 else None]


def first_table(text: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table in text, header and rule left out."""
    rows, started = [], False
    for line in text.splitlines():
        if line.startswith("|"):
            started = True
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif started:
            break
    return rows[2:]


def test_the_readme_command_table_has_every_command_and_only_their_flags() -> None:
    rows = {}
    table = README.split("## Commands", 1)[1]
    for cells in first_table(table):
        command = re.search(r"`gpu-dra ([a-z-]+)", cells[0])
        assert command, cells[0]
        rows[command.group(1)] = cells[0] + " " + cells[1]
    assert set(rows) == set(SUBCOMMANDS)
    for name, text in rows.items():
        unknown = set(FLAG.findall(text)) - flags_of(name)
        assert not unknown, f"README's row of gpu-dra {name} names flags it does not have: {sorted(unknown)}"


@pytest.mark.parametrize("command, title", [
    ("kubelet-plugin", "`gpu-dra kubelet-plugin`"),
    ("controller", "`gpu-dra controller`"),
    ("webhook", "`gpu-dra webhook`"),
    ("publish", "`gpu-dra publish` and how slices are kept exact at scale"),
])
def test_each_flag_table_names_exactly_the_flags_of_its_command(command: str, title: str) -> None:
    documented = {f for cells in first_table(section(title)) for f in FLAG.findall(cells[0])}
    actual = flags_of(command)
    assert not actual - documented, f"docs/operations.md, {title}: flags missing: {sorted(actual - documented)}"
    assert not documented - actual, f"docs/operations.md, {title}: flags that do not exist: {sorted(documented - actual)}"


def _plugin_environment() -> dict[str, str]:
    """flag -> environment variable, from the flags' help texts ([env NAME])."""
    parser = build_parser("kubelet-plugin")
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    out = {}
    for a in action.choices["kubelet-plugin"]._actions:
        found = re.search(r"\[env (\w+)\]", a.help or "")
        if found:
            out[a.option_strings[0]] = found.group(1)
    return out


def test_the_plugin_table_names_each_flags_environment_variable() -> None:
    env = _plugin_environment()
    rows = first_table(section("`gpu-dra kubelet-plugin`"))
    documented: dict[str, set[str]] = {}
    for cells in rows:
        names = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[1]))
        for flag in FLAG.findall(cells[0]):
            documented[flag] = names
    for flag, variable in env.items():
        assert variable in documented.get(flag, set()), f"{flag}: environment {variable} not in its row"


def test_deploy_readme_lists_the_environment_the_chart_gives_the_plugin() -> None:
    chart: set[str] = set()
    # The defaults, and the values that add variables: a node policy, a simulated fleet.
    for args in ([], ["--set-json", 'nodePolicy={"default":{"wholeGpu":true}}', "-f",
                      str(ROOT / "deploy" / "kind" / "values-simulated.yaml")]):
        [ds] = [o for o in render(*args) if o["kind"] == "DaemonSet"]
        [plugin] = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["command"][-1] == "kubelet-plugin"]
        chart |= {e["name"] for e in plugin.get("env", [])}
    paragraph = DEPLOY_README.split("The plugin container gets its settings as environment variables.", 1)[1]
    paragraph = paragraph.split("\n\n", 1)[0]
    listed = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", paragraph))
    code = set(_plugin_environment().values())
    assert listed == chart - {"NVIDIA_VISIBLE_DEVICES"}, (sorted(chart - listed), sorted(listed - chart))
    assert listed <= code, f"deploy/README.md lists variables the plugin does not read: {sorted(listed - code)}"


def _documented_values() -> set[str]:
    """Key paths named in the values table's first column; `.x` continues the previous full name's prefix."""
    names: set[str] = set()
    for cells in first_table(section("Installing with the Helm chart")):
        prefix = ""
        for name in re.findall(r"`([a-zA-Z0-9.]+)`", cells[0]):
            if name.startswith("."):
                name = prefix + name[1:]
            else:
                prefix = name.rsplit(".", 1)[0] + "." if "." in name else ""
            names.add(name)
    return names


def _uncovered(values: Any, path: str, documented: set[str]) -> list[str]:
    if path in documented:
        return []
    if isinstance(values, dict) and values:
        return [p for k, v in values.items() for p in _uncovered(v, f"{path}.{k}" if path else k, documented)]
    return [path]


def _exists(values: Any, path: str) -> bool:
    for key in path.split("."):
        if not isinstance(values, dict) or key not in values:
            return False
        values = values[key]
    return True


def test_the_values_table_covers_every_value_and_names_only_real_ones() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = _documented_values()
    missing = _uncovered(values, "", documented)
    assert not missing, f"values.yaml keys not in docs/operations.md's values table: {missing}"
    unknown = sorted(p for p in documented if not _exists(values, p))
    assert not unknown, f"docs/operations.md's values table names keys values.yaml does not have: {unknown}"
