"""The build_tree A/B tool (bench/ab_build_tree.py): its package copies and its inputs (CPU).

The measurement itself needs a GPU; on the CPU the tool must refuse clearly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.scripts import load_bench

_IMPORT = "import ddtree.kernels.tree_cuda as t; print(t.__file__)"


@pytest.mark.parametrize("rev", ["HEAD", "directory", None], ids=["revision", "tree", "worktree"])
def test_a_package_copy_is_what_its_processes_import(rev: str | None, tmp_path: Path) -> None:
    ab = load_bench("ab_build_tree")
    if rev == "directory":  # a source tree elsewhere: the working tree's own files, copied
        rev = str(tmp_path / "tree")
        for part in ("proto", "kernels"):
            shutil.copytree(ab.REPO / part, Path(rev) / part)
    copy = ab.package_copy(rev, tmp_path / "side")
    for name in ("build_tree.cu", "build_tree_select_bulk.cuh", "tree_cuda.py"):
        assert (copy / "ddtree" / "kernels" / name).is_file(), name
    assert (copy / "ddtree" / "__init__.py").is_file()
    env = dict(os.environ, PYTHONPATH=str(copy))
    imported = subprocess.run(
        [sys.executable, "-c", _IMPORT], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    # Ahead of the installed (editable) ddtree, which would make both sides the same code.
    assert Path(imported).resolve().is_relative_to(copy.resolve())


def test_shapes_are_parsed() -> None:
    ab = load_bench("ab_build_tree")
    assert ab.parse_shapes("32:64:3,1:16:0.5") == [(32, 64, 3.0), (1, 16, 0.5)]
    with pytest.raises(ValueError):
        ab.parse_shapes("32:64")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_clearly() -> None:
    ab = load_bench("ab_build_tree")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        ab.main(["--base", "HEAD", "--shapes", "1:16:3"])


def test_several_heads_are_sides_of_their_own(tmp_path: Path) -> None:
    ab = load_bench("ab_build_tree")
    assert ab.head_sides(None) == {"head": "worktree"}
    tree = str(tmp_path)
    assert ab.head_sides([tree]) == {"head": tree}
    assert list(ab.head_sides([tree, "HEAD"])) == ["head1", "head2"]


def test_the_summary_compares_every_head_with_the_base() -> None:
    ab = load_bench("ab_build_tree")

    def row(side: str, graph_ms: float, topk_us: float, sha: str = "same") -> dict:
        kernels = {"ddtree_build_topk": topk_us, "ddtree_build_select": 9.0}
        return {
            "side": side,
            "shape": "32:64:3",
            "graph_ms": graph_ms,
            "kernels_us": kernels,
            "trees_sha256": sha,
        }

    rows = [
        row("base", 0.10, 66.0),
        row("base", 0.12, 68.0),
        row("head1", 0.09, 64.0),
        row("head2", 0.11, 70.0),
    ]
    summary = ab.summarise(rows, ["base", "head1", "head2"])["32:64:3"]
    assert summary["base_graph_ms"] == 0.11 and summary["base_topk_us"] == 67.0
    assert summary["head1_over_base"] == round(0.09 / 0.11, 4)
    assert summary["head2_topk_us"] == 70.0 and summary["trees_equal"]
    rows.append(row("head2", 0.11, 70.0, sha="other"))
    assert not ab.summarise(rows, ["base", "head1", "head2"])["32:64:3"]["trees_equal"]


def test_the_summary_names_each_sides_agreement_with_the_reference() -> None:
    ab = load_bench("ab_build_tree")

    def row(side: str, exact: bool, same: bool) -> dict:
        return {
            "side": side,
            "shape": "32:16:3",
            "graph_ms": 0.07,
            "kernels_us": {},
            "trees_sha256": side,
            "reference": {"exact_order": exact, "same_sorted_log_probs": same},
        }

    rows = [
        row("base", True, True),
        row("base", True, True),
        row("head1", True, True),
        row("head1", False, True),
        row("head2", False, True),
        row("head2", False, False),
    ]
    summary = ab.summarise(rows, ["base", "head1", "head2"])["32:16:3"]
    assert summary["base_reference"] == "exact"
    assert summary["head1_reference"] == "same_scores"
    assert summary["head2_reference"] == "differs"
    assert not summary["trees_equal"]
    # Rows measured without --reference name no agreement.
    plain = [{k: v for k, v in r.items() if k != "reference"} for r in rows]
    assert "base_reference" not in ab.summarise(plain, ["base", "head1", "head2"])["32:16:3"]


def test_a_report_cut_short_keeps_what_was_measured(tmp_path: Path) -> None:
    """The A/B rewrites its report after every process: with the heads of a shape not measured
    yet (a device call's time limit) the report holds the rows so far, the base's median, no
    ratio, and the note."""
    ab = load_bench("ab_build_tree")
    sides = {"base": "HEAD", "head1": "dir1", "head2": "dir2"}
    rows = [
        {
            "side": side,
            "round": 0,
            "shape": shape,
            "graph_ms": 0.08,
            "kernels_us": {"ddtree_build_topk": 66.0},
            "trees_sha256": "same",
            "gpu": "NVIDIA H200",
        }
        for shape, side in [("32:64:3", "base"), ("32:64:3", "head1"), ("32:16:3", "base")]
    ]
    out = tmp_path / "ab.json"
    summary = ab.write_report(out, "2026-12-01", sides, rows, "head1: the plan change")
    report = json.loads(out.read_text())
    assert report["summary"] == summary and report["rows"] == rows
    assert report["note"] == "head1: the plan change" and report["gpu"] == "NVIDIA H200"
    assert report["date"] == "2026-12-01"
    assert summary["32:64:3"]["head1_over_base"] == 1.0
    assert "head2_graph_ms" not in summary["32:64:3"]
    assert "head2_over_base" not in summary["32:64:3"]
    assert list(summary["32:16:3"]) == ["base_graph_ms", "base_topk_us", "trees_equal"]
    assert (
        ab.write_report(out, "2026-12-01", sides, [], None) == {}
    )  # before the first process: no note
    assert "note" not in json.loads(out.read_text())


def test_reference_agreement_tells_order_from_scores() -> None:
    """The check that --reference runs in each process (bench_tree.reference_agreement), on
    reference trees built on the CPU."""
    from ddtree.kernels import reference

    agreement = load_bench("bench_tree").reference_agreement
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(5))
    roots = torch.zeros(2, dtype=torch.int64)
    tree = reference.build_tree(logits, roots, 7)
    assert agreement(tree, tree) == {"exact_order": True, "same_sorted_log_probs": True}
    # The same nodes in another order: the scores agree, the order does not.
    swapped = reference.build_tree(logits, roots, 7)
    swapped.tokens[:, [1, 2]] = swapped.tokens[:, [2, 1]]
    swapped.log_probs[:, [1, 2]] = swapped.log_probs[:, [2, 1]]
    assert agreement(swapped, tree) == {"exact_order": False, "same_sorted_log_probs": True}
    # A score off by more than 1e-5 (relative and absolute).
    moved = reference.build_tree(logits, roots, 7)
    moved.log_probs[0, 3] -= 1e-3
    assert agreement(moved, tree)["same_sorted_log_probs"] is False
