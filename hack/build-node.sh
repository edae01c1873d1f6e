#!/usr/bin/env bash
# Builds what a real local node runs (testbed/localnode.py) into a cache outside the repository, keyed by
# version, and reuses it:
#   kubelet                                   from the control plane's prepared go.mod (k8s/<K8S_VERSION>/bin)
#   containerd, ctr, containerd-shim-runc-v2  from github.com/containerd/containerd/v2 (containerd/<version>/bin)
#   runc                                      from github.com/opencontainers/runc, with seccomp (runc/<version>/bin)
#   pause and busybox test images             as OCI archives, no registry needed (images/<inputs hash>/)
#   the CUDA stand-in for simulated nodes     libcuda.so / libnvidia-ml.so / nvidia-smi from hack/cuda-standin
#                                             (images/<inputs hash>/cuda-standin/{lib,bin})
#   cuda-probe test image                     Debian's glibc + busybox + cuda-probe (images/<inputs hash>/)
# and links them into one node directory: node/<K8S_VERSION>_containerd-<v>_runc-<v>/{bin,images,cuda-standin}.
# Usage: hack/build-node.sh   (prints the node's bin directory on its last line; images are in ../images)
# Versions, Debian package versions and image names are pinned in hack/versions.env; the environment
# overrides them (K8S_VERSION, CONTAINERD_VERSION, RUNC_VERSION, ...).
set -euo pipefail

SCRIPT=build-node
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
K8S_VERSION="${K8S_VERSION:-$(pinned K8S_VERSION)}"
CONTAINERD_VERSION="${CONTAINERD_VERSION:-$(pinned CONTAINERD_VERSION)}"
RUNC_VERSION="${RUNC_VERSION:-$(pinned RUNC_VERSION)}"
BUSYBOX_STATIC_DEB_VERSION="${BUSYBOX_STATIC_DEB_VERSION:-$(pinned BUSYBOX_STATIC_DEB_VERSION)}"
LIBSECCOMP_DEV_DEB_VERSION="${LIBSECCOMP_DEV_DEB_VERSION:-$(pinned LIBSECCOMP_DEV_DEB_VERSION)}"
PAUSE_IMAGE="${PAUSE_IMAGE:-$(pinned PAUSE_IMAGE)}"
BUSYBOX_IMAGE="${BUSYBOX_IMAGE:-$(pinned BUSYBOX_IMAGE)}"
CUDA_PROBE_IMAGE="${CUDA_PROBE_IMAGE:-$(pinned CUDA_PROBE_IMAGE)}"
SIM_DRIVER_VERSION="${SIM_DRIVER_VERSION:-$(pinned SIM_DRIVER_VERSION)}"

K8S_DIR="$CACHE_ROOT/k8s/$K8S_VERSION"
CTRD_DIR="$CACHE_ROOT/containerd/$CONTAINERD_VERSION"
RUNC_DIR="$CACHE_ROOT/runc/$RUNC_VERSION"
DEB_DIR="$CACHE_ROOT/debs"
NODE="$CACHE_ROOT/node/${K8S_VERSION}_containerd-${CONTAINERD_VERSION}_runc-${RUNC_VERSION}"

[[ "$K8S_VERSION" =~ ^v1\.[0-9]+\.[0-9]+$ ]] \
  || die "K8S_VERSION '$K8S_VERSION' is not a Kubernetes release like v1.37.2 (set it, or pin it in $VERSIONS_FILE)"
[[ "$CONTAINERD_VERSION" =~ ^v2\.[0-9]+\.[0-9]+$ ]] \
  || die "CONTAINERD_VERSION '$CONTAINERD_VERSION' is not a containerd 2 release like v2.4.2 (pin it in $VERSIONS_FILE)"
[[ "$RUNC_VERSION" =~ ^v1\.[0-9]+\.[0-9]+$ ]] \
  || die "RUNC_VERSION '$RUNC_VERSION' is not a runc release like v1.5.3 (pin it in $VERSIONS_FILE)"
[ -n "$PAUSE_IMAGE" ] && [ -n "$BUSYBOX_IMAGE" ] && [ -n "$CUDA_PROBE_IMAGE" ] \
  || die "PAUSE_IMAGE, BUSYBOX_IMAGE and CUDA_PROBE_IMAGE must be pinned in $VERSIONS_FILE"
