"""``ddtree.kernels.checks``: argument errors that name the field, and the data-flag bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.generators import draft_logits, random_tree

from ddtree.kernels import ErrorFlag, build_tree, checks
from ddtree.kernels.types import Acceptance

TREE, TOKEN = int(ErrorFlag.TREE), int(ErrorFlag.TOKEN)
BLOCK, LENGTH, PATH = int(ErrorFlag.BLOCK_TABLE), int(ErrorFlag.LENGTH), int(ErrorFlag.ACCEPTANCE)


@pytest.mark.parametrize(
    ("logits", "budget", "kwargs", "error", "pattern"),
    [
        pytest.param(
            torch.zeros(4, 33, 100),
            4,
            {},
            ValueError,
            r"draft_logits: expected shape \(batch_size, draft_len, vocab_size\) with .*"
            r"1 <= draft_len <= 32.*got \(4, 33, 100\)",
            id="draft-len-33",
        ),
        pytest.param(
            torch.zeros(4, 3, 10, dtype=torch.int32),
            4,
            {},
            ValueError,
            "draft_logits: expected dtype bfloat16/float16/float32, got torch.int32",
            id="int-logits",
        ),
        pytest.param(
            torch.zeros(4, 10),
            4,
            {},
            ValueError,
            r"draft_logits: expected shape \(batch_size, draft_len, vocab_size\) = \(\*, \*, \*\)",
            id="rank-2-logits",
        ),
        pytest.param(
            torch.zeros(4, 3, 10).transpose(1, 2),
            4,
            {},
            ValueError,
            r"draft_logits: expected a contiguous tensor; pass draft_logits.contiguous\(\)",
            id="strided-logits",
        ),
        pytest.param(
            torch.zeros(4, 3, 10),
            0,
            {},
            ValueError,
            "budget: expected 1 <= budget <= 1024",
            id="b0",
        ),
        pytest.param(
            torch.zeros(4, 3, 10), 1025, {}, ValueError, "budget: .* got 1025", id="budget-1025"
        ),
        pytest.param(
            torch.zeros(4, 3, 10), 2.0, {}, TypeError, "budget: expected an int", id="float-budget"
        ),
        pytest.param(
            torch.zeros(4, 3, 10),
            8,
            {"max_budget": 4},
            ValueError,
            "max_budget: expected max_budget >= budget = 8, got 4",
            id="max-budget-below-budget",
        ),
        pytest.param(
            torch.zeros(4, 3, 10),
            torch.tensor([1, 2, 3, 1025]),
            {},
            ValueError,
            r"budget: expected every entry in \[1, 1024\], got values in \[1, 1025\]",
            id="budget-tensor-1025",
        ),
        pytest.param(
            torch.zeros(4, 3, 10),
            torch.tensor([1, 2, 3]),
            {},
            ValueError,
            r"budget: expected shape \(batch_size,\) = \(4,\), got \(3,\)",
            id="budget-tensor-short",
        ),
        pytest.param(
            torch.zeros(4, 3, 10),
            4,
            {"temperature": 0.0},
            ValueError,
            "temperature: expected a finite float > 0, got 0.0",
            id="temperature-0",
        ),
        pytest.param(
            torch.zeros(4, 3, 10),
            4,
            {"error_flags": torch.zeros(4, dtype=torch.int64)},
            ValueError,
            "error_flags: expected dtype int32, got torch.int64",
            id="int64-error-flags",
        ),
    ],
)
def test_build_tree_argument_errors_name_the_field(
    logits: torch.Tensor, budget: object, kwargs: dict, error: type, pattern: str
) -> None:
    roots = torch.zeros(logits.shape[0] if logits.dim() else 1, dtype=torch.int64)
    with pytest.raises(error, match=pattern):
        build_tree(logits, roots, budget, backend="reference", **kwargs)


def test_root_tokens_must_be_a_tensor() -> None:
    with pytest.raises(TypeError, match="root_tokens: expected a torch.Tensor"):
        build_tree(torch.zeros(2, 3, 5), [0, 1], 3, backend="reference")


def test_normalize_budget_forms() -> None:
    cpu = torch.device("cpu")
    budgets, n = checks.normalize_budget(7, 3, cpu, None)
    assert (budgets.tolist(), n, budgets.dtype) == ([7, 7, 7], 8, torch.int32)
    budgets, n = checks.normalize_budget(7, 2, cpu, 9)
    assert (budgets.tolist(), n) == ([7, 7], 10)
    budgets, n = checks.normalize_budget(torch.tensor([3, 5]), 2, cpu, None)
    assert (budgets.tolist(), n, budgets.dtype) == ([3, 5], 6, torch.int32)
    budgets, n = checks.normalize_budget(torch.tensor([0, 50], dtype=torch.int32), 2, cpu, 9)
    assert (budgets.tolist(), n) == ([1, 9], 10)


def test_tree_flags_find_each_malformation() -> None:
    tree = random_tree(6, 8, 3, 5, shape="chain", seed=0)
    num_nodes = torch.full((6,), 4, dtype=torch.int32)
    parents, depths = tree.parents.clone(), tree.depths.clone()
    num_nodes[1] = 0  # no root
    num_nodes[2] = 9  # more than num_nodes_max
    parents[3, 2] = 2  # not an earlier node
    depths[4, 3] = 4  # deeper than draft_len (and not parent depth + 1)
    depths[5, 0] = 1  # root not at depth 0
    bad = dataclasses.replace(tree, num_nodes=num_nodes, parents=parents, depths=depths)
    assert checks.tree_flags(bad).tolist() == [0, TREE, TREE, TREE, TREE, TREE]
    # Damage past num_nodes is ignored.
    parents[0, 5] = 7
    assert int(checks.tree_flags(dataclasses.replace(bad, parents=parents))[0]) == 0


def test_token_flags() -> None:
    assert checks.root_token_flags(torch.tensor([0, 9, 10, -1]), 10).tolist() == [
        0,
        0,
        TOKEN,
        TOKEN,
    ]
    tree = random_tree(2, 5, 3, 5, shape="star", seed=0)
    tree = dataclasses.replace(tree, num_nodes=torch.tensor([3, 5], dtype=torch.int32))
    targets = torch.zeros(2, 5, dtype=torch.int64)
    targets[0, 4] = -1  # past num_nodes: ignored
    targets[1, 4] = -1
    assert checks.target_token_flags(tree, targets).tolist() == [0, TOKEN]


def _acceptance(nodes: list[list[int]], lengths: list[int]) -> Acceptance:
    node_tensor = torch.tensor(nodes, dtype=torch.int32)
    return Acceptance(
        nodes=node_tensor,
        tokens=torch.zeros(node_tensor.shape, dtype=torch.int64),
        length=torch.tensor(lengths, dtype=torch.int32),
        bonus=torch.zeros(len(lengths), dtype=torch.int64),
    )


def test_acceptance_flags() -> None:
    acceptance = _acceptance(
        [[0, 1, 4], [0, 2, -1], [1, 2, 3], [0, 3, 3], [0, -1, -1], [0, 1, 2]],
        [3, 2, 3, 3, 0, 4],
    )
    assert checks.acceptance_flags(acceptance).tolist() == [0, 0, PATH, PATH, PATH, PATH]


def test_commit_kv_flags_check_only_touched_blocks() -> None:
    acceptance = _acceptance([[0, 5], [0, 1], [0, 1], [0, 2]], [2, 2, 2, 1])
    # page_size 4, max_pages 3: capacity 12.
    table = torch.tensor([[0, 9, 1], [2, -1, 3], [4, 5, 6], [7, 8, 8]], dtype=torch.int32)
    prefix = torch.tensor([0, 1, 11, -1], dtype=torch.int32)
    flags = checks.commit_kv_flags(table, prefix, acceptance, num_pages=9, page_size=4)
    # Request 0 reads position 5 (block 1 -> page 9, bad); request 1 touches only block 0;
    # request 2 reaches position 12 (past capacity); request 3 has a negative prefix.
    assert flags.tolist() == [BLOCK, 0, LENGTH, LENGTH]


def test_attention_flags() -> None:
    tree = random_tree(4, 6, 3, 5, shape="star", seed=0)
    num_nodes = torch.tensor([6, 6, 0, 3], dtype=torch.int32)
    tree = dataclasses.replace(tree, num_nodes=num_nodes)
    table = torch.tensor([[0, 1, 2], [3, -1, 4], [5, 6, 7], [8, 8, -7]], dtype=torch.int32)
    prefix = torch.tensor([6, 1, 0, 10], dtype=torch.int32)
    flags = checks.attention_flags(table, prefix, tree, num_pages=9, page_size=4)
    assert flags.tolist() == [0, BLOCK, TREE, LENGTH | BLOCK]


def test_resolve_flags_ors_into_error_flags_and_skips_old_bits() -> None:
    error_flags = torch.tensor([0, LENGTH, 0], dtype=torch.int32)
    skip = checks.resolve_flags(torch.tensor([0, 0, TOKEN], dtype=torch.int32), error_flags, {})
    assert error_flags.tolist() == [0, LENGTH, TOKEN]
    assert skip.tolist() == [False, True, True]


def test_resolve_flags_raises_with_every_field_and_request() -> None:
    flags = torch.tensor([0, TREE, TOKEN | TREE] + [TOKEN] * 20, dtype=torch.int32)
    with pytest.raises(ValueError) as raised:
        checks.resolve_flags(flags, None, checks.FLAG_MESSAGES["accept"])
    message = str(raised.value)
    assert message.startswith("tree: malformed")
    assert "in request(s) [1, 2]" in message
    assert "target_tokens: negative token id" in message
    assert "[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, ...]" in message
    assert "pass error_flags" in message


def test_public_op_dispatches_to_the_reference_on_cpu() -> None:
    logits = draft_logits(2, 3, 9, seed=1)
    tree = build_tree(logits, torch.tensor([1, 2]), 5)
    assert tree.num_nodes.tolist() == [6, 6]
