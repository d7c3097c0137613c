"""The quick-start snippet of docs/api.md (and of README.md, once it holds it) runs against a
``ddtree serve`` process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.serving import LogWatcher

REPO = Path(__file__).resolve().parents[2]
_MARKER = "<!-- quickstart -->"
_DOC_ADDRESS = "127.0.0.1:50051"


def _snippet(document: Path) -> str:
    text = document.read_text()
    after = text[text.index(_MARKER) + len(_MARKER) :]
    match = re.match(r"\s*```python\n(.*?)```", after, re.DOTALL)
    assert match, f"{document.name}: no python block after {_MARKER}"
    return match.group(1)


def _documents() -> list[Path]:
    candidates = [REPO / "docs" / "api.md", REPO / "README.md"]
    return [d for d in candidates if d.exists() and _MARKER in d.read_text()]


@pytest.mark.parametrize("document", _documents(), ids=lambda d: d.name)
def test_quickstart_snippet_runs_against_ddtree_serve(document: Path, tmp_path: Path) -> None:
    snippet = _snippet(document)
    assert _DOC_ADDRESS in snippet
    server = subprocess.Popen(
        [sys.executable, "-m", "ddtree.service", "serve", "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "DDTREE_DEVICE": "cpu"},
    )
    log = LogWatcher(server.stderr)
    try:
        address = log.wait_for("event=listening").split("addresses=")[1].strip()
        log.wait_for("event=serving")
        script = tmp_path / "quickstart.py"
        script.write_text(snippet.replace(_DOC_ADDRESS, address))
        result = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert "accepted lengths: [9, 9]" in result.stdout
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.join()
        assert server.stderr is not None
        server.stderr.close()
