"""``python -m bench``: run the benchmarks, print a table of figures against their targets, exit 1 when a
target is missed (or a benchmark fails), 0 otherwise."""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from bench import BENCHMARKS, ON_REQUEST, load
from bench.core import (
    TARGETS_FILE,
    CheckResult,
    Figure,
    TargetsError,
    check,
    load_targets,
    render_details,
    render_table,
)
from bench.params import FULL, QUICK, Params


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute on 2 cores)")
    p.add_argument("--only", action="append", metavar="NAME", default=[],
                   help=f"run only this benchmark (repeatable, or comma-separated): {', '.join(BENCHMARKS)}")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--targets", default=str(TARGETS_FILE), metavar="FILE", help="targets file (default: %(default)s)")
    p.add_argument("--fleet", metavar="FILE", help="benchmark this fleet file instead of the generated 100-node fleet")
    p.add_argument("--json", metavar="FILE", help="also write the figures and verdicts to FILE as JSON")
    p.add_argument("--publish-nodes", type=int, metavar="N",
                   help="publish: nodes of the fleet published on the API server (default 100; 1000 takes ~15 min)")
    p.add_argument("--loops-nodes", type=int, metavar="N",
                   help="controlloops: nodes × the demo's node-a (default 200; 1000 for the large row)")
    p.add_argument("--sched-nodes", type=int, metavar="N",
                   help="scheduler: nodes × 8 H100 per device-model shape (default 200; 1000 for the large row)")
    p.add_argument("--sched-pods", type=int, metavar="N", help="scheduler: pods bound per shape (default 1000)")
    p.add_argument("--sched-profile", metavar="DIR",
                   help="scheduler: also write the scheduler's CPU and heap profiles and /metrics to DIR")
    p.add_argument("--sched-shapes", metavar="A,B",
                   help="scheduler: only these device-model shapes (comma-separated; the baseline `whole` always "
                        "runs); the targets of the others are not judged")
    p.add_argument("--peer-bin", metavar="PATH",
                   help="run `peer`: our kubelet plugin beside the Go reference driver's (this binary, built by "
                        "hack/build-peer-driver.sh) on one real kubelet; alone unless --only names others")
    return p


def selected(only: Sequence[str], peer_bin: str | None = None) -> list[str]:
    """The benchmarks to run, in their order. With ``peer_bin`` the side-by-side benchmark runs, alone unless
    ``only`` names others; without it, naming it is an error (it has nothing to compare with)."""
    names = [n.strip() for item in only for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS and n not in ON_REQUEST]
    if unknown:
        raise SystemExit(f"python -m bench: unknown benchmark(s) {', '.join(unknown)}; "
                         f"choose from {', '.join([*BENCHMARKS, *ON_REQUEST])}")
    if "peer" in names and not peer_bin:
        raise SystemExit("python -m bench: peer needs --peer-bin PATH (the Go reference kubelet plugin; "
                         "hack/build-peer-driver.sh builds it and prints its path)")
    if peer_bin:
        return [n for n in BENCHMARKS if n in names] + ["peer"]
    return [n for n in BENCHMARKS if not names or n in names]


def run_benchmarks(names: Sequence[str], params: Params, log=sys.stderr) -> tuple[list[Figure], dict[str, str]]:
    """Figures of every named benchmark, and the error of each one that failed."""
    figures: list[Figure] = []
    errors: dict[str, str] = {}
    for name in names:
        start = time.perf_counter()
        try:
            module = load(name)
            print(f"running {name}: {module.DESCRIPTION} ...", file=log, flush=True)
            figures.extend(module.run(params))
        except Exception as exc:  # noqa: BLE001 - one failing benchmark must not hide the others' figures
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=log)
        print(f"  {name} took {time.perf_counter() - start:.1f} s", file=log, flush=True)
    return figures, errors


def _json(result: CheckResult, errors: dict[str, str], quick: bool) -> str:
    rows = [{"key": v.figure.key, "label": v.figure.label, "value": v.figure.value, "unit": v.figure.unit,
             "detail": v.figure.detail,
             "target": None if v.target is None else {v.target.direction: v.target.limit, "unit": v.target.unit},
             "ratio": v.ratio, "ok": v.ok} for v in result.verdicts]
    return json.dumps({"quick": quick, "figures": rows, "problems": list(result.problems), "errors": errors},
                      indent=2, default=str)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name in [*BENCHMARKS, *ON_REQUEST]:
            print(f"{name:10s} {load(name).DESCRIPTION}")
        return 0
    names = selected(args.only, args.peer_bin)
    if args.peer_bin is not None:
        from bench.peer import PeerBinaryError, check_peer_bin
        try:
            check_peer_bin(args.peer_bin)
        except PeerBinaryError as exc:
            print(f"python -m bench: {exc}", file=sys.stderr)
            return 2
    try:
        targets = load_targets(args.targets)
    except TargetsError as exc:
        print(f"python -m bench: {exc}", file=sys.stderr)
        return 2
    params = (QUICK if args.quick else FULL).with_fleet(args.fleet).with_publish_nodes(args.publish_nodes) \
        .with_loops_nodes(args.loops_nodes)
    shapes = tuple(n.strip() for n in args.sched_shapes.split(",") if n.strip()) if args.sched_shapes else None
    params = params.with_scheduler(args.sched_nodes, args.sched_pods, args.sched_profile, shapes)
    if shapes is not None:
        from bench.scheduler import SHAPES, select_shapes, unjudged
        try:
            select_shapes(SHAPES, shapes)
        except ValueError as exc:
            print(f"python -m bench: --sched-shapes: {exc}", file=sys.stderr)
            return 2
        skipped = unjudged(targets, shapes)
        targets = {k: t for k, t in targets.items() if k not in skipped}
    params = params.with_peer_bin(args.peer_bin)
    started = time.perf_counter()
    figures, errors = run_benchmarks(names, params)
    ran = [n for n in names if n not in errors]
    result = check(figures, targets, ran)

    mode = "quick run (--quick): fewer repetitions" if args.quick else "full run"
    print(f"\ngpu-dra-driver benchmarks, {mode}, {time.perf_counter() - started:.0f} s. "
          "'of target' is the share of the budget used: at most 1.00× passes.\n")
    print(render_table(result))
    details = render_details(figures)
    if details:
        print("\nhow each figure was measured:")
        print(details)
    if args.json:
        Path(args.json).write_text(_json(result, errors, args.quick))

    failures = [f"benchmark {n} failed: {e}" for n, e in errors.items()]
    failures += list(result.problems)
    failures += [f"{v.figure.key}: {v.figure.value:g} {v.figure.unit}, target {v.target.describe()}"
                 for v in result.missed if v.target is not None]
    judged = sum(1 for v in result.verdicts if v.target is not None)
    if failures:
        print(f"\nFAILED ({len(failures)}):")
        for line in failures:
            print(f"  {line}")
        return 1
    print(f"\nall {judged} targets met.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
