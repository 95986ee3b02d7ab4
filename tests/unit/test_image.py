"""The image's package builds from what docker/Dockerfile copies, and nothing else: its COPY lines are
assembled into an empty folder and the package is built there (`pip wheel --no-deps`), so a folder that
pyproject.toml names and the Dockerfile leaves out fails here, not on a GPU host."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def copies(dockerfile: Path) -> list[tuple[str, str]]:
    """(source in the build context, destination relative to WORKDIR) of each COPY of the final stage."""
    pairs: list[tuple[str, str]] = []
    for line in dockerfile.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if words[0].upper() == "FROM":
            pairs = []  # an earlier stage's copies are not in the image
        if words[0].upper() == "COPY":
            args = [w for w in words[1:] if not w.startswith("--")]
            if args[0].startswith("["):
                args = json.loads(" ".join(args))
            *sources, destination = args
            pairs += [(source, destination) for source in sources]
    return pairs


def test_the_dockerfile_copies_what_the_package_is_built_from(tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    pairs = copies(DOCKERFILE)
    assert pairs, f"{DOCKERFILE} copies nothing"
    for source, destination in pairs:
        target = context / PurePosixPath(destination)
        origin = ROOT / source
        if origin.is_dir():
            shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(origin, target if not destination.endswith("/") else target / origin.name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=context,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"the image's `pip install` would fail:\n{done.stderr[-3000:]}"
    [wheel] = tmp_path.glob("llmesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in setuptools["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, f"the image's package lacks {package}"
    for package, patterns in setuptools["package-data"].items():
        for pattern in patterns:
            assert any(PurePosixPath(n).match(f"{package}/{pattern}") for n in names), (package, pattern)


def test_the_build_context_keeps_what_the_dockerfile_copies():
    """.dockerignore (what Docker leaves out of the build context) names none of the copied folders or files,
    nor anything inside them but caches."""
    ignored = [
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for source, _ in copies(DOCKERFILE):
        for pattern in ignored:
            assert not fnmatch.fnmatch(source, pattern) and not source.startswith(pattern + "/"), (source, pattern)
            inside = [p for p in (ROOT / source).rglob("*") if fnmatch.fnmatch(str(p.relative_to(ROOT)), pattern)]
            assert all("__pycache__" in p.parts for p in inside), (source, pattern, inside[:3])


def test_copies_are_read_as_docker_reads_them(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        'FROM a AS build\nCOPY x /x\nFROM b\nCOPY --chown=1 p q ./\n# COPY no ./no\nCOPY ["r s", "t/"]\n'
    )
    assert copies(dockerfile) == [("p", "./"), ("q", "./"), ("r s", "t/")]
