"""``assert_close`` and exact-equality helpers that report where tensors differ."""

from __future__ import annotations

import torch

from ddtree.kernels.types import Acceptance, Tree

__all__ = ["assert_close", "assert_equal", "assert_same_acceptance", "assert_same_tree"]


def _positions(mask: torch.Tensor, limit: int = 5) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in idx) for idx in torch.nonzero(mask)[:limit]]


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> None:
    """Require identical shape, dtype and values (NaN equals NaN); report the first mismatches.

    Raises
    ------
    AssertionError
        With the shapes, dtypes or up to five differing positions and their values.
    """
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    actual, expected = actual.cpu(), expected.cpu()
    same = actual == expected
    if actual.is_floating_point():
        same |= torch.isnan(actual) & torch.isnan(expected)
    if not bool(same.all()):
        where = _positions(~same)
        detail = ", ".join(f"{p}: {actual[p].item()} vs {expected[p].item()}" for p in where)
        raise AssertionError(f"{name}: {int((~same).sum())} mismatches; first {detail}")


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    cosine_tol: float | None = 1e-5,
    name: str = "tensor",
) -> None:
    """Compare floating tensors: non-finite masks first, then tolerances, then cosine distance.

    The NaN, ``+inf`` and ``-inf`` positions must match exactly. Finite entries must satisfy
    ``|actual - expected| <= atol + rtol * |expected|``. For more than 1,000 finite entries the
    cosine distance of the flattened finite values must also be ``<= cosine_tol`` (catches a
    systematic bias that stays inside elementwise tolerances).

    Parameters
    ----------
    actual, expected : torch.Tensor
        Same shape; any floating dtype and device (compared in fp64 on the CPU).
    atol, rtol : float
        Elementwise tolerances.
    cosine_tol : float, optional
        Cosine-distance bound for long vectors; None skips the check.
    name : str
        Shown in messages.

    Raises
    ------
    AssertionError
        Naming the first differing non-finite positions, or the worst positions with values.
    """
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    for label, test in (
        ("NaN", torch.isnan),
        ("+inf", lambda t: t == float("inf")),
        ("-inf", lambda t: t == float("-inf")),
    ):
        differ = test(a) != test(e)
        if bool(differ.any()):
            where = _positions(differ)
            detail = ", ".join(f"{p}: {a[p].item()} vs {e[p].item()}" for p in where)
            raise AssertionError(
                f"{name}: {label} positions differ ({int(differ.sum())}); {detail}"
            )
    finite = torch.isfinite(e)
    error = torch.where(finite, (a - e).abs(), 0.0)
    excess = error - (atol + rtol * e.abs())
    if bool((excess > 0).any()):
        worst = torch.argsort(excess.flatten(), descending=True)[:5]
        rows = []
        for flat in worst.tolist():
            if excess.flatten()[flat] <= 0:
                break
            pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
            rows.append(f"{pos}: {a[pos].item():.8g} vs {e[pos].item():.8g}")
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())} of {e.numel()} entries outside "
            f"atol={atol}, rtol={rtol}; max abs error {error.max().item():.3g}; worst "
            + ", ".join(rows)
        )
    if cosine_tol is not None and int(finite.sum()) > 1000:
        fa, fe = a[finite], e[finite]
        denominator = fa.norm() * fe.norm()
        if denominator > 0:
            distance = 1.0 - float(fa @ fe / denominator)
            assert distance <= cosine_tol, f"{name}: cosine distance {distance:.3g} > {cosine_tol}"


def assert_same_tree(actual: Tree, expected: Tree, *, log_prob_atol: float = 0.0) -> None:
    """Two trees agree: every integer field exactly, ``log_probs`` within ``log_prob_atol``.

    ``log_prob_atol = 0`` demands bit equality (the reference against itself on one device);
    a CUDA kernel whose fp32 ``log_softmax`` differs by a few ulps passes a small tolerance.
    """
    assert actual.draft_len == expected.draft_len, (
        f"draft_len {actual.draft_len} != {expected.draft_len}"
    )
    for field in ("num_nodes", "tokens", "parents", "depths", "mask"):
        assert_equal(getattr(actual, field).cpu(), getattr(expected, field).cpu(), f"tree.{field}")
    if log_prob_atol == 0.0:
        assert_equal(actual.log_probs.cpu(), expected.log_probs.cpu(), "tree.log_probs")
    else:
        assert_close(
            actual.log_probs, expected.log_probs, atol=log_prob_atol, rtol=0.0, name="log_probs"
        )


def assert_same_acceptance(actual: Acceptance, expected: Acceptance) -> None:
    """Two acceptances agree exactly in every field."""
    for field in ("nodes", "tokens", "length", "bonus"):
        assert_equal(
            getattr(actual, field).cpu(), getattr(expected, field).cpu(), f"acceptance.{field}"
        )
