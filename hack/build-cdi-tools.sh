#!/usr/bin/env bash
# Builds the two CDI programs into a cache outside the repository and reuses them:
#   nvidia-cdi-hook  from github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook at NVIDIA_CTK_VERSION
#                    (hack/versions.env) -> ~/.cache/gpu-dra/cdi-hook/<version>/bin/nvidia-cdi-hook.
#                    The driver's CDI specs run it as createContainer hooks (soname links, the container's
#                    loader cache, no device-node changes by the driver); the image ships it, the chart
#                    installs it on each node, the real-node tests hand it to the plugin.
#                    HOOK_ARCH=arm64 cross-compiles it for the arm64 image (cgo with hack/build-cross-cc.sh's
#                    compiler) -> ~/.cache/gpu-dra/cdi-hook/<version>-arm64/bin/nvidia-cdi-hook.
#   cdi-validate     hack/cdi-validate (the CDI reference library, version in its go.mod), keyed by a hash of
#                    its sources -> ~/.cache/gpu-dra/cdi-validate/<hash>/bin/cdi-validate. Tests check every
#                    spec the driver writes with it.
# Usage: hack/build-cdi-tools.sh [hook|validate|all]   (default all; prints each binary's path on its own line)
#   NVIDIA_CTK_VERSION=v1.20.2 overrides the pin; GPU_DRA_CACHE moves the cache; GPU_DRA_CDI_NO_BUILD=1 only
#   looks for finished builds (fails naming the missing one).
set -euo pipefail

SCRIPT=build-cdi-tools
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NVIDIA_CTK_VERSION="${NVIDIA_CTK_VERSION:-$(pinned NVIDIA_CTK_VERSION)}"
WHAT="${1:-all}"
case "$WHAT" in hook|validate|all) ;; *) die "unknown target '$WHAT' (hook, validate or all)";; esac

[[ "$NVIDIA_CTK_VERSION" =~ ^v1\.[0-9]+\.[0-9]+$ ]] \
  || die "NVIDIA_CTK_VERSION '$NVIDIA_CTK_VERSION' is not a toolkit release like v1.20.2 (set it, or pin it in $VERSIONS_FILE)"

# The build machine's architecture (as Go names it) builds natively; another one is a cross build.
case "$(uname -m)" in x86_64) HOST_ARCH=amd64;; aarch64|arm64) HOST_ARCH=arm64;; *) HOST_ARCH=$(uname -m);; esac
HOOK_ARCH="${HOOK_ARCH:-$HOST_ARCH}"
case "$HOOK_ARCH" in amd64|arm64) ;; *) die "HOOK_ARCH '$HOOK_ARCH' is not amd64 or arm64";; esac
HOOK_DIR="$CACHE_ROOT/cdi-hook/$NVIDIA_CTK_VERSION"
[ "$HOOK_ARCH" = "$HOST_ARCH" ] || HOOK_DIR="$HOOK_DIR-$HOOK_ARCH"
HOOK_BIN="$HOOK_DIR/bin/nvidia-cdi-hook"
VALIDATE_SRC="$HACK/cdi-validate"

need_go() {
  [ -z "${GPU_DRA_CDI_NO_BUILD:-}" ] || die "no $1 in the cache; run hack/build-cdi-tools.sh (or make cdi-tools)"
  command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26 on PATH); install it from your distribution or go.dev"
  local gover
  gover=$(go env GOVERSION | sed 's/^go//')
  case "$gover" in 1.2[6-9]*|1.[3-9]*) ;; *) die "Go $gover is too old: $1 needs Go >= 1.26";; esac
  export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"
  export GOFLAGS="-buildvcs=false"
}

build_hook() {
  if [ -x "$HOOK_BIN" ] && [ "$(cat "$HOOK_DIR/.complete" 2>/dev/null)" = "$NVIDIA_CTK_VERSION" ]; then
    log "reusing $HOOK_BIN"; echo "$HOOK_BIN"; return
  fi
  need_go nvidia-cdi-hook
  local mod=github.com/NVIDIA/nvidia-container-toolkit start=$SECONDS
  mkdir -p "$HOOK_DIR"
  rm -rf "$HOOK_DIR/bin.tmp"; mkdir -p "$HOOK_DIR/bin.tmp"
  if [ "$HOOK_ARCH" != "$HOST_ARCH" ]; then build_hook_cross "$mod" "$start"; return; fi
  log "building nvidia-cdi-hook $NVIDIA_CTK_VERSION from $mod (a few minutes the first time; output: $BUILD_LOG)"
  (cd "$HOOK_DIR" && GOBIN="$HOOK_DIR/bin.tmp" quiet go install "${HOOK_FLAGS[@]}" "$mod/cmd/nvidia-cdi-hook@$NVIDIA_CTK_VERSION") \
    || die "go install of $mod/cmd/nvidia-cdi-hook@$NVIDIA_CTK_VERSION failed (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
  "$HOOK_DIR/bin.tmp/nvidia-cdi-hook" --help >/dev/null 2>&1 \
    || die "the nvidia-cdi-hook built does not run ($HOOK_DIR/bin.tmp/nvidia-cdi-hook --help)"
  # The sub-commands the driver's CDI specs run (dra/node/cdi.py).
  local sub
  for sub in create-symlinks update-ldcache disable-device-node-modification; do
    "$HOOK_DIR/bin.tmp/nvidia-cdi-hook" "$sub" --help >/dev/null 2>&1 \
      || die "nvidia-cdi-hook $NVIDIA_CTK_VERSION has no '$sub' sub-command, which the driver's CDI specs use"
  done
  finish_hook "$start"
}

