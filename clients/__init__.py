"""Python clients of the ddtree service.

- ``Client`` / ``AsyncClient``: remote, over gRPC (``host:port`` or ``unix:/path``); need only
  the base dependencies.
- ``EmbeddedClient``: the same methods over an engine in this process (needs the ``server``
  extra's code paths, imported when it is created).

All three return ``ddtree.kernels.types.Tree`` / ``Acceptance`` and raise
``ddtree.clients.errors`` exceptions.

- ``Channel``: a GPU doorbell channel to a server on the same node (``ddtree.clients.channel``,
  docs/channel.md): build_tree / accept steps with no RPC and no host synchronisation per step;
  needs the ``cuda`` extra when opened.
"""

from ddtree.clients.channel import Channel
from ddtree.clients.embedded import EmbeddedClient
from ddtree.clients.errors import DDTreeClientError
from ddtree.clients.remote import AsyncClient, Client, PreparedCall, RetryPolicy, TlsOptions
from ddtree.clients.types import DeviceInfo, KvCommit, MemoryRegion, ServerInfo, ServerLimits

__all__ = [
    "AsyncClient",
    "Channel",
    "Client",
    "DDTreeClientError",
    "DeviceInfo",
    "EmbeddedClient",
    "KvCommit",
    "MemoryRegion",
    "PreparedCall",
    "RetryPolicy",
    "ServerInfo",
    "ServerLimits",
    "TlsOptions",
]
