"""The DeviceClasses of this driver, as wire-format dicts (resource.k8s.io/v1).

Every class name derives from the driver name, so a custom driver name gets its own set:

    <driver>              whole GPUs        (type == 'gpu')
    mig.<driver>          MIG partitions    (type == 'mig')
    slot.<driver>         shared slots      (type == 'slot', time-slicing or MPS)
    shared.<driver>       memory shares     (type == 'shared', consumable capacity)
    <family>.<driver>     whole GPUs of one family, e.g. hopper.gpu.dra-driver.io

In NVIDIA compatibility mode the driver is gpu.nvidia.com and the first two are NVIDIA's own names,
`gpu.nvidia.com` (also serving the extended resource nvidia.com/gpu) and `mig.nvidia.com`, so claims
written for NVIDIA's driver keep working.

`python -m api.deviceclasses` rewrites the generated YAML in deploy/ from these definitions. Older API
servers drop fields they do not support; `classes_for_server` leaves those out for them.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from api.k8snames import is_dns_subdomain
from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME

DEVICE_CLASS_API_VERSION = "resource.k8s.io/v1"
# Families with example classes, spelled as the `family` attribute spells them (GFD's spelling).
FAMILIES = ("ampere", "ada-lovelace", "hopper", "blackwell")
NVIDIA_EXTENDED_RESOURCE = "nvidia.com/gpu"
# extendedResourceName (DRAExtendedResource) is alpha and off by default in 1.34 and 1.35, whose API servers
# silently drop the field; beta and on from 1.36.
EXTENDED_RESOURCE_MIN_MINOR = 36
# Stands for the driver name in the chart's copy; the chart replaces it with .Values.driverName.
CHART_DRIVER_PLACEHOLDER = "driver-name.placeholder.invalid"

_PART_OF = {"app.kubernetes.io/part-of": "gpu-dra-driver"}


def validate_driver_name(name: str) -> str:
    """A DRA driver name is a lower-case DNS subdomain of at most 63 characters (it is also a CEL domain)."""
    if not is_dns_subdomain(name, 63):
        raise ValueError(f"driver name {name!r} must be a lower-case DNS subdomain of at most 63 characters, "
                         "e.g. gpu.example.com")
    return name


def selector(driver: str, device_type: str | None = None, family: str | None = None) -> str:
    """CEL for the Kubernetes device-selector environment; `driver` must already be validated."""
    attrs = f"device.attributes['{driver}']"
    terms = [f"device.driver == '{driver}'"]
    if device_type:
        terms.append(f"{attrs}.type == '{device_type}'")
    if family:
        # has(): a device without the attribute is skipped instead of failing the whole allocation.
        terms.append(f"has({attrs}.family) && {attrs}.family == '{family}'")
    return " && ".join(terms)


def _device_class(name: str, expression: str, extended_resource_name: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": expression}}]}
    if extended_resource_name:
        spec["extendedResourceName"] = extended_resource_name
    return {
        "apiVersion": DEVICE_CLASS_API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": name, "labels": dict(_PART_OF)},
        "spec": spec,
    }


def device_classes(driver_name: str = DEFAULT_DRIVER_NAME, *, compat_nvidia: bool = False) -> list[dict[str, Any]]:
    """DeviceClass objects for `driver_name`; in compat mode the driver is gpu.nvidia.com.

    Raises ValueError for an invalid driver name, or a driver other than gpu.nvidia.com in compat mode.
    """
    if compat_nvidia:
        if driver_name not in (DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME):
            raise ValueError(f"NVIDIA compatibility mode uses driver name {NVIDIA_DRIVER_NAME}, "
                             f"not {driver_name!r}")
        driver = NVIDIA_DRIVER_NAME
        gpu_name, mig_name, extended = NVIDIA_DRIVER_NAME, "mig.nvidia.com", NVIDIA_EXTENDED_RESOURCE
    else:
        driver = validate_driver_name(driver_name)
        gpu_name, mig_name, extended = driver, f"mig.{driver}", None
    classes = [
        _device_class(gpu_name, selector(driver, "gpu"), extended),
        _device_class(mig_name, selector(driver, "mig")),
        _device_class(f"slot.{driver}", selector(driver, "slot")),
        _device_class(f"shared.{driver}", selector(driver, "shared")),
    ]
    classes += [_device_class(f"{family}.{driver}", selector(driver, "gpu", family)) for family in FAMILIES]
    return classes


def classes_for_server(classes: list[dict[str, Any]], minor: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The classes as an API server of Kubernetes 1.<minor> stores them, and a note per field left out.

    A field the server drops would make every comparison with the stored class show a change, and the
    class would be rewritten forever; without it the class is written once. The inputs are not changed."""
    out, notes = [], []
    for cls in classes:
        spec = cls.get("spec") or {}
        if minor < EXTENDED_RESOURCE_MIN_MINOR and "extendedResourceName" in spec:
            notes.append(f"DeviceClass {cls['metadata']['name']} is created without extendedResourceName "
                         f"{spec['extendedResourceName']}: pods asking for that extended resource are served by "
                         f"DRA from Kubernetes 1.{EXTENDED_RESOURCE_MIN_MINOR} on; claims for the class work")
            cls = {**cls, "spec": {k: v for k, v in spec.items() if k != "extendedResourceName"}}
        out.append(cls)
    return out, notes


def render_yaml(objects: list[dict[str, Any]]) -> str:
    """Objects as a multi-document YAML stream, keys in wire order, long CEL strings on one line."""
    return yaml.safe_dump_all(objects, sort_keys=False, explicit_start=True, width=10_000)


_HEADER = "# Generated by `python -m api.deviceclasses` from api/deviceclasses.py; do not edit.\n"


def generated_files() -> dict[str, str]:
    """Repository-relative path -> content of every generated DeviceClass file."""
    chart_files = "deploy/helm/gpu-dra-driver/files"
    return {
        "deploy/deviceclasses/gpu-dra-driver.yaml": _HEADER + render_yaml(device_classes()),
        "deploy/deviceclasses/nvidia-compat.yaml": _HEADER + render_yaml(device_classes(compat_nvidia=True)),
        # The chart cannot run Python: it gets the same classes with a placeholder for the driver name.
        f"{chart_files}/deviceclasses.yaml":
            _HEADER + "# The chart puts its driverName in place of the placeholder driver name below.\n"
            + render_yaml(device_classes(CHART_DRIVER_PLACEHOLDER)),
        f"{chart_files}/deviceclasses-nvidia-compat.yaml": _HEADER + render_yaml(device_classes(compat_nvidia=True)),
    }


def write_generated_files(root: Path) -> list[Path]:
    written = []
    for relative, text in generated_files().items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write_generated_files(Path(__file__).resolve().parent.parent):
        print(f"wrote {written_path}", file=sys.stderr)
