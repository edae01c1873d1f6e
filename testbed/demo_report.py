"""What the demo prints: the allocation table (with each pod's phase), what each pod's container saw, a readable
cut of `kubectl describe resourceslice`, and the write counts of the slice controller. Pure functions over
wire-format dicts and text, so they are unit-tested without a cluster."""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from testbed.demo_examples import PodClaim

NONE = "-"


@dataclass(frozen=True)
class AllocationRow:
    """One allocated device of one pod's claim, with what the slice says about the device."""

    example: str
    pod: str
    phase: str
    claim: str
    request: str
    node: str
    device: str
    device_type: str
    detail: str          # MIG profile, or sharing strategy for slots and shares
    memory: str          # the device's memory; for shares the consumed amount and the total
    product: str


def device_index(slices: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(driver, pool, device name) -> the device as published."""
    index: dict[tuple[str, str, str], dict[str, Any]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        pool = (spec.get("pool") or {}).get("name", "")
        for d in spec.get("devices") or []:
            index[(spec.get("driver", ""), pool, d.get("name", ""))] = d
    return index


def _attr(device: Mapping[str, Any], name: str) -> str:
    value = (device.get("attributes") or {}).get(name) or {}
    for kind in ("string", "version", "int", "bool"):
        if kind in value:
            return str(value[kind])
    return ""


def _capacity(device: Mapping[str, Any], name: str) -> str:
    return str(((device.get("capacity") or {}).get(name) or {}).get("value", ""))


def allocation_rows(claims: Sequence[PodClaim], slices: Iterable[Mapping[str, Any]],
                    phases: Mapping[str, str] | None = None) -> list[AllocationRow]:
    """One row per allocation result of every allocated pod claim (unallocated ones are left out); `phases`
    gives each pod's phase by pod name."""
    index = device_index(slices)
    rows = []
    for c in claims:
        for r in c.results:
            device = index.get((r.get("driver", ""), r.get("pool", ""), r.get("device", "")), {})
            kind = _attr(device, "type") or "?"
            detail = _attr(device, "profile") if kind == "mig" else _attr(device, "sharing")
            memory = _capacity(device, "memory")
            consumed = (r.get("consumedCapacity") or {}).get("memory")
            if consumed:
                memory = f"{consumed} of {memory}" if memory else str(consumed)
            rows.append(AllocationRow(
                example=c.example, pod=c.pod, phase=(phases or {}).get(c.pod, NONE), claim=c.claim or NONE,
                request=r.get("request", NONE),
                node=c.node or NONE, device=r.get("device", NONE), device_type=kind,
                detail=detail if detail and detail != "none" else NONE, memory=memory or NONE,
                product=_attr(device, "productName") or NONE))
    return rows


TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("EXAMPLE", "example"), ("POD", "pod"), ("PHASE", "phase"), ("CLAIM", "claim"), ("REQUEST", "request"),
    ("NODE", "node"), ("DEVICE", "device"), ("TYPE", "device_type"), ("PROFILE/SHARING", "detail"),
    ("MEMORY", "memory"), ("PRODUCT", "product"),
)


