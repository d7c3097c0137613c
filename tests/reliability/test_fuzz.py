"""Hostile input: a hypothesis fuzzer over every RPC's requests against a real server on loopback.

Each case is one valid request with one adversarial change (a dtype, a byte length that disagrees
with the shape, huge or negative extents, a reference to an unknown region, NaN/inf logits,
out-of-range tokens, parents, block-table entries and lengths, budgets 0 and past the maximum,
draft_len and vocab_size at and past their limits, ...). The expected answer comes from first
principles for structural changes, and from the pure-torch reference ops (with their
``error_flags``) for changed values: every case must get exactly that status code and
``ErrorInfo.reason``, a message naming the field, and, when it succeeds, a response byte-equal
to the reference's. Every call has a deadline (no hang) and after each test the untouched
requests are answered byte-identically to the first time (the server is unharmed).

Cases per run: see ``EXAMPLES``; ``test_cases_total`` checks that they add up to >= 10,000.

``test_fuzz_gpu.py`` runs these same tests against ``ddtree serve`` on a GPU (CUDA kernels, real
CUDA IPC for references) by loading a second copy of this module with ``SERVER_DEVICE =
"cuda"``: there references are supported, the CUDA kernels' documented limits (head and value
widths, KV row bytes) are expected where the reference would accept, and answers are compared
with the reference's within floating-point tolerances (``compare_responses``).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import pytest
import torch
from helpers.invariants import assert_tree_valid, has_near_ties
from helpers.ipc import HostMapper
from helpers.serving import ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree import kernels
from ddtree.clients import _wire
from ddtree.kernels.types import MAX_BUDGET, MAX_DRAFT_LEN, ErrorFlag, Tree
from ddtree.service import convert
from ddtree.service.config import ServiceConfig
from ddtree.service.engine import Engine
from ddtree.service.memory import MemoryLimits, RegionTable
from ddtree.service.server import SERVICE_NAME
from ddtree.v1 import tensor_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

EXAMPLES = {
    "build_tree": 2600,
    "accept_tree": 2600,
    "verify_attention": 2000,
    "memory_rpcs": 800,
    "references": 1200,
    "raw_bytes": 1000,
    "output_references": 300,
}
"""Hypothesis examples per test (each is one RPC, plus a reference-op run for value changes)."""

SERVER_DEVICE = "cpu"
"""Device of the server under test; ``test_fuzz_gpu.py`` sets ``"cuda"`` in its copy."""
CUDA_LIMITS = (
    "the CUDA verify_attention supports",
    "head_dim * element size must be a multiple of 16 bytes",
)
"""Messages of the CUDA kernels' documented shape limits (``ValueError`` naming the tensor)."""

CALL_TIMEOUT_S = 10.0
MAX_TENSOR_BYTES = 1 << 16
MAX_BATCH_SIZE = 8
MAX_MESSAGE_BYTES = 1 << 20

B, L, V, BUDGET = 2, 3, 11, 5
HEADS, HEAD_DIM, V_DIM, PAGE, MAX_PAGES = 2, 8, 4, 4, 4
NUM_PAGES = B * MAX_PAGES

_ITEMSIZE = {1: 2, 2: 2, 3: 4, 4: 4, 5: 8, 6: 1}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_MODEL_RE = re.compile(r"^[A-Za-z0-9_.:-]{0,64}$")
_ARGUMENT_REASONS = {
    "MISSING_FIELD",
    "INVALID_TENSOR",
    "TENSOR_TOO_LARGE",
    "VALUE_OUT_OF_RANGE",
    "INVALID_TOKEN",
    "INVALID_TREE",
    "INVALID_BLOCK_TABLE",
    "INVALID_LENGTH",
    "INVALID_ACCEPTANCE",
    "INVALID_REFERENCE",
    "INVALID_ARGUMENT",
}
# Which reason each error flag gives, per op, in the order the service reports them (docs/api.md).
_FLAG_REASONS: dict[str, tuple[tuple[ErrorFlag, str], ...]] = {
    "build_tree": ((ErrorFlag.TOKEN, "INVALID_TOKEN"),),
    "accept": (
        (ErrorFlag.TREE, "INVALID_TREE"),
        (ErrorFlag.TOKEN, "INVALID_TOKEN"),
        (ErrorFlag.ACCEPTANCE, "INVALID_ACCEPTANCE"),
    ),
    "commit_kv": (
        (ErrorFlag.BLOCK_TABLE, "INVALID_BLOCK_TABLE"),
        (ErrorFlag.LENGTH, "INVALID_LENGTH"),
        (ErrorFlag.ACCEPTANCE, "INVALID_ACCEPTANCE"),
    ),
    "verify_attention": (
        (ErrorFlag.BLOCK_TABLE, "INVALID_BLOCK_TABLE"),
        (ErrorFlag.LENGTH, "INVALID_LENGTH"),
        (ErrorFlag.TREE, "INVALID_TREE"),
    ),
}

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

cases_run: dict[str, int] = {}
outcomes: Counter[str] = Counter()
"""Answers seen, ``"<rpc> <CODE> <REASON>"`` -> count (written to ``DDTREE_FUZZ_REPORT``)."""


def examples(name: str) -> int:
    """Examples of one test: ``EXAMPLES`` times ``DDTREE_FUZZ_SCALE`` (default 1)."""
    return max(1, round(EXAMPLES[name] * float(os.environ.get("DDTREE_FUZZ_SCALE", "1"))))


# ---------------------------------------------------------------------------- expectations


@dataclass(frozen=True)
class Expect:
    """The answer a case must get: a status code, a reason and the field it names.

    ``reasons`` lists the allowed reasons (one, except where the test only knows the class of
    error); ``field`` is the exact ``BadRequest`` field (``None``: any field of the RPC).
    ``response`` (for OK) is the serialized response the reference gives, ``None``: not checked.
    """

    code: str
    reasons: frozenset[str] = frozenset()
    field: str | None = None
    response: bytes | None = None
    ok_allowed: bool = False
    cuda_limit: str | None = None
    """For a CUDA server: the answer is INVALID_ARGUMENT with this text of a kernel limit."""
    unspecified: tuple[int, ...] = ()
    """Requests (batch indices) whose numeric answer the contract leaves open (VerifyAttention:
    see ``open_requests``)."""


def error(reason: str, field: str | None, code: str = "INVALID_ARGUMENT") -> Expect:
    return Expect(code, frozenset({reason}), field)


def ok(response: bytes | None) -> Expect:
    return Expect("OK", response=response)


def any_argument_error(rpc: str, *, ok_allowed: bool = False) -> Expect:
    return Expect("INVALID_ARGUMENT", frozenset(_ARGUMENT_REASONS), None, ok_allowed=ok_allowed)


def cuda_limit_error(text: str) -> Expect:
    return Expect("INVALID_ARGUMENT", frozenset({"INVALID_ARGUMENT"}), cuda_limit=text)


def _is_cuda_limit(got: Any) -> bool:
    return (
        SERVER_DEVICE == "cuda"
        and (got.code, got.reason) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT")
        and any(text in got.message for text in CUDA_LIMITS)
    )


