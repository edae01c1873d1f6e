"""The container check of ``gpu-dra doctor``: a GPU container made from a CDI spec, as a runtime would make it,
and the driver's libraries loaded in it by soname. Run as root, in a private mount namespace of its own
(``unshare --mount --propagation private python -m ops.doctor.container REQUEST.json``); it prints one
JSON object (``loaded``, ``gpus``, ``summary``, ``hooks``) and changes nothing outside that namespace:

* the container's root is this system's ``/etc``, ``/usr``, ``/lib*``, ``/bin``, ``/sbin``, each an overlay whose
  writable layer is a tmpfs (the lower directories are never written);
* the driver's folder is hidden there (removed in the overlay), and so is every driver file the spec mounts, so
  the driver is reachable only through the spec;
* the spec's device nodes are bound (or created from major:minor) under a private ``/dev``, its mounts bound
  read-only at their container paths, its createContainer hooks run with the OCI state of that root on stdin;
* then, chrooted there, ``libcuda.so.1`` and ``libnvidia-ml.so.1`` are loaded by soname in a fresh process (a
  probe program when one is given, else a Python of that root with ctypes) and asked how many GPUs they see.

The namespace, its mounts and the tmpfs end with this process.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
# What the container's root is made of: the loader, libc and its cache come from here (this system's own).
IMAGE_DIRS: tuple[str, ...] = ("etc", "usr", "lib", "lib64", "lib32", "libx32", "bin", "sbin")
HOOK_TIMEOUT_S = 60
PROBE_TIMEOUT_S = 60
# Pythons looked for inside the container's root when this process's own is not there (Debian's, the image's).
PYTHONS: tuple[str, ...] = ("/usr/bin/python3", "/usr/bin/python3.11", "/usr/local/bin/python3")

_libc = ctypes.CDLL(None, use_errno=True)


class ContainerError(RuntimeError):
    """A step of building the container failed; the message names it."""


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                   flags, data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise ContainerError(f"mount {source or fstype} on {target}: {os.strerror(err)}")


def _inside(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _make_target(target: str, like: str) -> None:
    """An empty file or directory at ``target`` (made in the overlay) to bind ``like`` onto."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.lexists(target) and (os.path.islink(target) or os.path.isdir(target) != os.path.isdir(like)):
        _remove(target)
    if os.path.isdir(like):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "w").close()


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def build_root(work: str, hide: list[str]) -> str:
    """The container's root under ``work`` (a tmpfs), with ``hide`` (paths as this process sees them) removed."""
    root = os.path.join(work, "root")
    os.makedirs(root)
    _mount(root, root, None, MS_BIND)   # a mount point of its own, as a container's root is (hooks pivot_root there)
    for name in IMAGE_DIRS:
        source = "/" + name
        if os.path.islink(source):
            os.symlink(os.readlink(source), os.path.join(root, name))   # merged /usr: lib -> usr/lib
            continue
        if not os.path.isdir(source):
            continue
        upper, scratch, target = (os.path.join(work, kind, name) for kind in ("upper", "scratch", "root"))
        for d in (upper, scratch, target):
            os.makedirs(d, exist_ok=True)
        _mount("overlay", target, "overlay", 0, f"lowerdir={source},upperdir={upper},workdir={scratch}")
    for path in hide:
        inside = _inside(root, path)
        if os.path.lexists(inside):
            _remove(inside)
    for name in ("dev", "proc", "sys", "tmp", "run"):
        os.makedirs(os.path.join(root, name), exist_ok=True)
    _mount("tmpfs", os.path.join(root, "dev"), "tmpfs", 0, "mode=755")
    _mount("/proc", os.path.join(root, "proc"), None, MS_BIND | MS_REC)
    _mount("/sys", os.path.join(root, "sys"), None, MS_BIND | MS_REC)
    return root


def add_device_nodes(root: str, nodes: list[dict[str, Any]]) -> None:
    """Each node is ``{"path", "local"?, "major"?, "minor"?}``: bound from ``local`` or made from major:minor."""
    for node in nodes:
        target = _inside(root, node["path"])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        local = node.get("local")
        if local and os.path.exists(local):
            open(target, "w").close()
            _mount(local, target, None, MS_BIND)
        elif node.get("major") is not None:
            os.mknod(target, 0o666 | 0o020000, os.makedev(int(node["major"]), int(node["minor"])))
        else:
            raise ContainerError(f"device node {node['path']}: {local} does not exist and the spec has no major:minor")


def add_mounts(root: str, mounts: list[dict[str, Any]]) -> None:
    """Each mount is ``{"local", "containerPath"}``: bound read-only, as the spec's ``ro`` option says."""
    for m in mounts:
        target = _inside(root, m["containerPath"])
        if not os.path.exists(m["local"]):
            raise ContainerError(f"mount {m['containerPath']}: {m['local']} does not exist")
        _make_target(target, m["local"])
        _mount(m["local"], target, None, MS_BIND | MS_REC)
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def run_hooks(work: str, root: str, hooks: list[dict[str, Any]]) -> list[str]:
    """createContainer hooks as runc runs them: argv from the spec, the OCI state on stdin."""
    bundle = os.path.join(work, "bundle")
    os.makedirs(bundle, exist_ok=True)
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump({"ociVersion": "1.0.2", "root": {"path": root, "readonly": False},
                   "process": {"cwd": "/", "args": ["/bin/true"], "env": []}}, f)
    state = json.dumps({"ociVersion": "1.0.2", "id": "gpu-dra-doctor", "status": "creating", "pid": os.getpid(),
                        "bundle": bundle})
    done = []
    for hook in hooks:
        args = list(hook.get("args") or [hook["local"]])
        argv = [hook["local"], *args[1:]]
        try:
            result = subprocess.run(argv, input=state, capture_output=True, text=True, timeout=HOOK_TIMEOUT_S,
                                    env=dict(e.split("=", 1) for e in hook.get("env") or []) or None)
        except (OSError, subprocess.SubprocessError) as err:
            raise ContainerError(f"hook {' '.join(args[:2])}: {err}") from None
        if result.returncode != 0:
            output = " ".join(f"{result.stdout} {result.stderr}".split())[:400]
            raise ContainerError(f"hook {' '.join(args[:2])} exited with {result.returncode}: {output}")
        done.append(" ".join(args[1:2]) or hook["local"])
    return done