[[ "$SIM_DRIVER_VERSION" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] \
  || die "SIM_DRIVER_VERSION '$SIM_DRIVER_VERSION' is not a driver version like 580.95.05 (pin it in $VERSIONS_FILE)"

# The images change with their inputs, not with a version number: key them by a hash of those.
# The cuda-probe image takes glibc from the driver image's Debian lock, unpacked by hack/build-image.py.
STANDIN_SRC="$HACK/cuda-standin"
IMAGE_KEY=$(cat "$HACK/pause.c" "$HACK/build-oci-image.py" "$HACK/build-image.py" "$HACK/../deploy/image/debian.lock" \
  "$STANDIN_SRC"/*.c "$STANDIN_SRC"/*.h "$STANDIN_SRC/Makefile" "$STANDIN_SRC/build-probe-image.py" \
  <(echo "$BUSYBOX_STATIC_DEB_VERSION $PAUSE_IMAGE $BUSYBOX_IMAGE $CUDA_PROBE_IMAGE $SIM_DRIVER_VERSION") \
  | sha256sum | cut -c1-16)
IMG_DIR="$CACHE_ROOT/images/$IMAGE_KEY"
STAMP="kubelet=$K8S_VERSION containerd=$CONTAINERD_VERSION runc=$RUNC_VERSION images=$IMAGE_KEY"
NODE_BINS=(kubelet containerd ctr containerd-shim-runc-v2 runc)
IMAGES=(pause.oci.tar busybox.oci.tar cuda-probe.oci.tar)
STANDIN_FILES=("lib/libcuda.so.$SIM_DRIVER_VERSION" "lib/libnvidia-ml.so.$SIM_DRIVER_VERSION" bin/nvidia-smi bin/cuda-probe)

have_all() {
  [ "$(cat "$NODE/.complete" 2>/dev/null)" = "$STAMP" ] || return 1
  for b in "${NODE_BINS[@]}"; do [ -x "$NODE/bin/$b" ] || return 1; done
  for i in "${IMAGES[@]}"; do [ -f "$NODE/images/$i" ] || return 1; done
  for f in "${STANDIN_FILES[@]}"; do [ -f "$NODE/cuda-standin/$f" ] || return 1; done
}

if have_all; then
  log "reusing $NODE"
  echo "$NODE/bin"; exit 0
fi
# Callers that only look for a finished cache (testbed/localnode.py's find_node_binaries(build=False)).
[ -z "${GPU_DRA_NODE_NO_BUILD:-}" ] || die "no complete node build in $NODE; run hack/build-node.sh"

command -v go >/dev/null 2>&1 || die "Go is not installed (need Go >= 1.26 on PATH); install it from your distribution or go.dev"
GOVER=$(go env GOVERSION | sed 's/^go//')
case "$GOVER" in 1.2[6-9]*|1.[3-9]*) ;; *) die "Go $GOVER is too old: the node binaries need Go >= 1.26";; esac
command -v gcc >/dev/null 2>&1 || die "gcc is not installed: runc needs cgo and the pause image a static C build (Debian: apt-get install gcc libc6-dev)"
command -v python3 >/dev/null 2>&1 || die "python3 is not installed: it packs the test images"
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"
export GOFLAGS="-buildvcs=false"

# Seconds per piece, for the log and for $NODE/build-times.txt.
declare -A TIMES=()
timed() { # timed NAME CMD...: runs CMD, records its duration unless it reused a cache (exit 10)
  local name=$1; shift; local start=$SECONDS rc=0
  # A subshell with errexit of its own: inside `cmd || ...` bash would ignore errors in the function.
  set +e; ( set -e; "$@" ); rc=$?; set -e
  if [ "$rc" -eq 0 ]; then TIMES[$name]=$((SECONDS-start)); log "built $name in $((SECONDS-start))s"
  elif [ "$rc" -ne 10 ]; then exit "$rc"; fi
}

# apt_fetch PKG VERSION DEST: downloads one Debian package (never installs it) and unpacks it into DEST.
# Prints the version actually fetched.
apt_fetch() {
  local pkg=$1 ver=$2 dest=$3 tmp got out
  command -v apt-get >/dev/null 2>&1 || { echo "apt-get is not available" >&2; return 1; }
  tmp=$(mktemp -d); chmod 755 "$tmp"
  # As root, apt drops to the _apt user to download; that user cannot write a root-owned mktemp dir.
  if ! out=$(cd "$tmp" && apt-get -q -o APT::Sandbox::User=root download "$pkg=$ver" 2>&1); then
    log "$pkg=$ver is not available from apt (${out##*$'\n'}); using the current candidate"
    out=$(cd "$tmp" && apt-get -q -o APT::Sandbox::User=root download "$pkg" 2>&1) \
      || { echo "apt-get download $pkg failed: ${out##*$'\n'} (run apt-get update?)" >&2; rm -rf "$tmp"; return 1; }
  fi
  got=$(dpkg-deb -f "$tmp"/*.deb Version) || { echo "cannot read $pkg's .deb" >&2; return 1; }
  rm -rf "$dest.tmp"; mkdir -p "$dest.tmp"
  dpkg-deb -x "$tmp"/*.deb "$dest.tmp" || { echo "dpkg-deb -x failed for $pkg" >&2; return 1; }
  echo "$got" > "$dest.tmp/.deb-version"
  rm -rf "$dest"; mv "$dest.tmp" "$dest"; rm -rf "$tmp"
  echo "$got"
}

build_kubelet() {
  [ -x "$K8S_DIR/bin/kubelet" ] && { log "kubelet $K8S_VERSION already built"; return 10; }
  if [ ! -f "$K8S_DIR/src/k8s/go.mod" ] || [ ! -f "$K8S_DIR/.complete" ]; then
    log "no prepared go.mod for k8s.io/kubernetes@$K8S_VERSION: building the control plane first"
    K8S_VERSION="$K8S_VERSION" bash "$HACK/build-control-plane.sh" >/dev/null \
      || die "hack/build-control-plane.sh failed; the kubelet is built from its go.mod"
  fi
  # A module of its own with the control plane's go.mod and go.sum: the same versions of everything,
  # without touching the control plane's sources.
  local mod="$K8S_DIR/src/kubelet"
  mkdir -p "$mod" "$K8S_DIR/bin"
  cp "$K8S_DIR/src/k8s/go.mod" "$K8S_DIR/src/k8s/go.sum" "$mod/"
  sed -i 's/^module .*/module gpu-dra-kubelet-build/' "$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kubelet"\n' > "$mod/tools.go"
  cd "$mod"
  log "go mod tidy for the kubelet"
  GOFLAGS="-mod=mod -buildvcs=false" quiet go mod tidy \
    || die "go mod tidy failed for the kubelet of k8s.io/kubernetes@$K8S_VERSION (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
  local minor; minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  log "building kubelet $K8S_VERSION (output: $BUILD_LOG)"
  CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" quiet go build -trimpath -ldflags "$ld" -o "$K8S_DIR/bin/kubelet.tmp" k8s.io/kubernetes/cmd/kubelet \
    || die "go build of the kubelet failed"
  mv "$K8S_DIR/bin/kubelet.tmp" "$K8S_DIR/bin/kubelet"
}

build_containerd() {
  local b ok=1
  for b in containerd ctr containerd-shim-runc-v2; do [ -x "$CTRD_DIR/bin/$b" ] || ok=0; done
  [ "$ok" = 1 ] && { log "containerd $CONTAINERD_VERSION already built"; return 10; }
  mkdir -p "$CTRD_DIR/bin.tmp"; cd "$CTRD_DIR"
  log "building containerd, ctr and containerd-shim-runc-v2 $CONTAINERD_VERSION (output: $BUILD_LOG)"
  go mod download "github.com/containerd/containerd/v2@$CONTAINERD_VERSION" >/dev/null 2>&1 \
    || die "cannot download github.com/containerd/containerd/v2@$CONTAINERD_VERSION: is the Go module proxy reachable? (GOPROXY=$(go env GOPROXY))"
  local pkg=github.com/containerd/containerd/v2
  # Graph drivers needing C libraries (btrfs, devicemapper, zfs) are left out: overlayfs and native suffice.
  GOBIN="$CTRD_DIR/bin.tmp" CGO_ENABLED=0 quiet go install -trimpath -tags "no_btrfs no_devmapper no_zfs" \
    -ldflags "-s -w -X $pkg/version.Version=$CONTAINERD_VERSION" \
    "$pkg/cmd/containerd@$CONTAINERD_VERSION" "$pkg/cmd/ctr@$CONTAINERD_VERSION" \
    "$pkg/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" || die "go install of containerd $CONTAINERD_VERSION failed"
  rm -rf "$CTRD_DIR/bin"; mv "$CTRD_DIR/bin.tmp" "$CTRD_DIR/bin"
}

# Headers and static library of libseccomp for runc: a downloaded Debian package unpacked into the cache
# (nothing installed), else the host's libseccomp-dev. Sets PKG_CONFIG_PATH.
libseccomp() {
  command -v pkg-config >/dev/null 2>&1 \
    || die "pkg-config is not installed: runc finds libseccomp through it (Debian: apt-get install pkg-config)"
  local dest="$DEB_DIR/libseccomp-dev_$LIBSECCOMP_DEV_DEB_VERSION" got
  if [ ! -f "$dest/.deb-version" ]; then
    if ! got=$(apt_fetch libseccomp-dev "$LIBSECCOMP_DEV_DEB_VERSION" "$dest"); then
      pkg-config --exists libseccomp 2>/dev/null \
        || die "runc needs libseccomp headers: apt-get download libseccomp-dev failed and the host has no libseccomp-dev (pkg-config libseccomp); install libseccomp-dev"
      log "using the host's libseccomp $(pkg-config --modversion libseccomp)"
      return 0
    fi
    log "fetched libseccomp-dev $got into $dest"
  fi
  local libdir; libdir=$(dirname "$(find "$dest/usr/lib" -name libseccomp.a | head -n 1)")
  [ -f "$libdir/libseccomp.a" ] || die "$dest has no libseccomp.a"
  # Only the static library: runc then carries libseccomp itself and needs no -dev package at run time.
  rm -f "$libdir"/libseccomp.so
  mkdir -p "$dest/pkgconfig"
  sed -e "s|^prefix=.*|prefix=$dest/usr|" -e "s|^libdir=.*|libdir=$libdir|" \
      -e "s|^includedir=.*|includedir=$dest/usr/include|" "$libdir/pkgconfig/libseccomp.pc" > "$dest/pkgconfig/libseccomp.pc"
  export PKG_CONFIG_PATH="$dest/pkgconfig"
  pkg-config --exists libseccomp || die "pkg-config cannot read $dest/pkgconfig/libseccomp.pc"
}

build_runc() {
  [ -x "$RUNC_DIR/bin/runc" ] && { log "runc $RUNC_VERSION already built"; return 10; }
  libseccomp
  mkdir -p "$RUNC_DIR/bin.tmp"; cd "$RUNC_DIR"
  go mod download "github.com/opencontainers/runc@$RUNC_VERSION" >/dev/null 2>&1 \
    || die "cannot download github.com/opencontainers/runc@$RUNC_VERSION: is the Go module proxy reachable? (GOPROXY=$(go env GOPROXY))"
  log "building runc $RUNC_VERSION with seccomp (output: $BUILD_LOG)"
  # containerd gives every sandbox the runtime/default seccomp profile: a runc without seccomp starts no pod.
  # Linked statically (netgo, osusergo: no glibc NSS at run time), like runc's own release binaries.
  GOBIN="$RUNC_DIR/bin.tmp" CGO_ENABLED=1 quiet go install -trimpath -tags "seccomp netgo osusergo urfave_cli_no_docs" \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v} -extldflags -static" \
    "github.com/opencontainers/runc@$RUNC_VERSION" || die "go install of runc $RUNC_VERSION failed (cgo with libseccomp)"
  "$RUNC_DIR/bin.tmp/runc" --version | grep -q 'seccomp' || die "the runc built has no seccomp support"
  rm -rf "$RUNC_DIR/bin"; mv "$RUNC_DIR/bin.tmp" "$RUNC_DIR/bin"
}

