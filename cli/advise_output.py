"""What `gpu-dra advise` prints: the table (one row per workload, template and request, then one line each saying
why), the JSON or YAML document, the gap line, and with ``--emit templates`` the objects to apply, each checked by
the admission webhook's rules first and preceded by comments saying why and how to point the workload at it."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import yaml

from api.names import NVIDIA_DRIVER_NAME
from cli.kubeflags import dump
from dra.model.catalog import model_for_product_name
from ops.advise.advice import KEEP, RESIZE, Advice, duration
from ops.advise.report import Report
from ops.advise.sizing import Candidate
from ops.advise.templates import Emitted
from ops.advise.usage import Gap


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def gap_line(gaps: Sequence[Gap]) -> str:
    """The longest gap, in one line (how many more there are)."""
    g = gaps[0]
    whose = f"the plugin at {g.instance}" if g.instance else "any plugin"
    more = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
    return (f"the window has a gap: no samples from {whose} between {iso(g.start)} and {iso(g.end)} "
            f"({duration(g.seconds)}){more}: a peak there is not seen")


def heading(report: Report) -> str:
    if report.source == "snapshot":
        return (f"advice from a snapshot of {report.where} at {iso(report.end)}: memory now, not peaks over time; "
                "check with --prometheus before acting on it")
    return f"advice from Prometheus {report.where} over {duration(report.window)} to {iso(report.end)}"


def short_model(product: str) -> str:
    """The catalog's name of a product (H100-80GB), else the product name."""
    model = model_for_product_name(product)
    return model.name if model else product


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}Gi"


def advice_cell(a: Advice) -> str:
    if a.verdict == RESIZE and a.recommendation is not None:
        return a.recommendation.describe()
    return "keep" if a.verdict == KEEP else f"none ({a.verdict})"


def _source(a: Advice) -> str:
    return f"{a.group.source.name if a.group.source else '?'}/{a.group.request}"


def render(report: Report, output: str) -> str:
    if output in ("json", "yaml"):
        return dump(document(report), output)
    wide = output == "wide"
    head = ["NAMESPACE", "WORKLOAD", "TEMPLATE/REQUEST", "GPU", "RAN ON", "PEAK", "P95"]
    head += ["SAMPLES", "SPAN", "SM P95", "NODES"] if wide else []
    head += ["ADVICE", "FREES"]
    rows = []
    for a in report.advices:
        g, f = a.group, a.figures
        row = [g.workload.namespace, g.workload.ref, _source(a), short_model(g.model), a.ran_on.label.split(" (")[0],
               _gib(f.peak), _gib(f.p95)]
        if wide:
            row += [str(f.samples), "now" if report.source == "snapshot" else duration(f.span),
                    "-" if f.sm_p95 is None else f"{f.sm_p95:.0f}%", ",".join(sorted({s.node for s in g.series}))]
        row += [advice_cell(a), "-" if a.frees is None else f"{float(a.frees):.2f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [heading(report), ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    lines.append("")
    for a in report.advices:
        lines.append(f"{a.group.workload.namespace} {a.group.workload.ref} {_source(a)}: {a.why}")
        if wide and a.alternatives:
            lines.append("  also fits: " + ", ".join(c.describe() for c in a.alternatives))
    return "\n".join(lines) + "\n"


def document(report: Report) -> dict[str, Any]:
    source: dict[str, Any] = {"kind": report.source, "where": report.where, "end": iso(report.end)}
    if report.source != "snapshot":
        source["window"] = duration(report.window)
    return {"source": source,
            "gaps": [{"start": iso(g.start), "end": iso(g.end), "instance": g.instance} for g in report.gaps],
            "advice": [_advice_doc(a) for a in report.advices]}


def _candidate_doc(c: Candidate) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": c.kind, "device": c.describe(), "memory_bytes": c.memory_bytes,
                           "gpu_fraction": round(float(c.fraction), 4)}
    if c.sms is not None:
        doc["multiprocessors"] = c.sms
    if c.profile:
        doc["profile"] = c.profile
    if c.kind == "slot":
        doc.update(slots=c.slots, slot_count=c.slot_count, thread_percentage=c.thread_percentage)
    if c.kind == "share":
        doc["share_strategy"] = c.share_strategy
    return doc


def _advice_doc(a: Advice) -> dict[str, Any]:
    g, f = a.group, a.figures
    src = g.source
    doc: dict[str, Any] = {
        "namespace": g.workload.namespace, "workload": {"kind": g.workload.kind, "name": g.workload.name},
        "source": {"kind": src.kind, "name": src.name, "entry": src.entry} if src else None,
        "request": g.request, "gpu_model": g.model, "catalog_model": short_model(g.model),
        "pods": sorted({s.pod for s in g.series}), "nodes": sorted({s.node for s in g.series}),
        "ran_on": {"kind": a.ran_on.kind, "device": a.ran_on.label, "memory_bytes": a.ran_on.memory_bytes,
                   "gpu_fraction": None if a.ran_on.fraction is None else round(float(a.ran_on.fraction), 4)},
        "peak_bytes": int(f.peak), "p95_bytes": int(f.p95), "samples": f.samples, "span_seconds": int(f.span),
        "sm_peak_percent": f.sm_peak, "sm_p95_percent": f.sm_p95, "verdict": a.verdict, "why": a.why,
        "recommendation": _candidate_doc(a.recommendation) if a.recommendation is not None else None,
    }
    if a.need is not None:
        doc["need"] = {"memory_bytes": a.need.memory_bytes, "multiprocessors": round(a.need.sms, 1)}
    if a.frees is not None:
        doc["frees_gpu_fraction"] = round(float(a.frees), 4)
    if a.alternatives:
        doc["alternatives"] = [c.describe() for c in a.alternatives]
    return doc


def write_objects(report: Report, emitted: Sequence[Emitted], driver: str, prog: str) -> bool:
    """The objects as one YAML stream on standard output, each after its comments; an object the webhook's rules
    refuse is left out with a line on standard error. False when one was left out."""
    from controller.webhook import config_problems

    print(f"# {heading(report)}")
    if not emitted:
        print("# nothing to change: no workload is advised another device")
    complete = True
    for e in emitted:
        meta = e.obj["metadata"]
        problems = config_problems(e.obj, e.resource, driver_name=driver, compat_nvidia=driver == NVIDIA_DRIVER_NAME)
        if problems:
            print(f"{prog}: the advised {e.obj['kind']} {meta['namespace']}/{meta['name']} would be refused: "
                  f"{problems[0]}", file=sys.stderr)
            complete = False
            continue
        comments = "".join(f"# {line}\n" for line in [*e.why, e.switch])
        sys.stdout.write("---\n" + comments + yaml.safe_dump(e.obj, sort_keys=False, width=10_000))
    return complete
