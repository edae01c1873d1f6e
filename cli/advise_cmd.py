"""`gpu-dra advise` (also `kubectl gpu advise`): from what each workload used to what it should claim.

Usage comes from Prometheus over ``--window`` (the kubelet plugins' per-claim series), or with ``--from-node`` from
one scrape of that node's plugin (a snapshot, said so everywhere it shows); workloads, templates and what each GPU
model offers from the API server. The advice is ``ops.advise``; this module reads the flags and prints a table,
JSON or YAML, or with ``--emit templates`` the objects to apply, each checked by the admission webhook's rules
first (``controller.webhook.config_problems``).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from api.names import DEFAULT_DRIVER_NAME
from cli.failures import EXIT_PROMETHEUS, PROMETHEUS_EXIT_STATUS
from cli.kubeflags import add_connection_arguments

if TYPE_CHECKING:       # imported when run, not when --help of every command is built (cli.main)
    from kube.client import KubeApi
    from ops.advise.advice import Settings
    from ops.advise.prometheus import HttpConfig, PrometheusApi
    from ops.advise.report import Source

PROG = "gpu-dra advise"
EXIT_NO_SERIES, EXIT_GAP, EXIT_REFUSED_OBJECT = 1, 3, 4
# In --help (cli.main), with the statuses of cluster failures (cli.failures).
EXIT_STATUS = {0: "advice printed (each group with its reason, also where nothing is recommended)",
               EXIT_NO_SERIES: "no per-claim series in the window (or on the node): nothing to advise on",
               EXIT_GAP: "advice printed, but the window has a gap longer than --max-gap: a peak in it is not seen",
               EXIT_REFUSED_OBJECT: "an advised object the admission webhook's rules refuse (left out)",
               **PROMETHEUS_EXIT_STATUS}
USES_CLUSTER = True
FORMATS = ("table", "wide", "json", "yaml")
HELP_NOTE = ("Groups the per-claim GPU series by workload (Deployment, StatefulSet, Job, CronJob, ... or the bare "
             "pod), claim template and request, and names for each the smallest device of its GPU model that holds "
             "its peak memory plus --headroom and its SM use (p95): a MIG profile, an MPS slot, a memory share, or "
             "the whole GPU; or says why not: too little data, a limit hit (advise up, not down), memory it shared "
             "with time-sliced pods. docs/advise.md says how it decides.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("where usage comes from")
    src.add_argument("--prometheus", metavar="URL", help="the Prometheus server's base URL (user:password@ in it is "
                     "basic auth), e.g. http://prometheus.monitoring:9090")
    src.add_argument("--window", default="7d", metavar="DURATION", help="how far back to look (Prometheus "
                     "duration: 30m, 12h, 7d, 2w)")
    src.add_argument("--prometheus-user", metavar="USER",
                     help="basic auth user (password from --prometheus-password-file)")
    src.add_argument("--prometheus-password-file", metavar="FILE", help="basic auth password file")
    src.add_argument("--prometheus-token-file", metavar="FILE", help="bearer token file")
    src.add_argument("--prometheus-ca-file", metavar="FILE", help="CA of an https Prometheus")
    src.add_argument("--http-config", metavar="FILE", help="promtool's --http.config.file (basic_auth, "
                     "authorization, tls_config); flags given as well win")
    src.add_argument("--from-node", metavar="NODE", help="instead of Prometheus: one scrape of NODE's kubelet plugin "
                     "/metrics (through the API server's proxy to its pod): memory now, a snapshot")
    src.add_argument("--metrics-url", metavar="URL", help="with or instead of --from-node: read that /metrics URL "
                     "directly (a port-forward, a plugin on the host network)")
    rules = parser.add_argument_group("how it decides")
    rules.add_argument("--headroom", default="20%", metavar="PERCENT", help="added to the peak memory and SM use")
    rules.add_argument("--min-samples", type=int, default=100, metavar="N", help="fewer samples: too little data")
    rules.add_argument("--min-span", default="1h", metavar="DURATION", help="samples spanning less: too little data")
    rules.add_argument("--max-gap", default="10m", metavar="DURATION", help="a longer stretch of the window without "
                       "samples of a plugin is reported (exit status 3)")
    rules.add_argument("--kinds", default="mig,slot,share,gpu", metavar="LIST", help="the kinds of device to "
                       "recommend among, of those the cluster publishes for the model: mig, slot (MPS), share, gpu")
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--output", default="table", choices=FORMATS, help="output format (wide adds samples, "
                     "span, SM use, nodes and the other devices that fit)")
    out.add_argument("--emit", choices=["templates"], help="print, instead, per workload the ResourceClaimTemplate "
                     "(or claim) asking for the advised device, ready for kubectl apply, with the patch that "
                     "points the workload at it")
    parser.add_argument("-n", "--namespace", help="only this namespace (default: every namespace)")
    add_connection_arguments(parser)
    parser.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, metavar="NAME",
                        help=f"DRA driver name (default {DEFAULT_DRIVER_NAME})")


def run(args: argparse.Namespace) -> int:
    from cli.advise_output import render, write_objects
    from cli.failures import EXIT_USAGE, report
    from kube.client import KubeApi
    from kube.connect import ConnectError, api_client_from
    from ops.advise.prometheus import PrometheusApi, PrometheusError
    from ops.advise.reads import RIGHTS, AdviseReadError, read_slices
    from ops.advise.report import build, emit_all

    try:
        settings, window, max_gap = _settings(args)
        # Flags first: a URL that is no URL, a credentials file that is not there.
        prom = None if settings.snapshot else PrometheusApi(args.prometheus, http_config(args))
    except (ValueError, PrometheusError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        api = api_client_from(args.kubeconfig, args.context)
    except ConnectError as err:
        return report(PROG, err)
    kube = KubeApi(api, timeout=60.0)
    try:
        # The API server next: a cluster that cannot be read fails before Prometheus is asked anything.
        slices = read_slices(kube, args.driver_name)
        got = _snapshot(kube, args) if prom is None else _window(prom, args, window, max_gap)
        if isinstance(got, int):
            return got
        result = build(kube, slices, got, settings, args.driver_name)
        if args.emit:
            complete = write_objects(result, emit_all(kube, result.advices, args.driver_name), args.driver_name,
                                     PROG)
            return EXIT_REFUSED_OBJECT if not complete else EXIT_GAP if result.gaps else 0
    except PrometheusError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_PROMETHEUS
    except AdviseReadError as err:
        # Without an API error behind it: no plugin pod on --from-node's node, so nothing to advise on.
        return report(PROG, err, api, default=EXIT_NO_SERIES, needs=f"{PROG} needs {RIGHTS}")
    finally:
        api.close()
        if prom is not None:
            prom.close()
    sys.stdout.write(render(result, args.output))
    return EXIT_GAP if result.gaps else 0


def _settings(args: argparse.Namespace) -> tuple[Settings, float, float]:
    from api.k8snames import is_dns_subdomain
    from ops.advise.advice import Settings
    from ops.advise.history import parse_duration
    from ops.advise.sizing import KINDS

    headroom = args.headroom.strip().removesuffix("%")
    try:
        pct = float(headroom)
    except ValueError:
        raise ValueError(f"--headroom {args.headroom!r}: a percentage, e.g. 20%") from None
    if not 0 <= pct <= 1000:
        raise ValueError(f"--headroom {args.headroom!r}: between 0% and 1000%")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"--kinds {args.kinds!r}: a comma-separated list of {', '.join(KINDS)}")
    if args.min_samples < 1:
        raise ValueError(f"--min-samples {args.min_samples}: at least 1")
    if not args.prometheus and not args.from_node and not args.metrics_url:
        raise ValueError("give --prometheus URL (usage over --window) or --from-node NODE (a snapshot now)")
    if args.prometheus and (args.from_node or args.metrics_url):
        raise ValueError("--prometheus and --from-node/--metrics-url: one source at a time")
    for what, value in (("--from-node", args.from_node), ("-n", args.namespace), ("--driver-name", args.driver_name)):
        if value is not None and not is_dns_subdomain(value):
            raise ValueError(f"{what} {value[:260]!r}: not a Kubernetes name (lower-case DNS subdomain)")
    settings = Settings(headroom=pct / 100, min_samples=args.min_samples,
                        min_span=parse_duration(args.min_span, "--min-span"), kinds=kinds,
                        snapshot=bool(args.from_node or args.metrics_url))
    return settings, parse_duration(args.window, "--window"), parse_duration(args.max_gap, "--max-gap")


def http_config(args: argparse.Namespace) -> HttpConfig:
    """--http-config, with the credential flags given beside it in its place."""
    from dataclasses import replace

    from ops.advise.prometheus import HttpConfig, load_http_config, read_secret

    config = load_http_config(args.http_config) if args.http_config else HttpConfig()
    if args.prometheus_user:
        password = (read_secret(args.prometheus_password_file, "--prometheus-password-file")
                    if args.prometheus_password_file else "")
        config = replace(config, username=args.prometheus_user, password=password)
    if args.prometheus_token_file:
        config = replace(config, bearer_token=read_secret(args.prometheus_token_file, "--prometheus-token-file"))
    if args.prometheus_ca_file:
        config = replace(config, ca_file=args.prometheus_ca_file)
    return config


def _window(prom: PrometheusApi, args: argparse.Namespace, window: float, max_gap: float) -> Source | int:
    from cli.advise_output import gap_line
    from ops.advise.history import read_window
    from ops.advise.report import Source
    from ops.advise.usage import MEMORY

    got = read_window(prom, time.time(), window, namespace=args.namespace, max_gap=max_gap)
    if not got.series:
        where = f" of namespace {args.namespace}" if args.namespace else ""
        print(f"{PROG}: Prometheus at {prom.base} has no {MEMORY} series{where} in the last {args.window}: does it "
              f"scrape the kubelet plugins (docs/operations.md, \"Scraping the plugins\"), and did a pod hold a "
              f"device of {args.driver_name}?", file=sys.stderr)
        return EXIT_NO_SERIES
    if got.gaps:
        print(f"{PROG}: {gap_line(got.gaps)}", file=sys.stderr)
    return Source("prometheus", prom.base, got)


def _snapshot(kube: KubeApi, args: argparse.Namespace) -> Source | int:
    from ops.advise.history import Window
    from ops.advise.prometheus import PrometheusError, read_page
    from ops.advise.reads import plugin_metrics
    from ops.advise.report import Source
    from ops.advise.usage import series_from_exposition, unattributed_from_exposition

    now = time.time()
    if args.metrics_url:
        text = read_page(args.metrics_url)
        where = f"node {args.from_node} ({args.metrics_url})" if args.from_node else args.metrics_url
    else:
        text, pod = plugin_metrics(kube, args.from_node)
        where = f"node {args.from_node} (pod {pod})"
    try:
        series = series_from_exposition(text, now)
        unattributed = unattributed_from_exposition(text)
    except ValueError as err:
        raise PrometheusError(f"{where}: not a Prometheus text exposition ({err})") from err
    series = [s for s in series if (not args.from_node or s.node in (args.from_node, ""))
              and (not args.namespace or s.namespace == args.namespace)]
    if not series:
        where_ns = f" in namespace {args.namespace}" if args.namespace else ""
        print(f"{PROG}: the kubelet plugin at {where} exports no per-claim series now: no pod there{where_ns} holds "
              f"a prepared device of {args.driver_name}", file=sys.stderr)
        return EXIT_NO_SERIES
    return Source("snapshot", where, Window(now, 0.0, series, unattributed))