def check(method: Callable[..., Any], request: Any, expect: Expect, rpc: str) -> None:
    """Send ``request``; its answer must be ``expect``."""
    try:
        response = method(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        got = _wire.error_from_rpc(err)
        context = f"{rpc}: expected {expect}, got {got.code} {got.reason} {got.message!r}"
        if expect.code == "OK" or (expect.ok_allowed and got.code == "OK"):
            raise AssertionError(context) from None
        if expect.cuda_limit is not None or (
            expect.field is None and "INVALID_ARGUMENT" in expect.reasons and _is_cuda_limit(got)
        ):
            # A CUDA kernel's shape limit: the engine's message names the tensor and the limit
            # (no BadRequest field). Exact where the oracle knows the limit applies.
            assert _is_cuda_limit(got), context
            assert expect.cuda_limit is None or expect.cuda_limit in got.message, context
            assert got.message.startswith(rpc), context
            outcomes[f"{rpc} {got.code} {got.reason} (CUDA kernel limit)"] += 1
            return
        assert expect.cuda_limit is None, context
        assert got.code == expect.code, context
        assert got.reason in expect.reasons, context
        assert got.request_id, context  # every error names its request in the server log
        if expect.code == "INVALID_ARGUMENT":
            assert got.field, context
            assert got.field.startswith(rpc), context
            assert got.field in got.message, context
        if expect.field is not None:
            assert got.field == expect.field, context
        outcomes[f"{rpc} {got.code} {got.reason}"] += 1
        return
    assert expect.code == "OK" or expect.ok_allowed, f"{rpc}: expected {expect}, got OK"
    if expect.response is not None:
        if SERVER_DEVICE == "cpu":
            assert response.SerializeToString() == expect.response, f"{rpc}: response differs"
        else:
            before = len(numeric_mismatches)
            expected = type(response).FromString(expect.response)
            if expect.unspecified:
                expected = blank_requests(expected, expect.unspecified)
                response = blank_requests(response, expect.unspecified)
                outcomes[f"{rpc} OK, {len(expect.unspecified)} request(s) left open"] += 1
            compare_responses(rpc, expected, response)
            if len(numeric_mismatches) > before:
                _dump_mismatch(rpc, request, expect.response, response)
    outcomes[f"{rpc} OK"] += 1


def _dump_mismatch(rpc: str, request: Any, expected: bytes, got: Any) -> None:
    """With ``DDTREE_FUZZ_DUMP`` set to a directory, keep the first 20 requests whose CUDA answer
    differs from the reference's, with both answers (serialized protobuf), to replay on a CPU."""
    directory = os.environ.get("DDTREE_FUZZ_DUMP")
    if not directory or len(numeric_mismatches) > 200:
        return
    os.makedirs(directory, exist_ok=True)
    index = len(os.listdir(directory)) // 3
    if index >= 20:
        return
    stem = os.path.join(directory, f"{rpc}-{index:02d}")
    for suffix, data in (
        ("request", request.SerializeToString()),
        ("expected", expected),
        ("got", got.SerializeToString()),
    ):
        with open(f"{stem}.{suffix}.pb", "wb") as out:
            out.write(data)


# ---------------------------------------------------------------------------- GPU answers

numeric_mismatches: list[str] = []
"""CUDA answers outside the tolerances of ``compare_responses`` (asserted empty at the end)."""

_TOLERANCES = {
    "log_probs": (1e-4, 0.0),  # fp32 log_softmax: a few ulps (as tests/kernels/test_tree_cuda)
    "lse": (1e-2, 1e-3),  # fp32, another summation order (as tests/kernels/test_attention_cuda)
    "out": (2e-2, 5e-2),  # bf16 rounding of an fp32 accumulation
}
"""Absolute and relative tolerance of the float fields computed in another order on the GPU;
every other field (integers, the KV cache that AcceptTree copies) must be byte-identical."""


def compare_responses(rpc: str, expected: Any, got: Any, path: str = "") -> None:
    """Compare two responses field by field: shapes, integers and copied data byte for byte,
    computed floats within ``_TOLERANCES`` with NaN, +inf and -inf in the same places.
    Mismatches are recorded in ``numeric_mismatches`` (so one run reports all of them) rather
    than raised."""
    name = path or rpc
    if isinstance(expected, tensor_pb2.Tensor):
        if expected.dtype != got.dtype or list(expected.shape) != list(got.shape):
            numeric_mismatches.append(f"{name}: dtype/shape {got.dtype}{list(got.shape)}")
            return
        tolerance = _TOLERANCES.get(name.rsplit(".", 1)[-1])
        if tolerance is None:
            if expected.inline != got.inline:
                want, have = decode(expected), decode(got)
                differs = want.view(-1).view(torch.uint8) != have.view(-1).view(torch.uint8)
                numeric_mismatches.append(
                    f"{name}: {int(differs.sum())} bytes differ, first at byte "
                    f"{int(torch.nonzero(differs)[0])}"
                )
            return
        atol, rtol = tolerance
        want, have = decode(expected).float(), decode(got).float()
        inf = math.inf
        if not (
            torch.equal(want.isnan(), have.isnan())
            and torch.equal(want == inf, have == inf)
            and torch.equal(want == -inf, have == -inf)
        ):
            numeric_mismatches.append(f"{name}: NaN/inf pattern differs")
            return
        finite = want.isfinite()
        error = (want[finite] - have[finite]).abs() - (atol + rtol * want[finite].abs())
        if error.numel() and float(error.max()) > 0:
            numeric_mismatches.append(f"{name}: off by {float(error.max()):.3g} past tolerance")
        return
    if expected.DESCRIPTOR.full_name == "ddtree.v1.Tree" and _trees_agree(name, expected, got):
        return
    for descriptor in expected.DESCRIPTOR.fields:
        label = f"{name}.{descriptor.name}"
        if descriptor.message_type is not None:
            if expected.HasField(descriptor.name) != got.HasField(descriptor.name):
                numeric_mismatches.append(f"{label}: set in one answer only")
            elif expected.HasField(descriptor.name):
                compare_responses(
                    rpc, getattr(expected, descriptor.name), getattr(got, descriptor.name), label
                )
        elif getattr(expected, descriptor.name) != getattr(got, descriptor.name):
            numeric_mismatches.append(f"{label}: {getattr(got, descriptor.name)!r}")


def _trees_agree(name: str, expected: Any, got: Any) -> bool:
    """A CUDA tree against the reference's under the contract of ``kernels.build_tree``: node
    for node (then False, and ``compare_responses`` checks field by field) unless a last-bit
    difference of the CUDA log-softmax may legitimately change it: two of the reference's scores
    within 1e-5 of each other (they may come out in the other order), or a node of probability 0
    (a score like -3e38, which one more ulp turns into -inf, an impossible prefix). Then any
    valid tree agrees whose node probabilities, sorted, match within 1e-5 relative (True; a
    failure is recorded in ``numeric_mismatches``)."""
    want = decode_tree(expected)
    want_probs = want.log_probs.double().exp()  # [batch, nodes]; -inf and -3e38 give 0
    vanishing = bool((torch.isfinite(want.log_probs) & (want_probs == 0)).any())
    if not (has_near_ties(want) or vanishing) or list(expected.tokens.shape) != list(
        got.tokens.shape
    ):
        return False
    have = decode_tree(got)
    try:
        assert_tree_valid(have)
    except AssertionError as err:
        numeric_mismatches.append(f"{name}: not a valid tree ({err})")
        return True
    have_probs = have.log_probs.double().exp()  # [batch, nodes]
    want_sorted = want_probs.sort(dim=1, descending=True).values
    have_sorted = have_probs.sort(dim=1, descending=True).values
    if not torch.allclose(have_sorted, want_sorted, rtol=1e-5, atol=0.0):
        numeric_mismatches.append(f"{name}: sorted node probabilities differ")
    return True


# ---------------------------------------------------------------------------- inputs


def encode(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    return convert.tensor_to_proto(tensor)


def decode(message: tensor_pb2.Tensor) -> torch.Tensor:
    dtype = convert.DTYPE_TO_TORCH[message.dtype]
    if not message.inline:
        return torch.empty(tuple(message.shape), dtype=dtype)
    return torch.frombuffer(bytearray(message.inline), dtype=dtype).reshape(tuple(message.shape))


def decode_tree(message: Any) -> Tree:
    return Tree(
        tokens=decode(message.tokens),
        parents=decode(message.parents),
        depths=decode(message.depths),
        log_probs=decode(message.log_probs),
        num_nodes=decode(message.num_nodes),
        mask=decode(message.mask),
        draft_len=int(message.draft_len),
    )


@dataclass
class Inputs:
    """Valid requests of each RPC (small shapes) and their responses from the first call."""

    build: pb.BuildTreeRequest
    accept: pb.AcceptTreeRequest
    verify: pb.VerifyAttentionRequest
    golden: dict[str, bytes] = field(default_factory=dict)


def make_inputs() -> Inputs:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(B, L, V, generator=generator) * 3
    roots = torch.randint(0, V, (B,), generator=generator)
    tree = kernels.build_tree(logits, roots, BUDGET, backend="reference")
    targets = tree.tokens.roll(-1, dims=1).clamp(min=0)
    cache = torch.randn(NUM_PAGES, PAGE, HEAD_DIM, generator=generator).to(torch.bfloat16)
    table = torch.randperm(NUM_PAGES, generator=generator).to(torch.int32).reshape(B, MAX_PAGES)
    lens = torch.tensor([0, 3], dtype=torch.int32)
    q = torch.randn(B, tree.num_nodes_max, HEADS, HEAD_DIM, generator=generator)
    wire_tree = convert.tree_to_proto(tree)
    return Inputs(
        build=pb.BuildTreeRequest(draft_logits=encode(logits), root_tokens=encode(roots), budget=5),
        accept=pb.AcceptTreeRequest(
            tree=wire_tree,
            target_tokens=encode(targets),
            kv_commit=pb.KvCommit(
                kv_cache=encode(cache), block_table=encode(table), prefix_lens=encode(lens)
            ),
        ),
        verify=pb.VerifyAttentionRequest(
            q=encode(q.to(torch.bfloat16)),
            kv_cache=encode(cache),
            block_table=encode(table),
            prefix_lens=encode(lens),
            tree=wire_tree,
            v_dim=V_DIM,
        ),
    )


# ---------------------------------------------------------------------------- reference oracle


def flag_error(op: str, flags: torch.Tensor, rpc: str) -> Expect | None:
    bad = torch.nonzero(flags).flatten().tolist()
    if not bad:
        return None
    value = ErrorFlag(int(flags[bad[0]]))
    for flag, reason in _FLAG_REASONS[op]:
        if flag in value:
            return Expect("INVALID_ARGUMENT", frozenset({reason}))
    return any_argument_error(rpc)


def oracle_build(request: pb.BuildTreeRequest) -> Expect:
    logits, roots = decode(request.draft_logits), decode(request.root_tokens)
    budget: int | torch.Tensor
    budget = decode(request.budgets) if request.HasField("budgets") else int(request.budget)
    flags = torch.zeros(logits.shape[0], dtype=torch.int32)
    temperature = request.temperature if request.HasField("temperature") else 1.0
    try:
        tree = kernels.build_tree(
            logits,
            roots,
            budget,
            temperature=temperature,
            max_budget=int(request.max_budget) or None,
            error_flags=flags,
            backend="reference",
        )
    except ValueError:
        return any_argument_error("build_tree")
    failure = flag_error("build_tree", flags, "build_tree")
    if failure is not None:
        return failure
    return ok(pb.BuildTreeResponse(tree=convert.tree_to_proto(tree)).SerializeToString())


def oracle_accept(request: pb.AcceptTreeRequest) -> Expect:
    tree = decode_tree(request.tree)
    targets = decode(request.target_tokens)
    flags = torch.zeros(tree.tokens.shape[0], dtype=torch.int32)
    try:
        acceptance = kernels.accept(tree, targets, error_flags=flags, backend="reference")
    except ValueError:
        return any_argument_error("accept_tree")
    failure = flag_error("accept", flags, "accept_tree")
    if failure is not None:
        return failure
    response = pb.AcceptTreeResponse(acceptance=convert.acceptance_to_proto(acceptance))
    if request.HasField("kv_commit"):
        cache = decode(request.kv_commit.kv_cache).clone()
        try:
            kernels.commit_kv(
                cache,
                decode(request.kv_commit.block_table),
                decode(request.kv_commit.prefix_lens),
                acceptance,
                error_flags=flags,
                backend="reference",
            )
        except ValueError:
            return any_argument_error("accept_tree")
        if SERVER_DEVICE == "cuda" and cache.shape[-1] * cache.element_size() % 16:
            return cuda_limit_error(CUDA_LIMITS[1])
        failure = flag_error("commit_kv", flags, "accept_tree")
        if failure is not None:
            return failure
        response.kv_cache.CopyFrom(encode(cache))
    return ok(response.SerializeToString())


def oracle_verify(request: pb.VerifyAttentionRequest) -> Expect:
    tree = decode_tree(request.tree)
    flags = torch.zeros(tree.tokens.shape[0], dtype=torch.int32)
    try:
        out, lse = kernels.verify_attention(
            decode(request.q),
            decode(request.kv_cache),
            decode(request.block_table),
            decode(request.prefix_lens),
            tree,
            v_dim=request.v_dim if request.HasField("v_dim") else 512,
            sm_scale=request.sm_scale if request.HasField("sm_scale") else None,
            error_flags=flags,
            backend="reference",
        )
    except ValueError:
        return any_argument_error("verify_attention")
    if SERVER_DEVICE == "cuda":
        head_dim = request.q.shape[-1]
        v_dim = request.v_dim if request.HasField("v_dim") else 512
        if head_dim % 64 or v_dim % 64 or not 64 <= v_dim <= min(head_dim, 512):
            return cuda_limit_error(CUDA_LIMITS[0])
    failure = flag_error("verify_attention", flags, "verify_attention")
    if failure is not None:
        return failure
    response = pb.VerifyAttentionResponse(out=encode(out), lse=encode(lse)).SerializeToString()
    return replace(ok(response), unspecified=open_requests(request))


def open_requests(request: pb.VerifyAttentionRequest) -> tuple[int, ...]:
    """Requests whose rows ``kernels.verify_attention`` leaves open: a NaN or infinity in q (of
    their nodes) or in a cache row of their range ``[0, prefix_len + num_nodes)``, or a scaled
    score ``q . k * sm_scale * log2(e)`` past the fp32 range."""
    q, kv = decode(request.q).double(), decode(request.kv_cache).double()
    table, prefix = decode(request.block_table).long(), decode(request.prefix_lens).long()
    num_nodes = decode(request.tree.num_nodes).long()
    scale = request.sm_scale if request.HasField("sm_scale") else q.shape[-1] ** -0.5
    page_size = kv.shape[1]
    found = []
    for b in range(q.shape[0]):
        end = int(prefix[b] + num_nodes[b])
        positions = torch.arange(end)
        rows = kv[table[b, positions // page_size], positions % page_size]  # [end, head_dim]
        nodes = q[b, : int(num_nodes[b])]  # [nodes, heads, head_dim]
        if not (nodes.isfinite().all() and rows.isfinite().all()):
            found.append(b)
            continue
        scores = torch.einsum("nhd,td->nht", nodes, rows) * scale * math.log2(math.e)
        if scores.numel() and float(scores.abs().max()) >= torch.finfo(torch.float32).max:
            found.append(b)
    return tuple(found)


def blank_requests(response: Any, requests: tuple[int, ...]) -> Any:
    """A copy of a VerifyAttention response with the rows of ``requests`` zeroed."""
    blanked = type(response)()
    blanked.CopyFrom(response)
    for name in ("out", "lse"):
        tensor = decode(getattr(response, name)).clone()
        tensor[list(requests)] = 0
        getattr(blanked, name).CopyFrom(encode(tensor))
    return blanked


# ---------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Slot:
    """A tensor field of a request: its path from the request and its allowed dtypes."""

    path: tuple[str, ...]
    name: str
    dtypes: tuple[torch.dtype, ...]
    oneof: str | None = None
    """Field named when the tensor is unset, for a member of a oneof (``accept_tree.target``)."""


def _parent(request: Any, path: tuple[str, ...]) -> Any:
    message = request
    for part in path[:-1]:
        message = getattr(message, part)
    return message


def _tensor(request: Any, slot: Slot) -> tensor_pb2.Tensor:
    return getattr(_parent(request, slot.path), slot.path[-1])  # type: ignore[no-any-return]


_HUGE = st.sampled_from([2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1])
_EXTENT = st.one_of(st.integers(-3, 12), _HUGE, st.just(-(2**63)))
_SHAPES = st.lists(_EXTENT, min_size=0, max_size=5)


@st.composite
def tensor_change(draw: st.DrawFn, slots: tuple[Slot, ...], refs: bool = False) -> tuple:
    """A structural change of one tensor field; returns ``(slot, apply, expect_or_None)``.

    ``None`` means "run the reference oracle on the changed request".
    """
    slot = draw(st.sampled_from(slots))
    kind = draw(st.sampled_from(["dtype", "length", "shape", "reshape", "no_data", "unset", "ref"]))
    field = slot.name

    def apply_fn(fn: Callable[[tensor_pb2.Tensor], None]) -> Callable[[Any], None]:
        return lambda request: fn(_tensor(request, slot))

    if kind == "dtype":
        dtype = draw(st.integers(0, 12))

        def expect_dtype(message: tensor_pb2.Tensor) -> Expect | None:
            if dtype not in _ITEMSIZE:
                return error("INVALID_TENSOR", f"{field}.dtype")
            if _ITEMSIZE[dtype] * math.prod(message.shape) != len(message.inline):
                return error("INVALID_TENSOR", f"{field}.inline")
            if convert.DTYPE_TO_TORCH[dtype] not in slot.dtypes:
                return error("INVALID_TENSOR", field)
            return None

        return slot, ("dtype", dtype), expect_dtype
    if kind == "length":
        delta = draw(st.integers(-64, 64).filter(bool))
        return slot, ("length", delta), lambda m: error("INVALID_TENSOR", f"{field}.inline")
    if kind in ("shape", "reshape"):
        shape = draw(_SHAPES) if kind == "shape" else []  # reshape: filled in when applied
        return slot, (kind, shape, draw(st.randoms(use_true_random=False))), None
    if kind == "no_data":
        return slot, ("no_data",), lambda m: error("MISSING_FIELD", field)
    if kind == "unset":
        return slot, ("unset",), lambda m: error("MISSING_FIELD", slot.oneof or field)
    token = draw(st.text(max_size=200))
    offset = draw(st.one_of(st.integers(0, 4096), st.integers(0, 2**64 - 1)))
    if SERVER_DEVICE == "cuda":  # references are served; no region has this token
        return (
            slot,
            ("ref", token, offset),
            lambda m: error("MEMORY_TOKEN_NOT_FOUND", f"{field}.ref.region_token", "NOT_FOUND"),
        )
    return (
        slot,
        ("ref", token, offset),
        lambda m: error("MEMORY_REFERENCES_UNSUPPORTED", f"{field}.ref", "FAILED_PRECONDITION"),
    )


def apply_tensor_change(request: Any, change: tuple, rpc: str) -> Expect | None:
    """Apply a ``tensor_change`` to ``request`` (in place); returns the expectation."""
    slot, what, expect_of = change
    message = _tensor(request, slot)
    field = slot.name
    kind = what[0]
    if kind == "dtype":
        expected = expect_of(message)
        message.dtype = what[1]
        return expected
    if kind == "length":
        delta = what[1]
        data = message.inline
        message.inline = data[: len(data) + delta] if delta < 0 else data + b"\x7f" * delta
        return expect_of(message)
    if kind in ("shape", "reshape"):
        itemsize = _ITEMSIZE[message.dtype]
        numel = math.prod(message.shape)
        if kind == "reshape":
            rng = what[2]
            shape = [numel]
            while len(shape) < rng.randint(1, 4):
                shape.insert(rng.randint(0, len(shape)), 1)
            rng.shuffle(shape)
        else:
            shape = what[1]
        original = list(message.shape)
        del message.shape[:]
        message.shape.extend(shape)
        if any(extent < 0 for extent in shape):
            return error("INVALID_TENSOR", f"{field}.shape")
        byte_size = math.prod(shape) * itemsize
        if byte_size > MAX_TENSOR_BYTES:
            return error("TENSOR_TOO_LARGE", field)
        if byte_size != len(message.inline):
            return error("INVALID_TENSOR", f"{field}.inline")
        if shape == original:
            return None
        return any_argument_error(rpc, ok_allowed=True)
    if kind == "no_data":
        message.ClearField("inline")
        return expect_of(message)
    if kind == "unset":
        _parent(request, slot.path).ClearField(slot.path[-1])
        return expect_of(message)
    message.ref.region_token = what[1]
    message.ref.offset_bytes = what[2]
    return expect_of(message)


_INT64 = st.one_of(
    st.integers(-3, 40),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([-(2**63), -1, 2**31 - 1, 2**31, 2**63 - 1]),
)
_INT32 = st.one_of(
    st.integers(-3, 40),
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from([-(2**31), -1, 2**31 - 1]),
)
_SPECIAL_FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e38, -1e38, 1e-45]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
)


@st.composite
def value_change(draw: st.DrawFn, slots: tuple[Slot, ...]) -> tuple[Slot, list[tuple[int, Any]]]:
    """New values at a few positions of one tensor field (same dtype and shape)."""
    slot = draw(st.sampled_from(slots))
    count = draw(st.integers(1, 4))
    values = []
    for _ in range(count):
        position = draw(st.integers(0, 10_000))
        if slot.dtypes[0] in _FLOATS:
            value = draw(_SPECIAL_FLOATS)
        elif slot.dtypes[0] == torch.int32:
            value = draw(_INT32)
        else:
            value = draw(_INT64)
        values.append((position, value))
    return slot, values


def apply_value_change(request: Any, change: tuple[Slot, list[tuple[int, Any]]]) -> None:
    slot, values = change
    message = _tensor(request, slot)
    tensor = decode(message).clone()
    flat = tensor.view(-1)
    for position, value in values:
        flat[position % flat.numel()] = value
    message.CopyFrom(encode(tensor))


# ---------------------------------------------------------------------------- servers


FAKE_UUID = "GPU-00000000-fuzz-0000-0000-000000000000"


def _config() -> ServiceConfig:
    return ServiceConfig(
        listen=("127.0.0.1:0",),
        device="cpu",
        max_batch_size=MAX_BATCH_SIZE,
        max_tensor_bytes=MAX_TENSOR_BYTES,
        max_message_bytes=MAX_MESSAGE_BYTES,
    )


@dataclass
class Served:
    """A running server, a channel and stubs for raw protobuf requests."""

    thread: ServerThread
    channel: grpc.Channel
    stub: pb_grpc.TreeSpeculationServiceStub


def _serve(engine: Engine | None = None) -> Iterator[Served]:
    thread = ServerThread(_config(), engine=engine)
    thread.start()
    channel = grpc.insecure_channel(
        thread.addresses[0],
        options=[
            ("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", 4 * MAX_MESSAGE_BYTES),
        ],
    )
    try:
        yield Served(thread, channel, pb_grpc.TreeSpeculationServiceStub(channel))
    finally:
        channel.close()
        thread.stop()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """A CPU server as deployed (inline tensors only; references refused)."""
    yield from _serve()


@pytest.fixture(scope="module")
def host_mapper() -> HostMapper:
    return HostMapper()


@pytest.fixture(scope="module")
def served_refs(host_mapper: HostMapper) -> Iterator[Served]:
    """A CPU server whose engine has registered memory over host buffers (``HostMapper``), so
    the reference path (tokens, bounds, offsets) runs without a GPU."""
    engine = Engine(device="cpu")
    engine.memory = RegionTable(
        device=torch.device("cpu"),
        device_uuid=FAKE_UUID,
        mapper=host_mapper,
        limits=MemoryLimits(max_regions=64, max_bytes=1 << 24),
    )
    yield from _serve(engine)


@pytest.fixture(scope="module")
def inputs(served: Served) -> Inputs:
    return golden_inputs(served)


def golden_inputs(served: Served) -> Inputs:
    """``make_inputs()`` with the server's first answers, checked against the reference."""
    made = make_inputs()
    made.golden["build"] = served.stub.BuildTree(
        made.build, timeout=CALL_TIMEOUT_S
    ).SerializeToString()
    made.golden["accept"] = served.stub.AcceptTree(
        made.accept, timeout=CALL_TIMEOUT_S
    ).SerializeToString()
    made.golden["verify"] = served.stub.VerifyAttention(
        made.verify, timeout=CALL_TIMEOUT_S
    ).SerializeToString()
    # The golden answers are the reference's (within tolerances from CUDA kernels).
    for name, oracle, request, response_type in (
        ("build_tree", oracle_build, made.build, pb.BuildTreeResponse),
        ("accept_tree", oracle_accept, made.accept, pb.AcceptTreeResponse),
        ("verify_attention", oracle_verify, made.verify, pb.VerifyAttentionResponse),
    ):
        golden = made.golden[name.split("_")[0]]
        expected = oracle(request).response
        assert expected is not None, name
        if SERVER_DEVICE == "cpu":
            assert expected == golden, name
        else:  # recorded, asserted at the end: the fuzz cases still run
            compare_responses(
                name, response_type.FromString(expected), response_type.FromString(golden)
            )
    return made


def assert_unharmed(served: Served, inputs: Inputs) -> None:
    """The untouched requests are answered exactly as the first time (byte for byte)."""
    stub = served.stub
    assert (
        stub.BuildTree(inputs.build, timeout=CALL_TIMEOUT_S).SerializeToString()
        == inputs.golden["build"]
    )
    assert (
        stub.AcceptTree(inputs.accept, timeout=CALL_TIMEOUT_S).SerializeToString()
        == inputs.golden["accept"]
    )
    verify = stub.VerifyAttention(inputs.verify, timeout=CALL_TIMEOUT_S).SerializeToString()
    assert verify == inputs.golden["verify"]


def _count(name: str) -> None:
    cases_run[name] = cases_run.get(name, 0) + 1
    if os.environ.get("DDTREE_FUZZ_PROGRESS") and cases_run[name] % 500 == 0:
        sys.stderr.write(f"fuzz progress: {name} {cases_run[name]} cases\n")


# ---------------------------------------------------------------------------- BuildTree

BUILD_SLOTS = (
    Slot(("draft_logits",), "build_tree.draft_logits", _FLOATS),
    Slot(("root_tokens",), "build_tree.root_tokens", (torch.int64,)),
)
_MODEL = st.one_of(st.from_regex(r"[A-Za-z0-9_.:-]{0,70}", fullmatch=True), st.text(max_size=80))
_BUDGET = st.one_of(st.integers(0, 12), st.sampled_from([MAX_BUDGET, MAX_BUDGET + 1, 2**32 - 1]))


@st.composite
def build_case(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(
        st.sampled_from(
            [
                "tensor",
                "values",
                "budget",
                "budgets",
                "temperature",
                "model",
                "limits",
                "unsupported",
            ]
        )
    )
    if kind == "tensor":
        return kind, draw(tensor_change(BUILD_SLOTS))
    if kind == "values":
        return kind, draw(value_change(BUILD_SLOTS))
    if kind == "budget":
        return kind, (draw(_BUDGET), draw(st.one_of(st.just(0), _BUDGET)))
    if kind == "budgets":
        dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        values = draw(st.lists(_BUDGET, min_size=B, max_size=B))
        return kind, (dtype, values, draw(st.one_of(st.just(0), _BUDGET)))
    if kind == "temperature":
        return kind, draw(st.one_of(_SPECIAL_FLOATS, st.floats(-10, 10)))
    if kind == "model":
        return kind, draw(_MODEL)
    if kind == "limits":
        batch = draw(st.sampled_from([0, 1, MAX_BATCH_SIZE, MAX_BATCH_SIZE + 1]))
        draft_len = draw(st.sampled_from([0, 1, MAX_DRAFT_LEN, MAX_DRAFT_LEN + 1]))
        vocab = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(1, 600)))
        return kind, (batch, draft_len, vocab, draw(st.integers(0, 2**32 - 1)))
    return kind, draw(st.sampled_from(["event", "outputs"]))


def build_expectation(request: pb.BuildTreeRequest, kind: str, change: Any) -> Expect:
    if kind == "tensor":
        expected = apply_tensor_change(request, change, "build_tree")
        return oracle_build(request) if expected is None else expected
    if kind == "values":
        apply_value_change(request, change)
        return oracle_build(request)
    if kind in ("budget", "budgets"):
        if kind == "budget":
            request.budget, request.max_budget = change
            largest, smallest = request.budget, request.budget
            field = "build_tree.budget"
        else:
            dtype, values, request.max_budget = change
            if dtype == torch.int32:
                values = [(v + 2**31) % 2**32 - 2**31 for v in values]
            request.budgets.CopyFrom(encode(torch.tensor(values, dtype=dtype)))
            largest, smallest = max(values), min(values)
            field = "build_tree.budgets"
        if not (smallest >= 1 and largest <= MAX_BUDGET):
            return error("VALUE_OUT_OF_RANGE", field)
        if request.max_budget and not largest <= request.max_budget <= MAX_BUDGET:
            return error("VALUE_OUT_OF_RANGE", "build_tree.max_budget")
        return oracle_build(request)
    if kind == "temperature":
        request.temperature = change
        if not (math.isfinite(change) and change > 0):
            return error("VALUE_OUT_OF_RANGE", "build_tree.temperature")
        return oracle_build(request)
    if kind == "model":
        request.model = change
        if not _MODEL_RE.fullmatch(change):
            return error("INVALID_MODEL_LABEL", "build_tree.model")
        return oracle_build(request)
    if kind == "limits":
        batch, draft_len, vocab, seed = change
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(batch, draft_len, vocab, generator=generator)
        roots = torch.randint(0, max(vocab, 1), (batch,), generator=generator)
        request.draft_logits.CopyFrom(encode(logits))
        request.root_tokens.CopyFrom(encode(roots))
        field = "build_tree.draft_logits"
        if logits.numel() * 4 > MAX_TENSOR_BYTES:
            return error("TENSOR_TOO_LARGE", field)
        if batch < 1:
            return error("INVALID_TENSOR", field)
        if batch > MAX_BATCH_SIZE:
            return error("TENSOR_TOO_LARGE", field)
        if not 1 <= draft_len <= MAX_DRAFT_LEN or vocab < 1:
            return error("INVALID_TENSOR", field)
        return oracle_build(request)
    if change == "event":
        request.wait_event_ipc_handle = b"\x01" * 64
        if SERVER_DEVICE == "cuda":  # not an event any process exported: the driver refuses it
            return error("IPC_OPEN_FAILED", None, "FAILED_PRECONDITION")
        return error(
            "EVENT_HANDLES_UNSUPPORTED", "build_tree.wait_event_ipc_handle", "FAILED_PRECONDITION"
        )
    request.outputs.tokens.region_token = "x"
    if SERVER_DEVICE == "cuda":
        return error("MEMORY_TOKEN_NOT_FOUND", None, "NOT_FOUND")
    return error("MEMORY_REFERENCES_UNSUPPORTED", "build_tree.outputs", "FAILED_PRECONDITION")


def test_build_tree_fuzz(served: Served, inputs: Inputs) -> None:
    @settings(FUZZ, max_examples=examples("build_tree"))
    @given(build_case())
    def run(case: tuple[str, Any]) -> None:
        request = pb.BuildTreeRequest()
        request.CopyFrom(inputs.build)
        expect = build_expectation(request, *case)
        check(served.stub.BuildTree, request, expect, "build_tree")
        _count("build_tree")

    run()
    assert_unharmed(served, inputs)


# ---------------------------------------------------------------------------- AcceptTree


def _tree_slots(prefix: str, path: tuple[str, ...]) -> tuple[Slot, ...]:
    kinds = (
        ("tokens", torch.int64),
        ("parents", torch.int32),
        ("depths", torch.int32),
        ("log_probs", torch.float32),
        ("num_nodes", torch.int32),
        ("mask", torch.int64),
    )
    return tuple(Slot((*path, name), f"{prefix}.{name}", (dtype,)) for name, dtype in kinds)


ACCEPT_TREE_SLOTS = _tree_slots("accept_tree.tree", ("tree",))
ACCEPT_SLOTS = (
    *ACCEPT_TREE_SLOTS,
    Slot(("target_tokens",), "accept_tree.target_tokens", (torch.int64,), "accept_tree.target"),
)
_ANY_CACHE_DTYPE = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int32,
    torch.int64,
    torch.uint8,
)
COMMIT_SLOTS = (
    Slot(("kv_commit", "kv_cache"), "accept_tree.kv_commit.kv_cache", _ANY_CACHE_DTYPE),
    Slot(("kv_commit", "block_table"), "accept_tree.kv_commit.block_table", (torch.int32,)),
    Slot(("kv_commit", "prefix_lens"), "accept_tree.kv_commit.prefix_lens", (torch.int32,)),
)
_VALUE_SLOTS_ACCEPT = tuple(s for s in ACCEPT_SLOTS if s.path[-1] != "log_probs") + COMMIT_SLOTS[1:]


