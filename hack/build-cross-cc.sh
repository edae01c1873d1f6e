#!/usr/bin/env bash
# Lays out a C cross compiler for arm64 (aarch64-linux-gnu) from Debian's packages, downloaded with
# `apt-get download` and unpacked into the cache, never installed: gcc-12-aarch64-linux-gnu (pinned as
# AARCH64_CROSS_GCC_DEB_VERSION in hack/versions.env), its binutils and the arm64 glibc (static libraries
# included). cgo links the arm64 nvidia-cdi-hook statically with it (hack/build-cdi-tools.sh), as the amd64 one is
# linked with the host's gcc. -> ~/.cache/gpu-dra/cross-cc/arm64-<version>/bin/aarch64-linux-gnu-gcc, a wrapper
# that points the unpacked compiler at its own tree.
# Usage: hack/build-cross-cc.sh   (prints the wrapper's path on its last line; an amd64 Debian host with apt-get)
set -euo pipefail

SCRIPT=build-cross-cc
# shellcheck source=hack/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
GCC_VERSION="${AARCH64_CROSS_GCC_DEB_VERSION:-$(pinned AARCH64_CROSS_GCC_DEB_VERSION)}"
[ -n "$GCC_VERSION" ] || die "AARCH64_CROSS_GCC_DEB_VERSION is not pinned in $VERSIONS_FILE"
OUT="$CACHE_ROOT/cross-cc/arm64-$GCC_VERSION"
CC_WRAPPER="$OUT/bin/aarch64-linux-gnu-gcc"
if [ -x "$CC_WRAPPER" ] && [ "$(cat "$OUT/.complete" 2>/dev/null)" = "$GCC_VERSION" ]; then
  log "reusing $CC_WRAPPER"; echo "$CC_WRAPPER"; exit 0
fi

command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 \
  || die "the arm64 cross compiler comes from Debian packages: needs apt-get and dpkg-deb (a Debian 12 host)"
# Debian's cross packages run on the architecture they are built for; these are amd64 programs.
[ "$(dpkg --print-architecture)" = amd64 ] || die "the arm64 cross compiler is laid out for amd64 build hosts only"

# The compiler at the pin; binutils and the arm64 C library at apt's candidates (the image's glibc is bookworm's).
PINNED=(gcc-12-aarch64-linux-gnu cpp-12-aarch64-linux-gnu libgcc-12-dev-arm64-cross libgcc-s1-arm64-cross)
CANDIDATES=(binutils-aarch64-linux-gnu libc6-dev-arm64-cross libc6-arm64-cross linux-libc-dev-arm64-cross)
start=$SECONDS
rm -rf "$OUT"; mkdir -p "$OUT/debs" "$OUT/root" "$OUT/bin"
chmod 755 "$OUT/debs"   # as root, apt downloads as the _apt user
specs=()
for pkg in "${PINNED[@]}"; do specs+=("$pkg=$GCC_VERSION"); done
log "downloading the arm64 cross compiler (gcc $GCC_VERSION, about 35 MB) with apt-get download"
if ! (cd "$OUT/debs" && quiet apt-get -q -o APT::Sandbox::User=root download "${specs[@]}" "${CANDIDATES[@]}"); then
  log "WARNING: gcc $GCC_VERSION is not available from apt; using the current candidates (pin the new version in $VERSIONS_FILE)"
  (cd "$OUT/debs" && quiet apt-get -q -o APT::Sandbox::User=root download "${PINNED[@]}" "${CANDIDATES[@]}") \
    || die "apt-get download of the arm64 cross compiler failed (apt-get update?)"
fi
for deb in "$OUT"/debs/*.deb; do
  dpkg-deb -x "$deb" "$OUT/root" || die "dpkg-deb -x $deb failed"
  echo "$(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version)" >> "$OUT/versions.txt"
done
rm -rf "$OUT/debs"
# The unpacked gcc finds cc1, as and ld relative to itself; the target's headers, crt files and libraries are
# found through the sysroot and -B; binutils' private libraries (libbfd, libopcodes for arm64) through the
# loader path.
cat > "$CC_WRAPPER" <<'EOF'
#!/bin/sh
# aarch64-linux-gnu-gcc from Debian's packages, unpacked next to this wrapper (hack/build-cross-cc.sh).
root="$(cd "$(dirname "$0")/.." && pwd)/root"
LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  exec "$root/usr/bin/aarch64-linux-gnu-gcc-12" --sysroot="$root" -B"$root/usr/aarch64-linux-gnu/lib" "$@"
EOF
chmod 755 "$CC_WRAPPER"
# A static arm64 program, as cgo will link the hook: its ELF header names the aarch64 machine (183).
printf 'int main(void) { return 0; }\n' > "$OUT/probe.c"
quiet "$CC_WRAPPER" -static -o "$OUT/probe" "$OUT/probe.c" || die "the arm64 cross compiler does not link a static program"
[ "$(od -An -tu2 -j18 -N2 "$OUT/probe" | tr -d ' ')" = 183 ] || die "the cross compiler's output is not an aarch64 program"
rm -f "$OUT/probe" "$OUT/probe.c"
echo "$GCC_VERSION" > "$OUT/.complete"
log "laid out the arm64 cross compiler in $((SECONDS-start))s: $CC_WRAPPER"
echo "$CC_WRAPPER"
