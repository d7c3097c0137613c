"""ddtree: the tree part of DDTree speculative decoding, as a GPU-resident gRPC service.

Subpackages: ``ddtree.kernels`` (ops and their pure-torch references), ``ddtree.service`` (engine,
gRPC server, ``ddtree`` command), ``ddtree.clients`` (remote and embedded clients) and ``ddtree.v1``
(generated wire contract).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ddtree")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
