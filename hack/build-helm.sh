#!/usr/bin/env bash
# Builds Helm from its Go module (helm.sh/helm/v4, version pinned as HELM_VERSION in hack/versions.env) into a
# cache outside the repository, keyed by version, and reuses it: ~/.cache/gpu-dra/helm/<version>/bin/helm.
# Usage: hack/build-helm.sh   (prints the path of the helm binary on its last line)
#   HELM_VERSION=v4.3.2 hack/build-helm.sh   overrides the pin; GPU_DRA_CACHE moves the cache.
set -euo pipefail

SCRIPT=build-helm
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
HELM_VERSION="${HELM_VERSION:-$(pinned HELM_VERSION)}"
OUT="$CACHE_ROOT/helm/$HELM_VERSION"
BIN="$OUT/bin/helm"

# The module path carries the major version (helm.sh/helm/v4): only v4 releases build from this path.
[[ "$HELM_VERSION" =~ ^v4\.[0-9]+\.[0-9]+$ ]] \
  || die "HELM_VERSION '$HELM_VERSION' is not a Helm 4 release like v4.3.2 (set it, or pin it in $VERSIONS_FILE)"

if [ -x "$BIN" ] && [ "$(cat "$OUT/.complete" 2>/dev/null)" = "$HELM_VERSION" ]; then
  log "reusing $BIN"
  echo "$BIN"; exit 0
fi
[ -z "${GPU_DRA_HELM_NO_BUILD:-}" ] || die "no Helm $HELM_VERSION in $OUT; run hack/build-helm.sh (or make helm)"

command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26 on PATH); install it from your distribution or go.dev"
GOVER=$(go env GOVERSION | sed 's/^go//')
case "$GOVER" in 1.2[6-9]*|1.[3-9]*) ;; *) die "Go $GOVER is too old: Helm $HELM_VERSION needs Go >= 1.26";; esac
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"
export GOFLAGS="-buildvcs=false"

mkdir -p "$OUT/bin.tmp"
cd "$OUT"
log "downloading helm.sh/helm/v4@$HELM_VERSION from the Go module proxy"
err=$(go mod download "helm.sh/helm/v4@$HELM_VERSION" 2>&1) \
  || die "cannot download helm.sh/helm/v4@$HELM_VERSION: ${err##*$'\n'} (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
start=$SECONDS
log "building helm $HELM_VERSION (output: $BUILD_LOG)"
# The same ldflags as Helm's Makefile, so `helm version` reports the release; no cgo, like the release binaries.
pkg=helm.sh/helm/v4/internal/version
GOBIN="$OUT/bin.tmp" CGO_ENABLED=0 quiet go install -trimpath \
  -ldflags "-s -w -X $pkg.version=$HELM_VERSION -X $pkg.gitTreeState=clean" \
  "helm.sh/helm/v4/cmd/helm@$HELM_VERSION" || die "go install of helm $HELM_VERSION failed"
"$OUT/bin.tmp/helm" version --short >/dev/null 2>&1 || die "the helm built does not run ($OUT/bin.tmp/helm version)"
rm -rf "$OUT/bin"; mv "$OUT/bin.tmp" "$OUT/bin"
echo "$HELM_VERSION" > "$OUT/.complete"
echo "helm $((SECONDS-start))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$OUT/build-times.txt"
log "built helm $HELM_VERSION in $((SECONDS-start))s: $BIN"
echo "$BIN"
