"""hack/release.py's refusals and its chart: a release is a clean commit with a semver version, the registry is
asked what it has (a repository it does not know has no versions; any other answer stops the release), and the
packaged chart carries the version and pins the release's image by digest. The release itself, pushed into a
real registry and installed from it, is tests/e2e/test_helm_realnode.py."""
from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from testbed.helmchart import helm_binary

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))
import release  # noqa: E402 - hack/ is no package: its path first

DIGEST = "sha256:" + "ab" * 32


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A committed tree with a pyproject.toml."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "0.1.0"\n')
    (repo / ".gitignore").write_text("dist/\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "one")
    return repo


@pytest.mark.parametrize("version", ["1.2.3", "0.1.0", "2.0.0-rc.1"])
def test_semantic_versions_are_taken(version: str) -> None:
    release.check_version(version)


@pytest.mark.parametrize("version", ["", "v1.2.3", "1.2", "01.2.3", "1.2.3.4", "latest"])
def test_other_versions_are_refused(version: str) -> None:
    with pytest.raises(release.ReleaseError, match="is not a semantic version"):
        release.check_version(version)


@pytest.mark.parametrize("registry", ["", "https://r.example.com", "r.example.com/Team", "r.example.com/"])
def test_a_registry_that_is_not_host_port_path_is_refused(registry: str) -> None:
    with pytest.raises(release.ReleaseError, match="is not host"):
        release.check_registry(registry)
    release.check_registry("127.0.0.1:5000/gpu-dra")


def test_a_clean_tree_gives_its_commit(repo: Path) -> None:
    (repo / "dist").mkdir()
    (repo / "dist" / "x.whl").write_text("ignored files do not count")
    assert release.check_clean(repo) == git(repo, "rev-parse", "HEAD").strip()


@pytest.mark.parametrize("change", ["untracked", "modified", "staged"])
def test_a_dirty_tree_is_refused(repo: Path, change: str) -> None:
    if change == "untracked":
        (repo / "new.py").write_text("")
    else:
        (repo / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "0.2.0"\n')
        if change == "staged":
            git(repo, "add", "pyproject.toml")
    with pytest.raises(release.ReleaseError, match="the tree is not clean"):
        release.check_clean(repo)


def test_the_staged_tree_is_the_commit_with_the_version_stamped(repo: Path, tmp_path: Path) -> None:
    (repo / "pyproject.toml").write_text("changed, not committed")
    src = release.stage(repo, git(repo, "rev-parse", "HEAD").strip(), tmp_path / "stage", "1.4.2")
    assert (src / "pyproject.toml").read_text() == '[project]\nname = "x"\nversion = "1.4.2"\n'
    assert sorted(p.name for p in src.iterdir()) == [".gitignore", "pyproject.toml"]


def test_the_download_url_is_given_or_the_github_origins_release(repo: Path) -> None:
    assert release.download_url("https://dl.example.com/v{version}/", "1.2.3", repo) == "https://dl.example.com/v1.2.3"
    with pytest.raises(release.ReleaseError, match="set DOWNLOAD_URL"):
        release.download_url("", "1.2.3", repo)
    for origin in ("https://github.com/acme/gpu-dra-driver.git", "git@github.com:acme/gpu-dra-driver.git"):
        if "origin" in git(repo, "remote"):
            git(repo, "remote", "remove", "origin")
        git(repo, "remote", "add", "origin", origin)
        assert release.download_url("", "1.2.3", repo) == \
            "https://github.com/acme/gpu-dra-driver/releases/download/v1.2.3"


def fake_crane(tmp_path: Path, stderr: str, rc: int, stdout: str = "") -> str:
    crane = tmp_path / "crane"
    crane.write_text(f"#!/bin/sh\nprintf '%s' '{stdout}'\nprintf '%s\\n' '{stderr}' >&2\nexit {rc}\n")
    crane.chmod(0o755)
    return str(crane)


def test_a_repository_the_registry_does_not_know_has_no_versions(tmp_path: Path) -> None:
    crane = fake_crane(tmp_path, "GET https://r/v2/x/tags/list: NAME_UNKNOWN: repository name not known", 1)
    assert release.tags(crane, "r/x") == set()
    assert release.tags(fake_crane(tmp_path, "", 0, "0.1.0\n0.2.0\n"), "r/x") == {"0.1.0", "0.2.0"}


def test_any_other_registry_answer_stops_the_release(tmp_path: Path) -> None:
    crane = fake_crane(tmp_path, "GET https://r/v2/: UNAUTHORIZED: authentication required", 1)
    with pytest.raises(release.ReleaseError, match="UNAUTHORIZED.*crane auth login"):
        release.tags(crane, "r/x")


def test_the_packaged_chart_has_the_version_and_pins_the_image_by_digest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / release.CHART, src / release.CHART)
    (src / "hack").mkdir()
    shutil.copyfile(ROOT / "hack" / "versions.env", src / "hack" / "versions.env")
    dist = tmp_path / "dist"
    package = release.package_chart(helm_binary(), src, "r.example.com:5000/team/gpu-dra-driver", DIGEST, "1.2.3",
                                    dist)
    assert package == dist / "gpu-dra-driver-1.2.3.tgz"
    with tarfile.open(package) as tar:
        chart = yaml.safe_load(tar.extractfile("gpu-dra-driver/Chart.yaml").read())  # type: ignore[union-attr]
        values = tar.extractfile("gpu-dra-driver/values.yaml").read().decode()  # type: ignore[union-attr]
    assert (chart["version"], chart["appVersion"]) == ("1.2.3", "1.2.3")
    assert chart["annotations"] == {release.DIGEST_ANNOTATION: DIGEST}
    assert yaml.safe_load(io.StringIO(values))["image"]["repository"] == "r.example.com:5000/team/gpu-dra-driver"
    assert "# Secrets (kubernetes.io/dockerconfigjson)" in values    # the values' comments are kept


def test_the_charts_default_repository_is_the_pinned_image_repository() -> None:
    """The release replaces the chart's default repository line, found as the pin says it."""
    values = yaml.safe_load((ROOT / release.CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == release.pinned(ROOT, "DRIVER_IMAGE_REPOSITORY")


def scripted_crane(tmp_path: Path, digest: str) -> str:
    """A crane whose registry has tag 1.0.0 under `digest`, and which records the pushes asked of it."""
    crane = tmp_path / "crane"
    crane.write_text(f"#!/bin/sh\ncase \"$1\" in\n  ls) echo 1.0.0;;\n  digest) echo {digest};;\n"
                     f"  push) echo \"$@\" >> {tmp_path / 'pushes'};;\nesac\n")
    crane.chmod(0o755)
    return str(crane)


def test_an_image_pushed_with_the_same_digest_is_not_pushed_again(tmp_path: Path) -> None:
    """A release that stopped after the image (before the chart) runs again: the same build, nothing to push."""
    crane = scripted_crane(tmp_path, DIGEST)
    assert release.push_image(crane, tmp_path / "layout", "r.example.com/x/gpu-dra-driver:1.0.0", DIGEST) is False
    assert not (tmp_path / "pushes").exists()


def test_an_image_pushed_with_another_digest_is_refused(tmp_path: Path) -> None:
    crane = scripted_crane(tmp_path, "sha256:" + "cd" * 32)
    with pytest.raises(release.ReleaseError, match="already pushed, as sha256:cdcd"):
        release.push_image(crane, tmp_path / "layout", "r.example.com/x/gpu-dra-driver:1.0.0", DIGEST)
    assert not (tmp_path / "pushes").exists()
