"""The ``ddtree`` command: ``ddtree serve`` runs the gRPC service, ``ddtree demo`` a demo client."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

import ddtree
from ddtree.service.config import add_arguments, config_from_args

__all__ = ["build_parser", "main"]

_DESCRIPTION = """\
ddtree: the tree part of DDTree tree speculative decoding as a gRPC service.

Start the service, then call it from another shell with the Python client:

  ddtree serve                               # 127.0.0.1:50051, GPU if present, else CPU
  ddtree serve --listen 0.0.0.0:50051 --listen unix:/tmp/ddtree.sock

  python -c "from ddtree.clients import Client; print(Client('127.0.0.1:50051').server_info())"
"""

_SERVE_DESCRIPTION = """\
Serve ddtree.v1.TreeSpeculationService (plus grpc.health.v1 health checking and server
reflection) until SIGTERM or Ctrl-C, then drain: health turns NOT_SERVING, in-flight calls get
--grace-s seconds to finish, and the process exits 0.

Health reports NOT_SERVING while the kernels warm up (first start on a GPU compiles them, later
starts load them from the cache) and SERVING after. Without a GPU the pure-torch reference runs
on the CPU, so this works on a laptop.

Every option can also be set by an environment variable (shown in brackets); a flag wins over
its variable.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ddtree`` command."""
    parser = argparse.ArgumentParser(
        prog="ddtree",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ddtree {ddtree.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the gRPC service",
        description=_SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(serve)
    commands.add_parser(
        "demo",
        help="run the end-to-end demo client (arguments after 'demo' go to it; see demo --help)",
        add_help=False,
    )
    return parser


def _run_demo(argv: list[str]) -> int:
    try:
        demo = importlib.import_module("ddtree.clients.demo")
    except ModuleNotFoundError as err:
        if err.name != "ddtree.clients.demo":
            raise
        sys.stderr.write("ddtree demo: the demo client (ddtree.clients.demo) is not installed\n")
        return 2
    result = demo.main(argv)
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddtree`` command; returns the process exit code.

    Exit codes: 0 success, 1 the server could not start, 2 bad arguments, 3 the device failed
    while serving (restart the process).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":
        return _run_demo(args[1:])
    parser = build_parser()
    namespace = parser.parse_args(args)
    try:
        config = config_from_args(namespace)
    except ValueError as err:
        parser.error(str(err))
    if "grpc" not in sys.modules:  # gRPC reads its I/O engine once, when imported
        os.environ.update(config.grpc_environment())
    from ddtree.service.server import serve

    return serve(config)
