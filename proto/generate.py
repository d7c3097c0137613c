"""Regenerate the committed protobuf/gRPC stubs of ``ddtree.v1`` from ``proto/ddtree/v1/*.proto``.

Run from anywhere: ``python proto/generate.py`` (writes next to the .proto files) or
``python proto/generate.py --out DIR`` (writes ``DIR/ddtree/v1/...``, used by the drift test).
Needs exactly the pinned code generator (the ``proto`` extra): the generated files embed its
version, and CI regenerates them and fails on any difference.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version
from pathlib import Path

__all__ = ["GRPCIO_TOOLS_VERSION", "PROTO_ROOT", "generate", "main"]

GRPCIO_TOOLS_VERSION = "1.84.0"
"""The grpcio-tools release the committed stubs are generated with."""

PROTO_ROOT = Path(__file__).resolve().parent
"""Include root: ``ddtree/v1/foo.proto`` lives under it, matching the ``ddtree.v1`` package."""


def generate(out_dir: Path) -> list[Path]:
    """Generate ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every ddtree/v1 proto.

    Parameters
    ----------
    out_dir : Path
        Root to write into; files land in ``out_dir/ddtree/v1/``.

    Returns
    -------
    list of Path
        The .proto files compiled, relative to ``PROTO_ROOT``.

    Raises
    ------
    RuntimeError
        grpcio-tools is missing or not the pinned version, or protoc failed.
    """
    try:
        installed = version("grpcio-tools")
    except Exception as err:
        raise RuntimeError(
            f"grpcio-tools is not installed; pip install 'grpcio-tools=={GRPCIO_TOOLS_VERSION}' "
            "(the 'proto' extra)"
        ) from err
    if installed != GRPCIO_TOOLS_VERSION:
        raise RuntimeError(
            f"grpcio-tools {installed} is installed, the stubs are pinned to "
            f"{GRPCIO_TOOLS_VERSION}; pip install 'grpcio-tools=={GRPCIO_TOOLS_VERSION}'"
        )
    from importlib.resources import files

    from grpc_tools import protoc

    v1_dir = PROTO_ROOT / "ddtree" / "v1"
    protos = sorted(p.relative_to(PROTO_ROOT) for p in v1_dir.glob("*.proto"))
    well_known = str(files("grpc_tools") / "_proto")
    (out_dir / "ddtree" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(p.as_posix() for p in protos),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
    return protos


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=PROTO_ROOT,
        help="root to write ddtree/v1/*_pb2*.py into (default: next to the .proto files)",
    )
    args = parser.parse_args(argv)
    try:
        protos = generate(args.out)
    except RuntimeError as err:
        sys.stderr.write(f"generate.py: {err}\n")
        return 1
    sys.stdout.write(f"generated stubs for {len(protos)} proto files under {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