@st.composite
def accept_case(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(
        st.sampled_from(
            ["tensor", "values", "draft_len", "temperature", "target", "model", "no_tree"]
        )
    )
    if kind == "tensor":
        return kind, draw(tensor_change(ACCEPT_SLOTS + COMMIT_SLOTS))
    if kind == "values":
        return kind, draw(value_change(_VALUE_SLOTS_ACCEPT))
    if kind == "draft_len":
        return kind, draw(st.one_of(st.integers(0, 40), st.just(2**32 - 1)))
    if kind == "temperature":
        return kind, draw(_SPECIAL_FLOATS)
    if kind == "model":
        return kind, draw(_MODEL)
    return kind, None


def accept_expectation(request: pb.AcceptTreeRequest, kind: str, change: Any) -> Expect:
    if kind == "tensor":
        expected = apply_tensor_change(request, change, "accept_tree")
        return oracle_accept(request) if expected is None else expected
    if kind == "values":
        apply_value_change(request, change)
        return oracle_accept(request)
    if kind == "draft_len":
        request.tree.draft_len = change
        if not 1 <= change <= MAX_DRAFT_LEN:
            return error("VALUE_OUT_OF_RANGE", "accept_tree.tree.draft_len")
        return oracle_accept(request)
    if kind == "temperature":
        request.temperature = change
        if not (math.isfinite(change) and change >= 0):
            return error("VALUE_OUT_OF_RANGE", "accept_tree.temperature")
        if change > 0:  # sampling needs logits; this request sends tokens
            return error("VALUE_OUT_OF_RANGE", "accept_tree.temperature")
        return oracle_accept(request)
    if kind == "target":
        request.ClearField("target_tokens")
        return error("MISSING_FIELD", "accept_tree.target")
    if kind == "model":
        request.model = change
        if not _MODEL_RE.fullmatch(change):
            return error("INVALID_MODEL_LABEL", "accept_tree.model")
        return oracle_accept(request)
    request.ClearField("tree")
    return error("MISSING_FIELD", "accept_tree.tree")


def test_accept_tree_fuzz(served: Served, inputs: Inputs) -> None:
    @settings(FUZZ, max_examples=examples("accept_tree"))
    @given(accept_case())
    def run(case: tuple[str, Any]) -> None:
        request = pb.AcceptTreeRequest()
        request.CopyFrom(inputs.accept)
        expect = accept_expectation(request, *case)
        check(served.stub.AcceptTree, request, expect, "accept_tree")
        _count("accept_tree")

    run()
    assert_unharmed(served, inputs)


# ---------------------------------------------------------------------------- VerifyAttention

VERIFY_SLOTS = (
    Slot(("q",), "verify_attention.q", (torch.bfloat16,)),
    Slot(("kv_cache",), "verify_attention.kv_cache", (torch.bfloat16,)),
    Slot(("block_table",), "verify_attention.block_table", (torch.int32,)),
    Slot(("prefix_lens",), "verify_attention.prefix_lens", (torch.int32,)),
    *_tree_slots("verify_attention.tree", ("tree",)),
)
_VALUE_SLOTS_VERIFY = tuple(s for s in VERIFY_SLOTS if s.path[-1] not in ("log_probs", "tokens"))


@st.composite
def verify_case(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["tensor", "values", "v_dim", "sm_scale", "model"]))
    if kind == "tensor":
        return kind, draw(tensor_change(VERIFY_SLOTS))
    if kind == "values":
        return kind, draw(value_change(_VALUE_SLOTS_VERIFY))
    if kind == "v_dim":
        return kind, draw(st.one_of(st.integers(0, HEAD_DIM + 2), st.just(2**32 - 1)))
    if kind == "sm_scale":
        return kind, draw(st.one_of(_SPECIAL_FLOATS, st.floats(-2, 2)))
    return kind, draw(_MODEL)