# Static (cgo for go-nvml, glibc linked in; pure-Go DNS and user lookups): runc runs the hook from the host's file
# system, so it must not depend on the host's libc version. The version shows in `--version`.
HOOK_FLAGS=(-trimpath -tags netgo,osusergo
  -ldflags "-s -w -linkmode external -extldflags -static -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=${NVIDIA_CTK_VERSION#v}")

# The same build for HOOK_ARCH with Debian's cross compiler. `go install` puts a cross-compiled program in
# $GOPATH/bin/linux_<arch> (it refuses GOBIN then): a GOPATH of its own, the shared module cache. It cannot run
# here, so its ELF header is what is checked.
build_hook_cross() {
  local mod=$1 start=$2 cc gopath
  cc=$(bash "$HACK/build-cross-cc.sh" | tail -n 1) || die "no C cross compiler for $HOOK_ARCH (hack/build-cross-cc.sh)"
  gopath=$(mktemp -d)
  log "cross-compiling nvidia-cdi-hook $NVIDIA_CTK_VERSION for linux/$HOOK_ARCH from $mod (output: $BUILD_LOG)"
  (cd "$HOOK_DIR" && GOPATH="$gopath" GOMODCACHE="$(go env GOMODCACHE)" GOOS=linux GOARCH="$HOOK_ARCH" CGO_ENABLED=1 \
      CC="$cc" quiet go install "${HOOK_FLAGS[@]}" "$mod/cmd/nvidia-cdi-hook@$NVIDIA_CTK_VERSION") \
    || { rm -rf "$gopath"; die "cross-compiling $mod/cmd/nvidia-cdi-hook@$NVIDIA_CTK_VERSION for $HOOK_ARCH failed"; }
  mv "$gopath/bin/linux_$HOOK_ARCH/nvidia-cdi-hook" "$HOOK_DIR/bin.tmp/"
  chmod -R u+w "$gopath"; rm -rf "$gopath"
  # e_machine: 183 is aarch64 (EM_AARCH64), 62 x86-64.
  local machine
  machine=$(od -An -tu2 -j18 -N2 "$HOOK_DIR/bin.tmp/nvidia-cdi-hook" | tr -d ' ')
  [ "$machine" = "$([ "$HOOK_ARCH" = arm64 ] && echo 183 || echo 62)" ] \
    || die "the nvidia-cdi-hook built for $HOOK_ARCH has ELF machine $machine"
  finish_hook "$start"
}

finish_hook() {
  local start=$1
  rm -rf "$HOOK_DIR/bin"; mv "$HOOK_DIR/bin.tmp" "$HOOK_DIR/bin"
  echo "$NVIDIA_CTK_VERSION" > "$HOOK_DIR/.complete"
  echo "nvidia-cdi-hook linux/$HOOK_ARCH $((SECONDS-start))s $(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$HOOK_DIR/build-times.txt"
  log "built nvidia-cdi-hook $NVIDIA_CTK_VERSION for linux/$HOOK_ARCH in $((SECONDS-start))s: $HOOK_BIN"
  echo "$HOOK_BIN"
}

build_validate() {
  # Keyed by its sources: a change to main.go or the library version builds a new one.
  local key
  key=$(cat "$VALIDATE_SRC/main.go" "$VALIDATE_SRC/go.mod" "$VALIDATE_SRC/go.sum" | sha256sum | cut -c1-16) \
    || die "cannot read $VALIDATE_SRC"
  local VALIDATE_KEY=$key VALIDATE_DIR="$CACHE_ROOT/cdi-validate/$key"
  local VALIDATE_BIN="$VALIDATE_DIR/bin/cdi-validate"
  if [ -x "$VALIDATE_BIN" ] && [ "$(cat "$VALIDATE_DIR/.complete" 2>/dev/null)" = "$VALIDATE_KEY" ]; then
    log "reusing $VALIDATE_BIN"; echo "$VALIDATE_BIN"; return
  fi
  need_go cdi-validate
  local start=$SECONDS
  mkdir -p "$VALIDATE_DIR/bin"
  log "building cdi-validate from $VALIDATE_SRC (output: $BUILD_LOG)"
  (cd "$VALIDATE_SRC" && CGO_ENABLED=0 quiet go build -trimpath -o "$VALIDATE_DIR/bin/cdi-validate.tmp" .) \
    || die "go build of $VALIDATE_SRC failed (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
  mv "$VALIDATE_DIR/bin/cdi-validate.tmp" "$VALIDATE_BIN"
  echo "$VALIDATE_KEY" > "$VALIDATE_DIR/.complete"
  log "built cdi-validate in $((SECONDS-start))s: $VALIDATE_BIN"
  echo "$VALIDATE_BIN"
}

case "$WHAT" in
  hook) build_hook ;;
  validate) build_validate ;;
  all) build_validate; build_hook ;;
esac
