"""``gpu-dra doctor``: whether this node can run GPU containers with this driver, one check a line with the fix.

Checks, in order (a check that needs an earlier one's result is skipped when that failed):

* ``gpu`` (real nodes): an NVIDIA PCI device (vendor 0x10de under ``<sys root>/bus/pci/devices``) and the kernel
  module (``<proc root>/driver/nvidia``), before NVML: a machine without either is told so, not sent to NVML's
  "does not initialise";
* ``nvml``: NVML loads from the driver root and sees the GPUs (read-only queries: discovery, nothing is set);
* ``driver-root``: the driver root has libcuda, NVML and nvidia-smi, and which layout it has (host Debian-style,
  host RHEL-style ``lib64``, the GPU operator's ``/run/nvidia/driver``, a single folder ``lib64/`` + ``bin/`` as
  GKE's ``/usr/local/nvidia``); a soname link of libcuda or libnvidia-ml whose target is missing fails it;
* ``cdi-hook``: the CDI hook program exists and runs (``--version``);
* ``cdi-spec``: the whole-GPU CDI spec of GPU 0, written to a temporary directory, names only device nodes that
  exist with the spec's major:minor, and host paths and hooks that exist;
* ``container``: as root with ``unshare``, a container made from that spec (``ops.doctor.container``) loads
  libcuda.so.1 and libnvidia-ml.so.1 by soname and sees the GPU;
* ``sharing-tools``: nvidia-smi (time-slicing) runs and nvidia-cuda-mps-control (MPS) is present.

Nothing here changes a GPU setting: no MIG mode, compute mode or time-slice is written. A simulated node
(``dra.sim.nodeobjects``) goes through the same checks; its device nodes may be plain files (tests cannot mknod).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from dra.model.gpu import GpuInfo, NodeInventory
from dra.node.cdi import CdiSpecError, CdiSpecWriter, ClaimDevice, load_spec
from dra.node.driverroot import DriverFiles, DriverRoot, DriverRootError
from dra.node.inventory import describe_nvml_error, discover
from dra.node.nodeobjects import GPU_NODES_ONLY, NodeObjects, NodeSetupError
from dra.node.sharingtools import NvidiaSmiSharingControl, SharingError

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
DOCTOR_VENDOR = "k8s.gpu.dra-driver.io"
TOOL_TIMEOUT_S = 20
CONTAINER_TIMEOUT_S = 150
# Where Debian and Ubuntu images' loaders look without a cache entry: libraries elsewhere need the ldcache hook.
DEFAULT_LOADER_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
                       "/usr/lib/aarch64-linux-gnu", "/lib", "/usr/lib")
OPERATOR_ROOT = "/run/nvidia/driver"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: Status
    summary: str
    fix: str = ""


@dataclass
class DoctorOptions:
    probe: str | None = None            # a cuda-probe program for the container check (else ctypes in Python)
    container: bool = True              # run the container check when root and unshare allow it
    is_root: bool | None = None         # None: os.geteuid() == 0
    sys_root: str = "/sys"              # where this process sees /sys (the PCI devices)
    unshare: str | None = None          # the unshare program (None: looked up on PATH)


@dataclass
class _State:
    inventory: NodeInventory | None = None
    root: DriverRoot | None = None
    files: DriverFiles | None = None
    spec: dict[str, Any] | None = None
    checks: list[Check] = field(default_factory=list)


def run_checks(objects: NodeObjects, options: DoctorOptions | None = None) -> list[Check]:
    """Every check, in order; never raises for what it finds on the node."""
    options = options or DoctorOptions()
    state = _State()
    nvml = None
    try:
        if objects.simulated or _check_gpu(objects, state, options):
            nvml = _check_nvml(objects, state)
        else:
            state.checks.append(Check("nvml", "SKIP", "no NVIDIA GPU with a loaded kernel module (see gpu)"))
        _check_driver_root(objects, state)
        _check_hook(objects, state)
        with tempfile.TemporaryDirectory(prefix="gpu-dra-doctor-") as spec_dir:
            _check_spec(objects, state, Path(spec_dir))
        _check_container(objects, state, options)
        _check_tools(objects, state)
    finally:
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - the report is what matters
                pass
    return state.checks


def exit_code(checks: list[Check]) -> int:
    """0 when nothing failed (warnings and skipped checks included), 1 otherwise."""
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def render(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.summary}")
        if c.fix and c.status in ("FAIL", "WARN"):
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    counts = {s: sum(1 for c in checks if c.status == s) for s in ("PASS", "WARN", "FAIL", "SKIP")}
    lines.append(f"{len(checks)} checks: {counts['PASS']} passed, {counts['WARN']} warned, {counts['FAIL']} failed, "
                 f"{counts['SKIP']} skipped")
    return "\n".join(lines)


# ----- checks ------------------------------------------------------------------------------------------------------
NVIDIA_PCI_VENDOR = "0x10de"


def nvidia_pci_devices(sys_root: str | Path) -> list[str]:
    """The PCI addresses of NVIDIA devices (vendor 0x10de) under ``<sys_root>/bus/pci/devices``, sorted."""
    found = []
    for dev in sorted(Path(sys_root, "bus/pci/devices").glob("*")):
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
        except OSError:
            continue
        if vendor == NVIDIA_PCI_VENDOR:
            found.append(dev.name)
    return found


def _check_gpu(objects: NodeObjects, state: _State, options: DoctorOptions) -> bool:
    """An NVIDIA PCI device and the kernel module, read from sysfs and /proc; True when NVML is worth asking."""
    add = state.checks.append
    pci = Path(options.sys_root, "bus/pci/devices")
    devices = nvidia_pci_devices(options.sys_root)
    if not devices:
        add(Check("gpu", "FAIL", f"no NVIDIA GPU on this machine: no PCI device of vendor {NVIDIA_PCI_VENDOR} "
                                 f"under {pci}",
                  f"{GPU_NODES_ONLY}; in a VM, check that the GPU is passed through"))
        return False
    named = ", ".join(devices[:4]) + (f" and {len(devices) - 4} more" if len(devices) > 4 else "")
    module = Path(objects.paths.proc_root, "driver/nvidia")
    if not module.is_dir():
        add(Check("gpu", "FAIL", f"{len(devices)} NVIDIA PCI device(s) ({named}) but the NVIDIA kernel module is not "
                                 f"loaded: no {module}",
                  "install the NVIDIA driver and load its module (modprobe nvidia; the GPU Operator's driver "
                  "container does both)"))
        return False
    try:
        # "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (...)"
        found = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", (module / "version").read_text().splitlines()[0] + " ")
        version = found.group(1) if found else "of unknown version"
    except (OSError, IndexError):
        version = "of unknown version"
    add(Check("gpu", "PASS", f"{len(devices)} NVIDIA PCI device(s) ({named}); NVIDIA kernel module {version} loaded"))
    return True


def _check_nvml(objects: NodeObjects, state: _State) -> Any:
    add = state.checks.append
    import pynvml

    try:
        nvml = objects.open_nvml()
    except NodeSetupError as err:
        add(Check("nvml", "FAIL", f"NVML cannot be loaded: {err}",
                  "point --driver-root at the folder the driver is installed in (/, /run/nvidia/driver, "
                  "/usr/local/nvidia)"))
        return None
    except pynvml.NVMLError as err:
        add(Check("nvml", "FAIL", f"NVML does not initialise: {describe_nvml_error(err)}",
                  "check that the NVIDIA kernel module is loaded and /dev/nvidiactl exists (nvidia-smi on the host)"))
        return None
    try:
        inventory = discover(nvml)
    except pynvml.NVMLError as err:
        add(Check("nvml", "FAIL", f"NVML loaded but discovery failed: {describe_nvml_error(err)}",
                  "see the driver's log (dmesg) for the GPUs"))
        return nvml
    state.inventory = inventory
    kinds: dict[str, list[int]] = {}
    for g in inventory.gpus:
        kinds.setdefault(_describe_gpu(g), []).append(g.index)
    gpus = "; ".join(f"{_indexes(idx)}: {what}" for what, idx in kinds.items())
    head = f"NVML {inventory.driver_version} (CUDA {inventory.cuda_driver_version}) sees {len(inventory.gpus)} GPU(s)"
    if not inventory.gpus:
        add(Check("nvml", "FAIL", head, "no GPU is visible: check the device nodes under --dev-root and the driver"))
    elif any(not g.healthy for g in inventory.gpus):
        add(Check("nvml", "WARN", f"{head}: {gpus}", "the unhealthy GPUs are published tainted; see dmesg for XIDs"))
    else:
        add(Check("nvml", "PASS", f"{head}: {gpus}"))
    return nvml


def _describe_gpu(g: GpuInfo) -> str:
    if not g.healthy:
        return f"UNHEALTHY ({g.health_reason})"
    mig = "" if not g.mig_capable else ", MIG on" if g.mig_enabled else ", MIG off"
    return f"{g.product_name} ({g.memory_mib} MiB{mig})"


def _indexes(indexes: list[int]) -> str:
    """'GPU 3' or 'GPUs 0-7' (consecutive) or 'GPUs 0,2'."""
    if len(indexes) == 1:
        return f"GPU {indexes[0]}"
    if indexes == list(range(indexes[0], indexes[-1] + 1)):
        return f"GPUs {indexes[0]}-{indexes[-1]}"
    return "GPUs " + ",".join(map(str, indexes))


def driver_layout(root: DriverRoot, files: DriverFiles) -> str:
    """Which of the known driver layouts the root has, in words."""
    folders = set(files.lib_folders)
    debian = any(f.endswith("-linux-gnu") for f in folders)
    if debian:
        layout = "Debian-style (lib/<arch>-linux-gnu)"
    elif "/usr/lib64" in folders:
        layout = "RHEL-style (usr/lib64)"
    elif "/lib64" in folders and any(PurePosixPath(b.container_path).parent == PurePosixPath("/bin")
                                     for b in files.binaries):
        layout = "single folder (lib64/ + bin/, as GKE's /usr/local/nvidia)"
    else:
        layout = f"libraries in {', '.join(sorted(folders)) or 'no folder'}"
    where = {str(root.root), str(root.host_root)}
    if any(w.rstrip("/").endswith(OPERATOR_ROOT) for w in where):
        return f"GPU operator driver container ({OPERATOR_ROOT}), {layout} inside"
    if where & {"/", ""}:
        return f"host install, {layout}"
    return layout


def _check_driver_root(objects: NodeObjects, state: _State) -> None:
    add = state.checks.append
    version = state.inventory.driver_version if state.inventory else None
    root = objects.driver_root(version)
    state.root = root
    try:
        files = root.files()
    except DriverRootError as err:
        add(Check("driver-root", "FAIL", str(err),
                  "set --driver-root (and --host-driver-root) to where the driver's libcuda.so.* is"))
        return
    state.files = files
    library_paths = [p.container_path for p in files.libraries] + [link.container_path for link in files.soname_links]
    names = [PurePosixPath(p).name for p in library_paths]
    missing = [lib for lib in ("libcuda.so", "libnvidia-ml.so") if not any(n.startswith(lib + ".") for n in names)]
    tools = [PurePosixPath(b.container_path).name for b in files.binaries]
    summary = (f"{root.root}: {driver_layout(root, files)}; driver {files.version or '?'}; libraries in "
               f"{', '.join(files.lib_folders) or '-'}; tools: {', '.join(tools) or 'none'}")
    needed = [d for d in files.dangling_links
              if PurePosixPath(d.split(" -> ")[0]).name.startswith(("libcuda.so", "libnvidia-ml.so"))]
    others = [d for d in files.dangling_links if d not in needed]
    if missing:
        add(Check("driver-root", "FAIL", f"{root.root}: no {' or '.join(m + '.*' for m in missing)} in any library "
                                         f"folder; tools: {', '.join(tools) or 'none'}",
                  "set --driver-root to the folder the NVIDIA driver is installed in"))
    elif needed:
        add(Check("driver-root", "FAIL", f"{summary}; dangling link(s) {'; '.join(needed)} (target missing): "
                                         "containers would load CUDA or NVML by that soname and fail",
                  "reinstall the driver, or point the link at the library of this driver version (ldconfig)"))
    elif others:
        add(Check("driver-root", "WARN", f"{summary}; dangling link(s) {'; '.join(others)} (target missing): "
                                         "left out of the CDI specs, so programs that need them fail to load them",
                  "reinstall the driver, or point the link at the library of this driver version (ldconfig)"))
    elif "nvidia-smi" not in tools:
        add(Check("driver-root", "WARN", f"{summary}; no nvidia-smi",
                  "install the driver's utilities (nvidia-smi) into the driver root"))
    else:
        add(Check("driver-root", "PASS", summary))


def _hook_local_path(objects: NodeObjects, root: DriverRoot, files: DriverFiles) -> str | None:
    if files.hook is None:
        return None
    if objects.paths.cdi_hook_path:          # seen by this process at its host path
        return files.hook.host_path
    return os.path.join(str(root.root), files.hook.container_path.lstrip("/"))


def _check_hook(objects: NodeObjects, state: _State) -> None:
    add = state.checks.append
    if state.files is None or state.root is None:
        add(Check("cdi-hook", "SKIP", "the driver root could not be read"))
        return
    files = state.files
    outside = [f for f in files.lib_folders if f not in DEFAULT_LOADER_DIRS]
    fix = ("pass --cdi-hook-path with the host path of nvidia-cdi-hook (the chart installs the image's own into the "
           "plugin directory)")
    local = _hook_local_path(objects, state.root, files)
    if local is None or files.hook is None:
        why = (f"the libraries are in {', '.join(outside)}, which images' loaders do not search: CUDA programs "
               "would see no GPU" if outside else "soname links and the containers' loader cache are not managed")
        add(Check("cdi-hook", "FAIL", f"no nvidia-cdi-hook or nvidia-ctk in the driver root and no --cdi-hook-path; "
                                      f"{why}", fix))
        return
    argv = [local, "--version"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        add(Check("cdi-hook", "FAIL", f"{local} does not run: {err}", fix))
        return
    output = " ".join(f"{done.stdout} {done.stderr}".split())[:200]
    if done.returncode != 0:
        add(Check("cdi-hook", "FAIL", f"{local} --version exited with {done.returncode}: {output}", fix))
    else:
        add(Check("cdi-hook", "PASS", f"{files.hook.host_path} runs" + (f" ({output})" if output else "")))


def _local(path: str, host_prefix: PurePosixPath | str, local_prefix: Path | str) -> str:
    """Where this process sees a host path under ``host_prefix``."""
    try:
        rel = PurePosixPath(path).relative_to(PurePosixPath(str(host_prefix)))
    except ValueError:
        return path
    return os.path.join(str(local_prefix), str(rel))


def _spec_parts(root: DriverRoot, spec: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                  list[dict[str, Any]]]:
    """Device nodes, mounts and hooks of the spec with where this process sees each."""
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices", [])]
    nodes, mounts, hooks = [], [], []
    for e in edits:
        for n in e.get("deviceNodes") or []:
            local = _local(n["hostPath"], root.host_dev_root, root.dev_root) if n.get("hostPath") else None
            nodes.append({**n, "local": local})
        for m in e.get("mounts") or []:
            mounts.append({**m, "local": _local(m["hostPath"], root.host_root, root.root)})
        for h in e.get("hooks") or []:
            hooks.append({**h, "local": h["path"]})
    return nodes, mounts, hooks


def _check_spec(objects: NodeObjects, state: _State, spec_dir: Path) -> None:
    add = state.checks.append
    if state.inventory is None or not state.inventory.gpus or state.root is None:
        add(Check("cdi-spec", "SKIP", "no GPU 0 from NVML"))
        return
    gpu = state.inventory.gpus[0]
    device = ClaimDevice(name="gpu-0", uuid=gpu.uuid, gpu_minor=gpu.minor, gpu_index=gpu.index)
    writer = CdiSpecWriter(spec_dir, state.root, vendor=DOCTOR_VENDOR)   # own edits only: what the plugin falls back to
    try:
        writer.write_claim_spec("doctor", [device])
        spec = load_spec(writer.spec_path("doctor"))
    except (DriverRootError, CdiSpecError, OSError, ValueError) as err:
        add(Check("cdi-spec", "FAIL", f"the whole-GPU spec of GPU 0 cannot be built: {err}",
                  "the device nodes come from --dev-root and the MIG/uvm majors from --proc-root: check both"))
        return
    state.spec = spec
    nodes, mounts, hooks = _spec_parts(state.root, spec)
    problems = [p for n in nodes if (p := _node_problem(n, objects.simulated))]
    problems += [f"mount {m['containerPath']}: {m['local']} does not exist" for m in mounts
                 if not os.path.exists(m["local"])]
    problems += [f"hook {h['path']}: not an executable file" for h in hooks
                 if not (os.path.isfile(h["local"]) and os.access(h["local"], os.X_OK))]
    summary = (f"spec for GPU 0 ({gpu.uuid}), cdiVersion {spec['cdiVersion']}: {len(nodes)} device node(s), "
               f"{len(mounts)} mount(s), {len(hooks)} hook(s)")
    if problems:
        add(Check("cdi-spec", "FAIL", f"{summary}; {'; '.join(problems)}",
                  "a container given this spec would fail to start: fix --dev-root/--driver-root/--host-driver-root, "
                  "or load the driver's device nodes (nvidia-modprobe -u -c=0)"))
    else:
        add(Check("cdi-spec", "PASS", f"{summary}, all present on this node"))


def _node_problem(node: dict[str, Any], simulated: bool) -> str | None:
    path, local = node["path"], node.get("local")
    want = (node.get("major"), node.get("minor"))
    if local is None:
        return f"device node {path}: not on this node (the spec only has {want[0]}:{want[1]})"
    try:
        st = os.stat(local)
    except OSError:
        return f"device node {path}: {local} does not exist"
    if not stat.S_ISCHR(st.st_mode):
        return None if simulated else f"device node {path}: {local} is not a character device"
    got = (os.major(st.st_rdev), os.minor(st.st_rdev))
    if want[0] is not None and got != want:
        return f"device node {path}: {local} is {got[0]}:{got[1]}, the spec says {want[0]}:{want[1]}"
    return None


def _check_container(objects: NodeObjects, state: _State, options: DoctorOptions) -> None:
    add = state.checks.append
    if not options.container:
        add(Check("container", "SKIP", "not asked for (--no-container)"))
        return
    if state.spec is None or state.root is None or state.files is None:
        add(Check("container", "SKIP", "no CDI spec to build a container from"))
        return
    is_root = os.geteuid() == 0 if options.is_root is None else options.is_root
    unshare = options.unshare or shutil.which("unshare")
    if not is_root or unshare is None:
        add(Check("container", "SKIP", "needs root and unshare(1) (a private mount namespace)",
                  "run as root (kubectl exec into the plugin pod) to check a container end to end"))
        return
    if options.probe and not os.access(options.probe, os.X_OK):
        add(Check("container", "FAIL", f"--probe {options.probe}: not an executable file", "build cuda-probe"))
        return
    nodes, mounts, hooks = _spec_parts(state.root, state.spec)
    root, files = state.root, state.files
    hide = [str(root.root)] if str(root.root) not in ("/", "") else []
    # The driver reachable only through the spec: its files at their container paths are hidden too.
    hide += [p.container_path for p in (*files.libraries, *files.binaries)]
    hide += [link.container_path for link in files.soname_links]
    with tempfile.TemporaryDirectory(prefix="gpu-dra-doctor-ctr-") as work:
        mount_dir = os.path.join(work, "mnt")
        request = {"work": mount_dir, "hide": hide, "device_nodes": nodes, "mounts": mounts,
                   "hooks": hooks, "probe": options.probe}
        os.makedirs(mount_dir)
        request_file = os.path.join(work, "request.json")
        Path(request_file).write_text(json.dumps(request))
        argv = [unshare, "--mount", "--propagation", "private", sys.executable, "-m", "ops.doctor.container",
                request_file]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=CONTAINER_TIMEOUT_S, check=False,
                                  cwd=str(Path(__file__).resolve().parents[2]))
        except subprocess.TimeoutExpired:
            add(Check("container", "FAIL", f"the container check did not finish in {CONTAINER_TIMEOUT_S} s",
                      "a hook or the driver hangs: run the hook by hand"))
            return
        except OSError as err:
            add(Check("container", "SKIP", f"cannot run {unshare}: {err}"))
            return
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        output = " ".join(f"{done.stdout} {done.stderr}".split())[:300]
        add(Check("container", "FAIL", f"the container check exited with {done.returncode}: {output}",
                  "see the message; unshare needs CAP_SYS_ADMIN"))
        return
    hooked = f", hooks {', '.join(result.get('hooks', []))}" if result.get("hooks") else ", no hooks"
    summary = f"private-namespace container from the spec{hooked}: {result.get('summary', '')}"
    if not result.get("loaded"):
        add(Check("container", "FAIL", summary,
                  "libraries outside the image's loader path need the update-ldcache hook (--cdi-hook-path); "
                  "check the spec's mounts"))
    elif not objects.simulated and not result.get("gpus"):
        # What a CUDA program in a pod would report: the driver loads but no device is usable.
        add(Check("container", "FAIL", f"{summary}; CUDA sees no GPU",
                  "the spec's device nodes must be the GPU's and the control nodes' (check --dev-root)"))
    else:
        add(Check("container", "PASS", summary))


def _check_tools(objects: NodeObjects, state: _State) -> None:
    add = state.checks.append
    if state.root is None or state.files is None:
        add(Check("sharing-tools", "SKIP", "the driver root could not be read"))
        return
    try:
        control = objects.sharing_control(state.root)
    except SharingError as err:
        add(Check("sharing-tools", "WARN", f"{err}: time-slicing and MPS claims will fail (whole GPUs and MIG work)",
                  "install the driver's utilities into the driver root"))
        return
    if not isinstance(control, NvidiaSmiSharingControl):     # a simulated node's tools are simulated
        add(Check("sharing-tools", "PASS", f"simulated nvidia-smi and MPS control ({type(control).__name__})"))
        return
    mps = state.root.find_binary("nvidia-cuda-mps-control")
    try:
        # -L lists the GPUs: read-only, like every other call here.
        done = subprocess.run([control.nvidia_smi, "-L"], env={**os.environ, **control.extra_env},
                              capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
        smi = (done.returncode, " ".join(f"{done.stdout} {done.stderr}".split())[:200])
    except (OSError, subprocess.SubprocessError) as err:
        smi = (-1, str(err))
    mig = [g.index for g in (state.inventory.gpus if state.inventory else []) if g.mig_capable]
    note = f"; MIG-capable GPUs: {', '.join(map(str, mig))}" if mig else ""
    if smi[0] != 0:
        add(Check("sharing-tools", "WARN", f"{control.nvidia_smi} -L failed ({smi[0]}): {smi[1]}; time-slicing "
                                           "claims will fail", "check the driver's utilities in the driver root"))
    elif mps is None:
        add(Check("sharing-tools", "WARN", f"nvidia-smi runs; no nvidia-cuda-mps-control: MPS claims will fail{note}",
                  "install the driver's MPS programs into the driver root"))
    else:
        add(Check("sharing-tools", "PASS", f"nvidia-smi runs, nvidia-cuda-mps-control present{note}"))
