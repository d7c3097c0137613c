"""The CUDA kernels under NVIDIA compute-sanitizer (GPU; skipped where the tool is absent).

Each sanitizer tool runs a set of this suite's own GPU tests in a child pytest process, only
the ddtree kernels instrumented (``--kernel-name kns=ddtree_``), and must report nothing. The
set is small cases that together take every kernel path: each top-k geometry and its merge,
rows sorted ascending (nearly every vector a hit, the candidate buffers shrunk all along the
row), the register select with and without exact ties (both copies of its pop loop, and ties
past the depths its tuples pack), the bulk select and its fallback, the early select (on the
first depths' flagged rows) and its fallback, the serial select in shared memory, the wide
select and its fallback, budget 1 and 1024, draft_len 32, non-finite rows, the
all-or-nothing writes into ``out``, accept in its three modes, commit_kv and verify_attention.
Those tests check their outputs against the reference as usual; the sanitizer adds what a
wrong index could do without changing an output:

* memcheck: out-of-bounds and misaligned accesses in global, local and shared memory;
* racecheck: shared-memory hazards between threads that no barrier orders;
* synccheck: barriers and warp synchronisation used where not every thread can reach them.

initcheck (reads of global memory nothing wrote) is left out: it did not finish these tests in
100 s on the H200, where the other three take 5-35 s each (docs/kernels.md, session 20).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
_TREE = "tests/kernels/test_tree_cuda.py"
_ATTENTION = "tests/kernels/test_attention_cuda.py"
_CASES = [
    f"{_TREE}::test_build_tree_matches_reference[B1-L1-V8-b1-f32-random]",
    f"{_TREE}::test_build_tree_matches_reference[B3-L4-V17-b7-bf16-random]",
    f"{_TREE}::test_build_tree_matches_reference[B5-L15-V1000-b65-f16-random]",
    f"{_TREE}::test_build_tree_matches_reference[B4-L32-V5000-b512-bf16-random]",
    f"{_TREE}::test_build_tree_matches_reference[B3-L5-V100-b1024-f32-random]",
    f"{_TREE}::test_build_tree_matches_reference[B4-L6-V2000-b65-bf16-peaked]",
    f"{_TREE}::test_build_tree_matches_reference[B3-L7-V1001-b7-f16-ties]",
    f"{_TREE}::test_build_tree_rows_whose_token_ids_order_their_values[2-ascending]",
    f"{_TREE}::test_build_tree_merge_in_the_topk_blocks_matches_the_merge_launch[peaked]",
    f"{_TREE}::test_build_tree_merge_in_the_topk_blocks_matches_the_merge_launch[random]",
    f"{_TREE}::test_build_tree_wide_select_matches_the_serial_select[8-flat]",
    f"{_TREE}::test_build_tree_wide_select_matches_the_serial_select[3000-ties]",
    f"{_TREE}::test_build_tree_bulk_select_matches_the_serial_select[3000-16-ties]",
    f"{_TREE}::test_build_tree_non_finite_rows[64-f32]",
    f"{_TREE}::test_build_tree_non_finite_rows[3000-bf16]",
    f"{_TREE}::test_build_tree_non_finite_rows[64-f16]",
    f"{_TREE}::test_build_tree_exact_ties_follow_rank_tuple_order[3-1024-dtype1-12-0]",
    f"{_TREE}::test_build_tree_exact_ties_follow_rank_tuple_order[2-64-dtype2-12-0]",
    f"{_TREE}::test_build_tree_exact_ties_follow_rank_tuple_order[2-64-dtype4-32-20]",
    f"{_TREE}::test_build_tree_out_is_untouched_when_any_request_is_flagged[2-bad-root]",
    f"{_TREE}::test_accept_tokens_matches_reference[9-65-16-mixed]",
    f"{_TREE}::test_accept_logits_matches_reference[f16-1001-0.8]",
    f"{_TREE}::test_accept_out_matches_reference[greedy-logits]",
    f"{_TREE}::test_accept_out_is_untouched_when_any_request_is_flagged[2-bad-tree]",
    f"{_TREE}::test_commit_kv_matches_reference[7-72]",
    f"{_TREE}::test_commit_kv_all_or_nothing[flagged-by-accept]",
    f"{_ATTENTION}::test_matches_reference[h8-n17-page16-chain]",
]
# Each tool's options beyond the common ones, and the summary line that says it found nothing.
# memcheck would also report the CUDA API errors that cuda-python and torch provoke on purpose
# while they probe the driver (cuGetProcAddress), which are not kernel errors.
_TOOLS = {
    "memcheck": (["--report-api-errors", "no"], "ERROR SUMMARY: 0 errors"),
    "racecheck": ([], "RACECHECK SUMMARY: 0 hazards displayed"),
    "synccheck": ([], "ERROR SUMMARY: 0 errors"),
}


def _sanitizer() -> str | None:
    """The ``compute-sanitizer`` executable: on PATH, else under CUDA_HOME / CUDA_PATH, else
    /usr/local/cuda; None when none is found."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in roots:
        if root and os.access(os.path.join(root, "bin", "compute-sanitizer"), os.X_OK):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


@pytest.fixture(scope="module")
def sanitizer() -> str:
    """The sanitizer, after the chosen tests passed once without it: a failure there is the
    test's own, and the kernels they need are compiled into the shared kernel cache."""
    tool = _sanitizer()
    if tool is None:
        pytest.skip("needs NVIDIA compute-sanitizer (CUDA toolkit; PATH, CUDA_HOME or /usr/local)")
    plain = subprocess.run(_pytest_command(), cwd=_REPO, env=_child_env(), capture_output=True)
    assert plain.returncode == 0, plain.stdout.decode()[-4000:]
    return tool


def _child_env() -> dict[str, str]:
    return {**os.environ, "DDTREE_REQUIRE_GPU": "1"}


def _pytest_command() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_CASES]


def test_every_case_is_a_test_of_the_suite() -> None:
    """The node ids name tests that exist (CPU): a renamed test or parameter would otherwise
    surface only on a GPU, as a child pytest that ran nothing."""
    listed = subprocess.run([*_pytest_command(), "--collect-only"], cwd=_REPO, capture_output=True)
    output = listed.stdout.decode(errors="replace")
    assert listed.returncode == 0, output[-4000:]
    collected = {line.strip() for line in output.splitlines()}
    assert [case for case in _CASES if case not in collected] == []


@pytest.mark.gpu
@pytest.mark.parametrize("tool", list(_TOOLS))
def test_kernels_are_clean_under_compute_sanitizer(sanitizer: str, tool: str) -> None:
    options, clean = _TOOLS[tool]
    command = [
        sanitizer,
        "--tool",
        tool,
        *options,
        "--kernel-name",
        "kns=ddtree_",
        "--error-exitcode",
        "86",
        "--print-limit",
        "20",
        *_pytest_command(),
    ]
    run = subprocess.run(command, cwd=_REPO, env=_child_env(), capture_output=True)
    output = run.stdout.decode(errors="replace") + run.stderr.decode(errors="replace")
    assert run.returncode == 0, output[-6000:]
    assert clean in output, output[-6000:]
