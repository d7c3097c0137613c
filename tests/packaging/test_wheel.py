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
def wheel_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
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
    return wheel


@pytest.fixture(scope="module")
def wheel_names(wheel_path: Path, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    with zipfile.ZipFile(wheel_path) as archive:
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


_IMPORT_CHECK = """
import importlib, importlib.resources, pathlib, sys
import ddtree
root = pathlib.Path(ddtree.__file__).resolve().parent
assert root.is_relative_to(pathlib.Path(sys.prefix).resolve()), (root, sys.prefix)
for name in sys.argv[1:]:
    importlib.import_module(name)
kernels = importlib.resources.files("ddtree.kernels")
assert any(p.name.endswith(".cu") for p in kernels.iterdir())
assert importlib.resources.files("ddtree.v1").joinpath("tensor.proto").is_file()
print("ok")
"""


def test_installed_wheel_imports_every_subpackage(wheel_path: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # System site-packages provide the dependencies; the venv's own copy of ddtree comes first.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel_path)],
        check=True,
        timeout=300,
    )
    packages = sorted(_source_packages())
    result = subprocess.run(
        [str(python), "-c", _IMPORT_CHECK, *packages],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