def verify_expectation(request: pb.VerifyAttentionRequest, kind: str, change: Any) -> Expect:
    if kind == "tensor":
        expected = apply_tensor_change(request, change, "verify_attention")
        return oracle_verify(request) if expected is None else expected
    if kind == "values":
        apply_value_change(request, change)
        return oracle_verify(request)
    if kind == "v_dim":
        request.v_dim = change
        if not 1 <= change <= HEAD_DIM:
            return error("VALUE_OUT_OF_RANGE", "verify_attention.v_dim")
        return oracle_verify(request)
    if kind == "sm_scale":
        request.sm_scale = change
        if not (math.isfinite(change) and change > 0):
            return error("VALUE_OUT_OF_RANGE", "verify_attention.sm_scale")
        return oracle_verify(request)
    request.model = change
    if not _MODEL_RE.fullmatch(change):
        return error("INVALID_MODEL_LABEL", "verify_attention.model")
    return oracle_verify(request)


def test_verify_attention_fuzz(served: Served, inputs: Inputs) -> None:
    @settings(FUZZ, max_examples=examples("verify_attention"))
    @given(verify_case())
    def run(case: tuple[str, Any]) -> None:
        request = pb.VerifyAttentionRequest()
        request.CopyFrom(inputs.verify)
        expect = verify_expectation(request, *case)
        check(served.stub.VerifyAttention, request, expect, "verify_attention")
        _count("verify_attention")

    run()
    assert_unharmed(served, inputs)


