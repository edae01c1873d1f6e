"""`gpu-dra <command>` loads that command's module only: the node plugin's sockets come up without the imports
of every other sub-command in front of them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli.main import SUBCOMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from cli import main as m
try:
    m.main(sys.argv[1:])
except SystemExit:
    pass
print(" ".join(sorted(k for k in sys.modules if k.startswith("cli.") and k.endswith("_cmd"))))
"""


def loaded_commands(*argv: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    return set(out.stdout.splitlines()[-1].split())   # the last line; help text comes before it


def test_a_sub_command_imports_its_own_module_only() -> None:
    assert loaded_commands("kubelet-plugin", "--help") == {"cli.kubeletplugin_cmd"}


def test_the_top_level_help_still_lists_every_sub_command() -> None:
    text = build_parser("kubelet-plugin").format_help()
    assert all(name in text for name in SUBCOMMANDS)
    # Unknown first words (an option, a typo) load every parser, so argparse answers as before.
    assert loaded_commands("--help") == {m for m, _ in SUBCOMMANDS.values()}
