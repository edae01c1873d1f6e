#!/usr/bin/env bash
# Builds the Kueue manager from its Go module (sigs.k8s.io/kueue, version pinned as KUEUE_VERSION in
# hack/versions.env) into a cache outside the repository, keyed by version, and reuses it:
# ~/.cache/gpu-dra/kueue/<version>/bin/kueue, with the module's CRDs (config/components/crd/bases) next to it in
# ~/.cache/gpu-dra/kueue/<version>/crd/. The quota tests run the manager as a process against the local control
# plane (testbed/kueue.py).
# Usage: hack/build-kueue.sh   (prints the version directory on its last line)
#   KUEUE_VERSION=v0.17.0 hack/build-kueue.sh   overrides the pin; GPU_DRA_CACHE moves the cache.
set -euo pipefail

SCRIPT=build-kueue
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
KUEUE_VERSION="${KUEUE_VERSION:-$(pinned KUEUE_VERSION)}"
OUT="$CACHE_ROOT/kueue/$KUEUE_VERSION"
BIN="$OUT/bin/kueue"

# The module path has no major-version suffix, so only v0.x releases build from it; the tests' configuration
# (DRA device class mappings, the v1beta2 API) is that of v0.17 and later.
[[ "$KUEUE_VERSION" =~ ^v0\.(1[7-9]|[2-9][0-9])\.[0-9]+$ ]] \
  || die "KUEUE_VERSION '$KUEUE_VERSION' is not a Kueue release >= v0.17.0 like v0.17.0 (set it, or pin it in $VERSIONS_FILE)"

if [ -x "$BIN" ] && [ -d "$OUT/crd" ] && [ "$(cat "$OUT/.complete" 2>/dev/null)" = "$KUEUE_VERSION" ]; then
  log "reusing $OUT"
  echo "$OUT"; exit 0
fi

command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26 on PATH); install it from your distribution or go.dev"
GOVER=$(go env GOVERSION | sed 's/^go//')
case "$GOVER" in 1.2[6-9]*|1.[3-9]*) ;; *) die "Go $GOVER is too old: Kueue $KUEUE_VERSION needs Go >= 1.26";; esac
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"
export GOFLAGS="-buildvcs=false"

mkdir -p "$OUT"
rm -rf "$OUT/bin.tmp" "$OUT/crd.tmp"; mkdir -p "$OUT/bin.tmp" "$OUT/crd.tmp"
cd "$OUT"
mod=sigs.k8s.io/kueue
log "downloading $mod@$KUEUE_VERSION from the Go module proxy"
dir=$(go mod download -json "$mod@$KUEUE_VERSION" 2>&1 | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') || true
[ -n "$dir" ] && [ -d "$dir/config/components/crd/bases" ] \
  || die "cannot download $mod@$KUEUE_VERSION (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
start=$SECONDS
log "building kueue $KUEUE_VERSION (output: $BUILD_LOG)"
# The version ldflags of Kueue's Makefile, so the manager logs its release; no cgo.
vpkg=$mod/pkg/version
GOBIN="$OUT/bin.tmp" CGO_ENABLED=0 quiet go install -trimpath \
  -ldflags "-s -w -X $vpkg.GitVersion=$KUEUE_VERSION" \
  "$mod/cmd/kueue@$KUEUE_VERSION" || die "go install of kueue $KUEUE_VERSION failed"
"$OUT/bin.tmp/kueue" --help >/dev/null 2>&1 || die "the kueue built does not run ($OUT/bin.tmp/kueue --help)"
# The CRDs without Kueue's conversion-webhook patches: the tests speak only the storage version (v1beta2), so
# the API server needs no webhook to serve them.
cp "$dir"/config/components/crd/bases/*.yaml "$OUT/crd.tmp/"
chmod u+w "$OUT"/crd.tmp/*.yaml
rm -rf "$OUT/bin" "$OUT/crd"; mv "$OUT/bin.tmp" "$OUT/bin"; mv "$OUT/crd.tmp" "$OUT/crd"
echo "$KUEUE_VERSION" > "$OUT/.complete"
echo "kueue $((SECONDS-start))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$OUT/build-times.txt"
log "built kueue $KUEUE_VERSION in $((SECONDS-start))s: $BIN"
echo "$OUT"