# ---------------------------------------------------------------------------- memory RPCs


SERVER_UUID = ""
"""UUID of the GPU server's device (``test_fuzz_gpu.py``), so registrations reach the driver."""
MAX_REGISTERED_BYTES = 1 << 40
"""The server's ``max_registered_bytes`` (the default)."""


@st.composite
def memory_case(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["register", "unregister", "list", "info"]))
    if kind == "register":
        uuids = st.text(max_size=60)
        handles = st.binary(max_size=100)
        if SERVER_UUID:
            uuids = st.one_of(uuids, st.just(SERVER_UUID), st.just(SERVER_UUID))
            handles = st.one_of(handles, st.binary(min_size=64, max_size=64))
        return kind, pb.RegisterMemoryRequest(
            ipc_handle=draw(handles),
            device_uuid=draw(uuids),
            byte_size=draw(st.one_of(st.integers(0, 4096), st.integers(0, 2**64 - 1))),
            client_id=draw(_MODEL),
        )
    if kind == "unregister":
        return kind, pb.UnregisterMemoryRequest(region_token=draw(st.text(max_size=200)))
    if kind == "list":
        return kind, pb.ListMemoryRequest(client_id=draw(st.text(max_size=100)))
    return kind, pb.GetServerInfoRequest()


def register_expectation(request: pb.RegisterMemoryRequest) -> Expect:
    """A GPU server's answer to a registration of random bytes (never a real handle)."""
    if len(request.ipc_handle) != 64:
        return error("INVALID_IPC_HANDLE", "register_memory.ipc_handle")
    if not _MODEL_RE.fullmatch(request.client_id):
        return error("INVALID_ARGUMENT", "register_memory.client_id")
    if request.device_uuid != SERVER_UUID:
        return error("DEVICE_MISMATCH", "register_memory.device_uuid", "FAILED_PRECONDITION")
    if request.byte_size < 1:
        return error("INVALID_IPC_HANDLE", "register_memory.byte_size")
    if request.byte_size > MAX_REGISTERED_BYTES:
        return error("MEMORY_LIMIT_EXCEEDED", None, "RESOURCE_EXHAUSTED")
    return error("IPC_OPEN_FAILED", None, "FAILED_PRECONDITION")


