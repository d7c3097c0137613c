"""Every CUDA kernel source compiles for every supported architecture through NVRTC (no GPU)."""

from __future__ import annotations

import dataclasses
import functools
import re
import struct

import pytest

from ddtree.kernels import jit, tree_cuda

pytestmark = pytest.mark.skipif(
    not jit.is_available(),
    reason="cuda-python with NVRTC is not installed (pip install 'ddtree[cuda]')",
)

# Variants the ops select with -D macros; every source must compile under each that it reads.
# Each dtype and each top-k block shape appears once per architecture.
_VARIANTS = {
    "build_tree.cu": [
        {
            "DDTREE_DTYPE": dtype,
            "TOPK_WARPS": warps,
            "UNROLL": unroll,
            "TOPK_MIN_BLOCKS": blocks,
            "DDTREE_BULK_AFTER": bulk,
            "DDTREE_EXPAND_AT": expand_at,
            "DDTREE_MERGE_RANKS": ranks,
            "DDTREE_EARLY_DEPTHS": early,
            "SELECT_THREADS": 128 if early else 512,
        }
        for dtype, warps, unroll, blocks, bulk, expand_at, ranks, early in (
            (0, 8, 2, 4, 0, 128, 1, 8),
            (1, 4, 4, 2, 4, 128, 1, 0),
            (2, 8, 2, 4, -1, 32, 0, 0),
        )
    ],
    "accept.cu": [
        {"DDTREE_DTYPE": dtype, "ACCEPT_THREADS": threads}
        for dtype, threads in ((0, 256), (1, 1024), (2, 256))
    ],
    # 0: the protocol kernels alone (caller side); 1: with build_tree.cu; 2: with accept.cu and
    # commit_kv.cu (target tokens: 256 threads; target logits: 1024).
    "channel.cu": [
        {},
        {
            "DDTREE_CHANNEL_OP": 1,
            "DDTREE_DTYPE": 1,
            "TOPK_WARPS": 8,
            "UNROLL": 2,
            "DDTREE_EARLY_DEPTHS": 8,
            "SELECT_THREADS": 128,
        },
        {"DDTREE_CHANNEL_OP": 1, "DDTREE_DTYPE": 0, "TOPK_WARPS": 4, "UNROLL": 2},
        {"DDTREE_CHANNEL_OP": 2, "DDTREE_DTYPE": 0, "ACCEPT_THREADS": 256, "COLS_PER_BLOCK": 64},
        {"DDTREE_CHANNEL_OP": 2, "DDTREE_DTYPE": 2, "ACCEPT_THREADS": 1024, "COLS_PER_BLOCK": 64},
    ],
}


def _cases() -> list[tuple[str, str, dict[str, int]]]:
    return [
        (name, arch, defines)
        for name in jit.kernel_sources()
        for arch in jit.SUPPORTED_ARCHS
        for defines in _VARIANTS.get(name, [{}])
    ]


def test_every_source_is_listed() -> None:
    names = jit.kernel_sources()
    assert {"build_tree.cu", "accept.cu", "commit_kv.cu", "channel.cu"} <= set(names), names


@pytest.mark.parametrize(
    ("name", "arch", "defines"),
    _cases(),
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()) or "-",
)
def test_source_compiles(name: str, arch: str, defines: dict[str, int], tmp_path) -> None:
    cubin, key = jit.compile_cubin(name, arch, defines, cache=jit.KernelCache(tmp_path))
    assert cubin.startswith(b"\x7fELF")
    assert len(key) == 64


def _static_shared_bytes(cubin: bytes) -> dict[str, int]:
    """Each kernel's static shared memory in a cubin: the sizes of its ``.nv.shared.<kernel>``
    ELF sections (ELF64, little-endian)."""
    (table,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, table + i * entry_size) for i in range(count)]
    names = headers[names_index][4]

    def name(offset: int) -> str:
        start = names + offset
        return cubin[start : cubin.index(b"\0", start)].decode()

    prefix = ".nv.shared."
    return {name(h[0])[len(prefix) :]: h[5] for h in headers if name(h[0]).startswith(prefix)}


