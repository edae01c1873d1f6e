"""The sample node of README.md's `gpu-dra doctor` output: `python -m testbed.doctor_demo DIR` builds, under DIR,
the driver root of node-a of examples/fleets/demo.yaml in one folder (``lib64/`` + ``bin/``, as GKE's
``/usr/local/nvidia``: the node build's CUDA stand-in, see dra.sim.driverlayout), a dev root with the node's
device nodes (plain files: a simulated node's may be) and a proc root with the driver's /proc/devices lines,
then prints the doctor command that checks them. It needs the node build (`make node-binaries`; built here if
missing)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from dra.sim.fleet import load_fleet
from testbed.hostplumbing import NodeError
from testbed.localnode import find_node_binaries, install_driver_root

REPO = Path(__file__).resolve().parents[1]
FLEET = REPO / "examples" / "fleets" / "demo.yaml"
NODE = "node-a"
LAYOUT = "single-folder"
# /proc/devices of a node with the driver and nvidia-uvm loaded (the majors a real node showed).
PROC_DEVICES = ("Character devices:\n  1 mem\n195 nvidia-frontend\n237 nvidia-caps\n509 nvidia-uvm\n\n"
                "Block devices:\n  8 sd\n")


def build(base: Path) -> dict[str, Path]:
    """Builds (again, from scratch) driver/, devroot/ and proc/ under ``base``; returns them by flag name."""
    roots = {"--driver-root": base / "driver", "--dev-root": base / "devroot", "--proc-root": base / "proc"}
    for path in roots.values():
        shutil.rmtree(path, ignore_errors=True)
    install_driver_root(roots["--driver-root"], find_node_binaries(build=True), LAYOUT, fleet=FLEET, node_name=NODE)
    dev = roots["--dev-root"] / "dev"
    dev.mkdir(parents=True)
    gpus = load_fleet(FLEET).node(NODE).gpu_count
    for name in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", *(f"nvidia{i}" for i in range(gpus))]:
        (dev / name).write_text("")
    roots["--proc-root"].mkdir(parents=True)
    (roots["--proc-root"] / "devices").write_text(PROC_DEVICES)
    return roots


def doctor_command(roots: dict[str, Path]) -> list[str]:
    return ["gpu-dra", "doctor", "--fleet", str(FLEET.relative_to(REPO)), "--node", NODE,
            *(word for flag, path in roots.items() for word in (flag, str(path)))]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m testbed.doctor_demo DIR   (README's sample: /tmp/doctor-demo)", file=sys.stderr)
        return 2
    try:
        roots = build(Path(args[0]).absolute())
    except (NodeError, OSError) as err:
        print(f"testbed.doctor_demo: {err}", file=sys.stderr)
        return 1
    print(" ".join(doctor_command(roots)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