def test_memory_rpcs_fuzz(served: Served, inputs: Inputs) -> None:
    """No region registered yet: random registrations refused (a CPU server has no registered
    memory at all; a GPU server's driver refuses handles no process exported), no token known,
    no region listed."""
    stub = served.stub

    @settings(FUZZ, max_examples=examples("memory_rpcs"))
    @given(memory_case())
    def run(case: tuple[str, Any]) -> None:
        kind, request = case
        if kind == "register":
            if SERVER_DEVICE == "cuda":
                expect = register_expectation(request)
            else:
                expect = error("MEMORY_REGISTRATION_UNSUPPORTED", None, "FAILED_PRECONDITION")
            check(stub.RegisterMemory, request, expect, "register_memory")
        elif kind == "unregister":
            expect = error("MEMORY_TOKEN_NOT_FOUND", "unregister_memory.region_token", "NOT_FOUND")
            check(stub.UnregisterMemory, request, expect, "unregister_memory")
        elif (
            kind == "list"
            and SERVER_DEVICE == "cuda"
            and not _MODEL_RE.fullmatch(request.client_id)
        ):
            expect = error("INVALID_ARGUMENT", "list_memory.client_id")
            check(stub.ListMemory, request, expect, "list_memory")
        elif kind == "list":
            assert not stub.ListMemory(request, timeout=CALL_TIMEOUT_S).regions
            outcomes["list_memory OK"] += 1
        else:
            info = stub.GetServerInfo(request, timeout=CALL_TIMEOUT_S)
            assert info.limits.max_budget == MAX_BUDGET
            outcomes["get_server_info OK"] += 1
        _count("memory_rpcs")

    run()
    assert_unharmed(served, inputs)


