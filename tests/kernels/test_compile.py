"""Every CUDA kernel source compiles for every supported architecture through NVRTC (no GPU)."""

from __future__ import annotations

import pytest

from ddtree.kernels import jit

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
        }
        for dtype, warps, unroll, blocks, bulk in (
            (0, 8, 2, 4, 0),
            (1, 4, 4, 2, 4),
            (2, 8, 2, 4, -1),
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
        {"DDTREE_CHANNEL_OP": 1, "DDTREE_DTYPE": 1, "TOPK_WARPS": 8, "UNROLL": 2},
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