build_images() {
  local ok=1 i f
  for i in "${IMAGES[@]}"; do [ -f "$IMG_DIR/$i" ] || ok=0; done
  for f in "${STANDIN_FILES[@]}"; do [ -f "$IMG_DIR/cuda-standin/$f" ] || ok=0; done
  [ "$ok" = 1 ] && { log "images $IMAGE_KEY already built"; return 10; }
  local work; work=$(mktemp -d); trap 'rm -rf "$work"' RETURN
  mkdir -p "$IMG_DIR"
  # pause: one static binary of our own.
  mkdir -p "$work/pause"
  quiet gcc -static -Os -s -Wall -o "$work/pause/pause" "$HACK/pause.c" \
    || die "gcc -static failed for hack/pause.c: is the static C library installed? (Debian: libc6-dev)"
  python3 "$HACK/build-oci-image.py" --rootfs "$work/pause" --name "$PAUSE_IMAGE" \
    --out "$IMG_DIR/pause.oci.tar" --entrypoint /pause >/dev/null
  # busybox: Debian's static busybox with a link per applet, and the directories a container expects.
  local bb="$DEB_DIR/busybox-static_$BUSYBOX_STATIC_DEB_VERSION" got
  if [ ! -f "$bb/.deb-version" ]; then
    got=$(apt_fetch busybox-static "$BUSYBOX_STATIC_DEB_VERSION" "$bb") \
      || die "cannot fetch Debian's busybox-static for the test image (apt-get download busybox-static)"
    log "fetched busybox-static $got"
  fi
  local root="$work/busybox"
  mkdir -p "$root/bin" "$root/etc" "$root/root" "$root/proc" "$root/sys" "$root/dev" "$root/var" "$root/tmp"
  chmod 1777 "$root/tmp"
  cp "$bb/bin/busybox" "$root/bin/busybox"
  local applet
  for applet in $("$root/bin/busybox" --list); do
    [ "$applet" = busybox ] || ln -s busybox "$root/bin/$applet"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
  chmod 644 "$root/etc/passwd" "$root/etc/group"
  python3 "$HACK/build-oci-image.py" --rootfs "$root" --name "$BUSYBOX_IMAGE" \
    --out "$IMG_DIR/busybox.oci.tar" --cmd /bin/sh --env PATH=/bin >/dev/null
  echo "$BUSYBOX_IMAGE busybox-static $(cat "$bb/.deb-version")" > "$IMG_DIR/sources.txt"
  echo "$PAUSE_IMAGE hack/pause.c" >> "$IMG_DIR/sources.txt"
  # The CUDA stand-in (simulated nodes' driver libraries) and cuda-probe, dynamically linked against glibc.
  make -s -C "$STANDIN_SRC" OUT="$work/cuda-standin" VERSION="$SIM_DRIVER_VERSION" CC=gcc >&2 \
    || die "building hack/cuda-standin failed (gcc and libc6-dev needed)"
  python3 "$STANDIN_SRC/build-probe-image.py" --probe "$work/cuda-standin/bin/cuda-probe" --busybox "$bb/bin/busybox" \
    --name "$CUDA_PROBE_IMAGE" --out "$IMG_DIR/cuda-probe.oci.tar" --cache "$DEB_DIR/files" >/dev/null \
    || die "hack/cuda-standin/build-probe-image.py failed"
  rm -rf "$IMG_DIR/cuda-standin"; mv "$work/cuda-standin" "$IMG_DIR/cuda-standin"
  echo "$CUDA_PROBE_IMAGE hack/cuda-standin (libc6 from deploy/image/debian.lock), busybox-static" >> "$IMG_DIR/sources.txt"
}

timed images build_images
timed containerd build_containerd
timed runc build_runc
timed kubelet build_kubelet

mkdir -p "$NODE/bin" "$NODE/images"
ln -sfn "$K8S_DIR/bin/kubelet" "$NODE/bin/kubelet"
for b in containerd ctr containerd-shim-runc-v2; do ln -sfn "$CTRD_DIR/bin/$b" "$NODE/bin/$b"; done
ln -sfn "$RUNC_DIR/bin/runc" "$NODE/bin/runc"
for i in "${IMAGES[@]}" sources.txt; do ln -sfn "$IMG_DIR/$i" "$NODE/images/$i"; done
ln -sfn "$IMG_DIR/cuda-standin" "$NODE/cuda-standin"
for name in "${!TIMES[@]}"; do echo "$name ${TIMES[$name]}s $(date -u +%Y-%m-%dT%H:%M:%SZ)"; done >> "$NODE/build-times.txt"
echo "$STAMP" > "$NODE/.complete"
have_all || die "internal: $NODE is incomplete after the build"
log "node binaries ready in $NODE/bin, images in $NODE/images"
echo "$NODE/bin"