# ---------------------------------------------------------------------------- references

REGION_BYTES = 4096


@dataclass(frozen=True)
class Region:
    token: str
    byte_size: int


@pytest.fixture(scope="module")
def region(served_refs: Served, host_mapper: HostMapper) -> Region:
    handle = host_mapper.export(torch.zeros(REGION_BYTES, dtype=torch.uint8))
    response = served_refs.stub.RegisterMemory(
        pb.RegisterMemoryRequest(
            ipc_handle=handle, device_uuid=FAKE_UUID, byte_size=REGION_BYTES, client_id="fuzz"
        ),
        timeout=CALL_TIMEOUT_S,
    )
    return Region(response.region_token, response.byte_size)


@st.composite
def reference_case(draw: st.DrawFn, token: str) -> tuple[Slot, str, int]:
    slot = draw(st.sampled_from(BUILD_SLOTS))
    chosen = draw(
        st.one_of(
            st.just(token),
            st.just(""),
            st.text(max_size=200),
            st.integers(0, len(token) - 1).map(
                lambda i: token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1 :]
            ),
        )
    )
    offset = draw(
        st.one_of(
            st.integers(0, REGION_BYTES + 16),
            st.sampled_from([REGION_BYTES - 264, REGION_BYTES - 263, 2**63, 2**64 - 1]),
            st.integers(0, 2**64 - 1),
        )
    )
    return slot, chosen, offset


def test_references_fuzz(served_refs: Served, region: Region, inputs: Inputs) -> None:
    """Tensor references with unknown, altered and empty tokens and every kind of offset."""
    stub = served_refs.stub

    @settings(FUZZ, max_examples=examples("references"))
    @given(reference_case(region.token))
    def run(case: tuple[Slot, str, int]) -> None:
        slot, token, offset = case
        request = pb.BuildTreeRequest()
        request.CopyFrom(inputs.build)
        message = _tensor(request, slot)
        byte_size = len(message.inline)
        itemsize = _ITEMSIZE[message.dtype]
        message.ref.region_token = token
        message.ref.offset_bytes = offset
        field = slot.name
        if token != region.token:
            expect = error("MEMORY_TOKEN_NOT_FOUND", f"{field}.ref.region_token", "NOT_FOUND")
        elif offset % itemsize or offset + byte_size > region.byte_size:
            expect = error("INVALID_REFERENCE", f"{field}.ref")
        else:
            # The region holds zeros: the oracle reads the same.
            plain = pb.BuildTreeRequest()
            plain.CopyFrom(inputs.build)
            _tensor(plain, slot).inline = bytes(byte_size)
            expect = oracle_build(plain)
        check(stub.BuildTree, request, expect, "build_tree")
        _count("references")

    run()
    listed = stub.ListMemory(pb.ListMemoryRequest(client_id="fuzz"), timeout=CALL_TIMEOUT_S)
    assert [r.byte_size for r in listed.regions] == [REGION_BYTES]
    assert region.token.encode() not in listed.SerializeToString()
    golden = stub.BuildTree(inputs.build, timeout=CALL_TIMEOUT_S).SerializeToString()
    assert golden == inputs.golden["build"]


OUT_REGION_BYTES = 2048
_TREE_OUTPUTS = (
    ("tokens", torch.int64, (B, 1 + BUDGET)),
    ("parents", torch.int32, (B, 1 + BUDGET)),
    ("depths", torch.int32, (B, 1 + BUDGET)),
    ("log_probs", torch.float32, (B, 1 + BUDGET)),
    ("num_nodes", torch.int32, (B,)),
    ("mask", torch.int64, (B, 1 + BUDGET, 1)),
)
_TREE_OUTPUT_BYTES = sum(
    math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    for _, dtype, shape in _TREE_OUTPUTS
)


@pytest.fixture(scope="module")
def out_region(served_refs: Served, host_mapper: HostMapper) -> tuple[str, torch.Tensor]:
    """A second region (the caller's output buffer) and the host bytes behind it."""
    buffer = torch.zeros(OUT_REGION_BYTES, dtype=torch.uint8)
    response = served_refs.stub.RegisterMemory(
        pb.RegisterMemoryRequest(
            ipc_handle=host_mapper.export(buffer),
            device_uuid=FAKE_UUID,
            byte_size=OUT_REGION_BYTES,
            client_id="fuzz-out",
        ),
        timeout=CALL_TIMEOUT_S,
    )
    return response.region_token, buffer


