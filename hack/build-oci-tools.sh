#!/usr/bin/env bash
# Builds the two OCI registry programs of a release into a cache outside the repository, keyed by version, and
# reuses them:
#   crane     github.com/google/go-containerregistry/cmd/crane at CRANE_VERSION (hack/versions.env)
#             -> ~/.cache/gpu-dra/crane/<version>/bin/crane. `make release` pushes the image index with it and asks
#             the registry which versions it has.
#   registry  the CNCF distribution registry, github.com/distribution/distribution/v3/cmd/registry at
#             DISTRIBUTION_VERSION -> ~/.cache/gpu-dra/registry/<version>/bin/registry. The release test runs it
#             with TLS and htpasswd (bcrypt) authentication, as users run it, and the test node pulls from it.
# Usage: hack/build-oci-tools.sh [crane|registry|all]   (default all; prints each binary's path on its own line)
#   CRANE_VERSION=... DISTRIBUTION_VERSION=... override the pins; GPU_DRA_CACHE moves the cache.
set -euo pipefail

SCRIPT=build-oci-tools
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
CRANE_VERSION="${CRANE_VERSION:-$(pinned CRANE_VERSION)}"
DISTRIBUTION_VERSION="${DISTRIBUTION_VERSION:-$(pinned DISTRIBUTION_VERSION)}"
WHAT="${1:-all}"
case "$WHAT" in crane|registry|all) ;; *) die "unknown target '$WHAT' (crane, registry or all)";; esac

[[ "$CRANE_VERSION" =~ ^v0\.[0-9]+\.[0-9]+$ ]] \
  || die "CRANE_VERSION '$CRANE_VERSION' is not a go-containerregistry release like v0.22.1 (set it, or pin it in $VERSIONS_FILE)"
# The module path carries the major version (distribution/v3): only v3 releases build from it.
[[ "$DISTRIBUTION_VERSION" =~ ^v3\.[0-9]+\.[0-9]+$ ]] \
  || die "DISTRIBUTION_VERSION '$DISTRIBUTION_VERSION' is not a distribution v3 release like v3.1.2 (set it, or pin it in $VERSIONS_FILE)"

# build NAME VERSION MODULE PACKAGE LDFLAGS: go install of MODULE/PACKAGE@VERSION (static, no cgo) into
# $CACHE_ROOT/NAME/VERSION/bin, unless a complete build is there; prints the binary's path.
build() {
  local name=$1 version=$2 mod=$3 pkg=$4 ldflags=$5
  local out="$CACHE_ROOT/$name/$version" bin="$CACHE_ROOT/$name/$version/bin/$name"
  if [ -x "$bin" ] && [ "$(cat "$out/.complete" 2>/dev/null)" = "$version" ]; then
    log "reusing $bin"; echo "$bin"; return
  fi
  command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26 on PATH); install it from your distribution or go.dev"
  local gover start
  gover=$(go env GOVERSION | sed 's/^go//')
  case "$gover" in 1.2[6-9]*|1.[3-9]*) ;; *) die "Go $gover is too old: $name $version needs Go >= 1.26";; esac
  export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}" GOFLAGS="-buildvcs=false"
  mkdir -p "$out"; rm -rf "$out/bin.tmp"; mkdir -p "$out/bin.tmp"
  log "downloading $mod@$version from the Go module proxy"
  local err
  err=$(cd "$out" && go mod download "$mod@$version" 2>&1) \
    || die "cannot download $mod@$version: ${err##*$'\n'} (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
  start=$SECONDS
  log "building $name $version (output: $BUILD_LOG)"
  (cd "$out" && GOBIN="$out/bin.tmp" CGO_ENABLED=0 quiet go install -trimpath -ldflags "-s -w $ldflags" \
      "$mod/$pkg@$version") || die "go install of $mod/$pkg@$version failed"
  rm -rf "$out/bin"; mv "$out/bin.tmp" "$out/bin"
  echo "$version" > "$out/.complete"
  echo "$name $((SECONDS-start))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$out/build-times.txt"
  log "built $name $version in $((SECONDS-start))s: $bin"
  echo "$bin"
}

# Each with its release's version ldflags, so `crane version` and `registry --version` report it.
build_crane() {
  local mod=github.com/google/go-containerregistry
  local bin
  bin=$(build crane "$CRANE_VERSION" "$mod" cmd/crane "-X $mod/cmd/crane/cmd.Version=$CRANE_VERSION")
  [ "$("$bin" version 2>/dev/null)" = "$CRANE_VERSION" ] || die "the crane built does not run or reports another version ($bin version)"
  echo "$bin"
}

build_registry() {
  local mod=github.com/distribution/distribution/v3
  local bin
  bin=$(build registry "$DISTRIBUTION_VERSION" "$mod" cmd/registry "-X $mod/version.version=$DISTRIBUTION_VERSION")
  "$bin" --version 2>/dev/null | grep -q " $DISTRIBUTION_VERSION" \
    || die "the registry built does not run or reports another version ($bin --version)"
  echo "$bin"
}

case "$WHAT" in
  crane) build_crane ;;
  registry) build_registry ;;
  all) build_crane; build_registry ;;
esac
