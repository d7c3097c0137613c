"""The Helm chart helm/ddtree: lint, render every CI value set, validate the manifests against the
Kubernetes schemas, reject bad values, and check what each template renders."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "ddtree"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# Oldest (chart kubeVersion) and newest Kubernetes versions the schemas are checked against.
KUBERNETES_VERSIONS = ("1.27.0", "1.37.0")


@pytest.fixture(scope="session")
def helm() -> str:
    path = os.environ.get("DDTREE_HELM") or shutil.which("helm")
    if not path:
        pytest.skip(
            "needs the helm 3 binary: not on PATH and DDTREE_HELM unset "
            "(bash .ci/install-helm.sh installs it)"
        )
    return path


def _run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm, *args], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )


def render(helm: str, *args: str) -> list[dict]:
    """``helm template`` the chart with extra arguments and return its documents."""
    result = _run_helm(helm, "template", "rel", str(CHART), "--namespace", "ml", *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def only(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def kinds(docs: list[dict]) -> set[str]:
    return {d["kind"] for d in docs}


def pod_spec(docs: list[dict]) -> dict:
    workload = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    assert len(workload) == 1
    return workload[0]["spec"]["template"]["spec"]


def server_container(docs: list[dict]) -> dict:
    return next(c for c in pod_spec(docs)["containers"] if c["name"] == "ddtree")


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


# ---------------------------------------------------------------- lint, render, validate


def test_ci_value_sets_cover_default_daemonset_mps_and_servicemonitor():
    assert [p.name for p in CI_VALUES] == [
        "daemonset-values.yaml",
        "default-values.yaml",
        "ingress-values.yaml",
        "mps-values.yaml",
        "servicemonitor-values.yaml",
    ]


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_lint_strict_passes(helm, values):
    result = _run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_rendered_manifests_match_the_kubernetes_schemas(helm, values, version):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="needs the kubernetes-validate package (pip)"
    )
    for doc in render(helm, "-f", str(values)):
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # Prometheus Operator CRDs: checked by the dedicated tests below
        kubernetes_validate.validate(doc, version, strict=True)


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("replicaCont=2", "Additional property replicaCont is not allowed"),
        ("gpu.cout=2", "Additional property cout is not allowed"),
        ("mode=StatefulSet", "mode must be one of"),
        ("image.tag=latest", "image.tag"),
        ("ports.grpc=0", "ports.grpc"),
        ("gpu.count=-1", "gpu.count"),
        ("server.logLevel=LOUD", "server.logLevel"),
        ("server.grpcIo=epoll", "server.grpcIo"),
        ("server.device=gpu0", "server.device"),
        ("serviceMonitor.interval=often", "serviceMonitor.interval"),
        ("unixSocket.hostPath=run/ddtree", "unixSocket.hostPath"),
        ("service.internalTrafficPolicy=Nearby", "service.internalTrafficPolicy"),
        ("limits.maxRegionsPerClient=-1", "limits.maxRegionsPerClient"),
        ("limits.maxChannels=-1", "limits.maxChannels"),
        ("limits.memoryIdleTimeoutSeconds=0", "limits.memoryIdleTimeoutSeconds"),
        ("keepalive.timeoutSecond=5", "Additional property timeoutSecond is not allowed"),
    ],
)
def test_schema_rejects_bad_values(helm, setting, complaint):
    result = _run_helm(helm, "template", "rel", str(CHART), "--set", setting)
    assert result.returncode != 0
    assert complaint in result.stderr


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_schema_accepts_every_ci_value_set(helm, values):
    # helm lint already validates; this states it as its own fact with the file named.
    result = _run_helm(helm, "template", "rel", str(CHART), "-f", str(values))
    assert result.returncode == 0, result.stderr


def test_schema_forbids_unknown_keys_everywhere():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict, where: str, values_node: object) -> None:
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{where} allows unknown keys"
            assert isinstance(values_node, dict)
            missing = set(values_node) - set(node["properties"])
            assert not missing, f"{where}: values.yaml keys without a schema: {missing}"
            for key, child in node["properties"].items():
                assert child.get("description"), f"{where}.{key} has no description"
                walk(child, f"{where}.{key}", values_node.get(key))

    walk(schema, "values", values)


def test_refuses_a_termination_grace_period_shorter_than_the_server_grace(helm):
    result = _run_helm(helm, "template", "rel", str(CHART), "--set", "server.graceSeconds=30")
    assert result.returncode != 0
    assert "terminationGracePeriodSeconds (30) must exceed server.graceSeconds (30)" in (
        result.stderr
    )


# ---------------------------------------------------------------- workload


def test_deployment_mode_renders_a_deployment_and_no_daemonset(helm):
    docs = render(helm)
    assert "Deployment" in kinds(docs)
    assert "DaemonSet" not in kinds(docs)
    assert only(docs, "Deployment")["spec"]["replicas"] == 1


def test_daemonset_mode_renders_a_daemonset_with_host_ipc_and_the_socket(helm):
    docs = render(helm, "-f", str(CHART / "ci" / "daemonset-values.yaml"))
    assert "Deployment" not in kinds(docs)
    spec = pod_spec(docs)
    assert spec["hostIPC"] is True
    socket = next(v for v in spec["volumes"] if v["name"] == "socket")
    assert socket["hostPath"] == {"path": "/run/ddtree", "type": "DirectoryOrCreate"}
    container = server_container(docs)
    assert env_of(container)["DDTREE_LISTEN"] == "0.0.0.0:50051,unix:/run/ddtree/ddtree.sock"
    assert container["args"] == ["serve"]
    assert env_of(container)["DDTREE_UNIX_SOCKET_MODE"] == "0660"
    init = only_init(spec, "socket-dir")
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert env_of(container)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert only(docs, "Service")["spec"]["internalTrafficPolicy"] == "Local"


def test_mps_mounts_the_daemons_pipe_directory_and_points_cuda_at_it(helm):
    docs = render(helm, "-f", str(CHART / "ci" / "mps-values.yaml"))
    spec = pod_spec(docs)
    pipe = next(v for v in spec["volumes"] if v["name"] == "mps-pipe")
    assert pipe["hostPath"] == {"path": "/tmp/nvidia-mps", "type": "Directory"}
    container = server_container(docs)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "mps-pipe")
    assert mount["mountPath"] == "/run/nvidia-mps"
    assert env_of(container)["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia-mps"


def test_mps_without_host_ipc_is_refused(helm):
    result = _run_helm(helm, "template", "rel", str(CHART), "--set", "mps.enabled=true")
    assert result.returncode != 0
    assert "mps.enabled needs hostIPC: true" in result.stderr


def only_init(spec: dict, name: str) -> dict:
    found = [c for c in spec.get("initContainers", []) if c["name"] == name]
    assert len(found) == 1
    return found[0]


def test_renders_no_host_namespaces_and_no_socket_by_default(helm):
    spec = pod_spec(render(helm))
    assert "hostIPC" not in spec
    assert "hostPID" not in spec
    assert "initContainers" not in spec
    assert all("hostPath" not in v for v in spec["volumes"])


def test_gpu_count_is_requested_as_nvidia_gpu(helm):
    container = server_container(render(helm, "--set", "gpu.count=2"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["memory"] == "16Gi"


def test_gpu_count_zero_requests_no_gpu(helm):
    container = server_container(render(helm, "--set", "gpu.count=0"))
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert "nvidia.com/gpu" not in container["resources"]["requests"]


def test_probes_are_native_grpc_probes_on_the_numeric_grpc_port(helm):
    container = server_container(render(helm, "--set", "ports.grpc=7001"))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": 7001}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # kernel warm-up
    assert {"name": "grpc", "containerPort": 7001, "protocol": "TCP"} in container["ports"]


def test_pod_runs_non_root_with_a_read_only_root_and_no_capabilities(helm):
    docs = render(helm)
    spec = pod_spec(docs)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["automountServiceAccountToken"] is False
    security = server_container(docs)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}


def test_kernel_cache_is_an_emptydir_at_ddtree_cache_dir(helm):
    docs = render(helm)
    container = server_container(docs)
    assert env_of(container)["DDTREE_CACHE_DIR"] == "/var/cache/ddtree"
    assert {"name": "kernel-cache", "mountPath": "/var/cache/ddtree"} in container["volumeMounts"]
    cache = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "kernel-cache")
    assert cache == {"name": "kernel-cache", "emptyDir": {"sizeLimit": "1Gi"}}


def test_kernel_cache_volume_can_be_replaced(helm):
    docs = render(helm, "--set", "kernelCache.volume.persistentVolumeClaim.claimName=kernels")
    cache = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "kernel-cache")
    assert cache == {"name": "kernel-cache", "persistentVolumeClaim": {"claimName": "kernels"}}


def test_server_settings_become_ddtree_environment_variables(helm):
    env = env_of(
        server_container(
            render(helm, "--set", "server.logLevel=DEBUG", "--set", "ports.metrics=9400")
        )
    )
    assert env["DDTREE_LOG_LEVEL"] == "DEBUG"
    assert env["DDTREE_METRICS_PORT"] == "9400"
    assert env["DDTREE_METRICS_HOST"] == "0.0.0.0"
    assert env["DDTREE_LISTEN"] == "0.0.0.0:50051"
    assert env["DDTREE_MAX_MESSAGE_BYTES"] == "536870912"


def test_the_server_reads_every_rendered_setting_and_gets_the_chart_defaults(helm):
    """The container's DDTREE_* environment, parsed by the server's own loader, gives the
    values.yaml settings (and each of the server's own defaults where the chart keeps them)."""
    from ddtree.service.config import ServiceConfig

    env = env_of(server_container(render(helm)))
    config = ServiceConfig.from_env({k: v for k, v in env.items() if k.startswith("DDTREE_")})
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    limits, keepalive = values["limits"], values["keepalive"]
    assert config.grpc_io == values["server"]["grpcIo"]
    assert config.max_registered_regions == limits["maxRegisteredRegions"]
    assert config.max_registered_bytes == limits["maxRegisteredBytes"]
    assert config.memory_idle_timeout_s == limits["memoryIdleTimeoutSeconds"]
    assert config.max_channels == limits["maxChannels"]
    assert config.bind_regions_to_client is limits["bindRegionsToClient"]
    assert config.max_concurrent_calls_per_client == limits["maxConcurrentCallsPerClient"]
    assert config.max_regions_per_client == limits["maxRegionsPerClient"]
    assert config.max_registered_bytes_per_client == limits["maxRegisteredBytesPerClient"]
    assert config.keepalive_time_s == keepalive["timeSeconds"]
    assert config.keepalive_timeout_s == keepalive["timeoutSeconds"]
    assert config.keepalive_permit_without_calls is keepalive["permitWithoutCalls"]
    assert config.keepalive_min_ping_interval_s == keepalive["minPingIntervalSeconds"]
    assert config.keepalive_max_ping_strikes == keepalive["maxPingStrikes"]
    assert config.max_connection_idle_s == keepalive["maxConnectionIdleSeconds"]
    assert config.max_connection_age_s == keepalive["maxConnectionAgeSeconds"]
    assert config.max_connection_age_grace_s == keepalive["maxConnectionAgeGraceSeconds"]
    # Where values.yaml keeps the server's defaults, the rendered pod changes nothing.
    defaults = ServiceConfig()
    for name in (
        "grpc_io",
        "max_registered_regions",
        "max_registered_bytes",
        "memory_idle_timeout_s",
        "max_channels",
        "bind_regions_to_client",
        "keepalive_time_s",
        "keepalive_timeout_s",
        "keepalive_max_ping_strikes",
        "max_connection_age_grace_s",
    ):
        assert getattr(config, name) == getattr(defaults, name), name


def test_limits_and_keepalive_settings_reach_the_container(helm):
    env = env_of(
        server_container(
            render(
                helm,
                "--set",
                "limits.maxRegionsPerClient=8",
                "--set",
                "limits.bindRegionsToClient=false",
                "--set",
                "limits.maxRegisteredBytesPerClient=68719476736",
                "--set",
                "keepalive.maxConnectionIdleSeconds=300",
                "--set",
                "limits.maxChannels=0",
            )
        )
    )
    assert env["DDTREE_MAX_REGIONS_PER_CLIENT"] == "8"
    assert env["DDTREE_BIND_REGIONS_TO_CLIENT"] == "0"
    assert env["DDTREE_MAX_REGISTERED_BYTES_PER_CLIENT"] == "68719476736"
    assert env["DDTREE_MAX_CONNECTION_IDLE_S"] == "300"
    assert env["DDTREE_MAX_CHANNELS"] == "0"


def test_metrics_disabled_renders_no_metrics_port_or_variable(helm):
    docs = render(helm, "--set", "metrics.enabled=false")
    container = server_container(docs)
    assert "DDTREE_METRICS_PORT" not in env_of(container)
    assert [p["name"] for p in container["ports"]] == ["grpc"]
    assert [p["name"] for p in only(docs, "Service")["spec"]["ports"]] == ["grpc"]


def test_image_tag_defaults_to_the_app_version_which_follows_pyproject(helm):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    # tomllib is 3.11+; the project supports 3.10, so read the one version line.
    version = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    assert chart["appVersion"] == version.group(1)
    assert server_container(render(helm))["image"] == f"ddtree:{chart['appVersion']}"
    digest = "sha256:" + "a" * 64
    assert server_container(render(helm, "--set", f"image.digest={digest}"))["image"] == (
        f"ddtree@{digest}"
    )


def test_selector_labels_are_only_name_and_instance(helm):
    docs = render(helm)
    selector = {"app.kubernetes.io/name": "ddtree", "app.kubernetes.io/instance": "rel"}
    assert only(docs, "Deployment")["spec"]["selector"]["matchLabels"] == selector
    assert only(docs, "Service")["spec"]["selector"] == selector


# ---------------------------------------------------------------- service and monitoring


def test_service_exposes_the_grpc_and_metrics_ports_by_name(helm):
    ports = only(render(helm), "Service")["spec"]["ports"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in ports] == [
        ("grpc", 50051, "grpc"),
        ("metrics", 9090, "metrics"),
    ]


def test_renders_no_servicemonitor_prometheusrule_pdb_or_ingress_by_default(helm):
    optional = {"ServiceMonitor", "PrometheusRule", "PodDisruptionBudget", "Ingress"}
    assert not kinds(render(helm)) & optional


def test_ingress_routes_its_hosts_to_the_grpc_port(helm):
    ingress = only(render(helm, "-f", str(CHART / "ci" / "ingress-values.yaml")), "Ingress")
    assert ingress["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPC"
    }
    assert ingress["spec"]["ingressClassName"] == "nginx"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "ddtree.example.com"
    assert rule["http"]["paths"] == [
        {
            "path": "/",
            "pathType": "Prefix",
            "backend": {"service": {"name": "rel-ddtree", "port": {"name": "grpc"}}},
        }
    ]
    assert ingress["spec"]["tls"] == [{"hosts": ["ddtree.example.com"], "secretName": "ddtree-tls"}]


def test_ingress_without_hosts_is_refused(helm):
    result = _run_helm(helm, "template", "rel", str(CHART), "--set", "ingress.enabled=true")
    assert result.returncode != 0
    assert "ingress.hosts: give at least one host when ingress.enabled" in result.stderr


def test_servicemonitor_scrapes_the_metrics_port_of_the_release(helm):
    docs = render(helm, "-f", str(CHART / "ci" / "servicemonitor-values.yaml"))
    monitor = only(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "10s", "scrapeTimeout": "10s"}
    ]
    assert monitor["spec"]["selector"]["matchLabels"] == only(docs, "Service")["spec"]["selector"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}


