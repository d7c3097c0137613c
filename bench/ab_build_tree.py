"""A/B of the build_tree kernels of two or more source trees on one GPU, in alternating processes.

Each side is a copy of the ``ddtree`` package holding the kernel sources of a git revision, of
another source tree (a directory holding ``proto/`` and ``kernels/``, such as an unpacked ``git
archive``) or of the working tree. It runs in processes of its own with a kernel cache of its
own, so that the two sides never share compiled code, and the sides alternate round by round,
so that drift within a machine session hits both alike. Per shape (batch, budget, logit scale;
draft_len 16, vocab 163,840, bf16 ``randn * scale`` rotated over at least 240 MB of buffers,
seeded by the shape), each process reports the op's device time in a replayed CUDA graph and per
kernel (``sweep_build_tree.measure_build``) and a sha256 of the trees of the first four buffers,
so that a change meant to keep the trees is checked bit for bit; with ``--reference``, also
how the tree of the first buffer agrees with the reference op's (``reference_agreement`` of
bench_tree.py: the same order, or the same sorted log-probs within 1e-5), for changes that move
the trees' last bits (a launch geometry splits the row sums). Writes
``bench/results/<date>-<gpu>-ab-build-tree.json`` (or ``--out``; rewritten after every process,
so that a run cut short keeps what it measured): every process's rows, ``--note`` (what the sides
are), and per shape each side's median graph time and whether the trees agreed.

Usage: ``python bench/ab_build_tree.py --base REV|DIR [--head REV|DIR ...] [--shapes
B:K:SCALE,...] [--rounds N] [--reference] [--note TEXT] [--out PATH]`` (``--head`` left out: the
working tree; given more than once, the heads are sides ``head1``, ``head2``, ... and each is
compared with the base).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = "1:64:3,8:64:3,32:16:3,32:64:3,32:64:12,32:96:3,128:64:3"
# git on this checkout whoever owns it (CI runs as root).
_GIT = ["git", "-c", "safe.directory=*", "-C", str(REPO)]
# Package layout (pyproject.toml's package-dir): what build_tree needs of it.
_LAYOUT = {"proto/ddtree": "ddtree", "kernels": "ddtree/kernels"}


def parse_shapes(text: str) -> list[tuple[int, int, float]]:
    """``"B:K:SCALE,..."`` as (batch, budget, logit scale) triples."""
    shapes = []
    for item in text.split(","):
        batch, budget, scale = item.split(":")
        shapes.append((int(batch), int(budget), float(scale)))
    return shapes


def package_copy(rev: str | None, dest: Path) -> Path:
    """A copy of the ``ddtree`` package with the kernels of ``rev`` (a git revision, or a
    directory holding a source tree; None: the working tree) under ``dest``, to put first on
    ``PYTHONPATH``; returns ``dest``."""
    for source, target in _LAYOUT.items():
        out = dest / target
        if rev is None or Path(rev).is_dir():
            tree = REPO if rev is None else Path(rev)
            shutil.copytree(tree / source, out, ignore=shutil.ignore_patterns("__pycache__"))
            continue
        archive = subprocess.run(
            [*_GIT, "archive", "--format=tar", rev, source],
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    path = out / Path(member.name).relative_to(source)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    extracted = tar.extractfile(member)
                    assert extracted is not None
                    path.write_bytes(extracted.read())
    return dest


def _measure(shapes: list[tuple[int, int, float]], check_reference: bool) -> None:
    """Child process: one row per shape on stdout (JSON lines)."""
    import torch
    from bench_tree import DRAFT_LEN, VOCAB, bf16_logits, reference_agreement
    from sweep_build_tree import measure_build

    from ddtree.kernels import reference, tree_cuda
    from ddtree.kernels.types import TREE_FIELDS

    # The side's copy, not an installed ddtree, must be the one measured.
    copy = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve()
    if not Path(tree_cuda.__file__).resolve().is_relative_to(copy):
        raise SystemExit(f"ab_build_tree: imported {tree_cuda.__file__}, not the copy in {copy}")
    for batch, budget, scale in shapes:
        count = max(4, min(48, math.ceil(240e6 / (batch * DRAFT_LEN * VOCAB * 2))))
        buffers = bf16_logits(batch, count, scale=scale, seed=1000 * batch + budget)
        roots = torch.zeros(batch, dtype=torch.int64, device="cuda")
        digest = hashlib.sha256()
        trees = [tree_cuda.build_tree(logits, roots, budget) for logits in buffers[:4]]
        for tree in trees:
            for field in TREE_FIELDS:
                digest.update(getattr(tree, field).cpu().numpy().tobytes())
        row = {"shape": f"{batch}:{budget}:{scale:g}", **measure_build(batch, budget, buffers)}
        row["trees_sha256"] = digest.hexdigest()[:16]
        if check_reference:
            ref = reference.build_tree(buffers[0], roots, budget)
            row["reference"] = reference_agreement(trees[0], ref)
        del trees
        row["gpu"] = torch.cuda.get_device_name()
        print(json.dumps(row), flush=True)
        del buffers
        torch.cuda.empty_cache()


def _resolve(rev: str) -> str:
    """A directory as its absolute path, a revision as its commit."""
    if Path(rev).is_dir():
        return str(Path(rev).resolve())
    return subprocess.run(
        [*_GIT, "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def head_sides(heads: list[str] | None) -> dict[str, str]:
    """The head sides by name: ``head`` (the working tree when ``heads`` is empty, else the
    one given), or ``head1``, ``head2``, ... for several."""
    if not heads:
        return {"head": "worktree"}
    if len(heads) == 1:
        return {"head": _resolve(heads[0])}
    return {f"head{i}": _resolve(rev) for i, rev in enumerate(heads, 1)}


def summarise(rows: list[dict], sides: list[str]) -> dict[str, dict]:
    """Per shape: each side's median graph ms (``<side>_graph_ms``), each head's ratio to the
    base (``<side>_over_base``), each side's median top-k launch in microseconds where the
    profiler gave it (``<side>_topk_us``), whether every process built the same trees, and,
    where the rows were checked against the reference, each side's agreement with it
    (``<side>_reference``: ``exact`` in every process, else ``same_scores``, else
    ``differs``)."""
    summary = {}
    for shape in dict.fromkeys(row["shape"] for row in rows):
        of_shape = [row for row in rows if row["shape"] == shape]
        entry: dict = {}
        for side in sides:
            mine = [r for r in of_shape if r["side"] == side]
            if not mine:
                continue  # not measured yet: the run was cut short
            entry[f"{side}_graph_ms"] = statistics.median(r["graph_ms"] for r in mine)
            topk = [
                r["kernels_us"]["ddtree_build_topk"]
                for r in mine
                if isinstance(r["kernels_us"], dict) and "ddtree_build_topk" in r["kernels_us"]
            ]
            if topk:
                entry[f"{side}_topk_us"] = statistics.median(topk)
            checks = [r["reference"] for r in mine if "reference" in r]
            if checks:
                entry[f"{side}_reference"] = (
                    "exact"
                    if all(c["exact_order"] for c in checks)
                    else "same_scores"
                    if all(c["same_sorted_log_probs"] for c in checks)
                    else "differs"
                )
        for side in sides[1:]:
            if f"{side}_graph_ms" in entry and "base_graph_ms" in entry:
                entry[f"{side}_over_base"] = round(
                    entry[f"{side}_graph_ms"] / entry["base_graph_ms"], 4
                )
        entry["trees_equal"] = len({r["trees_sha256"] for r in of_shape}) == 1
        summary[shape] = entry
    return summary


def write_report(
    out: Path, date: str, sides: dict[str, str], rows: list[dict], note: str | None
) -> dict:
    """Writes the report of the rows measured so far to ``out`` (date, gpu, sides, note, summary,
    rows) and returns its summary. The A/B rewrites it after every process, so that a run cut
    short (a device call's time limit) keeps what it measured."""
    summary = summarise(rows, list(sides))
    report = {
        "date": date,
        "gpu": rows[0]["gpu"] if rows else "unknown",
        "sides": sides,
        **({"note": note} if note else {}),
        "summary": summary,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="side A: a git revision or a source tree's directory")
    parser.add_argument(
        "--head", action="append", help="side B, as --base (default: worktree; repeatable)"
    )
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also compare each process's first tree with the reference op's",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--note", help="what the sides are, kept in the report")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    if args.measure:
        _measure(shapes, args.reference)
        return
    if args.base is None:
        parser.error("--base is required")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("ab_build_tree: needs a CUDA GPU (torch reports none)")
    sides = {"base": _resolve(args.base), **head_sides(args.head)}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    slug = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    out = args.out or REPO / "bench" / "results" / f"{date}-{slug}-ab-build-tree.json"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ddtree-ab-") as tmp:
        root = Path(tmp)
        copies = {
            side: package_copy(None if rev == "worktree" else rev, root / side)
            for side, rev in sides.items()
        }
        for round_index in range(args.rounds):
            for side, copy in copies.items():
                env = dict(
                    os.environ,
                    PYTHONPATH=os.pathsep.join([str(copy), str(REPO / "bench")]),
                    DDTREE_CACHE_DIR=str(root / f"cache-{side}"),
                )
                result = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--measure",
                        "--shapes",
                        args.shapes,
                        *(["--reference"] if args.reference else []),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if result.returncode != 0:
                    raise SystemExit(f"ab_build_tree: the {side} process failed:\n{result.stderr}")
                for line in result.stdout.splitlines():
                    if line.startswith("{"):
                        row = json.loads(line)
                        rows.append({"side": side, "round": round_index, **row})
                        print(json.dumps(rows[-1]), flush=True)
                write_report(out, date, sides, rows, args.note)
    print(json.dumps(write_report(out, date, sides, rows, args.note), indent=1))


if __name__ == "__main__":
    main()
