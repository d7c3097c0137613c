"""Training and held-out text: the Python standard library's own ``.py`` sources.

Every Python installation ships them, so nothing is downloaded. The split is by file, decided
by a hash of the file's path relative to the stdlib directory, so it is the same on every
machine and every Python version (a file present in two versions lands on the same side):
a file is held out when the first byte of ``sha256(relative_path)`` is below
``HELD_OUT_BYTE_BELOW`` (about 10% of files). Files under ``site-packages`` and
``dist-packages`` are not part of the standard library and are skipped.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Literal

import torch

__all__ = [
    "HELD_OUT_BYTE_BELOW",
    "held_out_prompts",
    "is_held_out",
    "load_corpus",
    "stdlib_files",
]

HELD_OUT_BYTE_BELOW = 26
"""A file is held out when ``sha256(relative_path)[0] < 26`` (26 / 256, about 10%)."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

Split = Literal["train", "held_out"]


def is_held_out(relative_path: str) -> bool:
    """Whether the stdlib file at ``relative_path`` (POSIX form) belongs to the held-out split."""
    return hashlib.sha256(relative_path.encode()).digest()[0] < HELD_OUT_BYTE_BELOW


def stdlib_files(split: Split, root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of one split of the standard library.

    Parameters
    ----------
    split : {"train", "held_out"}
        Which side of the split.
    root : Path, optional
        Standard-library directory; default ``sysconfig.get_paths()["stdlib"]``.

    Returns
    -------
    list of Path
        Absolute paths, sorted by relative path.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    want_held_out = split == "held_out"
    found = []
    for path in base.rglob("*.py"):
        relative = path.relative_to(base)
        if _SKIP_DIRS.intersection(relative.parts[:-1]):
            continue
        if is_held_out(relative.as_posix()) == want_held_out:
            found.append((relative.as_posix(), path))
    return [path for _, path in sorted(found)]


def load_corpus(split: Split, root: Path | None = None) -> torch.Tensor:
    """All files of a split as one byte stream, each file followed by a newline.

    Returns
    -------
    torch.Tensor
        Shape ``(num_bytes,)``, uint8, CPU.
    """
    chunks = [path.read_bytes() + b"\n" for path in stdlib_files(split, root)]
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def held_out_prompts(count: int, prompt_bytes: int = 128, root: Path | None = None) -> list[bytes]:
    """Deterministic prompts from held-out files: the first ``prompt_bytes`` of a function body.

    Each prompt is cut from a different held-out file (files in sorted order, every file with a
    ``def`` at least ``prompt_bytes`` into it), ending just after the first line of the first
    ``def`` found past ``prompt_bytes``, so the model continues inside code.

    Parameters
    ----------
    count : int
        Number of prompts, ``>= 1``.
    prompt_bytes : int
        Length of each prompt in bytes.
    root : Path, optional
        Standard-library folder to read; default this interpreter's (see ``stdlib_files``).

    Returns
    -------
    list of bytes
        ``count`` prompts of exactly ``prompt_bytes`` bytes each.

    Raises
    ------
    ValueError
        The held-out split has fewer usable files than ``count``.
    """
    prompts = []
    for path in stdlib_files("held_out", root):
        text = path.read_bytes()
        start = text.find(b"\n    def ", prompt_bytes)
        if start < 0:
            continue
        end = text.find(b"\n", start + 1)
        if end < 0:
            continue
        prompts.append(text[end + 1 - prompt_bytes : end + 1])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"count: the held-out split has only {len(prompts)} usable files, got {count}")
