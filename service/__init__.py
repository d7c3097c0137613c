"""The ddtree service: an ``Engine`` over ``ddtree.kernels`` and a ``grpc.aio`` server around it.

Modules: ``engine`` (devices, ops, validation; no gRPC), ``calls`` (typed op arguments and their
checks), ``convert`` (protobuf <-> calls), ``servicer`` and ``server`` (gRPC), ``config``
(``DDTREE_*`` settings), ``errors`` (the exception hierarchy), ``cli`` (the ``ddtree`` command).
Importing this package imports none of them.
"""
