"""The runtime compiler's cache and launch parameters, without a GPU."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from ddtree.kernels import jit, tree_cuda

needs_nvrtc = pytest.mark.skipif(
    not jit.is_available(),
    reason="cuda-python with NVRTC is not installed (pip install 'ddtree[cuda]')",
)

_VERSIONS = {"nvrtc_version": "13.0", "driver_version": "none", "headers_version": "h"}


def test_cache_key_changes_with_every_input() -> None:
    base = jit.cache_key("src", ["-DA=1", "--std=c++17"], "sm_90", **_VERSIONS)
    assert base == jit.cache_key("src", ["--std=c++17", "-DA=1"], "sm_90", **_VERSIONS)
    variants = [
        jit.cache_key("src2", ["-DA=1", "--std=c++17"], "sm_90", **_VERSIONS),
        jit.cache_key("src", ["-DA=2", "--std=c++17"], "sm_90", **_VERSIONS),
        jit.cache_key("src", ["-DA=1", "--std=c++17"], "sm_100", **_VERSIONS),
        jit.cache_key(
            "src", ["-DA=1", "--std=c++17"], "sm_90", **{**_VERSIONS, "nvrtc_version": "13.1"}
        ),
        jit.cache_key(
            "src", ["-DA=1", "--std=c++17"], "sm_90", **{**_VERSIONS, "driver_version": "13000"}
        ),
        jit.cache_key(
            "src", ["-DA=1", "--std=c++17"], "sm_90", **{**_VERSIONS, "headers_version": "x"}
        ),
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_load_source_inlines_local_headers() -> None:
    for name in jit.kernel_sources():
        text = jit.load_source(name)
        assert '#include "' not in text, name
    assert "ddtree_mix32" in jit.load_source("commit_kv.cu")


def test_cache_put_is_atomic(tmp_path, monkeypatch) -> None:
    cache = jit.KernelCache(tmp_path)
    cache.put("k" * 64, b"\x7fELF-old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        cache.put("k" * 64, b"\x7fELF-new")
    monkeypatch.undo()
    assert cache.get("k" * 64) == b"\x7fELF-old"
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_corrupt_entry_is_a_miss_and_removed(tmp_path, caplog) -> None:
    cache = jit.KernelCache(tmp_path)
    (tmp_path / f"{'a' * 64}.cubin").write_bytes(b"garbage")
    assert cache.get("a" * 64) is None
    assert not (tmp_path / f"{'a' * 64}.cubin").exists()
    assert "corrupt" in caplog.text


@needs_nvrtc
def test_corrupt_entry_is_rebuilt(tmp_path) -> None:
    cache = jit.KernelCache(tmp_path)
    cubin, key = jit.compile_cubin("commit_kv.cu", "sm_90", cache=cache)
    (tmp_path / f"{key}.cubin").write_bytes(b"truncated")
    again, key2 = jit.compile_cubin("commit_kv.cu", "sm_90", cache=cache)
    assert key2 == key
    assert again == cubin
    assert (tmp_path / f"{key}.cubin").read_bytes() == cubin


@needs_nvrtc
def test_cache_hit_and_key_depend_on_defines_and_arch(tmp_path) -> None:
    cache = jit.KernelCache(tmp_path)
    _, k1 = jit.compile_cubin("commit_kv.cu", "sm_90", cache=cache)
    _, k2 = jit.compile_cubin("commit_kv.cu", "sm_90", {"COLS_PER_BLOCK": 32}, cache=cache)
    _, k3 = jit.compile_cubin("commit_kv.cu", "sm_120", cache=cache)
    assert len({k1, k2, k3}) == 3
    assert sorted(p.stem for p in tmp_path.glob("*.cubin")) == sorted([k1, k2, k3])


@needs_nvrtc
def test_disable_jit_turns_a_miss_into_an_error(tmp_path, monkeypatch) -> None:
    cache = jit.KernelCache(tmp_path)
    monkeypatch.setenv("DDTREE_DISABLE_JIT", "1")
    with pytest.raises(jit.CompileError, match="DDTREE_DISABLE_JIT") as info:
        jit.compile_cubin("commit_kv.cu", "sm_90", cache=cache)
    assert len(info.value.cache_key) == 64
    monkeypatch.delenv("DDTREE_DISABLE_JIT")
    cubin, key = jit.compile_cubin("commit_kv.cu", "sm_90", cache=cache)
    monkeypatch.setenv("DDTREE_DISABLE_JIT", "1")
    assert jit.compile_cubin("commit_kv.cu", "sm_90", cache=cache) == (cubin, key)


@needs_nvrtc
def test_compile_error_carries_log_and_key(tmp_path) -> None:
    with pytest.raises(jit.CompileError) as info:
        jit.compile_cubin(
            "commit_kv.cu", "sm_90", {"COLS_PER_BLOCK": "1;("}, cache=jit.KernelCache(tmp_path)
        )
    assert "error" in info.value.log
    assert len(info.value.cache_key) == 64
    assert list(tmp_path.glob("*.cubin")) == []


def test_cache_dir_honours_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path / "c"))
    assert jit.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DDTREE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert jit.cache_dir() == tmp_path / "x" / "ddtree" / "kernels"


def test_bad_arch_and_define_names_are_rejected(tmp_path) -> None:
    if not jit.is_available():
        pytest.skip("cuda-python with NVRTC is not installed")
    with pytest.raises(ValueError, match="arch"):
        jit.compile_cubin("commit_kv.cu", "90", cache=jit.KernelCache(tmp_path))
    with pytest.raises(ValueError, match="identifier"):
        jit.compile_cubin("commit_kv.cu", "sm_90", {"A B": 1}, cache=jit.KernelCache(tmp_path))


def test_require_available_names_the_extra(monkeypatch) -> None:
    monkeypatch.setattr(jit, "_availability_problem", lambda: "cuda-python is not installed")
    assert not jit.is_available()
    with pytest.raises(RuntimeError, match=r"ddtree\[cuda\]"):
        jit.require_available()


def test_launch_params_validate() -> None:
    assert jit.LaunchParams((4, 1, 1), (128, 1, 1), 1024).shared_mem_bytes == 1024
    with pytest.raises(ValueError, match="1024 threads"):
        jit.LaunchParams((1, 1, 1), (2048, 1, 1))
    with pytest.raises(ValueError, match=">= 1"):
        jit.LaunchParams((0, 1, 1), (32, 1, 1))
    with pytest.raises(ValueError, match="65535"):
        jit.LaunchParams((1, 70000, 1), (32, 1, 1))


@pytest.mark.parametrize(
    ("batch_size", "draft_len", "vocab_size", "max_budget"),
    [
        (1, 1, 8, 1),
        (32, 16, 163840, 64),
        (128, 16, 163840, 64),
        (3, 15, 32000, 300),
        (64, 32, 163840, 1024),
    ],
)
def test_build_tree_plan_covers_the_vocabulary(
    batch_size: int, draft_len: int, vocab_size: int, max_budget: int
) -> None:
    plan = tree_cuda.build_tree_plan(batch_size, draft_len, vocab_size, max_budget)
    rows = batch_size * draft_len
    assert plan.top_k == min(max_budget, vocab_size)
    assert plan.tile == plan.warps * 32 * plan.unroll * 8
    # Every warp's slice is a whole number of steps, and the chunks cover the vocabulary.
    assert plan.span % plan.tile == 0
    assert plan.num_chunks * plan.span >= vocab_size > (plan.num_chunks - 1) * plan.span
    assert plan.num_parts == plan.num_chunks * plan.warps
    # Rows are split only while they do not fill the GPU, into at most 32 lists for the merge.
    assert plan.num_chunks == 1 or plan.num_parts <= 32
    # After a shrink (at most 2 * top_k kept) one round of 32 expanded hit vectors still fits.
    assert plan.cap == max(2 * plan.top_k, 512) + 32 * 8
    assert plan.sort_size >= plan.top_k and plan.sort_size & (plan.sort_size - 1) == 0
    # Every build kernel of a plan is compiled with the same variant macros.
    assert plan.defines == {
        "TOPK_WARPS": plan.warps,
        "UNROLL": plan.unroll,
        "TOPK_MIN_BLOCKS": plan.min_blocks,
        "TOPK_BOUND_MAX_J": 16,
        "DDTREE_EXPAND_AT": plan.expand_at,
        # Rows merged in the top-k blocks are ordered by the warps' ranks from top_k 17 on.
        "DDTREE_MERGE_RANKS": int(plan.merge_here and plan.top_k >= 17),
        # The bulk select from the first round for batches of 4 and budgets of 32 on.
        "DDTREE_BULK_AFTER": 0 if batch_size >= 4 and max_budget >= 32 else -1,
        # The select starts on the first depths' rows where they take two waves of merging
        # top-k blocks (test_build_tree_plan_starts_the_select_early_where_...), in 128 threads.
        "DDTREE_EARLY_DEPTHS": plan.early_depths,
        "SELECT_THREADS": 128 if plan.early_depths else 512,
    }
    assert plan.topk.grid == (plan.num_chunks, rows, 1)
    assert plan.topk.block == (plan.warps * 32, 1, 1)
    # Candidates, then the hit vectors (16 bytes) and their first tokens (4 bytes).
    # A warp expands its hits once it has recorded 32, or 128 from top_k 17 on where as many
    # blocks per SM fit (see test_build_tree_plan_expands_hits_late_where_the_blocks_fit).
    assert plan.expand_at in ((32, 128) if plan.top_k >= 17 else (32,))
    hits = plan.expand_at + 32 * plan.unroll
    assert plan.topk.shared_mem_bytes == plan.warps * (plan.cap * 8 + hits * 20)
    assert plan.merge.grid == (rows, 1, 1)
    assert plan.merge.shared_mem_bytes == (plan.num_parts * plan.top_k + 2 * plan.sort_size) * 8
    # Rows of at most 512 candidate slots each are merged by 64 threads when more than one wave
    # of 256-thread blocks (8 per SM, 132 SMs) would hold them; otherwise by 256.
    small = plan.num_parts * plan.top_k <= 512 and rows > 132 * 8
    merge_threads = 64 if small else 256
    assert plan.merge.block == (merge_threads, 1, 1)
    # With one block per row and at most two waves of them (2 blocks per SM here), a block
    # merges its row when its warps' top_k candidates each fit in the hit buffers, and the merge
    # launch is skipped.
    waves_ok = rows <= 2 * 132 * 2
    # The room is that of 32 + 32 * unroll hit vectors whatever the plan's expand_at.
    room = 20 * 32 * (plan.unroll + 1)
    assert plan.merge_here == (plan.num_chunks == 1 and waves_ok and 8 * plan.top_k <= room)
    assert plan.select.grid == (batch_size, 1, 1)
    assert plan.select.block == (plan.defines["SELECT_THREADS"], 1, 1)
    lp_table = -(-draft_len * plan.top_k * 4 // 16) * 16 if plan.lp_in_smem else 0
    wide = tree_cuda.wide_select_bytes(plan.wide_cap, plan.wide_sort_size) if plan.wide_cap else 0
    assert plan.select.shared_mem_bytes == lp_table + wide
    assert plan.wide_cap == 0 or 2 * max_budget <= plan.wide_cap <= min(4 * max_budget, 4096)


def test_build_tree_plan_merges_in_the_topk_blocks_when_one_block_covers_a_row() -> None:
    assert tree_cuda.build_tree_plan(32, 16, 163840, 64).merge_here  # 512 rows, 264 slots
    assert tree_cuda.build_tree_plan(16, 32, 163840, 400).merge_here
    assert not tree_cuda.build_tree_plan(1, 16, 163840, 64).merge_here  # 4 chunks a row
    assert not tree_cuda.build_tree_plan(128, 16, 163840, 64).merge_here  # 8 waves
    assert not tree_cuda.build_tree_plan(16, 32, 163840, 512).merge_here  # 8 x 512 > the room


def test_build_tree_plan_takes_four_warp_topk_blocks_where_they_were_faster() -> None:
    plan = tree_cuda.build_tree_plan
    h200 = 227 * 1024 - 36 * 1024  # the opt-in less the static reserve (max_dynamic_smem)

    def geometry(batch_size: int, budget: int, smem: int = h200) -> tuple[int, int, int]:
        p = plan(batch_size, 16, 163840, budget, max_smem_bytes=smem)
        return p.warps, p.min_blocks, p.num_chunks

    # Large budgets: eight warps' buffers and static shared memory fit two blocks in an SM's
    # 228 KiB up to top_k 509; past it, blocks of four warps asking for four per SM (the same
    # 128 registers per thread) ...
    assert [geometry(32, k) for k in (64, 509, 510, 572, 1024)] == [
        (8, 2, 1),
        (8, 2, 1),
        (4, 4, 1),
        (4, 4, 1),
        (4, 4, 1),
    ]
    assert plan(32, 16, 163840, 1024, max_smem_bytes=h200).topk.block == (128, 1, 1)
    # ... where the rows fill them unsplit (at 128 rows they would be split in two).
    assert [geometry(b, 1024) for b in (1, 8, 16)] == [(8, 2, 2), (8, 2, 1), (4, 4, 1)]
    # Any budget: rows that fill four-warp blocks as evenly as eight-warp ones (1024 rows: two
    # waves of 528 slots against four of 264; 768 rows: two against three), unless halving the
    # warps takes j = ceil(top_k / warps) past 16, where the warps' lane bounds stop.
    assert [geometry(64, k)[:2] for k in (16, 64, 65, 128, 129, 512)] == [
        (4, 4),
        (4, 4),
        (8, 2),
        (8, 2),
        (4, 4),
        (4, 4),
    ]
    assert geometry(48, 64)[:2] == geometry(32, 64)[:2] == (8, 2)
    # Budgets up to 16: rows that one wave of four-warp blocks holds (528 slots) and eight-warp
    # blocks need two waves for (264 slots), unsplit; fewer rows keep eight warps.
    assert [geometry(b, 16) for b in (16, 17, 24, 32, 33)] == [
        (8, 2, 1),
        (4, 4, 1),
        (4, 4, 1),
        (4, 4, 1),
        (4, 4, 1),
    ]
    assert [geometry(32, k)[:2] for k in (8, 16, 17, 32)] == [(4, 4), (4, 4), (8, 2), (8, 2)]
    # Where fewer warps are taken for room (sm_120), the register cap stays.
    sm120 = 63 * 1024
    assert [geometry(32, k, sm120)[:2] for k in (64, 1024)] == [(4, 2), (2, 2)]


def test_build_tree_plan_expands_hits_late_where_the_blocks_fit() -> None:
    plan = tree_cuda.build_tree_plan
    h200 = 227 * 1024 - 36 * 1024

    def late(batch_size: int, budget: int, element_size: int = 2) -> tuple[int, int, int]:
        p = plan(batch_size, 16, 163840, budget, max_smem_bytes=h200, element_size=element_size)
        return p.expand_at, p.warps, p.min_blocks

    # Up to top_k 16 a warp expands every 32 hit vectors (the same kernels as before session 31).
    assert [late(32, k)[0] for k in (1, 9, 16)] == [32, 32, 32]
    # From 17 on every 128, while two eight-warp blocks with their 256-vector hit buffers still
    # fit an SM, counting each block's static shared memory against the SM's 228 KiB ...
    assert [late(32, k) for k in (17, 64, 256, 389)] == [(128, 8, 2)] * 4
    # ... and not where only one would (B 32 K 420 took 127.8 -> 196.1 us with them).
    assert [late(32, k) for k in (390, 420, 509)] == [(32, 8, 2)] * 3
    # Four-warp blocks where they keep their three or two blocks per SM with them ...
    assert [late(32, k) for k in (510, 600, 1024)] == [(128, 4, 4)] * 3
    # ... and not where they would lose one (session 32: B 64 K 490, four blocks to three, and
    # K 800, three to two, took 1.14x and 1.13x the time).
    assert late(64, 490) == late(64, 800) == (32, 4, 4)
    assert late(128, 64) == (128, 4, 4)
    assert late(3, 300, element_size=4) == (128, 8, 2)
    # The geometry is the one the 32-vector buffers get.
    for batch_size, budget in ((1, 64), (8, 256), (32, 420), (32, 1024)):
        p = plan(batch_size, 16, 163840, budget, max_smem_bytes=h200)
        assert p.topk.shared_mem_bytes == p.warps * (p.cap * 8 + (p.expand_at + 128) * 20)


def test_build_tree_plan_orders_merged_rows_by_ranks_from_top_k_17() -> None:
    plan = tree_cuda.build_tree_plan
    assert [plan(32, 16, 163840, k).merge_ranks for k in (16, 17, 64, 400)] == [
        False,
        True,
        True,
        True,
    ]
    # Rows merged by the merge launch compile no rank code.
    assert not plan(1, 16, 163840, 64).merge_ranks
    assert not plan(128, 16, 163840, 64).merge_ranks


def test_build_tree_plan_gives_the_wide_select_a_store() -> None:
    plan = tree_cuda.build_tree_plan
    assert plan(32, 16, 163840, 96).wide_cap == 0  # every budget pops from registers
    assert plan(32, 16, 163840, 256).wide_cap == 1024  # 4 * max_budget beside the table
    full = plan(32, 16, 163840, 1024)
    assert (full.wide_cap, full.wide_sort_size, full.lp_in_smem) == (4096, 1024, True)
    assert full.wide_min_budget == 97  # budgets up to 96 pop from registers
    tiny_vocab = plan(4, 16, 8, 1024)  # budgets past top_k: the store follows max_budget
    assert (tiny_vocab.wide_cap, tiny_vocab.wide_sort_size) == (4096, 1024)
    # Short of room the table goes to global memory first, then the store shrinks to 2x.
    deep = plan(1, 32, 163840, 1024, max_smem_bytes=190 * 1024)
    assert (deep.wide_cap, deep.lp_in_smem) == (4096, False)
    small = plan(32, 16, 163840, 1024, max_smem_bytes=70 * 1024)
    assert (small.wide_cap, small.lp_in_smem) == (2048, False)
    assert plan(32, 16, 163840, 1024, max_smem_bytes=63 * 1024).wide_cap == 0  # sm_120


def test_build_tree_plan_starts_the_select_early_where_the_rows_take_two_waves() -> None:
    plan = tree_cuda.build_tree_plan
    # Two waves of 264 eight-warp blocks that merge their rows: the first holds every request's
    # first 264 // batch depths, and two 128-thread select blocks fit beside a top-k block.
    early = plan(32, 16, 163840, 64)
    assert (early.early_depths, early.select.block) == (8, (128, 1, 1))
    assert early.defines["DDTREE_EARLY_DEPTHS"] == 8 and early.defines["SELECT_THREADS"] == 128
    # (Batch 16: one wave; batch 33: one wave of four-warp blocks.)
    assert [plan(b, 16, 163840, 64).early_depths for b in (16, 17, 24, 32, 33)] == [
        0,
        15,
        11,
        8,
        0,
    ]
    assert plan(24, 16, 163840, 96).early_depths == 11
    # One wave of four-warp blocks (budget 16), a merge launch (batch 128), the wide select
    # (budgets from 97): the select waits for the whole launch, with 512 threads.
    for late in (plan(32, 16, 163840, 16), plan(128, 16, 163840, 64), plan(32, 16, 163840, 97)):
        assert (late.early_depths, late.select.block) == (0, (512, 1, 1))
        assert late.defines["DDTREE_EARLY_DEPTHS"] == 0 and late.defines["SELECT_THREADS"] == 512
    # Only rows that their top-k blocks write can be flagged.
    with pytest.raises(ValueError, match="early_depths"):
        dataclasses.replace(early, merge_here=False)


@pytest.mark.parametrize("batch_size", [32, 128], ids=["merge-here", "merge-launch"])
def test_build_scratch_lays_out_the_plans_regions(batch_size: int) -> None:
    plan = tree_cuda.build_tree_plan(batch_size, 16, 163840, 64)
    rows = batch_size * 16
    scratch = tree_cuda.build_scratch(plan, rows, torch.device("cpu"))
    parts = 0 if plan.merge_here else rows * plan.num_parts
    ready = rows * 4 if plan.early_depths else 0
    sizes = [rows * 64 * 4, rows * 64 * 4, rows * 4, parts * 64 * 8, parts * 3 * 4, ready]
    starts = [scratch.topk_lp, scratch.topk_tok, scratch.topk_count, scratch.part_keys]
    starts += [scratch.part_stats, scratch.row_ready]
    starts += [scratch.memory.data_ptr() + scratch.memory.numel()]
    assert starts[0] == scratch.memory.data_ptr()
    for size, start, end in zip(sizes, starts[:-1], starts[1:], strict=True):
        assert end - start == -(-size // 256) * 256  # each region 256-byte aligned, in order


def test_build_tree_plan_rejects_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="shared memory"):
        tree_cuda.build_tree_plan(1, 1, 4_000_000, 1024, max_smem_bytes=12 * 1024)
    with pytest.raises(ValueError, match="65535"):
        tree_cuda.build_tree_plan(4096, 32, 1000, 16)


@pytest.mark.parametrize("unroll", [0, 3, 6])
def test_build_tree_plan_rejects_an_unroll_that_is_not_a_power_of_two(unroll: int) -> None:
    # A step's entries are summed by pairwise trees: a scratch UNROLL 3 build dropped a third of
    # them on the H200 (log-probs off by 1-41).
    with pytest.raises(ValueError, match="unroll"):
        tree_cuda.build_tree_plan(32, 16, 163840, 64, unroll=unroll)


def test_accept_and_commit_launch_params() -> None:
    assert tree_cuda.accept_launch_params(7, reads_logits=False).grid == (7, 1, 1)
    assert tree_cuda.accept_launch_params(7, reads_logits=True).block == (1024, 1, 1)
    params = tree_cuda.commit_kv_launch_params(5, 576 * 2)
    assert params.grid == (5, 2, 1)  # 72 16-byte columns in slices of 64
    assert tree_cuda.commit_kv_launch_params(5, 16).grid == (5, 1, 1)
    with pytest.raises(ValueError, match="multiple of 16"):
        tree_cuda.commit_kv_launch_params(5, 72 * 2 + 2)


def _body(source: str, kernel: str) -> list[str]:
    """The statements of a kernel's body, without comments and shared-memory declarations."""
    start = source.index(f" {kernel}(")
    body = source[source.index(") {\n", start) + 4 :]
    statements = []
    for line in body.splitlines():
        if line.startswith("}"):
            return statements
        code = line.split("//")[0].strip()
        if code and not code.startswith(("__shared__", "extern __shared__")):
            statements.append(code)
    raise AssertionError(f"{kernel} has no end")


