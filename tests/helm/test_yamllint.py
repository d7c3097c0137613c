"""The chart's plain YAML files pass yamllint (helm/.yamllint)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "ddtree"
FILES = [
    CHART / "Chart.yaml",
    CHART / "values.yaml",
    *sorted((CHART / "ci").glob("*.yaml")),
    *sorted((CHART / "files").glob("*.yaml")),
]


def test_chart_yaml_passes_yamllint():
    yamllint = shutil.which("yamllint")
    if yamllint is None:
        pytest.skip("needs yamllint on PATH (pip package yamllint)")
    result = subprocess.run(
        [yamllint, "--strict", "-c", str(ROOT / "helm" / ".yamllint"), *map(str, FILES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