@pytest.mark.parametrize(("batch_size", "budget"), [(32, 64), (32, 16), (128, 64), (4, 256)])
def test_the_plan_counts_the_kernels_static_shared_memory(
    batch_size: int, budget: int, tmp_path
) -> None:
    """The top-k block's static shared memory is what the plan counts per block besides its
    buffers (``tree_cuda.topk_static_smem``), and no build kernel's exceeds the reserve that the
    plan keeps below the opt-in limit for it (tree_cuda._STATIC_SMEM_RESERVE). Compiled for
    sm_90, the H200 the plan's numbers were measured on."""
    plan = tree_cuda.build_tree_plan(batch_size, 16, 163840, budget)
    defines = {"DDTREE_DTYPE": 1, **plan.defines}
    cubin, _ = jit.compile_cubin("build_tree.cu", "sm_90", defines, cache=jit.KernelCache(tmp_path))
    static = _static_shared_bytes(cubin)
    assert static["ddtree_build_topk"] == tree_cuda.topk_static_smem(plan.warps)
    assert max(static.values()) <= tree_cuda._STATIC_SMEM_RESERVE, static


def _ptx(name: str, arch: str, defines: dict[str, int]) -> str:
    """PTX of kernel source ``name`` for ``arch`` (NVRTC with jit's headers and flags; no GPU)."""
    from cuda.bindings import nvrtc

    def check(result: tuple[object, ...]) -> tuple[object, ...]:
        assert result[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, result
        return result

    source = jit.load_source(name).encode()
    (program,) = check(nvrtc.nvrtcCreateProgram(source, name.encode(), 0, [], []))[1:]
    options = [f"--gpu-architecture=compute_{arch[3:]}", "-std=c++17", "-default-device"]
    options += [f"-I{path}" for path in jit._include_dirs()]
    options += [f"-D{key}={value}" for key, value in defines.items()]
    try:
        compiled = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        assert compiled[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, compiled
        (size,) = check(nvrtc.nvrtcGetPTXSize(program))[1:]
        ptx = b" " * int(size)  # type: ignore[call-overload]
        check(nvrtc.nvrtcGetPTX(program, ptx))
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return ptx.decode().rstrip("\0")


def _entry(ptx: str, kernel: str) -> str:
    body = ptx[ptx.index(f".entry {kernel}(") :]
    end = body.find(".entry", 1)
    return body if end < 0 else body[:end]


@functools.cache
def _build_tree_ptx(early: bool) -> str:
    """sm_90 PTX of build_tree.cu (bf16) for batch 32, draft_len 16, budget 64: the H200's early
    plan, or the same plan with the select after the whole top-k launch."""
    plan = tree_cuda.build_tree_plan(32, 16, 163840, 64)
    assert plan.early_depths > 0
    if not early:
        plan = dataclasses.replace(
            plan, early_depths=0, select=dataclasses.replace(plan.select, block=(512, 1, 1))
        )
    return _ptx("build_tree.cu", "sm_90", {"DDTREE_DTYPE": 1, **plan.defines})


def test_an_early_select_reads_the_topk_rows_coherently() -> None:
    """An early select reads the top-k's rows while the top-k may still write others, so it
    must never load them through the read-only data path (``ld.global.nc``, whose contract is
    data read-only for the kernel's lifetime): its only non-coherent loads are of the caller's
    root tokens and budgets, where the select after the whole launch loads the rows so too."""
    loads = {
        early: len(
            re.findall(r"\bld\.global\.nc\b", _entry(_build_tree_ptx(early), "ddtree_build_select"))
        )
        for early in (True, False)
    }
    # root_tokens[b] and budgets[b] before the wait, root_tokens[i] in the all-or-nothing check
    assert loads[True] == 3
    assert loads[False] > 3


def test_only_early_plans_pass_row_flags_between_the_launches() -> None:
    """In an early plan the top-k resets every row's flag and reads the deeper rows' hints,
    and the select raises those hints (volatile global accesses besides the flags' acquire
    and release); a plan without an early select touches no flag at all."""

    def accesses(early: bool, kernel: str, op: str) -> int:
        entry = _entry(_build_tree_ptx(early), kernel)
        return len(re.findall(rf"\b{op}\.volatile\.global\b", entry))

    assert accesses(True, "ddtree_build_topk", "ld") > 0  # the hint
    assert accesses(True, "ddtree_build_topk", "st") > 0  # the reset
    assert accesses(True, "ddtree_build_select", "st") > 0  # raising the hints
    for kernel in ("ddtree_build_topk", "ddtree_build_select"):
        entry = _entry(_build_tree_ptx(False), kernel)
        assert not re.search(r"\b(ld|st)\.(volatile|acquire|release)[.\w]*\.global\b", entry)