def test_output_references_written_only_on_success(
    served_refs: Served, out_region: tuple[str, torch.Tensor], inputs: Inputs
) -> None:
    """BuildTree into caller memory: a failed call leaves every byte of the caller's buffer as it
    was; a successful one writes exactly the tree's bytes at the named offsets."""
    token, buffer = out_region
    stub = served_refs.stub

    @settings(FUZZ, max_examples=examples("output_references"))
    @given(
        st.sampled_from(["good", "nan_logits", "bad_token", "bad_budget", "bad_temperature"]),
        st.integers(0, (OUT_REGION_BYTES - _TREE_OUTPUT_BYTES) // 8).map(lambda k: 8 * k),
        st.binary(min_size=OUT_REGION_BYTES, max_size=OUT_REGION_BYTES),
    )
    def run(kind: str, base: int, before: bytes) -> None:
        buffer.copy_(torch.frombuffer(bytearray(before), dtype=torch.uint8))
        if buffer.is_cuda:  # the server reads the region from another process
            torch.cuda.synchronize(buffer.device)
        request = pb.BuildTreeRequest()
        request.CopyFrom(inputs.build)
        places = {}
        offset = base
        for name, dtype, shape in _TREE_OUTPUTS:
            ref = getattr(request.outputs, name)
            ref.region_token, ref.offset_bytes = token, offset
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            places[name] = (offset, size)
            offset += size
        if kind == "nan_logits":
            logits = decode(request.draft_logits).clone()
            logits[0, 0, :5] = math.nan
            request.draft_logits.CopyFrom(encode(logits))
        elif kind == "bad_token":
            request.root_tokens.CopyFrom(encode(torch.tensor([V + 5, 0])))
        elif kind == "bad_budget":
            request.budget = 0
        elif kind == "bad_temperature":
            request.temperature = math.nan
        oracle = oracle_build(_without_outputs(request))
        if kind.startswith("bad"):
            assert oracle.code == "INVALID_ARGUMENT"
            check(stub.BuildTree, request, oracle, "build_tree")
            assert bytes(buffer.cpu().numpy()) == before  # not one byte written
        else:
            response = stub.BuildTree(request, timeout=CALL_TIMEOUT_S)
            assert response.tree.tokens.ref.region_token == token
            expected = pb.BuildTreeResponse.FromString(oracle.response or b"").tree
            after = bytearray(buffer.cpu().numpy())
            written = type(expected)()
            written.CopyFrom(expected)
            for name, (start, size) in places.items():
                getattr(written, name).inline = bytes(after[start : start + size])
                after[start : start + size] = before[start : start + size]
            if SERVER_DEVICE == "cpu":
                assert written == expected
            else:  # the CUDA kernels: within the tolerances of the inline answers
                mismatches = len(numeric_mismatches)
                compare_responses("build_tree", expected, written, "build_tree.tree")
                assert len(numeric_mismatches) == mismatches, numeric_mismatches[mismatches:]
            assert bytes(after) == before  # nothing outside the destinations
            outcomes["build_tree OK (into caller memory)"] += 1
        _count("output_references")

    run()


def _without_outputs(request: pb.BuildTreeRequest) -> pb.BuildTreeRequest:
    plain = pb.BuildTreeRequest()
    plain.CopyFrom(request)
    plain.ClearField("outputs")
    return plain


# ---------------------------------------------------------------------------- raw bytes

_METHODS = {
    "GetServerInfo": pb.GetServerInfoRequest,
    "RegisterMemory": pb.RegisterMemoryRequest,
    "UnregisterMemory": pb.UnregisterMemoryRequest,
    "ListMemory": pb.ListMemoryRequest,
    "BuildTree": pb.BuildTreeRequest,
    "AcceptTree": pb.AcceptTreeRequest,
    "VerifyAttention": pb.VerifyAttentionRequest,
}


def _parses(request_type: Any, raw: bytes) -> bool:
    try:
        request_type.FromString(raw)
    except Exception:  # any parse failure: DecodeError, invalid UTF-8 in a string field
        return False
    return True


def check_raw(channel: grpc.Channel, method: str, raw: bytes) -> str:
    """Send ``raw`` bytes as the request of ``method``; returns the status code's name."""
    call = channel.unary_unary(f"/{SERVICE_NAME}/{method}")
    try:
        call(raw, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as err:
        got = _wire.error_from_rpc(err)
        context = f"{method} {raw[:40]!r}: {got.code} {got.reason} {got.message!r}"
        assert got.code not in ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"), context
        if not _parses(_METHODS[method], raw):
            assert (got.code, got.reason, got.field) == (
                "INVALID_ARGUMENT",
                "MALFORMED_REQUEST",
                "request",
            ), context
            assert f"not a valid ddtree.v1.{method}Request" in got.message, context
        else:
            assert got.reason and got.request_id, context
        outcomes[f"raw_bytes {got.code} {got.reason}"] += 1
        return got.code
    assert _parses(_METHODS[method], raw), f"{method}: {raw[:40]!r} answered OK"
    outcomes["raw_bytes OK"] += 1
    return "OK"


def test_raw_bytes_fuzz(served: Served, inputs: Inputs) -> None:
    """Bytes that are not protobuf (and some that happen to be) for every method."""
    valid = inputs.build.SerializeToString()

    @settings(FUZZ, max_examples=examples("raw_bytes"))
    @given(
        st.sampled_from(sorted(_METHODS)),
        st.one_of(
            st.binary(max_size=300),
            st.builds(
                lambda cut, junk: valid[:cut] + junk,
                st.integers(0, len(valid)),
                st.binary(max_size=8),
            ),
        ),
    )
    def run(method: str, raw: bytes) -> None:
        check_raw(served.channel, method, raw)
        _count("raw_bytes")

    run()
    assert_unharmed(served, inputs)


def test_messages_at_and_past_the_size_limit(served: Served, inputs: Inputs) -> None:
    base = pb.BuildTreeRequest()
    base.CopyFrom(inputs.build)
    base.model = "m"
    padding = MAX_MESSAGE_BYTES - base.ByteSize()
    # At the limit: a valid protobuf (an over-long model label) gets its validation answer.
    at_limit = pb.BuildTreeRequest()
    at_limit.CopyFrom(base)
    at_limit.model = "m" * (1 + padding)
    while at_limit.ByteSize() > MAX_MESSAGE_BYTES:
        at_limit.model = at_limit.model[:-1]
    assert at_limit.ByteSize() == MAX_MESSAGE_BYTES
    check(
        served.stub.BuildTree,
        at_limit,
        error("INVALID_MODEL_LABEL", "build_tree.model"),
        "build_tree",
    )
    assert check_raw(served.channel, "BuildTree", b"\xff" * MAX_MESSAGE_BYTES) == "INVALID_ARGUMENT"
    # Past the limit: gRPC refuses the message before the service sees it.
    past = pb.BuildTreeRequest()
    past.CopyFrom(at_limit)
    past.model += "m"
    for request in (past, b"\xff" * (MAX_MESSAGE_BYTES + 1)):
        call = (
            served.stub.BuildTree
            if isinstance(request, pb.BuildTreeRequest)
            else served.channel.unary_unary(f"/{SERVICE_NAME}/BuildTree")
        )
        with pytest.raises(grpc.RpcError) as raised:
            call(request, timeout=CALL_TIMEOUT_S)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_unharmed(served, inputs)


def test_cases_total() -> None:
    """The fuzz tests above ran at least 10,000 cases in all (at the default scale)."""
    expected = {name: examples(name) for name in EXAMPLES}
    if len(cases_run) < len(EXAMPLES):
        pytest.skip(f"runs after every fuzz test (ran: {sorted(cases_run)})")
    assert cases_run == expected
    if os.environ.get("DDTREE_FUZZ_SCALE", "1") == "1":
        assert sum(cases_run.values()) >= 10_000
    report = os.environ.get("DDTREE_FUZZ_REPORT")
    if report:
        summary: dict[str, Any] = {"cases": cases_run, "total": sum(cases_run.values())}
        summary["server_device"] = SERVER_DEVICE
        summary["outcomes"] = dict(sorted(outcomes.items()))
        summary["numeric_mismatches"] = numeric_mismatches[:50]
        with open(report, "w") as handle:
            json.dump(summary, handle, indent=2)


def test_cuda_tree_comparison_follows_the_contract() -> None:
    """``compare_responses`` on trees: with exact score ties (rows of two equal logits) a tree
    that orders tied siblings the other way agrees, one with a changed score does not; a tree
    without a last node of probability 0 agrees; without near ties every integer difference is
    reported."""
    logits = torch.full((2, 3, 50), -math.inf)
    logits[:, :, 7] = logits[:, :, 11] = 2.0
    tied = kernels.reference.build_tree(logits, torch.tensor([0, 1]), 6)
    swapped = Tree(**{**tied.__dict__, "tokens": tied.tokens.clone()})
    swapped.tokens[:, [1, 2]] = tied.tokens[:, [2, 1]]  # nodes 1 and 2: equal scores, siblings
    lowered = Tree(**{**tied.__dict__, "log_probs": tied.log_probs.clone()})
    lowered.log_probs[0, 3] -= 0.5
    random = kernels.reference.build_tree(
        torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1]), 6
    )
    moved = Tree(**{**random.__dict__, "tokens": random.tokens.clone()})
    moved.tokens[0, 1] += 1
    del numeric_mismatches[:]
    compare_responses("build_tree", convert.tree_to_proto(tied), convert.tree_to_proto(swapped))
    assert numeric_mismatches == []
    compare_responses("build_tree", convert.tree_to_proto(tied), convert.tree_to_proto(lowered))
    assert numeric_mismatches == ["build_tree: sorted node probabilities differ"]
    del numeric_mismatches[:]
    # A last node of probability 0 (score -1e38) missing: the same total probability.
    extreme = torch.full((1, 5, 8), -math.inf)
    extreme[:, :, 0], extreme[:, :, 1] = 1e38, 0.0
    full = kernels.reference.build_tree(extreme, torch.tensor([0]), 12)
    short = kernels.reference.build_tree(extreme, torch.tensor([0]), 11, max_budget=12)
    compare_responses("build_tree", convert.tree_to_proto(full), convert.tree_to_proto(short))
    assert numeric_mismatches == []
    compare_responses("build_tree", convert.tree_to_proto(random), convert.tree_to_proto(moved))
    assert numeric_mismatches == ["build_tree.tokens: 1 bytes differ, first at byte 8"]
    del numeric_mismatches[:]
