#!/usr/bin/env bash
# Builds the kubelet plugin of the Go reference DRA driver (kubernetes-sigs/dra-example-driver,
# cmd/dra-example-kubeletplugin) at a pinned commit into a cache outside the repository and reuses it:
# ~/.cache/gpu-dra/peer/<commit>/bin/dra-example-kubeletplugin. Only `python -m bench --peer-bin` uses it, to
# measure our kubelet plugin beside it on the same kubelet; nothing in `make test` needs it.
# Usage: hack/build-peer-driver.sh [SOURCE]   (prints the binary's path on its last line)
#   SOURCE: a clone of the repository (a work tree or a bare git directory) holding the commit; without it the
#   commit is fetched from https://github.com/kubernetes-sigs/dra-example-driver.
#   PEER_DRIVER_COMMIT=<sha> overrides the pin; GPU_DRA_CACHE moves the cache. Needs Go and the module proxy.
set -euo pipefail

SCRIPT=build-peer-driver
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
COMMIT="${PEER_DRIVER_COMMIT:-$(pinned PEER_DRIVER_COMMIT)}"
SOURCE="${1:-}"
[[ "$COMMIT" =~ ^[0-9a-f]{40}$ ]] \
  || die "PEER_DRIVER_COMMIT '$COMMIT' is not a full 40-hex commit (set it, or pin it in $VERSIONS_FILE)"
OUT="$CACHE_ROOT/peer/$COMMIT"
BIN="$OUT/bin/dra-example-kubeletplugin"

if [ -x "$BIN" ] && [ "$(cat "$OUT/.complete" 2>/dev/null)" = "$COMMIT" ]; then
  log "reusing $BIN"
  echo "$BIN"; exit 0
fi
command -v git >/dev/null 2>&1 || die "git is not installed"

mkdir -p "$OUT"
SRC="$OUT/src"
rm -rf "$SRC"; mkdir -p "$SRC"
if [ -n "$SOURCE" ]; then
  # A bare git directory or a work tree: export the pinned commit's files.
  gitdir="$SOURCE"; [ -d "$SOURCE/.git" ] && gitdir="$SOURCE/.git"
  git --git-dir="$gitdir" cat-file -e "$COMMIT^{commit}" 2>/dev/null \
    || die "$SOURCE has no commit $COMMIT"
  git --git-dir="$gitdir" archive "$COMMIT" | tar -x -C "$SRC"
else
  log "fetching $COMMIT from github.com/kubernetes-sigs/dra-example-driver"
  git -C "$SRC" init -q
  git -C "$SRC" fetch -q --depth 1 https://github.com/kubernetes-sigs/dra-example-driver "$COMMIT" \
    || die "cannot fetch commit $COMMIT (give a local clone as SOURCE)"
  git -C "$SRC" checkout -q FETCH_HEAD
fi

command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26 on PATH)"
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"
export GOFLAGS="-buildvcs=false"
start=$SECONDS
log "building cmd/dra-example-kubeletplugin at $COMMIT (output: $BUILD_LOG)"
mkdir -p "$OUT/bin.tmp"
(cd "$SRC" && CGO_ENABLED=0 quiet go build -trimpath -o "$OUT/bin.tmp/dra-example-kubeletplugin" ./cmd/dra-example-kubeletplugin) \
  || die "go build of cmd/dra-example-kubeletplugin failed (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
"$OUT/bin.tmp/dra-example-kubeletplugin" --help >/dev/null 2>&1 || die "the binary built does not run ($OUT/bin.tmp)"
rm -rf "$OUT/bin"; mv "$OUT/bin.tmp" "$OUT/bin"
rm -rf "$SRC"
echo "$COMMIT" > "$OUT/.complete"
log "built dra-example-kubeletplugin in $((SECONDS-start))s: $BIN"
echo "$BIN"
