#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kubectl from their
# published Go modules into a cache outside the repository, keyed by version, and reuses it.
# Usage: hack/build-control-plane.sh   (prints the bin directory on its last line)
#   K8S_VERSION=v1.34.4 hack/build-control-plane.sh   builds another release (default: the pin in
#   hack/versions.env; K8S_SKEW_VERSION there is the oldest supported release). ETCD_VERSION likewise.
set -euo pipefail

SCRIPT=build-control-plane
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
K8S_VERSION="${K8S_VERSION:-$(pinned K8S_VERSION)}"
ETCD_VERSION="${ETCD_VERSION:-$(pinned ETCD_VERSION)}"
OUT="$CACHE_ROOT/k8s/$K8S_VERSION"
BIN="$OUT/bin"
COMPONENTS=(kube-apiserver kube-scheduler kube-controller-manager kubectl)

# The staging modules are tagged v0.<minor>.<patch> for k8s.io/kubernetes v1.<minor>.<patch>: only plain
# release versions map that way.
[[ "$K8S_VERSION" =~ ^v1\.[0-9]+\.[0-9]+$ ]] \
  || die "K8S_VERSION '$K8S_VERSION' is not a Kubernetes release like v1.37.2 (set it, or pin it in $VERSIONS_FILE)"
[[ "$ETCD_VERSION" =~ ^v3\.[0-9]+\.[0-9]+$ ]] \
  || die "ETCD_VERSION '$ETCD_VERSION' is not an etcd release like v3.6.10 (set it, or pin it in $VERSIONS_FILE)"

have_all() {
  for c in "${COMPONENTS[@]}" etcd; do [ -x "$BIN/$c" ] || return 1; done
  [ -f "$OUT/.complete" ] || return 1
}

if have_all; then
  log "reusing $BIN"
  echo "$BIN"; exit 0
fi

command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26 on PATH); install it from your distribution or go.dev"
GOVER=$(go env GOVERSION | sed 's/^go//')
case "$GOVER" in 1.2[6-9]*|1.[3-9]*) ;; *) die "Go $GOVER is too old: Kubernetes $K8S_VERSION needs Go >= 1.26";; esac

mkdir -p "$BIN"
WORK="$OUT/src"
export GOFLAGS="-mod=mod"
export CGO_ENABLED=0
# Two cores are common in CI: keep the linker from running several giant links at once.
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"

minor=$(echo "$K8S_VERSION" | cut -d. -f2)
staging_ver="v0.${minor}.$(echo "$K8S_VERSION" | cut -d. -f3)"

build_k8s() {
  local mod="$WORK/k8s"
  mkdir -p "$mod"; cd "$mod"
  if [ ! -f go.mod ]; then
    log "resolving k8s.io/kubernetes@$K8S_VERSION from the module proxy"
    go mod init gpu-dra-k8s-build >/dev/null 2>&1
    gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])') \
      || die "cannot download k8s.io/kubernetes@$K8S_VERSION: is the Go module proxy reachable? (GOPROXY=$(go env GOPROXY))"
    go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
    # Staging modules are required at v0.0.0 and replaced upstream by local paths; point them at
    # their published tags instead (replace directives only work in the main module).
    for m in $(grep -E '^\s*k8s.io/[a-z0-9-]+ v0\.0\.0\s*$' "$gomod" | awk '{print $1}' | sort -u); do
      go mod edit -replace="$m=$m@$staging_ver"
    done
    # Keep upstream's GODEBUG defaults (1.34 says `godebug default=go1.24`), so that a build with a newer
    # Go behaves like the release (TLS, x509 and HTTP settings follow them).
    for kv in $(sed -n 's/^godebug[[:space:]]\{1,\}//p' "$gomod"); do
      go mod edit -godebug="$kv"
    done
    # Keep upstream's own replaces for third-party modules (pinned forks).
    grep -E '^\s*[a-z].* => [a-z].* v[0-9]' "$gomod" | grep -v '^\s*k8s.io/[a-z0-9-]* =>' | while read -r l; do
      from=$(echo "$l" | awk '{print $1}'); to=$(echo "$l" | awk '{print $3"@"$4}')
      go mod edit -replace="$from=$to"
    done || true
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
    log "go mod tidy (downloads ~1 GB of modules on a cold cache)"
    quiet go mod tidy || die "go mod tidy failed for k8s.io/kubernetes@$K8S_VERSION"
  fi
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  for c in "${COMPONENTS[@]}"; do
    if [ -x "$BIN/$c" ]; then log "$c already built"; continue; fi
    log "building $c $K8S_VERSION (output: $BUILD_LOG)"
    local start=$SECONDS
    quiet go build -trimpath -ldflags "$ld" -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c" || die "go build of $c failed"
    mv "$BIN/$c.tmp" "$BIN/$c"
    log "built $c in $((SECONDS-start))s"
  done
}

build_etcd() {
  [ -x "$BIN/etcd" ] && { log "etcd already built"; return; }
  local mod="$WORK/etcd"
  mkdir -p "$mod"; cd "$mod"
  if [ ! -f go.mod ]; then
    go mod init gpu-dra-etcd-build >/dev/null 2>&1
    cat > tools.go <<'GO'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
GO
    go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    log "resolving etcd $ETCD_VERSION"
    quiet go mod tidy || die "cannot resolve go.etcd.io/etcd/server/v3@$ETCD_VERSION from the module proxy"
  fi
  log "building etcd $ETCD_VERSION (output: $BUILD_LOG)"
  local start=$SECONDS
  quiet go build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3 || die "go build of etcd failed"
  mv "$BIN/etcd.tmp" "$BIN/etcd"
  log "built etcd in $((SECONDS-start))s"
}

build_etcd
build_k8s
touch "$OUT/.complete"
log "control plane $K8S_VERSION ready in $BIN ($(du -sh "$BIN" | cut -f1))"
echo "$BIN"
