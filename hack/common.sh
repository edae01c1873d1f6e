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

# The toolchain's output (module downloads, compiler and cgo warnings: about 100 lines for the static
# nvidia-cdi-hook) goes to this log under the cache, not to the terminal, where a build that succeeds would read
# as failing. A step that fails shows the last lines it wrote there and where the whole log is.
BUILD_LOG="$CACHE_ROOT/logs/$SCRIPT.log"
BUILD_LOG_TAIL="${GPU_DRA_BUILD_LOG_TAIL:-25}"
# quiet CMD ARGS...: runs the command with its output appended to $BUILD_LOG; its exit status is the command's.
quiet() {
  mkdir -p "${BUILD_LOG%/*}"
  printf '\n== %s %s: %s\n' "$SCRIPT" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >> "$BUILD_LOG"
  local from rc=0
  from=$(stat -c %s "$BUILD_LOG")
  "$@" >> "$BUILD_LOG" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    {
      printf '%s: the last lines of the output (all of it: %s):\n' "$SCRIPT" "$BUILD_LOG"
      tail -c "+$((from + 1))" "$BUILD_LOG" | tail -n "$BUILD_LOG_TAIL" | sed 's/^/  | /'
    } >&2
  fi
  return "$rc"
}
