"""Recording/alerting rules and the Grafana dashboard: promtool checks and unit tests, the
dashboard JSON, every PromQL expression parsing, and every metric name existing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddtree.service.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "helm" / "ddtree" / "files"
RULES = FILES / "ddtree-rules.yaml"
DASHBOARD = FILES / "ddtree-dashboard.json"
RULES_TEST = Path(__file__).with_name("rules_test.yaml")
DOCS = ROOT / "docs" / "observability.md"

# Grafana's variables, replaced by valid PromQL before parsing.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
    "$model": ".*",
    "$method": ".*",
}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("needs promtool on PATH (Debian package 'prometheus')")
    return path


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )


def _dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append((f"{panel['title']} / {target['refId']}", target["expr"]))
    return exprs


def _substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def _metric_names(expr: str) -> set[str]:
    """Raw ``ddtree_*`` series names an expression reads (recording-rule names use colons)."""
    return set(re.findall(r"(?<![:\w])ddtree_[a-z0-9_]+", expr))


@pytest.fixture(scope="module")
def exposed_series() -> set[str]:
    """Every series name the service's metrics expose, histograms expanded."""
    registry = CollectorRegistry()
    metrics = Metrics(registry, methods=[("ddtree.v1.TreeSpeculationService", "BuildTree")])
    metrics.set_devices([("cuda:0", "NVIDIA H200", "GPU-0", "9.0")])  # per-device series
    text = generate_latest(registry).decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
    return names


def test_rules_pass_promtool_check(promtool):
    result = _promtool(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


def test_rules_pass_their_promtool_unit_tests(promtool):
    result = _promtool(promtool, "test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_dashboard_expression_parses(promtool, tmp_path):
    rules = [
        {"record": f"ddtree_dashboard_check:expr_{i}", "expr": _substitute(expr)}
        for i, (_, expr) in enumerate(_dashboard_exprs())
    ]
    path = tmp_path / "dashboard-exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_a_broken_expression_fails_the_parse_check(promtool, tmp_path):
    # The check above must be able to fail: promtool rejects a malformed expression.
    path = tmp_path / "broken.yaml"
    rule = {"record": "ddtree_dashboard_check:broken", "expr": "sum by (le (rate(x[1m]))"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "broken", "rules": [rule]}]}))
    assert _promtool(promtool, "check", "rules", str(path)).returncode != 0


def test_dashboard_is_valid_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "ddtree-overview"
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model", "method"}
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel.get("description"), f"panel {panel['title']!r} has no description"


def test_dashboard_shows_what_operators_need():
    titles = {panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"]}
    assert {
        "Acceptance length over time",
        "Budget curve: mean acceptance length vs draft budget",
        "Acceptance by depth",
        "Latency percentiles per method",
        "Errors",
        "Device time per op",
    } <= titles


def test_dashboard_and_rules_read_only_metrics_the_service_exposes(exposed_series):
    exprs = [expr for _, expr in _dashboard_exprs()]
    rules = yaml.safe_load(RULES.read_text())
    exprs += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    read = set().union(*(_metric_names(expr) for expr in exprs))
    assert read, "no metric names found"
    missing = {name for name in read if name not in exposed_series}
    assert not missing, f"expressions read series the service never exposes: {missing}"


def test_every_promql_example_in_the_docs_parses_and_reads_exposed_metrics(
    promtool, tmp_path, exposed_series
):
    examples = re.findall(r"```promql\n(.*?)```", DOCS.read_text(), re.S)
    assert len(examples) >= 5
    rules = [
        {"record": f"ddtree_docs_check:example_{i}", "expr": expr.strip()}
        for i, expr in enumerate(examples)
    ]
    path = tmp_path / "docs-exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "docs", "rules": rules}]}))
    result = _promtool(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    read = set().union(*(_metric_names(expr) for expr in examples))
    assert read <= exposed_series, read - exposed_series
