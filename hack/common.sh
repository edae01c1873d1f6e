# Sourced by the hack/build-*.sh scripts: where pins and the cache are, and how they log. Set SCRIPT first
# (the name shown in log lines and errors).
HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VERSIONS_FILE="$HACK/versions.env"
# The value pinned for $1 in hack/versions.env (the last one if repeated); the environment overrides pins.
pinned() { sed -n "s/^$1=//p" "$VERSIONS_FILE" 2>/dev/null | tail -n 1; }
# The build cache, outside the repository (testbed/localcluster.py reads the same GPU_DRA_CACHE).
CACHE_ROOT="${GPU_DRA_CACHE:-$HOME/.cache/gpu-dra}"

log() { printf '[%s %s] %s\n' "$SCRIPT" "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '%s: error: %s\n' "$SCRIPT" "$*" >&2; exit 1; }
