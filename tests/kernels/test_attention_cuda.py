"""CUDA ``verify_attention`` against the fp32 reference, plus launch planning without a GPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.assertions import assert_close
from helpers.generators import paged_cache, random_tree

from ddtree.kernels import attention_cuda, checks, jit, reference
from ddtree.kernels.types import ErrorFlag, Tree

HEAD_DIM = 576
V_DIM = 512
H200 = {"num_sms": 132, "max_shared_mem_bytes": 232448}
SM120 = {"num_sms": 170, "max_shared_mem_bytes": 101376}


# ----------------------------------------------------------------------------- no GPU needed


@pytest.mark.parametrize("device", [H200, SM120], ids=["h200", "sm120"])
@pytest.mark.parametrize(
    ("batch_size", "num_heads", "num_nodes_max", "capacity"),
    [(1, 1, 1, 1), (1, 8, 65, 4161), (32, 8, 65, 8257), (4, 128, 65, 32833), (3, 16, 1025, 131072)],
)
def test_plan_fits_the_device(
    device: dict[str, int], batch_size: int, num_heads: int, num_nodes_max: int, capacity: int
) -> None:
    plan = attention_cuda.plan_launch(
        batch_size, num_nodes_max, num_heads, HEAD_DIM, V_DIM, capacity, **device
    )
    config = plan.config
    assert config.shared_mem_bytes <= device["max_shared_mem_bytes"]
    rows = num_nodes_max * num_heads
    assert plan.attention.grid == (math.ceil(rows / config.block_m), plan.num_splits, batch_size)
    assert plan.attention.block == (config.threads, 1, 1)
    assert plan.attention.shared_mem_bytes == config.shared_mem_bytes
    assert 1 <= plan.num_splits <= max(1, math.ceil(capacity / config.block_n))
    assert (plan.combine is None) == (plan.num_splits == 1)
    if plan.combine is not None:
        assert plan.combine.grid == (rows, batch_size, 1)


def test_plan_splits_small_batches_only() -> None:
    small = attention_cuda.plan_launch(1, 65, 8, HEAD_DIM, V_DIM, 8257, **H200)
    large = attention_cuda.plan_launch(4, 65, 128, HEAD_DIM, V_DIM, 32833, **H200)
    assert small.num_splits > 4
    assert large.num_splits == 1


def test_tile_configs() -> None:
    big = attention_cuda.tile_config(HEAD_DIM, V_DIM, H200["max_shared_mem_bytes"])
    assert (big.block_m, big.block_n, big.threads, big.shared_mem_bytes) == (64, 64, 256, 231424)
    small = attention_cuda.tile_config(HEAD_DIM, V_DIM, SM120["max_shared_mem_bytes"])
    assert (small.block_m, small.block_n, small.threads) == (32, 16, 128)
    assert small.shared_mem_bytes <= SM120["max_shared_mem_bytes"]
    hopper = attention_cuda.tile_config(HEAD_DIM, V_DIM, 232448, use_wgmma=True)
    assert hopper.wgmma and hopper.arch == "sm_90a" and hopper.shared_mem_bytes <= 232448
    assert hopper.defines()["VA_WGMMA"] == 1 and big.defines()["VA_WGMMA"] == 0
    narrow = attention_cuda.tile_config(HEAD_DIM, 256, 232448, use_wgmma=True)
    assert not narrow.wgmma  # the wgmma variant is built for v_dim 512 only


@pytest.mark.parametrize(("head_dim", "v_dim"), [(576, 500), (100, 64), (576, 640), (128, 192)])
def test_tile_config_rejects_unsupported_widths(head_dim: int, v_dim: int) -> None:
    with pytest.raises(ValueError, match="backend='reference'"):
        attention_cuda.tile_config(head_dim, v_dim, H200["max_shared_mem_bytes"])


@pytest.mark.skipif(not jit.is_available(), reason="cuda-python with NVRTC is not installed")
@pytest.mark.parametrize(
    ("arch", "limits", "use_wgmma"),
    [("sm_90a", H200, True), ("sm_100", H200, False), ("sm_120", SM120, False)],
    ids=["wgmma-sm_90a", "mma-sync-sm_100", "small-tiles-sm_120"],
)
def test_selected_variant_compiles(
    arch: str, limits: dict[str, int], use_wgmma: bool, tmp_path
) -> None:
    """The variant each device family selects compiles with NVRTC (no GPU needed)."""
    config = attention_cuda.tile_config(
        HEAD_DIM, V_DIM, limits["max_shared_mem_bytes"], use_wgmma=use_wgmma
    )
    assert config.wgmma == use_wgmma
    cubin, _ = jit.compile_cubin(
        "verify_attention.cu",
        config.arch or arch,
        config.defines(),
        cache=jit.KernelCache(tmp_path),
    )
    assert cubin.startswith(b"\x7fELF")


# ----------------------------------------------------------------------------- on the GPU


@dataclasses.dataclass
class Case:
    batch_size: int
    num_heads: int
    num_nodes_max: int
    page_size: int
    prefix_lens: list[int]
    tree_shape: str
    sm_scale: float | None = None
    seed: int = 0


CASES = {
    "h1-n1-page1": Case(3, 1, 1, 1, [0, 5, 37], "random"),
    "h8-n17-page16-chain": Case(2, 8, 17, 16, [0, 100], "chain"),
    "h16-n65-page64-mixed": Case(3, 16, 65, 64, [1000, 0, 4097], "mixed", 1 / math.sqrt(192)),
    "h128-n65-page16-star": Case(1, 128, 65, 16, [300], "star"),
    "h64-n17-page1-random": Case(2, 64, 17, 1, [513, 64], "random"),
    "h8-n1025-page64-random": Case(1, 8, 1025, 64, [2000], "random"),
    "h8-n65-page64-long": Case(3, 8, 65, 64, [131072 - 65, 70001, 1], "mixed"),
    "h1-n65-page16-short": Case(5, 1, 65, 16, [3, 0, 64, 17, 129], "mixed", 0.2),
}


def _inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, ...]:
    tree = random_tree(
        case.batch_size, case.num_nodes_max, 32, 1000, shape=case.tree_shape, seed=case.seed
    )
    prefix_lens = torch.tensor(case.prefix_lens, dtype=torch.int32)
    kv_cache, block_table = paged_cache(
        prefix_lens + case.num_nodes_max, case.page_size, HEAD_DIM, seed=case.seed + 1
    )
    gen = torch.Generator().manual_seed(case.seed + 2)
    q = torch.randn(
        case.batch_size, case.num_nodes_max, case.num_heads, HEAD_DIM, generator=gen
    ).to(torch.bfloat16)
    tree = Tree(
        **{
            f.name: getattr(tree, f.name).to(device) if f.name != "draft_len" else tree.draft_len
            for f in dataclasses.fields(Tree)
        }
    )
    return q.to(device), kv_cache.to(device), block_table.to(device), prefix_lens.to(device), tree


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(e)
    return float((a[finite] - e[finite]).norm() / e[finite].norm().clamp(min=1e-30))


def _poisoned(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (case.batch_size, case.num_nodes_max, case.num_heads)
    out = torch.full((*shape, V_DIM), math.nan, dtype=torch.bfloat16, device=device)
    lse = torch.full(shape, math.nan, device=device)
    return out, lse


def _check_against_reference(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> None:
    # Non-finite positions (padding rows: lse -inf) must match exactly; no NaN may survive.
    assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3, cosine_tol=None, name="lse")
    assert_close(out, ref_out, atol=2e-2, rtol=5e-2, cosine_tol=1e-4, name="out")
    assert _relative_error(out, ref_out) < 1e-2
    assert _relative_error(lse, ref_lse) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str) -> None:
    """The public CUDA op (the wgmma variant on Hopper) on poisoned outputs."""
    case = CASES[name]
    device = torch.device("cuda")
    q, kv_cache, block_table, prefix_lens, tree = _inputs(case, device)
    ref_out, ref_lse = reference.verify_attention(
        q, kv_cache, block_table, prefix_lens, tree, v_dim=V_DIM, sm_scale=case.sm_scale
    )
    out, lse = _poisoned(case, device)
    flags = torch.zeros(case.batch_size, dtype=torch.int32, device=device)
    got_out, got_lse = attention_cuda.verify_attention(
        q,
        kv_cache,
        block_table,
        prefix_lens,
        tree,
        v_dim=V_DIM,
        sm_scale=case.sm_scale,
        out=out,
        lse=lse,
        error_flags=flags,
    )
    assert got_out is out and got_lse is lse
    assert int(flags.abs().sum()) == 0
    _check_against_reference(out, lse, ref_out, ref_lse)


def _variants() -> list[tuple[str, dict[str, int], bool]]:
    """(id, device limits, use_wgmma) of every variant this GPU can run."""
    _, max_smem = attention_cuda._device_limits(torch.cuda.current_device())
    found = [("sm120-tiles", SM120, False), ("mma-sync", H200, False)]
    if attention_cuda.has_wgmma(torch.cuda.current_device()):
        found.append(("wgmma", H200, True))
    return [v for v in found if v[1]["max_shared_mem_bytes"] <= max_smem]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name", ["h8-n17-page16-chain", "h16-n65-page64-mixed", "h8-n1025-page64-random"]
)
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_every_variant_and_forced_splits(name: str, splits: int) -> None:
    """Every kernel variant this GPU can run (the sm_120 tiles too) at fixed split counts."""
    case = CASES[name]
    device = torch.device("cuda")
    q, kv_cache, block_table, prefix_lens, tree = _inputs(case, device)
    ref_out, ref_lse = reference.verify_attention(
        q, kv_cache, block_table, prefix_lens, tree, v_dim=V_DIM
    )
    variants = _variants()
    assert variants, "no kernel variant fits this GPU"
    for variant, limits, use_wgmma in variants:
        plan = attention_cuda.plan_launch(
            case.batch_size,
            case.num_nodes_max,
            case.num_heads,
            HEAD_DIM,
            V_DIM,
            1,
            **limits,
            num_splits=splits,
            use_wgmma=use_wgmma,
        )
        out, lse = _poisoned(case, device)
        flags = torch.zeros(case.batch_size, dtype=torch.int32, device=device)
        attention_cuda._run(
            plan,
            q,
            kv_cache,
            block_table,
            prefix_lens,
            tree,
            1 / math.sqrt(HEAD_DIM),
            out,
            lse,
            flags,
        )
        try:
            _check_against_reference(out, lse, ref_out, ref_lse)
        except AssertionError as err:
            raise AssertionError(f"variant {variant}: {err}") from err


def _corrupt(
    kind: str, block_table: torch.Tensor, prefix_lens: torch.Tensor, tree: Tree, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor, Tree, ErrorFlag]:
    block_table, prefix_lens = block_table.clone(), prefix_lens.clone()
    if kind == "page-too-large":
        block_table[1, 0] = num_pages
        return block_table, prefix_lens, tree, ErrorFlag.BLOCK_TABLE
    if kind == "page-negative":
        last = (int(prefix_lens[1]) + int(tree.num_nodes[1]) - 1) // 16
        block_table[1, last] = -7
        return block_table, prefix_lens, tree, ErrorFlag.BLOCK_TABLE
    if kind == "prefix-negative":
        prefix_lens[1] = -1
        return block_table, prefix_lens, tree, ErrorFlag.LENGTH
    if kind == "prefix-too-long":
        prefix_lens[1] = block_table.shape[1] * 16
        return block_table, prefix_lens, tree, ErrorFlag.LENGTH
    num_nodes = tree.num_nodes.clone()
    num_nodes[1] = 0
    return block_table, prefix_lens, dataclasses.replace(tree, num_nodes=num_nodes), ErrorFlag.TREE


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind", ["page-too-large", "page-negative", "prefix-negative", "prefix-too-long", "no-nodes"]
)
def test_bad_request_is_flagged_and_untouched(kind: str) -> None:
    case = Case(3, 8, 65, 16, [40, 300, 7], "mixed", seed=3)
    device = torch.device("cuda")
    q, kv_cache, block_table, prefix_lens, tree = _inputs(case, device)
    bad_table, bad_prefix, bad_tree, flag = _corrupt(
        kind, block_table, prefix_lens, tree, kv_cache.shape[0]
    )
    out, lse = _poisoned(case, device)
    flags = torch.zeros(case.batch_size, dtype=torch.int32, device=device)
    flags[2] = int(ErrorFlag.TOKEN)  # set by an earlier op: request 2 must be skipped too
    attention_cuda.verify_attention(
        q, kv_cache, bad_table, bad_prefix, bad_tree, out=out, lse=lse, error_flags=flags
    )
    # The bits are exactly the specification's (checks.attention_flags); a prefix past the
    # table's end also reads its -1 spare column, so it carries BLOCK_TABLE besides LENGTH.
    expected = checks.attention_flags(
        bad_table, bad_prefix, bad_tree, kv_cache.shape[0], kv_cache.shape[1]
    )
    expected[2] |= int(ErrorFlag.TOKEN)
    assert flags.tolist() == expected.tolist()
    assert int(flags[1]) & int(flag) and int(flags[0]) == 0
    assert bool(out[1:].isnan().all()) and bool(lse[1:].isnan().all())
    ref_out, ref_lse = reference.verify_attention(
        q[:1], kv_cache, block_table[:1], prefix_lens[:1], _first(tree)
    )
    _check_against_reference(out[:1], lse[:1], ref_out, ref_lse)
    with pytest.raises(ValueError, match="request\\(s\\) \\[1\\]"):
        attention_cuda.verify_attention(q, kv_cache, bad_table, bad_prefix, bad_tree)


def _first(tree: Tree) -> Tree:
    return Tree(
        **{
            f.name: getattr(tree, f.name)[:1] if f.name != "draft_len" else tree.draft_len
            for f in dataclasses.fields(Tree)
        }
    )


@pytest.mark.gpu
def test_public_op_dispatches_here() -> None:
    from ddtree.kernels.attention import verify_attention

    case = CASES["h8-n17-page16-chain"]
    device = torch.device("cuda")
    q, kv_cache, block_table, prefix_lens, tree = _inputs(case, device)
    out, lse = verify_attention(q, kv_cache, block_table, prefix_lens, tree, backend="cuda")
    ref_out, ref_lse = reference.verify_attention(q, kv_cache, block_table, prefix_lens, tree)
    _check_against_reference(out, lse, ref_out, ref_lse)
