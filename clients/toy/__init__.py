"""A small trained target LM and parallel drafter for demos and end-to-end tests.

Byte-level (``vocab_size`` 256), trained in minutes on a CPU from the Python standard library's
sources (see ``ddtree.clients.toy.train`` and ``docs/demo.md``): a 3.2M-parameter target and a
1.6M-parameter drafter with ``draft_len`` 15. Their acceptance numbers are a small model's, not
a large model's.

Example
-------
>>> from ddtree.clients.toy import load_pair
>>> target, drafter = load_pair()
>>> drafter.config.draft_len
15
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from ddtree.clients.toy.model import DrafterConfig, TargetConfig, ToyDrafter, ToyTarget

__all__ = ["DrafterConfig", "TargetConfig", "ToyDrafter", "ToyTarget", "load_pair"]


def _load_state(name: str, weights_dir: Path | None) -> dict[str, object]:
    if weights_dir is not None:
        return dict(torch.load(weights_dir / f"{name}.pt", map_location="cpu", weights_only=True))
    path = resources.files("ddtree.clients.toy").joinpath("weights").joinpath(f"{name}.pt")
    with resources.as_file(path) as file:
        return dict(torch.load(file, map_location="cpu", weights_only=True))


def load_pair(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    weights_dir: Path | None = None,
) -> tuple[ToyTarget, ToyDrafter]:
    """The committed target and drafter, in eval mode, without gradients.

    Parameters
    ----------
    device : str or torch.device
        Where to put both models.
    dtype : torch.dtype
        Float dtype to run them in (the weights are stored in fp16).
    weights_dir : Path, optional
        A folder with ``target.pt`` and ``drafter.pt`` written by ``ddtree.clients.toy.train``;
        default: the weights shipped in this package.

    Returns
    -------
    tuple of (ToyTarget, ToyDrafter)
    """
    target_state = _load_state("target", weights_dir)
    drafter_state = _load_state("drafter", weights_dir)
    target = ToyTarget(TargetConfig(**target_state["config"]))  # type: ignore[arg-type]
    target.load_state_dict(target_state["state_dict"])  # type: ignore[arg-type]
    drafter = ToyDrafter(DrafterConfig(**drafter_state["config"]))  # type: ignore[arg-type]
    drafter.load_state_dict(drafter_state["state_dict"])  # type: ignore[arg-type]
    models = []
    for model in (target, drafter):
        model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        models.append(model)
    return target, drafter
