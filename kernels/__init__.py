"""Stateless DDTree ops over torch tensors: a pure-torch reference and CUDA kernels.

Every op runs on the tensors' device and, for CUDA tensors, on torch's current stream; no op
synchronises with the host unless its docstring says so. ``backend="auto"`` picks the CUDA kernels
for CUDA tensors when the runtime compiler is available and the reference otherwise;
``backend="cuda"`` insists on the kernels, ``backend="reference"`` on the reference.

Glossary (one name per dimension, used in code, docs, proto comments and metrics):

==================  ======  ====================================================================
name                letter  meaning
==================  ======  ====================================================================
``batch_size``      B       requests in one call
``draft_len``       L       drafted positions after the root (tree depths 1..L), at most 32
``vocab_size``      V       vocabulary size of the drafter and the target
``budget``          -       draft nodes besides the root, 1..1024, per request
``num_nodes_max``   N       node slots per request, ``1 + max(budget)``
``num_nodes``       -       ``1 + nodes built`` for one request (``<= 1 + budget``)
``path_len``        -       slots of an accepted path, ``draft_len + 1``
``num_heads``       H       attention heads of the verify pass
``head_dim``        -       query/key width, 576 for MLA (512 latent + 64 rope)
``v_dim``           -       value width, the first 512 dims of the latent
``page_size``       -       token slots per KV-cache page
``num_pages``       -       pages in the paged latent cache
``max_pages``       -       block-table entries per request
``prefix_len``      -       committed tokens before the tree, per request
==================  ======  ====================================================================

Algorithm: DDTree, Ringel & Romano, arXiv 2604.12989 (see ``build_tree``).
"""

from ddtree.kernels.accept import accept
from ddtree.kernels.attention import verify_attention
from ddtree.kernels.build import build_tree
from ddtree.kernels.kv import commit_kv
from ddtree.kernels.types import MAX_BUDGET, MAX_DRAFT_LEN, Acceptance, ErrorFlag, Tree

__all__ = [
    "MAX_BUDGET",
    "MAX_DRAFT_LEN",
    "Acceptance",
    "ErrorFlag",
    "Tree",
    "accept",
    "build_tree",
    "commit_kv",
    "verify_attention",
]