def _before_wait(source: str, kernel: str) -> list[str]:
    """The statements of a kernel's body before its first ddtree_wait_for_previous_grid(),
    without comments and shared-memory declarations."""
    statements = []
    for code in _body(source, kernel):
        if code.endswith("ddtree_wait_for_previous_grid();"):
            return statements
        statements.append(code)
    raise AssertionError(f"{kernel} does not wait for the kernel before it")


def test_dependent_launches_wait_for_the_kernel_before_them() -> None:
    """Launches that may start while the previous kernel runs are those of kernels that wait
    for it before they touch what it reads or writes; the first kernel of build_tree and its
    merge launch plainly."""
    plan = tree_cuda.build_tree_plan(8, 16, 163840, 64)
    assert not plan.topk.dependent and not plan.merge.dependent
    assert plan.select.dependent
    assert tree_cuda.accept_launch_params(4, reads_logits=True).dependent
    assert tree_cuda.commit_kv_launch_params(4, 1152).dependent
    sources = {name: jit.load_source(name) for name in jit.kernel_sources()}
    for file, kernel in [("accept.cu", "ddtree_accept"), ("commit_kv.cu", "ddtree_commit_kv")]:
        assert _before_wait(sources[file], kernel) == []
    # Before its wait the select only declares locals, reads only the caller's data that
    # neither the top-k nor the merge touches and, in early plans, waits for the rows the top-k
    # flags (and then waits for the grid only where the tree may reach deeper, and at the end).
    body = _body(sources["build_tree.cu"], "ddtree_build_select")
    before = _before_wait(sources["build_tree.cu"], "ddtree_build_select")
    flag_wait = "if (early > 0) ddtree_wait_flags(row_ready + b * draft_len, early);"
    assert before[-1] == flag_wait
    assert all(statement.startswith("const ") for statement in before[:-1])
    read = set(re.findall(r"(\w+)\[", " ".join(before[:-1])))
    assert read == {"root_tokens", "budgets", "error_flags"}
    assert body[len(before)] == "if (early == 0) ddtree_wait_for_previous_grid();"
    # An early select may end before the top-k does: every way out waits for it first.
    exits = [i for i, statement in enumerate(body) if statement == "return;"]
    assert exits and all(
        body[i - 1] == "if (early > 0) ddtree_wait_for_previous_grid();" for i in exits
    )
    assert body[-1] == "if (early > 0) ddtree_wait_for_previous_grid();"


@needs_nvrtc
def test_dependent_launch_config_and_its_switch(monkeypatch) -> None:
    params = jit.LaunchParams((2, 1, 1), (64, 1, 1), 0, dependent=True)
    assert jit._launch_config(params, True).programmatic_stream_serialization
    assert not jit._launch_config(params, False).programmatic_stream_serialization
    monkeypatch.delenv("DDTREE_DEPENDENT_LAUNCH", raising=False)
    assert jit._dependent_launch_allowed()
    monkeypatch.setenv("DDTREE_DEPENDENT_LAUNCH", "0")
    assert not jit._dependent_launch_allowed()
