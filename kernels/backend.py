"""Choice between the CUDA kernels and the pure-torch reference for one op call."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Backend", "resolve_backend"]

Backend = Literal["auto", "cuda", "reference"]


def resolve_backend(backend: Backend, device: torch.device) -> Literal["cuda", "reference"]:
    """Return the backend that will run an op whose tensors live on ``device``.

    Parameters
    ----------
    backend : {"auto", "cuda", "reference"}
        What the caller asked for. ``"auto"`` takes the kernels for CUDA tensors when the runtime
        compiler is usable, else the reference.
    device : torch.device
        Device of the op's tensors.

    Returns
    -------
    str
        ``"cuda"`` or ``"reference"``.

    Raises
    ------
    ValueError
        ``backend`` is unknown, or ``"cuda"`` was asked for tensors that are not on a GPU.
    RuntimeError
        ``"cuda"`` was asked for but the runtime compiler (NVRTC through cuda-python) is missing;
        the message says which package to install.
    """
    if backend == "reference":
        return "reference"
    if backend not in ("auto", "cuda"):
        raise ValueError(f"backend: expected 'auto', 'cuda' or 'reference', got {backend!r}")
    if device.type != "cuda":
        if backend == "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got tensors on {device}")
        return "reference"
    from ddtree.kernels import jit

    if backend == "cuda":
        jit.require_available()
        return "cuda"
    return "cuda" if jit.is_available() else "reference"
