#!/usr/bin/env bash
# Builds Prometheus and promtool from Prometheus' Go module (github.com/prometheus/prometheus; PROMETHEUS_VERSION
# in hack/versions.env names the release, v3.x.y) into a cache outside the repository, keyed by version, and
# reuses it: ~/.cache/gpu-dra/prometheus/<version>/bin/{prometheus,promtool}. The metrics tests scrape the kubelet
# plugin with it and run every dashboard query through its HTTP API; promtool checks rules and scrape configs.
# Usage: hack/build-prometheus.sh   (prints the bin directory on its last line)
#   PROMETHEUS_VERSION=v3.16.0 hack/build-prometheus.sh   overrides the pin; GPU_DRA_CACHE moves the cache.
set -euo pipefail

SCRIPT=build-prometheus
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-$(pinned PROMETHEUS_VERSION)}"
OUT="$CACHE_ROOT/prometheus/$PROMETHEUS_VERSION"
BIN="$OUT/bin"

# Prometheus 3.x.y is tagged v0.3xx.y in its Go module (the module never reached v2+ import paths): 3.16.0 is
# v0.316.0. Only 3.x releases are accepted (the flags and the HTTP API the tests use are 3.x's).
[[ "$PROMETHEUS_VERSION" =~ ^v3\.([0-9]+)\.([0-9]+)$ ]] \
  || die "PROMETHEUS_VERSION '$PROMETHEUS_VERSION' is not a Prometheus 3 release like v3.16.0 (set it, or pin it in $VERSIONS_FILE)"
MODULE_VERSION="v0.3$(printf '%02d' "${BASH_REMATCH[1]}").${BASH_REMATCH[2]}"

if [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ] \
   && [ "$(cat "$OUT/.complete" 2>/dev/null)" = "$PROMETHEUS_VERSION" ]; then
  log "reusing $BIN"
  echo "$BIN"; exit 0
fi

command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26.7 on PATH); install it from your distribution or go.dev"
GOVER=$(go env GOVERSION | sed 's/^go//')
case "$GOVER" in 1.26.[7-9]*|1.26.[1-9][0-9]*|1.2[7-9]*|1.[3-9]*) ;;
  *) die "Go $GOVER is too old: Prometheus $PROMETHEUS_VERSION needs Go >= 1.26.7";; esac
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"
export GOFLAGS="-buildvcs=false"

mkdir -p "$OUT"
rm -rf "$OUT/bin.tmp"; mkdir -p "$OUT/bin.tmp"
cd "$OUT"
mod="github.com/prometheus/prometheus"
log "downloading $mod@$MODULE_VERSION (Prometheus $PROMETHEUS_VERSION) from the Go module proxy"
err=$(go mod download "$mod@$MODULE_VERSION" 2>&1) \
  || die "cannot download $mod@$MODULE_VERSION: ${err##*$'\n'} (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
start=$SECONDS
log "building prometheus and promtool $PROMETHEUS_VERSION (output: $BUILD_LOG)"
# Tags: without builtinassets the web UI is not embedded (the tests use the HTTP API only; the UI answers that
# its assets are missing). remove_all_sd drops every cloud service discovery and enable_kubernetes_sd keeps the
# one a cluster uses (docs/operations.md's scrape config), which cuts the cold build by about half.
# The version ldflags of Prometheus' .promu.yml, so `prometheus --version` reports the release; no cgo.
vpkg=github.com/prometheus/common/version
GOBIN="$OUT/bin.tmp" CGO_ENABLED=0 quiet go install -trimpath -tags "remove_all_sd,enable_kubernetes_sd" \
  -ldflags "-s -w -X $vpkg.Version=${PROMETHEUS_VERSION#v} -X $vpkg.Branch=HEAD -X $vpkg.BuildUser=gpu-dra" \
  "$mod/cmd/prometheus@$MODULE_VERSION" "$mod/cmd/promtool@$MODULE_VERSION" \
  || die "go install of prometheus/promtool $PROMETHEUS_VERSION ($mod@$MODULE_VERSION) failed"
"$OUT/bin.tmp/prometheus" --version 2>&1 | grep -q "version ${PROMETHEUS_VERSION#v}" \
  || die "the prometheus built does not run or reports another version ($OUT/bin.tmp/prometheus --version)"
"$OUT/bin.tmp/promtool" --version >/dev/null 2>&1 || die "the promtool built does not run ($OUT/bin.tmp/promtool --version)"
rm -rf "$OUT/bin"; mv "$OUT/bin.tmp" "$OUT/bin"
echo "$PROMETHEUS_VERSION" > "$OUT/.complete"
echo "prometheus+promtool $((SECONDS-start))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$OUT/build-times.txt"
log "built prometheus and promtool $PROMETHEUS_VERSION in $((SECONDS-start))s: $BIN"
echo "$BIN"