def test_servicemonitor_without_metrics_is_refused(helm):
    result = _run_helm(
        helm,
        "template",
        "rel",
        str(CHART),
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "metrics.enabled=false",
    )
    assert result.returncode != 0
    assert "serviceMonitor.enabled needs metrics.enabled and service.enabled" in result.stderr


def test_prometheusrule_carries_the_checked_rules_file(helm):
    docs = render(helm, "-f", str(CHART / "ci" / "servicemonitor-values.yaml"))
    rule = only(docs, "PrometheusRule")
    rules_file = yaml.safe_load((CHART / "files" / "ddtree-rules.yaml").read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == rules_file


def test_pdb_renders_in_deployment_mode_only(helm):
    docs = render(helm, "-f", str(CHART / "ci" / "servicemonitor-values.yaml"))
    assert only(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    daemonset = render(helm, "--set", "mode=DaemonSet", "--set", "podDisruptionBudget.enabled=true")
    assert "PodDisruptionBudget" not in kinds(daemonset)


def test_dashboard_configmap_carries_the_dashboard_for_the_grafana_sidecar(helm):
    config_map = only(render(helm), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["ddtree.json"])
    assert shipped == json.loads((CHART / "files" / "ddtree-dashboard.json").read_text())


def test_renders_no_dashboard_when_disabled(helm):
    assert "ConfigMap" not in kinds(render(helm, "--set", "dashboard.enabled=false"))


# ---------------------------------------------------------------- helm test


def test_helm_test_pod_checks_health_and_server_info_through_the_service(helm):
    pod = only(render(helm), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    script = container["command"][2]
    assert "HealthStub" in script
    assert "GetServerInfo" in script
    assert container["command"][3] == "rel-ddtree:50051"
    # The Service must never select the test pod.
    selector = only(render(helm), "Service")["spec"]["selector"]
    labels = pod["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in selector.items())


def test_helm_test_script_passes_against_a_real_server(helm, tmp_path):
    # Run the test pod's own script, unchanged, against a local server instead of the Service.
    from helpers.serving import ServerThread

    from ddtree.service.config import ServiceConfig

    command = only(render(helm), "Pod")["spec"]["containers"][0]["command"]
    assert command[:2] == ["python3", "-c"]
    server = ServerThread(ServiceConfig(listen=("127.0.0.1:0",), device="cpu"))
    address = server.start()[0]
    try:
        result = subprocess.run(
            [sys.executable, "-c", command[2], address, "10"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("SERVING; GetServerInfo: ")
    assert "version" in result.stdout


def test_packaged_chart_ships_the_dashboard_and_rules_and_renders(helm, tmp_path):
    result = _run_helm(helm, "package", str(CHART), "--destination", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (package,) = tmp_path.glob("ddtree-*.tgz")
    with tarfile.open(package) as archive:
        names = set(archive.getnames())
    assert {"ddtree/files/ddtree-dashboard.json", "ddtree/files/ddtree-rules.yaml"} <= names
    assert not any(name.startswith("ddtree/ci/") for name in names)
    rendered = _run_helm(
        helm, "template", "rel", str(package), "--set", "prometheusRule.enabled=true"
    )
    assert rendered.returncode == 0, rendered.stderr
    assert "kind: PrometheusRule" in rendered.stdout
