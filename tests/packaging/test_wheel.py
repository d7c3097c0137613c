"""A built wheel holds every subpackage, the .proto sources, kernel sources and py.typed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_SOURCES = ("pyproject.toml", "README.md", "proto", "kernels", "service", "clients")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Names inside a wheel built from a copy of the source tree (the work tree stays clean)."""
    source = tmp_path_factory.mktemp("src")
    for name in _SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.is_file():
            shutil.copy2(path, source / name)
    if not (source / "README.md").exists():  # the README is assembled separately
        (source / "README.md").write_text("ddtree\n")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("ddtree-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        (tmp_path_factory.getbasetemp() / "entry_points.txt").write_bytes(
            archive.read(entry_points)
        )
        return names


def _mapped_packages() -> dict[str, Path]:
    tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11's tomllib")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {
        name: REPO / folder for name, folder in config["tool"]["setuptools"]["package-dir"].items()
    }


def _source_packages() -> set[str]:
    """Every package in the source tree: mapped folders and their folders with __init__.py."""
    packages = set()
    for name, folder in _mapped_packages().items():
        for init in folder.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(folder).parts
            # A nested mapped folder (proto/ddtree/v1 under proto/ddtree) is its own entry.
            packages.add(".".join((name, *relative)))
    return packages


def test_every_subpackage_is_in_the_wheel(wheel_names: set[str]) -> None:
    missing = [
        package
        for package in sorted(_source_packages())
        if f"{package.replace('.', '/')}/__init__.py" not in wheel_names
    ]
    assert not missing, f"packages missing from the wheel (pyproject packages list?): {missing}"


def test_wheel_claims_only_the_ddtree_namespace(wheel_names: set[str]) -> None:
    top = {name.split("/")[0] for name in wheel_names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"ddtree"}


def test_wheel_ships_data_files(wheel_names: set[str]) -> None:
    assert "ddtree/py.typed" in wheel_names
    for proto in (REPO / "proto" / "ddtree" / "v1").glob("*.proto"):
        assert f"ddtree/v1/{proto.name}" in wheel_names
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert f"ddtree/v1/{proto.stem}{suffix}" in wheel_names
    kernel_sources = [*(REPO / "kernels").glob("*.cu"), *(REPO / "kernels").glob("*.cuh")]
    for source in kernel_sources:
        assert f"ddtree/kernels/{source.name}" in wheel_names, source.name


def test_wheel_declares_the_ddtree_command(
    wheel_names: set[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    text = (tmp_path_factory.getbasetemp() / "entry_points.txt").read_text()
    assert "ddtree = ddtree.service.cli:main" in text
