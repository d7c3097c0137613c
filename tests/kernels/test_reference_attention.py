"""``reference.verify_attention`` against fp64 dense attention with an explicit mask."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.assertions import assert_close
from helpers.generators import draft_logits, paged_cache, random_tree
from helpers.oracles import dense_attention

from ddtree.kernels import ErrorFlag, reference


@pytest.mark.parametrize("page_size", [1, 16, 64], ids=lambda p: f"page{p}")
@pytest.mark.parametrize(
    ("batch_size", "num_heads", "head_dim", "v_dim"),
    [
        pytest.param(1, 1, 40, 32, id="b1-h1-d40"),
        pytest.param(3, 2, 72, 64, id="b3-h2-d72"),
    ],
)
def test_matches_dense_attention(
    page_size: int, batch_size: int, num_heads: int, head_dim: int, v_dim: int
) -> None:
    tree = random_tree(batch_size, 20, 5, 9, shape="mixed", seed=page_size)
    prefix_lens = torch.tensor([0, 37, 130][:batch_size], dtype=torch.int32)
    cache, table = paged_cache(prefix_lens + tree.num_nodes, page_size, head_dim, seed=2)
    q = torch.randn(batch_size, 20, num_heads, head_dim).to(torch.bfloat16)
    out, lse = reference.verify_attention(q, cache, table, prefix_lens, tree, v_dim=v_dim)
    scale = 1 / math.sqrt(head_dim)
    expected_out, expected_lse = dense_attention(q, cache, table, prefix_lens, tree, v_dim, scale)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5, name="lse")
    assert_close(out, expected_out, atol=1e-2, rtol=1e-2, cosine_tol=1e-4, name="out")


def test_mla_shape_on_a_built_tree() -> None:
    """head_dim 576, v_dim 512 (MLA absorbed form), a DDTree from build_tree, custom scale."""
    logits = draft_logits(2, 3, 50, seed=1)
    tree = reference.build_tree(logits, torch.tensor([1, 2]), 12)
    prefix_lens = torch.tensor([5, 0], dtype=torch.int32)
    cache, table = paged_cache(prefix_lens + tree.num_nodes, 16, 576, seed=4)
    q = torch.randn(2, 13, 4, 576).to(torch.bfloat16)
    scale = 1 / math.sqrt(192)
    out, lse = reference.verify_attention(q, cache, table, prefix_lens, tree, sm_scale=scale)
    expected_out, expected_lse = dense_attention(q, cache, table, prefix_lens, tree, 512, scale)
    assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5, name="lse")
    assert_close(out, expected_out, atol=1e-2, rtol=1e-2, cosine_tol=1e-4, name="out")


def test_writes_into_given_outputs_and_pads_unused_nodes() -> None:
    tree = random_tree(2, 10, 3, 5, shape="random", seed=3)
    prefix_lens = torch.tensor([4, 0], dtype=torch.int32)
    cache, table = paged_cache(prefix_lens + tree.num_nodes, 4, 16, seed=1)
    q = torch.randn(2, 10, 2, 16).to(torch.bfloat16)
    out = torch.full((2, 10, 2, 8), 7.0, dtype=torch.bfloat16)
    lse = torch.full((2, 10, 2), 7.0)
    result = reference.verify_attention(
        q, cache, table, prefix_lens, tree, v_dim=8, out=out, lse=lse
    )
    assert result[0] is out and result[1] is lse
    for b in range(2):
        n = int(tree.num_nodes[b])
        assert (out[b, n:] == 0).all() and (lse[b, n:] == float("-inf")).all()
        assert torch.isfinite(lse[b, :n]).all()


def test_non_finite_values_stay_where_the_contract_puts_them() -> None:
    """NaN in cache rows past a request's range changes nothing; NaN in one node's q makes that
    node's rows NaN (never a finite answer), while padding slots keep 0 / -inf."""
    tree = random_tree(2, 10, 3, 5, shape="random", seed=5)
    prefix_lens = torch.tensor([6, 3], dtype=torch.int32)
    ends = prefix_lens + tree.num_nodes
    cache, table = paged_cache(ends + 8, 4, 16, seed=6)  # 8 spare rows past each range
    q = torch.randn(2, 10, 2, 16).to(torch.bfloat16)
    out, lse = reference.verify_attention(q, cache, table, prefix_lens, tree, v_dim=8)

    poisoned = cache.clone()
    for b in range(2):
        for position in range(int(ends[b]), int(ends[b]) + 8):
            poisoned[table[b, position // 4], position % 4] = float("nan")
    out2, lse2 = reference.verify_attention(q, poisoned, table, prefix_lens, tree, v_dim=8)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)

    q_nan = q.clone()
    q_nan[1, 0, 1] = float("nan")
    out3, lse3 = reference.verify_attention(q_nan, cache, table, prefix_lens, tree, v_dim=8)
    assert out3[1, 0, 1].isnan().all() and lse3[1, 0, 1].isnan()
    pad = int(tree.num_nodes[1])
    assert (out3[1, pad:] == 0).all() and (lse3[1, pad:] == float("-inf")).all()
    assert torch.equal(out3[0], out[0]) and torch.equal(lse3[0], lse[0])


def test_flagged_requests_keep_their_outputs() -> None:
    tree = random_tree(3, 8, 3, 5, shape="star", seed=1)
    prefix_lens = torch.tensor([3, 5, -2], dtype=torch.int32)
    cache, table = paged_cache(torch.tensor([11, 13, 8]), 4, 16, seed=2)
    table[1, 0] = 999
    q = torch.randn(3, 8, 1, 16).to(torch.bfloat16)
    out = torch.full((3, 8, 1, 16), 7.0, dtype=torch.bfloat16)
    lse = torch.full((3, 8, 1), 7.0)
    flags = torch.zeros(3, dtype=torch.int32)
    reference.verify_attention(
        q, cache, table, prefix_lens, tree, v_dim=16, out=out, lse=lse, error_flags=flags
    )
    assert flags.tolist() == [0, int(ErrorFlag.BLOCK_TABLE), int(ErrorFlag.LENGTH)]
    assert (out[1:] == 7).all() and (lse[1:] == 7).all()
    assert not (lse[0, : int(tree.num_nodes[0])] == 7).any()


def test_bad_prefix_without_error_flags_raises_naming_it() -> None:
    tree = random_tree(2, 8, 3, 5, seed=1)
    prefix_lens = torch.tensor([3, 40], dtype=torch.int32)
    cache, table = paged_cache(torch.tensor([11, 13]), 4, 16, seed=2)
    q = torch.randn(2, 8, 1, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^prefix_lens: .* request\(s\) \[1\]"):
        reference.verify_attention(q, cache, table, prefix_lens, tree, v_dim=16)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        pytest.param({"q": torch.zeros(2, 8, 1, 16)}, "q: expected dtype bfloat16", id="fp32-q"),
        pytest.param(
            {"q": torch.zeros(2, 9, 1, 16, dtype=torch.bfloat16)},
            r"q: expected shape \(batch_size, num_nodes_max, num_heads, head_dim\)",
            id="q-num-nodes",
        ),
        pytest.param(
            {"kv_cache": torch.zeros(8, 4, 12, dtype=torch.bfloat16)},
            r"kv_cache: expected head_dim = q.shape\[3\] = 16, got 12",
            id="kv-head-dim",
        ),
        pytest.param({"v_dim": 17}, r"v_dim: expected 1 <= v_dim <= 16", id="v-dim-17"),
        pytest.param({"sm_scale": 0.0}, "sm_scale: expected a finite float > 0", id="scale-0"),
        pytest.param(
            {"lse": torch.zeros(2, 8, 1, dtype=torch.bfloat16)},
            "lse: expected dtype float32",
            id="bf16-lse",
        ),
    ],
)
def test_bad_arguments_raise_naming_the_field(change: dict, pattern: str) -> None:
    arguments = {
        "q": torch.zeros(2, 8, 1, 16, dtype=torch.bfloat16),
        "kv_cache": torch.zeros(8, 4, 16, dtype=torch.bfloat16),
        "block_table": torch.zeros(2, 3, dtype=torch.int32),
        "prefix_lens": torch.zeros(2, dtype=torch.int32),
        "tree": random_tree(2, 8, 3, 5, seed=0),
        "v_dim": 16,
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=pattern):
        reference.verify_attention(**arguments)


@pytest.mark.gpu
def test_runs_on_cuda_like_on_cpu() -> None:
    tree = random_tree(3, 12, 4, 9, shape="mixed", seed=5)
    prefix_lens = torch.tensor([0, 9, 70], dtype=torch.int32)
    cache, table = paged_cache(prefix_lens + tree.num_nodes, 16, 64, seed=3)
    q = torch.randn(3, 12, 2, 64).to(torch.bfloat16)
    cpu_out, cpu_lse = reference.verify_attention(q, cache, table, prefix_lens, tree, v_dim=48)
    gpu_tree = type(tree)(
        **{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in tree.__dict__.items()}
    )
    gpu_out, gpu_lse = reference.verify_attention(
        q.cuda(), cache.cuda(), table.cuda(), prefix_lens.cuda(), gpu_tree, v_dim=48
    )
    assert_close(gpu_lse, cpu_lse, atol=1e-4, rtol=1e-5, name="lse")
    assert_close(gpu_out, cpu_out.float(), atol=1e-2, rtol=1e-2, name="out")
