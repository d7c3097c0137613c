"""ddtree.service.metrics: the budget curve against a scalar walk, and what each observation
exposes in a fresh registry."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ddtree
from ddtree.service.metrics import (
    BUDGET_LADDER,
    GRPC_CODES,
    OPS,
    Metrics,
    acceptance_stats,
    budget_curve,
    start_metrics_http_server,
)

SERVICE = "ddtree.v1.TreeSpeculationService"
METHODS = [(SERVICE, "BuildTree"), (SERVICE, "AcceptTree")]

# Every metric name is API (README, dashboards, alerts): a rename must fail here.
EXPECTED_FAMILIES = {
    "ddtree_rpc_calls": "counter",
    "ddtree_rpc_latency_seconds": "histogram",
    "ddtree_rpc_in_flight_calls": "gauge",
    "ddtree_op_device_seconds": "histogram",
    "ddtree_trees_built": "counter",
    "ddtree_draft_nodes": "counter",
    "ddtree_verify_walks": "counter",
    "ddtree_accepted_tokens": "counter",
    "ddtree_acceptance_length": "histogram",
    "ddtree_accepted_tokens_by_depth": "counter",
    "ddtree_budget_curve_acceptance_length": "counter",
    "ddtree_budget_curve_walks": "counter",
    "ddtree_registered_regions": "gauge",
    "ddtree_registered_bytes": "gauge",
    "ddtree_devices": "gauge",
    "ddtree_device_info": "gauge",
    "ddtree_build_info": "gauge",  # an Info metric, exposed as a gauge of value 1
    "ddtree_metrics_dropped": "counter",
}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Metrics:
    return Metrics(registry, methods=METHODS, max_models=2)


def _scalar_curve(nodes, length, num_nodes, ladder):
    """Walk each accepted path node by node and stop at the first node past the budget."""
    sums = [0] * len(ladder)
    walks = [0] * len(ladder)
    for path, tau, n in zip(nodes.tolist(), length.tolist(), num_nodes.tolist(), strict=True):
        if tau < 1:
            continue
        for k, budget in enumerate(ladder):
            if budget > n - 1:
                continue
            cut = 0
            for node in path[:tau]:
                if node < 0 or node > budget:
                    break
                cut += 1
            sums[k] += cut
            walks[k] += 1
    return sums, walks


def _random_walks(batch_size: int, path_len: int, max_nodes: int, seed: int):
    """Root-anchored increasing paths of random length (some rejected: length 0)."""
    gen = torch.Generator().manual_seed(seed)
    nodes = torch.full((batch_size, path_len), -1, dtype=torch.int32)
    length = torch.zeros(batch_size, dtype=torch.int32)
    num_nodes = torch.randint(1, max_nodes + 1, (batch_size,), generator=gen, dtype=torch.int32)
    for b in range(batch_size):
        n = int(num_nodes[b])
        if torch.rand((), generator=gen) < 0.1:
            continue  # a rejected walk: length 0, nodes all -1
        tau = int(torch.randint(1, min(path_len, n) + 1, (), generator=gen))
        picks = torch.randperm(n - 1, generator=gen)[: tau - 1] + 1
        path = [0, *sorted(picks.tolist())]
        nodes[b, :tau] = torch.tensor(path, dtype=torch.int32)
        length[b] = tau
    return nodes, length, num_nodes


@pytest.mark.parametrize(
    ("batch_size", "path_len", "max_nodes"),
    [(1, 2, 2), (3, 16, 65), (64, 16, 1025), (17, 33, 300)],
    ids=["one-walk", "budget-64", "budget-1024", "draft-len-32"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_budget_curve_matches_a_scalar_walk(batch_size, path_len, max_nodes, seed):
    nodes, length, num_nodes = _random_walks(batch_size, path_len, max_nodes, seed)
    sums, walks = budget_curve(nodes, length, num_nodes)
    expected_sums, expected_walks = _scalar_curve(nodes, length, num_nodes, BUDGET_LADDER)
    assert sums.tolist() == expected_sums
    assert walks.tolist() == expected_walks


def test_budget_curve_cuts_at_the_first_node_past_the_budget():
    # Path 0 -> 1 -> 5 -> 6: budget 1 keeps [0, 1], budgets 2 and 4 also stop before node 5.
    nodes = torch.tensor([[0, 1, 5, 6]], dtype=torch.int32)
    sums, walks = budget_curve(nodes, torch.tensor([4]), torch.tensor([9]), ladder=(1, 2, 4, 8))
    assert sums.tolist() == [2, 2, 2, 4]
    assert walks.tolist() == [1, 1, 1, 1]


def test_budget_curve_leaves_out_budgets_larger_than_the_tree():
    nodes = torch.tensor([[0, 2, -1]], dtype=torch.int32)
    sums, walks = budget_curve(nodes, torch.tensor([2]), torch.tensor([4]), ladder=(1, 2, 4))
    assert sums.tolist() == [1, 2, 0]
    assert walks.tolist() == [1, 1, 0]


def _scrambled_walks(batch_size: int, path_len: int, seed: int):
    """Paths that are not increasing and hold padding inside: the cut rule must still hold."""
    gen = torch.Generator().manual_seed(seed)
    nodes = torch.randint(-1, 40, (batch_size, path_len), generator=gen, dtype=torch.int32)
    nodes[:, 0] = 0
    length = torch.randint(0, path_len + 1, (batch_size,), generator=gen, dtype=torch.int32)
    num_nodes = torch.randint(1, 70, (batch_size,), generator=gen, dtype=torch.int32)
    return nodes, length, num_nodes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_budget_curve_cuts_scrambled_paths_like_a_scalar_walk(seed):
    nodes, length, num_nodes = _scrambled_walks(50, 9, seed)
    sums, walks = budget_curve(nodes, length, num_nodes, ladder=(1, 2, 3, 8, 16, 64))
    expected_sums, expected_walks = _scalar_curve(nodes, length, num_nodes, (1, 2, 3, 8, 16, 64))
    assert sums.tolist() == expected_sums
    assert walks.tolist() == expected_walks


@pytest.mark.parametrize("ladder", [(), (0, 1), (2, 2), (4, 2)], ids=repr)
def test_budget_curve_rejects_a_bad_ladder(ladder):
    nodes, length, num_nodes = _random_walks(2, 4, 9, seed=0)
    with pytest.raises(ValueError, match="ladder: expected strictly increasing budgets >= 1"):
        budget_curve(nodes, length, num_nodes, ladder)


def test_observations_are_snapshots_of_the_callers_tensors(metrics, registry):
    nodes = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    length = torch.tensor([3], dtype=torch.int32)
    num_nodes = torch.tensor([9], dtype=torch.int32)
    metrics.observe_acceptance(nodes, length, num_nodes)
    metrics.observe_trees(num_nodes)
    length.fill_(1)  # a caller reusing its buffers must not change what was observed
    num_nodes.fill_(1)
    assert metrics.pending == 2  # counted in batches, at the latest by the next scrape
    assert registry.get_sample_value("ddtree_accepted_tokens_total", {"model": ""}) == 2
    assert registry.get_sample_value("ddtree_draft_nodes_total", {"model": ""}) == 8
    assert metrics.pending == 0


def test_a_full_batch_is_counted_without_a_scrape(registry):
    metrics = Metrics(registry, batch=3)
    for _ in range(3):
        metrics.observe_trees(torch.tensor([5], dtype=torch.int32))
    assert metrics.pending == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_models": -1}, "max_models: expected >= 0"),
        ({"max_pending": 0}, "max_pending: expected >= 1"),
        ({"batch": 0}, "batch: expected 1..max_pending=4096"),
        ({"max_pending": 8, "batch": 9}, "batch: expected 1..max_pending=8"),
    ],
)
def test_metrics_reject_bad_limits(registry, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Metrics(registry, **kwargs)


def test_acceptance_stats_count_lengths_and_depths():
    nodes, length, num_nodes = _random_walks(40, 8, 30, seed=7)
    stats = acceptance_stats(nodes, length, num_nodes)
    taus = [t for t in length.tolist() if t >= 1]
    assert stats.walks == len(taus)
    assert stats.accepted_tokens == sum(t - 1 for t in taus)
    assert stats.length_counts.tolist() == [taus.count(t) for t in range(9)]
    assert stats.depth_counts.tolist() == [sum(t > d for t in taus) for d in range(1, 8)]


def test_exposition_has_every_documented_family_with_help(metrics, registry):
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {name: families[name].type for name in EXPECTED_FAMILIES} == EXPECTED_FAMILIES
    for name in EXPECTED_FAMILIES:
        assert re.fullmatch(r"ddtree_[a-z0-9_]+", name)
        assert families[name].documentation, f"{name} has no help text"


def test_known_label_sets_exist_before_any_call(metrics, registry):
    for _, method in METHODS:
        for code in GRPC_CODES:
            labels = {"service": SERVICE, "method": method, "code": code}
            assert registry.get_sample_value("ddtree_rpc_calls_total", labels) == 0.0
        labels = {"service": SERVICE, "method": method, "code": "OK", "le": "+Inf"}
        assert registry.get_sample_value("ddtree_rpc_latency_seconds_bucket", labels) == 0.0
    for budget in BUDGET_LADDER:
        labels = {"model": "", "budget": str(budget)}
        assert registry.get_sample_value("ddtree_budget_curve_walks_total", labels) == 0.0
    assert registry.get_sample_value("ddtree_verify_walks_total", {"model": ""}) == 0.0


def test_observe_acceptance_exposes_walks_lengths_depths_and_curve(metrics, registry):
    # Walk A: nodes 0, 1, 3 (tau 3) in a 4-draft-node tree; walk B: nodes 0, 2 (tau 2) in a
    # 2-node tree; walk C was rejected (tau 0) and counts nowhere.
    nodes = torch.tensor([[0, 1, 3, -1], [0, 2, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    length = torch.tensor([3, 2, 0], dtype=torch.int32)
    num_nodes = torch.tensor([5, 3, 5], dtype=torch.int32)
    metrics.observe_acceptance(nodes, length, num_nodes, model="kimi-k2")

    def value(name, **labels):
        return registry.get_sample_value(name, {"model": "kimi-k2", **labels})

    assert value("ddtree_verify_walks_total") == 2
    assert value("ddtree_accepted_tokens_total") == 3
    assert value("ddtree_acceptance_length_sum") == 5
    assert value("ddtree_acceptance_length_count") == 2
    assert value("ddtree_acceptance_length_bucket", le="1.0") == 0
    assert value("ddtree_acceptance_length_bucket", le="2.0") == 1
    assert value("ddtree_acceptance_length_bucket", le="3.0") == 2
    assert value("ddtree_accepted_tokens_by_depth_total", depth="1") == 2
    assert value("ddtree_accepted_tokens_by_depth_total", depth="2") == 1
    assert value("ddtree_accepted_tokens_by_depth_total", depth="3") == 0
    curve = {
        b: (
            value("ddtree_budget_curve_acceptance_length_total", budget=str(b)),
            value("ddtree_budget_curve_walks_total", budget=str(b)),
        )
        for b in (1, 2, 4, 8)
    }
    assert curve == {1: (3, 2), 2: (4, 2), 4: (3, 1), 8: (0, 0)}
    assert registry.get_sample_value("ddtree_verify_walks_total", {"model": ""}) == 0


def test_observe_trees_counts_trees_and_draft_nodes(metrics, registry):
    metrics.observe_trees(torch.tensor([65, 1, 10, 0], dtype=torch.int32))  # 0: no tree
    assert registry.get_sample_value("ddtree_trees_built_total", {"model": ""}) == 4
    assert registry.get_sample_value("ddtree_draft_nodes_total", {"model": ""}) == 64 + 0 + 9 + 0


def test_model_labels_past_the_cap_are_counted_as_other(metrics, registry):
    assert [metrics.model_label(m) for m in ("a", "b", "c", "d", "a", "")] == [
        "a",
        "b",
        "other",
        "other",
        "a",
        "",
    ]
    metrics.observe_trees(torch.tensor([3], dtype=torch.int32), model="e")
    assert registry.get_sample_value("ddtree_trees_built_total", {"model": "other"}) == 1
    assert registry.get_sample_value("ddtree_trees_built_total", {"model": "e"}) is None


def test_rpc_finished_counts_the_call_and_its_latency(metrics, registry):
    metrics.rpc_started(SERVICE, "BuildTree")
    in_flight = {"service": SERVICE, "method": "BuildTree"}
    assert registry.get_sample_value("ddtree_rpc_in_flight_calls", in_flight) == 1
    metrics.rpc_finished(SERVICE, "BuildTree", "INVALID_ARGUMENT", 0.0003)
    labels = {**in_flight, "code": "INVALID_ARGUMENT"}
    assert registry.get_sample_value("ddtree_rpc_in_flight_calls", in_flight) == 0
    assert registry.get_sample_value("ddtree_rpc_calls_total", labels) == 1
    assert (
        registry.get_sample_value("ddtree_rpc_latency_seconds_bucket", {**labels, "le": "0.0002"})
        == 0
    )
    assert (
        registry.get_sample_value("ddtree_rpc_latency_seconds_bucket", {**labels, "le": "0.0005"})
        == 1
    )


def test_time_op_on_cpu_observes_wall_time_once(metrics, registry):
    with metrics.time_op("build_tree", torch.device("cpu")):
        torch.ones(64).sum()
    labels = {"op": "build_tree", "device": "cpu"}
    assert registry.get_sample_value("ddtree_op_device_seconds_count", labels) == 1
    assert registry.get_sample_value("ddtree_op_device_seconds_sum", labels) > 0


def test_time_op_records_nothing_when_the_op_raises(metrics, registry):
    with pytest.raises(ValueError, match="bad"), metrics.time_op("accept", torch.device("cpu")):
        raise ValueError("bad")
    labels = {"op": "accept", "device": "cpu"}
    assert registry.get_sample_value("ddtree_op_device_seconds_count", labels) == 0


def test_devices_and_build_info(metrics, registry):
    metrics.set_devices([("cuda:0", "NVIDIA H200", "GPU-1234", "9.0")])
    metrics.set_build_info(
        version="0.1.0", backend="cuda", gpu_name="NVIDIA H200", compute_capability="9.0"
    )
    metrics.set_registered("cuda:0", regions=2, byte_size=4096)
    assert registry.get_sample_value("ddtree_devices") == 1
    info = {
        "device": "cuda:0",
        "name": "NVIDIA H200",
        "uuid": "GPU-1234",
        "compute_capability": "9.0",
    }
    assert registry.get_sample_value("ddtree_device_info", info) == 1
    build = {
        "version": "0.1.0",
        "backend": "cuda",
        "gpu_name": "NVIDIA H200",
        "compute_capability": "9.0",
    }
    assert registry.get_sample_value("ddtree_build_info", build) == 1
    assert registry.get_sample_value("ddtree_registered_bytes", {"device": "cuda:0"}) == 4096
    for op in OPS:
        labels = {"op": op, "device": "cuda:0"}
        assert registry.get_sample_value("ddtree_op_device_seconds_count", labels) == 0


def test_http_endpoint_serves_the_registry(metrics):
    metrics.observe_trees(torch.tensor([5], dtype=torch.int32))
    server, thread, port = start_metrics_http_server(metrics.registry, host="127.0.0.1", port=0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            body = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert 'ddtree_draft_nodes_total{model=""} 4.0' in body


@pytest.mark.gpu
def test_time_op_on_cuda_reads_event_time_after_the_device_passes(metrics, registry):
    device = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=device)
    with metrics.time_op("verify_attention", device):
        for _ in range(8):
            a = a @ a.T / 2048
    metrics.flush()
    labels = {"op": "verify_attention", "device": "cuda:0"}
    assert metrics.pending == 0
    assert registry.get_sample_value("ddtree_op_device_seconds_count", labels) == 1
    assert registry.get_sample_value("ddtree_op_device_seconds_sum", labels) > 1e-6


@pytest.mark.gpu
def test_time_op_reuses_events_once_read_and_never_before(registry):
    device = torch.device("cuda", 0)
    metrics = Metrics(registry, max_pending=3, batch=3)
    stream = torch.cuda.Stream(device)
    a = torch.randn(1024, 1024, device=device)
    seen: set[int] = set()
    for round_ in range(3):
        held = []  # events of observations not read yet: none may be handed out again
        for _ in range(2):
            with metrics.time_op("build_tree", device, stream), torch.cuda.stream(stream):
                a = a @ a.T / 1024
            held.append(metrics._pending[-1])
        ids = {id(e) for item in held for e in (item.timing.start, item.event)}
        assert len(ids) == 4
        if round_:
            assert ids <= seen  # the first round's events, read by flush, come back
        seen |= ids
        metrics.flush()
    # A fourth op while three wait (the stream held back) drops the oldest: its events come
    # back unread, and every pair is back in the pool once the rest are read.
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1 << 28)  # about 0.1 s: none of the four is ready when queued
    for _ in range(4):
        with metrics.time_op("build_tree", device, stream), torch.cuda.stream(stream):
            a = a @ a.T / 1024
    metrics.flush()
    labels = {"op": "build_tree", "device": "cuda:0"}
    assert registry.get_sample_value("ddtree_op_device_seconds_count", labels) == 6 + 3
    assert registry.get_sample_value("ddtree_metrics_dropped_total", {"kind": "device_time"}) == 1
    assert len(metrics._free_events[0]) == 4  # two pairs from the rounds, two made for the four


@pytest.mark.gpu
def test_cuda_acceptances_count_like_cpu_ones(registry):
    nodes, length, num_nodes = _random_walks(64, 16, 1025, seed=3)
    on_cpu = Metrics(CollectorRegistry())
    on_cpu.observe_acceptance(nodes, length, num_nodes)
    on_gpu = Metrics(registry)
    on_gpu.observe_acceptance(nodes.cuda(), length.cuda(), num_nodes.cuda())
    on_gpu.observe_trees(num_nodes.cuda())
    on_cpu.observe_trees(num_nodes)
    torch.cuda.synchronize()
    # get_sample_value collects the registry, and a scrape drains what the device has finished:
    # no flush needed.
    for name in (
        "ddtree_verify_walks_total",
        "ddtree_accepted_tokens_total",
        "ddtree_draft_nodes_total",
    ):
        assert registry.get_sample_value(name, {"model": ""}) == on_cpu.registry.get_sample_value(
            name, {"model": ""}
        )
    for budget in BUDGET_LADDER:
        labels = {"model": "", "budget": str(budget)}
        name = "ddtree_budget_curve_acceptance_length_total"
        assert registry.get_sample_value(name, labels) == on_cpu.registry.get_sample_value(
            name, labels
        )
    assert on_gpu.pending == 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_budget_curve_is_what_each_smaller_tree_accepts(seed):
    # The claim behind the live budget curve: walking the budget-b tree built from the same
    # logits with the same target accepts exactly the big tree's path cut at its first node > b.
    from ddtree.kernels import accept, build_tree

    gen = torch.Generator().manual_seed(seed)
    batch_size, draft_len, vocab_size, budget = 6, 5, 7, 64
    logits = torch.randn(batch_size, draft_len, vocab_size, generator=gen) * 3
    roots = torch.randint(0, vocab_size, (batch_size,), generator=gen)
    big = build_tree(logits, roots, budget, backend="reference")
    # A target that mostly agrees with the drafter's favourite child, so paths run deep.
    targets = torch.randint(0, vocab_size, big.tokens.shape, generator=gen)
    favourite = logits.argmax(dim=-1)  # [batch, draft_len]
    depth = big.depths.clamp(0, draft_len - 1).long()  # [batch, nodes]: next depth index
    agree = torch.rand(big.tokens.shape, generator=gen) < 0.8
    targets = torch.where(agree, favourite.gather(1, depth), targets)
    walked = accept(big, targets, backend="reference")
    ladder = tuple(b for b in BUDGET_LADDER if b <= budget)
    sums, walks = budget_curve(walked.nodes, walked.length, big.num_nodes, ladder)
    for k, b in enumerate(ladder):
        small = build_tree(logits, roots, b, backend="reference")
        small_walk = accept(small, targets[:, : small.num_nodes_max], backend="reference")
        assert int(sums[k]) == int(small_walk.length.sum()), f"budget {b}"
        assert int(walks[k]) == batch_size
    assert int(walked.length.sum()) > batch_size  # some draft tokens were accepted


def test_publish_engine_reports_a_cpu_engine(metrics, registry):
    from ddtree.service.engine import Engine

    with Engine(device="cpu", backend="reference") as engine:
        metrics.publish_engine(engine)
    assert registry.get_sample_value("ddtree_devices") == 1
    build = {
        "version": ddtree.__version__,
        "backend": "reference",
        "gpu_name": "",
        "compute_capability": "",
    }
    assert registry.get_sample_value("ddtree_build_info", build) == 1
    labels = {"op": "accept", "device": "cpu"}
    assert registry.get_sample_value("ddtree_op_device_seconds_count", labels) == 0


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
def test_engine_reports_its_ops_to_the_metrics(registry, device):
    # The engine as the server runs it, with the metrics as its observer: trees, walks, the
    # budget curve and each op's device time (CUDA events on a GPU) all arrive.
    from ddtree.service.calls import AcceptTreeCall, BuildTreeCall
    from ddtree.service.engine import Engine

    metrics = Metrics(registry)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=gen)
    roots = torch.tensor([1, 2, 3])
    with Engine(device=device, observer=metrics) as engine:
        engine.warm_up()
        tree = engine.build_tree(BuildTreeCall(logits, roots, 8, model="m")).result()
        # The target picks a token absent from each tree: every walk accepts the root only.
        missing = [min(set(range(50)) - set(row)) for row in tree.tokens.tolist()]
        targets = torch.tensor(missing)[:, None].expand(tree.tokens.shape).contiguous()
        targets = targets.to(tree.tokens.device)
        walked = engine.accept_tree(AcceptTreeCall(tree, targets, model="m")).result()
        metrics.flush()
    assert walked.acceptance.length.tolist() == [1, 1, 1]

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    assert value("ddtree_trees_built_total", model="m") == 3
    assert value("ddtree_draft_nodes_total", model="m") == int((tree.num_nodes - 1).sum())
    assert value("ddtree_verify_walks_total", model="m") == 3
    assert value("ddtree_accepted_tokens_total", model="m") == 0
    assert value("ddtree_budget_curve_acceptance_length_total", model="m", budget="8") == 3
    label = str(engine.device)
    for op in ("build_tree", "accept"):
        assert value("ddtree_op_device_seconds_count", op=op, device=label) == 1
        assert value("ddtree_op_device_seconds_sum", op=op, device=label) > 0