def load_in_root(root: str, probe: str | None) -> dict[str, Any]:
    """Chroot into ``root`` and load the two libraries by soname: ``loaded``, ``gpus`` (CUDA's count, None when
    unknown) and ``summary``."""
    if probe:
        target = _inside(root, "/usr/local/bin/gpu-dra-cuda-probe")
        _make_target(target, probe)
        _mount(probe, target, None, MS_BIND)
    os.chroot(root)
    os.chdir("/")
    if probe:
        return _run_probe("/usr/local/bin/gpu-dra-cuda-probe")
    # A fresh process: this one's loader keeps the cache it read before the chroot (the host's ld.so.cache).
    python = next((p for p in (sys.executable, *PYTHONS) if os.path.isfile(p) and os.access(p, os.X_OK)), None)
    if python is None:
        return {"loaded": False, "gpus": None,
                "summary": f"no Python in the container's root ({', '.join(PYTHONS)}) to load the libraries with; "
                           "give a cuda-probe program"}
    try:
        result = subprocess.run([python, "-I", "-c", _LOADER], capture_output=True, text=True,
                                timeout=PROBE_TIMEOUT_S, env={"PATH": "/usr/bin:/bin"})
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        return {"loaded": False, "gpus": None, "summary": f"{python} could not load the libraries: {err}"}


# Run by a Python inside the container: loads both libraries by soname, counts GPUs, prints JSON.
_LOADER = r"""
import ctypes, json
def count(lib, init, count, *args):
    try:
        init_fn, count_fn = getattr(lib, init), getattr(lib, count)
    except AttributeError:
        return None, "no " + init
    rc = init_fn(*args)
    if rc != 0:
        return None, "%s returned %d" % (init, rc)
    n = ctypes.c_uint(0)
    rc = count_fn(ctypes.byref(n))
    return (n.value, "%d GPU(s)" % n.value) if rc == 0 else (None, "%s returned %d" % (count, rc))
seen, gpus = [], None
for soname, init, cnt, args in (("libcuda.so.1", "cuInit", "cuDeviceGetCount", (0,)),
                                ("libnvidia-ml.so.1", "nvmlInit_v2", "nvmlDeviceGetCount_v2", ())):
    try:
        lib = ctypes.CDLL(soname)
    except OSError as err:
        print(json.dumps({"loaded": False, "gpus": None,
                          "summary": "%s not found by the container's loader (%s)" % (soname, err)}))
        raise SystemExit(0)
    n, words = count(lib, init, cnt, *args)
    if soname == "libcuda.so.1":
        gpus = n
    seen.append("%s: %s" % (soname, words))
print(json.dumps({"loaded": True, "gpus": gpus, "summary": "; ".join(seen)}))
"""


def _run_probe(path: str) -> dict[str, Any]:
    """cuda-probe's ``cuda: <n> devices [(why)]`` and ``nvml: ...`` lines."""
    try:
        result = subprocess.run([path, "--once"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError) as err:
        return {"loaded": False, "gpus": None, "summary": f"cuda-probe: {err}"}
    lines = [line for line in result.stdout.splitlines() if " devices" in line]
    summary = "; ".join(lines) or " ".join(result.stderr.split())[:300] or f"cuda-probe exited {result.returncode}"
    gpus = next((int(line.split()[1]) for line in lines if line.startswith("cuda: ") and line.split()[1].isdigit()),
                None)
    loaded = result.returncode == 0 and not any("dlopen" in line for line in lines)
    return {"loaded": loaded, "gpus": gpus, "summary": summary}


def run(request: dict[str, Any]) -> dict[str, Any]:
    work = request["work"]
    if _libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:   # nothing reaches the host's mounts
        raise ContainerError(f"making / private: {os.strerror(ctypes.get_errno())}")
    _mount("tmpfs", work, "tmpfs", 0, "mode=700")
    root = build_root(work, request.get("hide", []))
    add_device_nodes(root, request.get("device_nodes", []))
    add_mounts(root, request.get("mounts", []))
    hooks = run_hooks(work, root, request.get("hooks", []))
    return {**load_in_root(root, request.get("probe")), "hooks": hooks}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(json.dumps({"loaded": False, "summary": "usage: python -m ops.doctor.container REQUEST.json"}))
        return 2
    try:
        request = json.loads(Path(argv[0]).read_text())
        result = run(request)
    except (ContainerError, OSError, ValueError, KeyError) as err:
        result = {"loaded": False, "summary": str(err)}
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
