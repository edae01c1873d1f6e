"""The hack/build-*.sh scripts keep the Go toolchain's output (module downloads, cgo's deprecation warnings) in a
build log under the cache: a build that succeeds prints only its own progress lines, and one that fails shows the
last lines of that log and where it is. A stand-in `go` on PATH plays the toolchain: it writes a page of warnings
as the static cgo link of nvidia-cdi-hook does, then builds or fails."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WARNINGS = 100
# A stand-in for `go`: `go env`, and `go install`/`go build` that warn, then write an executable where the real
# one would (GOBIN/<name> or -o FILE) or, with GO_FAIL set, end with an error.
FAKE_GO = r"""#!/bin/sh
case "$1" in
  env) [ "$2" = GOVERSION ] && echo go1.26.0 || echo https://proxy.golang.org; exit 0;;
esac
i=0
while [ $i -lt WARNINGS ]; do
  echo "warning: Using 'getpwnam_r' in statically linked applications requires at runtime the shared libraries ($i)" >&2
  i=$((i+1))
done
if [ -n "$GO_FAIL" ]; then echo "link: running gcc failed: exit status 1" >&2; exit 1; fi
out=""; prev=""; last=""
for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; last=$a; done
if [ -z "$out" ]; then name=${last%@*}; out="$GOBIN/${name##*/}"; fi
mkdir -p "$(dirname "$out")"
printf '#!/bin/sh\nexit 0\n' > "$out"; chmod +x "$out"
""".replace("WARNINGS", str(WARNINGS))


def _run(tmp_path: Path, target: str, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "go").write_text(FAKE_GO)
    (bin_dir / "go").chmod(0o755)
    return subprocess.run(["bash", str(ROOT / "hack" / "build-cdi-tools.sh"), target], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "GPU_DRA_CACHE": str(tmp_path / "cache"),
                               "NVIDIA_CTK_VERSION": "v1.20.2", **env})


@pytest.mark.parametrize("target", ["hook", "validate"])
def test_a_build_that_succeeds_keeps_the_toolchains_output_in_its_log(tmp_path: Path, target: str) -> None:
    proc = _run(tmp_path, target)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) <= 3, proc.stderr          # "building ... (output: LOG)", "built ..."
    assert Path(proc.stdout.strip().splitlines()[-1]).is_file()
    logs = list((tmp_path / "cache" / "logs").glob("*.log"))
    assert len(logs) == 1 and logs[0].read_text().count("warning: Using 'getpwnam_r'") == WARNINGS
    assert str(logs[0]) in proc.stderr                               # said where the output goes


@pytest.mark.parametrize("target", ["hook", "validate"])
def test_a_build_that_fails_shows_the_end_of_its_log_and_where_it_is(tmp_path: Path, target: str) -> None:
    proc = _run(tmp_path, target, GO_FAIL="1")
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    log = tmp_path / "cache" / "logs" / "build-cdi-tools.log"
    assert any("link: running gcc failed: exit status 1" in line for line in lines), proc.stderr
    assert any(str(log) in line for line in lines), proc.stderr
    assert lines[-1].startswith("build-cdi-tools: error: go "), proc.stderr
    # The end of the output, not all of it.
    assert sum("warning: Using 'getpwnam_r'" in line for line in lines) < 40, proc.stderr