def format_table(rows: Sequence[AllocationRow], columns: Sequence[tuple[str, str]] = TABLE_COLUMNS) -> str:
    """A plain left-aligned table, kubectl style (two spaces between columns)."""
    cells = [[h for h, _ in columns]] + [[str(getattr(r, f)) for _, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)


def container_lines(pods: Mapping[str, Any], real_nodes: Collection[str]) -> list[str]:
    """One line per pod (per container where a pod has several): what its container printed about itself
    (`testbed.podprobe.ContainerView.summary`), or why there is nothing to show. `pods` maps pod names to
    `testbed.demo_node.PodRun`s; `real_nodes` are the nodes with a kubelet."""
    lines = []
    for name, run in pods.items():
        if run.views:
            for container, view in run.views.items():
                what = view.summary() if view.complete else "(its output is not complete yet)"
                lines.append(f"{name}/{container} on {run.node}: {what}")
        elif run.node is None:
            lines.append(f"{name}: not bound to a node")
        elif run.node not in real_nodes:
            lines.append(f"{name}: on {run.node}, which has no kubelet: not started")
        else:
            lines.append(f"{name}: {run.phase} on {run.node}, its container has printed nothing yet")
    return lines


@dataclass(frozen=True)
class SharedClaim:
    """A ResourceClaim that several pods use, and the GPUs (CUDA UUIDs) each pod's containers saw."""

    claim: str
    node: str
    seen: dict[str, tuple[str, ...]]       # pod -> sorted CUDA device UUIDs its containers saw

    @property
    def same_gpu(self) -> bool:
        """Every pod saw the same GPU(s), and at least one."""
        views = set(self.seen.values())
        return len(views) == 1 and bool(next(iter(views)))

    def line(self) -> str:
        pods = " and ".join(sorted(self.seen))
        if self.same_gpu:
            return f"claim {self.claim} is shared by pods {pods} on {self.node}: they see the same GPU " \
                   f"{', '.join(next(iter(self.seen.values())))}"
        each = "; ".join(f"{pod} sees {', '.join(uuids) or 'no CUDA device'}" for pod, uuids in sorted(self.seen.items()))
        return f"claim {self.claim} is shared by pods {pods} on {self.node}, but they do NOT see the same GPU: {each}"


def shared_claims(claims: Sequence[PodClaim], pods: Mapping[str, Any]) -> list[SharedClaim]:
    """Claims used by more than one pod whose containers all printed what they saw (`pods` as in
    `container_lines`), by claim name."""
    users: dict[str, list[PodClaim]] = {}
    for c in claims:
        if c.claim and c.node:
            users.setdefault(c.claim, []).append(c)
    out = []
    for claim, cs in sorted(users.items()):
        names = sorted({c.pod for c in cs})
        runs = {n: pods[n] for n in names if n in pods and pods[n].views}
        if len(names) < 2 or len(runs) < len(names):
            continue
        seen = {n: tuple(sorted({d.uuid for v in r.views.values() for d in v.cuda})) for n, r in runs.items()}
        out.append(SharedClaim(claim, cs[0].node or NONE, seen))
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def trim_describe(text: str, keep_devices: int = 2) -> str:
    """`kubectl describe resourceslice` output with only the first `keep_devices` devices of `Spec.Devices`.

    kubectl prints list items of maps without markers: every device starts again with the same first key
    (e.g. `Attributes:`) at the list's indentation. Everything outside the device list is kept as is, and
    the cut is marked with how many devices were left out and their names."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "Devices:" and _indent(ln) == 2), None)
    if start is None or start + 1 >= len(lines):
        return text
    item_indent = _indent(lines[start + 1])
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].strip() and _indent(lines[i]) < item_indent), len(lines))
    first_key = lines[start + 1].strip()
    starts = [i for i in range(start + 1, end)
              if _indent(lines[i]) == item_indent and lines[i].strip() == first_key]
    if len(starts) <= keep_devices:
        return text
    cut = starts[keep_devices]
    dropped = [ln.split(":", 1)[1].strip() for ln in lines[cut:end]
               if _indent(ln) == item_indent and ln.strip().startswith("Name:")]
    names = ", ".join(dropped[:4]) + (", ..." if len(dropped) > 4 else "")
    marker = " " * item_indent + f"... {len(starts) - keep_devices} more devices ({names}) left out here ..."
    return "\n".join(lines[:cut] + [marker] + lines[end:])


def format_writes(label: str, by_operation: Mapping[str, int]) -> str:
    total = sum(by_operation.values())
    detail = ", ".join(f"{op} {n}" for op, n in sorted(by_operation.items()) if n)
    return f"{label}: {total} API write(s)" + (f" ({detail})" if detail else "")


def closing_line(pods: Mapping[str, Any], real_nodes: Collection[str]) -> str:
    """The demo's last word on the pods: every one Running, and where; or how many are not, and why."""
    on: dict[str, int] = {}
    for run in pods.values():
        if run.phase == "Running":
            on[run.node] = on.get(run.node, 0) + 1
    where = ", ".join(f"{n} on {node}" for node, n in sorted(on.items()))
    stuck = {name: run for name, run in pods.items() if run.phase != "Running"}
    if not stuck:
        return f"every example pod is Running ({where})" if pods else "no example pod"
    idle = sorted({run.node for run in stuck.values() if run.node and run.node not in real_nodes})
    why = f"; {', '.join(idle)} ha{'s' if len(idle) == 1 else 've'} no kubelet" if idle else ""
    return f"{len(stuck)} of {len(pods)} example pod(s) not Running: {', '.join(sorted(stuck))}{why}"
