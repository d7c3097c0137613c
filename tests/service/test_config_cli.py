"""Configuration from flags and DDTREE_* variables, and the ``ddtree`` command line."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from helpers.serving import LogWatcher

from ddtree.clients import Client
from ddtree.service.cli import main
from ddtree.service.config import POLLING_GRPC_EXPERIMENTS, ServiceConfig, config_from_args


def test_defaults_serve_on_loopback() -> None:
    config = config_from_args([], {})
    assert config == ServiceConfig()
    assert config.listen == ("127.0.0.1:50051",)


def test_every_field_has_an_env_var_and_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for f in fields(ServiceConfig):
        assert f"--{f.name.replace('_', '-')}" in help_text, f.name
        assert f"DDTREE_{f.name.upper()}" in help_text, f.name


def test_env_vars_fill_the_config() -> None:
    env = {
        "DDTREE_LISTEN": "0.0.0.0:6000, unix:/tmp/x.sock",
        "DDTREE_MAX_MESSAGE_BYTES": str(8 << 20),
        "DDTREE_MAX_CONCURRENT_CALLS": "3",
        "DDTREE_GRACE_S": "2.5",
        "DDTREE_DEVICE": "cpu",
        "DDTREE_BACKEND": "reference",
        "DDTREE_LOG_LEVEL": "debug",
        "DDTREE_CACHE_DIR": "/tmp/kc",
        "DDTREE_DISABLE_JIT": "1",
        "DDTREE_METRICS_PORT": "9400",
        "DDTREE_MAX_CHANNELS": "0",
    }
    config = config_from_args([], env)
    assert config.listen == ("0.0.0.0:6000", "unix:/tmp/x.sock")
    assert config.max_message_bytes == 8 << 20
    assert config.max_concurrent_calls == 3
    assert config.grace_s == 2.5
    assert (config.device, config.backend, config.log_level) == ("cpu", "reference", "DEBUG")
    assert config.cache_dir == Path("/tmp/kc")
    assert config.disable_jit is True
    assert config.metrics_port == 9400
    assert config.max_channels == 0
    assert config.kernel_environment() == {
        "DDTREE_DISABLE_JIT": "1",
        "DDTREE_CACHE_DIR": "/tmp/kc",
    }


def test_flags_win_over_env_vars() -> None:
    env = {"DDTREE_LISTEN": "0.0.0.0:6000", "DDTREE_GRACE_S": "9"}
    config = config_from_args(["--listen", "127.0.0.1:0", "--listen", "unix:/tmp/a"], env)
    assert config.listen == ("127.0.0.1:0", "unix:/tmp/a")
    assert config.grace_s == 9.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DDTREE_GRACE_S": "soon"}, "DDTREE_GRACE_S"),
        ({"DDTREE_DISABLE_JIT": "maybe"}, "DDTREE_DISABLE_JIT"),
        ({"DDTREE_LISTEN": "localhost"}, "listen"),
        ({"DDTREE_LISTEN": "unix:relative.sock"}, "listen"),
        ({"DDTREE_DEVICE": "gpu0"}, "device"),
        ({"DDTREE_MAX_MESSAGE_BYTES": "10"}, "max_message_bytes"),
        ({"DDTREE_METRICS_PORT": "70000"}, "metrics_port"),
        ({"DDTREE_REQUEST_DEADLINE_CAP_S": "0"}, "request_deadline_cap_s"),
        ({"DDTREE_MAX_CHANNELS": "-1"}, "max_channels"),
        ({"DDTREE_GRPC_IO": "epoll"}, "grpc_io"),
    ],
    ids=[
        "grace",
        "bool",
        "no-port",
        "relative-unix",
        "device",
        "tiny-messages",
        "port",
        "cap",
        "channels",
        "grpc-io",
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args([], env)


def test_grpc_io_polling_appends_to_the_operators_experiments() -> None:
    polling = config_from_args([], {})
    assert polling.grpc_io == "polling"
    assert polling.grpc_environment({}) == {"GRPC_EXPERIMENTS": ",".join(POLLING_GRPC_EXPERIMENTS)}
    assert polling.grpc_environment({"GRPC_EXPERIMENTS": " foo , -event_engine_client"}) == {
        "GRPC_EXPERIMENTS": "foo,-event_engine_client,-event_engine_listener"
    }
    # Every experiment concerned named by the operator, on or off: theirs stands.
    named = {"GRPC_EXPERIMENTS": "event_engine_client,-event_engine_listener"}
    assert polling.grpc_environment(named) == {}
    engine = config_from_args(["--grpc-io", "event-engine"], {"DDTREE_GRPC_IO": "polling"})
    assert engine.grpc_io == "event-engine"
    assert engine.grpc_environment({}) == {}
    assert config_from_args([], {"DDTREE_GRPC_IO": " Event-Engine"}).grpc_io == "event-engine"


@pytest.mark.parametrize(
    ("grpc_io", "endpoint_source"),
    [("polling", "tcp_posix.cc"), ("event-engine", "posix_endpoint.cc")],
)
def test_serve_applies_grpc_io_before_grpc_starts(
    tmp_path: Path, grpc_io: str, endpoint_source: str
) -> None:
    """gRPC's trace of the server's socket names the code that served it: the polling
    endpoint (tcp_posix.cc) or the EventEngine's (posix_endpoint.cc). It fails if a gRPC
    release drops the polling path (the setting would then change nothing)."""
    socket = tmp_path / "serve.sock"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    env.update(
        PYTHONUNBUFFERED="1", DDTREE_GRPC_IO=grpc_io, GRPC_TRACE="tcp", GRPC_VERBOSITY="debug"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "ddtree.service", "serve"]
        + ["--device", "cpu", "--listen", f"unix:{socket}"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    log = LogWatcher(process.stderr)
    try:
        applied = log.wait_for("event=grpc_io ")
        expected = ",".join(POLLING_GRPC_EXPERIMENTS) if grpc_io == "polling" else "-"
        assert f"grpc_io={grpc_io} grpc_experiments={expected}" in applied
        log.wait_for("event=serving")
        with Client(f"unix:{socket}") as client:
            assert not client.server_info().supports_memory_references  # a CPU server
        log.wait_for(endpoint_source)
        other = "posix_endpoint.cc" if grpc_io == "polling" else "tcp_posix.cc"
        assert not any(other in line for line in log.lines)
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.join()
        assert process.stderr is not None
        process.stderr.close()


def test_help_explains_serving(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "SIGTERM" in out and "--listen" in out and "unix:/abs/path" in out


def test_bad_flag_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--device", "tpu"])
    assert exited.value.code == 2
    assert "device" in capsys.readouterr().err


def test_python_m_and_console_script_agree() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ddtree.service", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "ddtree serve" in result.stdout
    assert "demo" in result.stdout


def test_unbindable_address_exits_1(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddtree.service",
            "serve",
            "--device",
            "cpu",
            "--listen",
            f"unix:{tmp_path / 'missing-dir' / 's.sock'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "event=startup_failed" in result.stderr
