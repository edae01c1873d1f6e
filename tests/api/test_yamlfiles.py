"""The user's YAML files through the command line: every unusable fleet file (unreadable, not UTF-8, not YAML,
nested too deeply, also inside a node's policy) makes `gpu-dra slices`, `inventory` and `publish` exit 2 with
one line that names the file and the place in it, never a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from api.yamlfiles import MAX_DEPTH, YamlFileError, load_yaml_file, parse_yaml
from cli.main import main

REPO = Path(__file__).resolve().parents[2]
DEEP = 5000      # far past Python's recursion limit once composed recursively

# name -> (file content, what the one error line says after the file name)
BAD_FLEETS: dict[str, tuple[bytes, str]] = {
    "deep-nodes": (b"nodes: " + b"[" * DEEP + b"]" * DEEP + b"\n",
                   "line 1, column 71: nested deeper than 64 levels"),
    "deep-policy": (b"nodes:\n- name: n\n  gpus: [{model: L4}]\n  policy: {default: " + b"{a: " * DEEP + b"1"
                    + b"}" * DEEP + b"}\n", "line 4, column 258: nested deeper than 64 levels"),
    "deep-mapping-block": (("nodes:\n" + "".join("  " * i + "- a:\n" for i in range(1, DEEP // 10))).encode(),
                           "nested deeper than"),
    "not-utf8": (b"nodes:\n- name: n\xff\n  gpus: [{model: L4}]\n", "not UTF-8: line 2, byte 16: invalid start byte (0xff)"),
    "latin1-bom": (b"\xff\xfenodes: []\n", "not UTF-8: line 1, byte 0"),
    "not-yaml": (b"nodes: [\n  {name: a\n", "not valid YAML: line 3, column 1: while parsing a flow mapping"),
    "control-char": (b"nodes: \x07\n", "not valid YAML: character 7: special characters are not allowed"),
    "tab-indent": (b"nodes:\n\t- name: a\n", "not valid YAML: line 2, column 1:"),
}


def _argv(command: str, path: Path) -> list[str]:
    if command == "publish":   # the fleet is read before any connection is made
        return ["publish", "--fleet", str(path), "--kubeconfig", str(path.parent / "no-kubeconfig"), "--once"]
    return [command, "--fleet", str(path)]


@pytest.mark.parametrize("command", ["slices", "inventory", "publish"])
@pytest.mark.parametrize("case", sorted(BAD_FLEETS))
def test_bad_fleet_files_exit_2_with_one_line_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str) -> None:
    content, says = BAD_FLEETS[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(content)
    rc = main(_argv(command, path))
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    [line] = out.err.splitlines()
    assert line.startswith(f"gpu-dra {command}: {path}: "), line
    assert says in line, line


@pytest.mark.parametrize("command", ["slices", "inventory", "publish"])
def test_a_missing_or_unreadable_fleet_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     command: str) -> None:
    for path, says in ((tmp_path / "missing.yaml", "cannot read: No such file or directory"),
                       (tmp_path, "cannot read: Is a directory")):
        assert main(_argv(command, path)) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line == f"gpu-dra {command}: {path}: {says}"


def test_the_installed_command_prints_no_traceback(tmp_path: Path) -> None:
    """As a user runs it: a new interpreter, with its own recursion limit and stack."""
    path = tmp_path / "deep.yaml"
    path.write_bytes(BAD_FLEETS["deep-nodes"][0])
    proc = subprocess.run([sys.executable, "-m", "cli.main", "slices", "--fleet", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"gpu-dra slices: {path}: line 1, column 71: nested deeper than 64 levels"]


# ---- the loader itself ----------------------------------------------------------------------------------

def test_nesting_up_to_the_limit_loads() -> None:
    depth = MAX_DEPTH - 1                          # the document's root is the first level
    data = parse_yaml("a: " + "[" * depth + "]" * depth, "f.yaml")
    for _ in range(depth):
        data = data["a"] if isinstance(data, dict) else data[0]
    with pytest.raises(YamlFileError, match=r"^f\.yaml: line 1, column \d+: nested deeper than"):
        parse_yaml("a: " + "[" * (depth + 1) + "]" * (depth + 1), "f.yaml")


def test_a_recursion_limit_the_loader_does_not_know_is_still_one_line() -> None:
    """Called from deep in the stack, composing may run out of stack before the depth limit: still our error."""
    def nested(n: int) -> object:
        return nested(n - 1) if n else parse_yaml("a: " + "[" * 60 + "]" * 60, "f.yaml")

    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    # 100 frames left: composing 60 levels takes two frames each
    with pytest.raises(YamlFileError, match=r"^f\.yaml: nested too deeply to read$"):
        nested(sys.getrecursionlimit() - depth - 100)


def test_documents_and_the_callers_error_type(tmp_path: Path) -> None:
    class MyError(ValueError):
        pass

    path = tmp_path / "docs.yaml"
    path.write_text("---\na: 1\n---\n---\nb: 2\n")
    assert load_yaml_file(path, documents=True) == [{"a": 1}, {"b": 2}]
    path.write_text("a: [")
    with pytest.raises(MyError, match=r"^shown name: not valid YAML: "):
        load_yaml_file(path, source="shown name", error=MyError)
