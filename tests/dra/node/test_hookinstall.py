"""The chart's init container installs the image's nvidia-cdi-hook on the node (dra.node.hookinstall): atomically,
executable, idempotent, and never writing through a link planted at the target."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from dra.node.hookinstall import install_hook, main


def source(tmp_path: Path, body: bytes = b"\x7fELF hook v1") -> Path:
    path = tmp_path / "image" / "nvidia-cdi-hook"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    return path


def test_installs_executable_then_leaves_an_identical_copy_alone(tmp_path: Path) -> None:
    target = tmp_path / "plugins/gpu.dra-driver.io/bin/nvidia-cdi-hook"
    assert install_hook(source(tmp_path), target) is True
    st = target.stat()
    assert stat.S_IMODE(st.st_mode) == 0o755 and target.read_bytes() == b"\x7fELF hook v1"
    assert install_hook(source(tmp_path), target) is False
    assert target.stat().st_ino == st.st_ino
    assert not [p for p in target.parent.iterdir() if p.name != target.name]   # no temporary files left


def test_an_upgrade_replaces_the_file_by_rename(tmp_path: Path) -> None:
    target = tmp_path / "bin/nvidia-cdi-hook"
    install_hook(source(tmp_path), target)
    old = os.open(target, os.O_RDONLY)   # a hook runc started keeps the program it started from
    try:
        assert install_hook(source(tmp_path, b"\x7fELF hook v2"), target) is True
        assert os.read(old, 100) == b"\x7fELF hook v1"
    finally:
        os.close(old)
    assert target.read_bytes() == b"\x7fELF hook v2"


def test_a_planted_link_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    target = tmp_path / "bin/nvidia-cdi-hook"
    target.parent.mkdir()
    target.symlink_to(victim)
    assert install_hook(source(tmp_path), target) is True
    assert victim.read_bytes() == b"keep me"
    assert not target.is_symlink() and target.read_bytes() == b"\x7fELF hook v1"


def test_a_wrong_mode_is_reinstalled(tmp_path: Path) -> None:
    target = tmp_path / "bin/nvidia-cdi-hook"
    install_hook(source(tmp_path), target)
    target.chmod(0o644)
    assert install_hook(source(tmp_path), target) is True
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_command_line(tmp_path: Path, capsys) -> None:
    target = tmp_path / "bin/nvidia-cdi-hook"
    assert main([str(source(tmp_path)), str(target)]) == 0
    assert capsys.readouterr().out == f"installed: {target}\n"
    assert main([str(source(tmp_path)), "relative/path"]) == 2
    assert main([str(tmp_path / "missing"), str(target)]) == 1
    assert "cannot install" in capsys.readouterr().err
