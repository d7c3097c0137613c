"""End to end against a real Prometheus: ``ddtree serve --metrics-port`` is scraped every second,
traffic with known acceptance goes through the gRPC client, and Prometheus's HTTP query API must
give back the known acceptance rate, mean acceptance length and budget curve, both from the raw
counters and from the chart's recording rules."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import yaml

from ddtree.clients import Client
from ddtree.clients.errors import DDTreeClientError
from ddtree.kernels.types import Tree

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm" / "ddtree" / "files" / "ddtree-rules.yaml"
LADDER = (1, 2, 4, 8)  # budgets a budget-8 tree reports
DEADLINE_S = 60.0
_T = TypeVar("_T")


def _wait_for(what: str, check: Callable[[], _T | None], deadline_s: float = DEADLINE_S) -> _T:
    """Poll ``check`` until it returns a value other than None, within a bounded time."""
    end = time.monotonic() + deadline_s
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(0.2)


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; returns the vector's samples."""
        address = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(address, timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def by_label(self, expr: str, label: str) -> dict[str, float]:
        return {s["metric"][label]: float(s["value"][1]) for s in self.query(expr)}


def _ready(url: str) -> bool | None:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
            return True if reply.status == 200 else None
    except (urllib.error.URLError, ConnectionError):
        return None


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("needs the prometheus server on PATH (Debian package 'prometheus')")
    return path


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """``ddtree serve`` on loopback with metrics on; yields (gRPC address, metrics port)."""
    tmp = tmp_path_factory.mktemp("service")
    log_path = tmp / "serve.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree.service",
            "serve",
            # Port 0 for both, read back from the log: no race for a "free" port.
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--device",
            "cpu",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:

        def bound_ports() -> tuple[str, int] | None:
            assert process.poll() is None, log_path.read_text()
            text = log_path.read_text()
            grpc_bound = re.search(r"event=listening addresses=(127\.0\.0\.1:\d+)", text)
            metrics_bound = re.search(r"event=metrics_listening address=127\.0\.0\.1:(\d+)", text)
            if grpc_bound is None or metrics_bound is None:
                return None
            return grpc_bound.group(1), int(metrics_bound.group(1))

        grpc_address, metrics_port = _wait_for("the service to bind its ports", bound_ports)
        with Client(grpc_address, default_timeout_s=5.0) as client:

            def serving() -> bool | None:
                assert process.poll() is None, log_path.read_text()
                try:
                    return True if client.health() == "SERVING" else None
                except DDTreeClientError:  # not listening yet
                    return None

            _wait_for("the service to report SERVING", serving)
        yield grpc_address, metrics_port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()


@pytest.fixture(scope="module")
def prometheus(
    prometheus_binary: str, service: tuple[str, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """A real Prometheus scraping the service every second and evaluating the chart's rules."""
    tmp = tmp_path_factory.mktemp("prometheus")
    _, metrics_port = service
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "ddtree",
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log_path = tmp / "prometheus.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            # Port 0, read back from its "Listening on" log line: no race for a "free" port.
            "--web.listen-address=127.0.0.1:0",
            "--log.level=info",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def listening() -> str | None:
            assert process.poll() is None, log_path.read_text()
            text = log_path.read_text()
            bound = re.search(r'msg="Listening on" address=(127\.0\.0\.1:\d+)', text)
            return None if bound is None else f"http://{bound.group(1)}"

        url = _wait_for("Prometheus to bind its port", listening)

        def ready() -> bool | None:
            assert process.poll() is None, log_path.read_text()
            return _ready(url)

        _wait_for("Prometheus to be ready", ready)
        yield Prometheus(url)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()


def _path_to(tree: Tree, request: int, node: int) -> list[int]:
    """Node indices from the root to ``node`` (root first)."""
    parents = tree.parents[request].tolist()
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _targets_for_paths(tree: Tree, paths: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Target tokens that make each request's walk accept exactly its path.

    Along the path, the target picks the next path node's token; at every other node it picks
    the smallest token that is none of the node's children, so the walk stops there.
    """
    targets = torch.zeros_like(tree.tokens)  # [batch, num_nodes_max]
    for request, path in enumerate(paths):
        count = int(tree.num_nodes[request])
        parents = tree.parents[request, :count].tolist()
        tokens = tree.tokens[request, :count].tolist()
        for node in range(count):
            children = {tokens[c] for c in range(count) if parents[c] == node}
            targets[request, node] = min(set(range(vocab_size)) - children)
        for parent, child in zip(path, path[1:], strict=False):
            targets[request, parent] = tokens[child]
    return targets


@dataclass
class Expected:
    walks: int = 0
    length_sum: int = 0
    draft_nodes: int = 0
    curve_sums: dict[int, int] | None = None
    curve_walks: dict[int, int] | None = None


@pytest.fixture(scope="module")
def traffic(service: tuple[str, int], prometheus: Prometheus) -> Expected:
    """Three BuildTree + AcceptTree rounds whose acceptance is chosen node by node."""
    # Every series must have a zero sample before traffic, so that rates see the increase.
    _wait_for(
        "a first scrape of the service",
        lambda: True if prometheus.scalar('ddtree_verify_walks_total{model=""}') == 0 else None,
    )
    expected = Expected(curve_sums=dict.fromkeys(LADDER, 0), curve_walks=dict.fromkeys(LADDER, 0))
    batch_size, draft_len, vocab_size, budget = 5, 4, 32, 8
    generator = torch.Generator().manual_seed(11)
    grpc_address, _ = service
    with Client(grpc_address, default_timeout_s=30.0) as client:
        for round_index in range(3):
            logits = torch.randn(batch_size, draft_len, vocab_size, generator=generator)
            roots = torch.randint(0, vocab_size, (batch_size,), generator=generator)
            tree = client.build_tree(logits, roots, budget)
            expected.draft_nodes += int((tree.num_nodes - 1).sum())
            # A spread of accepted nodes: the root itself, shallow and deep nodes.
            ends = [(round_index * batch_size + b) % int(tree.num_nodes[b]) for b in range(5)]
            paths = [_path_to(tree, b, end) for b, end in enumerate(ends)]
            acceptance = client.accept_tree(tree, _targets_for_paths(tree, paths, vocab_size))
            assert acceptance.length.tolist() == [len(p) for p in paths]
            for path in paths:
                expected.walks += 1
                expected.length_sum += len(path)
                for b in LADDER:
                    # What budget b would have accepted: the path up to its first node > b.
                    kept = next((i for i, node in enumerate(path) if node > b), len(path))
                    expected.curve_sums[b] += kept
                    expected.curve_walks[b] += 1
    assert expected.length_sum > expected.walks, "traffic accepted no draft token at all"
    _wait_for(
        "the scrape that saw every walk",
        lambda: (
            True
            if prometheus.scalar('ddtree_verify_walks_total{model=""}') == expected.walks
            else None
        ),
    )
    return expected


def test_counters_give_the_known_acceptance_rate_and_mean_length(prometheus, traffic):
    accepted = traffic.length_sum - traffic.walks
    rate = prometheus.scalar(
        'sum(ddtree_accepted_tokens_total{model=""}) / sum(ddtree_draft_nodes_total{model=""})'
    )
    assert rate == pytest.approx(accepted / traffic.draft_nodes)
    mean = prometheus.scalar(
        'sum(ddtree_acceptance_length_sum{model=""})'
        ' / sum(ddtree_acceptance_length_count{model=""})'
    )
    assert mean == pytest.approx(traffic.length_sum / traffic.walks)
    assert prometheus.scalar('sum(ddtree_trees_built_total{model=""})') == 15


def test_counters_give_the_known_budget_curve(prometheus, traffic):
    curve = prometheus.by_label(
        'sum by (budget) (ddtree_budget_curve_acceptance_length_total{model=""})'
        ' / sum by (budget) (ddtree_budget_curve_walks_total{model=""})',
        "budget",
    )
    for b in LADDER:
        assert curve[str(b)] == pytest.approx(traffic.curve_sums[b] / traffic.curve_walks[b])
    # Budgets beyond the trees' 8 draft nodes were never observed: 0 / 0.
    assert all(math.isnan(curve[str(b)]) for b in (16, 32, 64, 128, 256, 512, 1024))
    # Nested trees: a larger budget never accepts less.
    means = [curve[str(b)] for b in LADDER]
    assert means == sorted(means)


def test_recording_rules_give_the_same_known_values(prometheus, traffic):
    def rules_caught_up() -> dict[str, float] | None:
        curve = prometheus.by_label(
            'ddtree:budget_curve_acceptance_length:mean_5m{model=""}', "budget"
        )
        mean = prometheus.scalar('ddtree:acceptance_length:mean_5m{model=""}')
        if mean is None or not math.isclose(mean, traffic.length_sum / traffic.walks):
            return None
        # The group records the mean before the curve: a query between the two evaluations
        # sees the new mean and no curve yet.
        if any(str(b) not in curve for b in LADDER):
            return None
        return curve

    curve = _wait_for("the recording rules to see the traffic", rules_caught_up)
    for b in LADDER:
        assert curve[str(b)] == pytest.approx(traffic.curve_sums[b] / traffic.curve_walks[b])
    ratio = prometheus.scalar('ddtree:draft_acceptance:ratio_rate5m{model=""}')
    assert ratio == pytest.approx((traffic.length_sum - traffic.walks) / traffic.draft_nodes)


def test_rpc_metrics_count_every_call(prometheus, traffic):
    calls = prometheus.by_label('sum by (method) (ddtree_rpc_calls_total{code="OK"})', "method")
    assert calls["BuildTree"] == 3
    assert calls["AcceptTree"] == 3
    assert prometheus.scalar("sum(ddtree_rpc_in_flight_calls)") == 0
    build_info = prometheus.query("ddtree_build_info")
    assert build_info[0]["metric"]["backend"] == "reference"


def test_the_model_label_of_a_call_reaches_prometheus(service, prometheus, traffic):
    grpc_address, _ = service
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 16, generator=generator)
    with Client(grpc_address, default_timeout_s=30.0) as client:
        tree = client.build_tree(logits, torch.tensor([1, 2]), 4, model="kimi-k2")
        # The target agrees with nothing: each walk accepts the root only.
        paths = [[0], [0]]
        client.accept_tree(tree, _targets_for_paths(tree, paths, 16), model="kimi-k2")
    # A scrape between the two calls may see the model's series at 0: wait for the walks.
    _wait_for(
        "the model's 2 walks",
        lambda: (
            True if prometheus.scalar('ddtree_verify_walks_total{model="kimi-k2"}') == 2 else None
        ),
    )
    assert prometheus.scalar('ddtree_accepted_tokens_total{model="kimi-k2"}') == 0
    assert prometheus.scalar('ddtree_trees_built_total{model="kimi-k2"}') == 2
    # The unlabelled traffic is untouched.
    assert prometheus.scalar('ddtree_verify_walks_total{model=""}') == traffic.walks


def test_prometheus_loads_and_evaluates_every_chart_rule(prometheus, traffic):
    def evaluated() -> list[dict[str, Any]] | None:
        with urllib.request.urlopen(f"{prometheus.url}/api/v1/rules", timeout=10) as reply:
            groups = json.load(reply)["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        never = "0001-01-01T00:00:00Z"  # Prometheus's zero time: not evaluated yet
        return rules if rules and all(r["lastEvaluation"] != never for r in rules) else None

    rules = _wait_for("every rule to be evaluated", evaluated)
    expected = yaml.safe_load(RULES.read_text())
    names = [r.get("record") or r.get("alert") for g in expected["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(names)
    assert {r["name"]: r["health"] for r in rules} == dict.fromkeys(names, "ok")
