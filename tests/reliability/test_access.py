"""Access control: mTLS refuses clients without a certificate, Unix-socket modes, per-client
call limits by identity, and region tokens (>= 128 random bits, never logged)."""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import logging
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

# The certificates of the TLS tests are made with `cryptography` (the dev extra); a machine
# without it (the GPU machine's image) skips this module instead of failing collection.
pytest.importorskip("cryptography", reason="needs the cryptography package (dev extra)")

import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers.gates import Gate
from helpers.ipc import HostMapper
from helpers.service_inputs import BUDGET, Step, make_step
from helpers.serving import ServerThread

from ddtree.clients import Client, RetryPolicy, TlsOptions, _wire
from ddtree.clients.errors import ResourceExhaustedError, UnavailableError
from ddtree.service.config import ServiceConfig, config_from_args
from ddtree.service.engine import Engine
from ddtree.service.errors import IpcOpenFailed, MemoryLimitExceeded, MemoryTokenNotFound
from ddtree.service.memory import TOKEN_BYTES, MemoryLimits, RegionTable
from ddtree.service.server import memory_limits
from ddtree.v1 import tensor_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class Pem:
    """A certificate and its key, PEM-encoded."""

    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ddtree tests"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _issue(
    common_name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``common_name``, self-signed (a CA) when ``issuer`` is None."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name) if issuer is None else issuer[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    signer = key if issuer is None else issuer[1]
    return builder.sign(signer, hashes.SHA256()), key


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    return Pem(
        cert=cert.public_bytes(serialization.Encoding.PEM),
        key=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


@dataclass(frozen=True)
class Pki:
    """A throwaway CA with a server and two client certificates, and a rogue CA's client."""

    ca: Pem
    server: Pem
    alice: Pem
    bob: Pem
    rogue: Pem


@pytest.fixture(scope="module")
def pki() -> Pki:
    ca = _issue("ddtree test CA", None)
    rogue_ca = _issue("rogue CA", None)
    return Pki(
        ca=_pem(*ca),
        server=_pem(*_issue("ddtree server", ca)),
        alice=_pem(*_issue("alice", ca)),
        bob=_pem(*_issue("bob", ca)),
        rogue=_pem(*_issue("alice", rogue_ca)),
    )


@pytest.fixture(scope="module")
def step() -> Step:
    return make_step()


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _tls_config(tmp_path: Path, pki: Pki, *, mutual: bool, **kwargs: object) -> ServiceConfig:
    return ServiceConfig(
        listen=("127.0.0.1:0",),
        device="cpu",
        tls_cert=_write(tmp_path, "server.pem", pki.server.cert),
        tls_key=_write(tmp_path, "server.key", pki.server.key),
        tls_client_ca=_write(tmp_path, "ca.pem", pki.ca.cert) if mutual else None,
        **kwargs,  # type: ignore[arg-type]
    )


def _tls(pki: Pki, client: Pem | None) -> TlsOptions:
    return TlsOptions(
        root_certificates=pki.ca.cert,
        certificate_chain=None if client is None else client.cert,
        private_key=None if client is None else client.key,
    )


def test_mtls_refuses_clients_without_a_trusted_certificate(tmp_path: Path, pki: Pki) -> None:
    with ServerThread(_tls_config(tmp_path, pki, mutual=True)) as thread:
        address = thread.addresses[0]
        with Client(address, tls=_tls(pki, pki.alice), retry=NO_RETRY) as trusted:
            assert trusted.server_info(timeout_s=10).version
        refused = {
            "no certificate": Client(address, tls=_tls(pki, None), retry=NO_RETRY),
            "rogue CA": Client(address, tls=_tls(pki, pki.rogue), retry=NO_RETRY),
            "plain text": Client(address, retry=NO_RETRY),
        }
        for what, client in refused.items():
            with client, pytest.raises(UnavailableError) as raised:
                client.server_info(timeout_s=10)
            assert raised.value.code == "UNAVAILABLE", what
        # The refusals did not disturb the server.
        with Client(address, tls=_tls(pki, pki.bob), retry=NO_RETRY) as trusted:
            assert trusted.health(timeout_s=10) == "SERVING"


def test_tls_without_client_ca_serves_clients_without_certificates(
    tmp_path: Path, pki: Pki
) -> None:
    with ServerThread(_tls_config(tmp_path, pki, mutual=False)) as thread:
        address = thread.addresses[0]
        with Client(address, tls=_tls(pki, None), retry=NO_RETRY) as client:
            assert client.health(timeout_s=10) == "SERVING"
        with Client(address, retry=NO_RETRY) as plain, pytest.raises(UnavailableError):
            plain.server_info(timeout_s=10)


def test_unreadable_tls_file_names_the_setting(tmp_path: Path, pki: Pki) -> None:
    config = _tls_config(tmp_path, pki, mutual=True)
    config.tls_client_ca.unlink()  # type: ignore[union-attr]
    thread = ServerThread(config)
    with pytest.raises(ValueError, match="tls_client_ca: cannot read"):
        thread.start()
    thread.stop()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"tls_cert": Path("/c.pem")}, "tls_cert, tls_key"),
        ({"tls_client_ca": Path("/ca.pem")}, "tls_client_ca"),
        ({"unix_socket_mode": 0o1777}, "unix_socket_mode"),
        ({"max_concurrent_calls_per_client": -1}, "max_concurrent_calls_per_client"),
        ({"max_regions_per_client": -1}, "max_regions_per_client"),
        ({"max_registered_bytes_per_client": -1}, "max_registered_bytes_per_client"),
    ],
    ids=["cert-without-key", "ca-without-tls", "mode", "per-client", "regions", "bytes"],
)
def test_bad_access_settings_name_the_setting(env: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServiceConfig(**env)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [None, 0o600, 0o666], ids=["default-0660", "0600", "0666"])
def test_unix_socket_is_created_with_the_configured_mode(tmp_path: Path, mode: int | None) -> None:
    path = tmp_path / "d.sock"
    extra = {} if mode is None else {"unix_socket_mode": mode}
    config = ServiceConfig(listen=(f"unix:{path}",), device="cpu", **extra)  # type: ignore[arg-type]
    with ServerThread(config) as thread:
        info = path.stat()
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == (0o660 if mode is None else mode)
        with Client(thread.addresses[0], retry=NO_RETRY) as client:
            assert client.health(timeout_s=10) == "SERVING"


@pytest.fixture
def gate() -> Iterator[Gate]:
    gate = Gate()
    yield gate
    gate.release.set()


def _build(client: Client, step: Step) -> torch.Tensor:
    return client.build_tree(step.draft_logits, step.root_tokens, BUDGET, timeout_s=30).tokens


def test_per_client_limit_counts_each_certificate_subject(
    tmp_path: Path, pki: Pki, step: Step, gate: Gate
) -> None:
    config = _tls_config(tmp_path, pki, mutual=True, max_concurrent_calls_per_client=1)
    with ServerThread(config, engine_observer=gate) as thread, ThreadPoolExecutor(2) as pool:
        address = thread.addresses[0]
        with (
            Client(address, tls=_tls(pki, pki.alice), retry=NO_RETRY) as alice,
            Client(address, tls=_tls(pki, pki.alice), retry=NO_RETRY) as alice_again,
            Client(address, tls=_tls(pki, pki.bob), retry=NO_RETRY) as bob,
        ):
            first = pool.submit(_build, alice, step)
            assert gate.entered.wait(30)
            # The same subject on a second connection is the same client.
            with pytest.raises(ResourceExhaustedError) as raised:
                _build(alice_again, step)
            assert raised.value.reason == "OVERLOADED"
            assert "CN=alice" in raised.value.message
            assert "max_concurrent_calls_per_client is 1" in raised.value.message
            # Another subject is admitted (it queues behind alice's call on the device).
            second = pool.submit(_build, bob, step)
            gate.release.set()
            assert torch.equal(first.result(timeout=30), step.tree.tokens)
            assert torch.equal(second.result(timeout=30), step.tree.tokens)
            # Alice's slot is free again.
            assert torch.equal(_build(alice_again, step), step.tree.tokens)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_per_client_limit_on_plain_transports(
    tmp_path: Path, step: Step, gate: Gate, transport: str
) -> None:
    address = "127.0.0.1:0" if transport == "tcp" else f"unix:{tmp_path / 'd.sock'}"
    config = ServiceConfig(listen=(address,), device="cpu", max_concurrent_calls_per_client=1)
    with ServerThread(config, engine_observer=gate) as thread, ThreadPoolExecutor(1) as pool:
        address = thread.addresses[0]
        with Client(address, retry=NO_RETRY) as client, Client(address, retry=NO_RETRY) as other:
            first = pool.submit(_build, client, step)
            assert gate.entered.wait(30)
            # A second connection from the same peer is the same client.
            with pytest.raises(ResourceExhaustedError) as raised:
                _build(other, step)
            identity = "ip:127.0.0.1" if transport == "tcp" else "unix"
            assert raised.value.reason == "OVERLOADED"
            assert f"client {identity} has 1 calls in flight" in raised.value.message
            # Health checks are not service calls and are never limited.
            assert other.health(timeout_s=10) == "SERVING"
            gate.release.set()
            assert torch.equal(first.result(timeout=30), step.tree.tokens)
            assert torch.equal(_build(other, step), step.tree.tokens)


def test_region_tokens_are_192_random_bits_and_never_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mapper = HostMapper()
    table = RegionTable(
        device=torch.device("cpu"),
        device_uuid="GPU-test",
        mapper=mapper,
        limits=MemoryLimits(max_regions=512, max_bytes=1 << 30),
    )
    handle = mapper.export(torch.zeros(4096, dtype=torch.uint8))
    tokens = []
    with caplog.at_level(logging.DEBUG, logger="ddtree"):
        for _ in range(256):
            token, _ = table.register(handle, "GPU-test", 4096, "client-a")
            tokens.append(token)
            leases = table.leases()
            view = leases.resolve("build_tree.draft_logits", token, 64, torch.float32, (4, 8))
            assert view.shape == (4, 8)
            leases.release()
        for token in tokens[:128]:
            table.unregister(token)
        table.sweep(force=True)
        table.close()
    assert TOKEN_BYTES * 8 >= 128
    assert len(set(tokens)) == len(tokens)
    for token in tokens:
        assert len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) == TOKEN_BYTES
    assert caplog.records, "the table logs its events"
    text = "\n".join(record.getMessage() for record in caplog.records)
    leaked = [token for token in tokens if token in text]
    assert not leaked


def test_access_settings_from_env_and_flags(tmp_path: Path) -> None:
    env = {
        "DDTREE_TLS_CERT": "/etc/ddtree/tls.crt",
        "DDTREE_TLS_KEY": "/etc/ddtree/tls.key",
        "DDTREE_TLS_CLIENT_CA": "/etc/ddtree/ca.crt",
        "DDTREE_UNIX_SOCKET_MODE": "0600",
        "DDTREE_MAX_CONCURRENT_CALLS_PER_CLIENT": "4",
        "DDTREE_BIND_REGIONS_TO_CLIENT": "0",
        "DDTREE_MAX_REGIONS_PER_CLIENT": "8",
        "DDTREE_MAX_REGISTERED_BYTES_PER_CLIENT": "1048576",
    }
    config = config_from_args([], env)
    assert config.tls_cert == Path("/etc/ddtree/tls.crt")
    assert config.tls_key == Path("/etc/ddtree/tls.key")
    assert config.tls_client_ca == Path("/etc/ddtree/ca.crt")
    assert config.unix_socket_mode == 0o600
    assert config.max_concurrent_calls_per_client == 4
    assert config.bind_regions_to_client is False
    assert (config.max_regions_per_client, config.max_registered_bytes_per_client) == (8, 1 << 20)
    limits = memory_limits(config)
    assert (limits.bind_to_owner, limits.max_regions_per_owner) == (False, 8)
    assert limits.max_bytes_per_owner == 1 << 20
    flags = ["--bind-regions-to-client", "--max-regions-per-client", "0"]
    config = config_from_args(flags, env)
    assert (config.bind_regions_to_client, config.max_regions_per_client) == (True, 0)
    assert config_from_args(["--no-bind-regions-to-client"], {}).bind_regions_to_client is False
    defaults = config_from_args([], {})
    assert defaults.bind_regions_to_client is True
    assert (defaults.max_regions_per_client, defaults.max_registered_bytes_per_client) == (0, 0)
    with pytest.raises(ValueError, match="DDTREE_BIND_REGIONS_TO_CLIENT"):
        config_from_args([], {"DDTREE_BIND_REGIONS_TO_CLIENT": "maybe"})
    flags = ["--unix-socket-mode", "660", "--max-concurrent-calls-per-client", "0"]
    config = config_from_args(flags, env)
    assert (config.unix_socket_mode, config.max_concurrent_calls_per_client) == (0o660, 0)
    assert config_from_args([], {}).unix_socket_mode == 0o660
    with pytest.raises(ValueError, match="DDTREE_UNIX_SOCKET_MODE"):
        config_from_args([], {"DDTREE_UNIX_SOCKET_MODE": "rw-rw----"})


def test_region_tokens_never_reach_the_server_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the real server (registered memory over host buffers): register, use, misuse and
    unregister a region at DEBUG; the token appears in no log line."""
    uuid = "GPU-00000000-log-0000-0000-000000000000"
    engine = Engine(device="cpu")
    mapper = HostMapper()
    engine.memory = RegionTable(device=torch.device("cpu"), device_uuid=uuid, mapper=mapper)
    config = ServiceConfig(listen=(f"unix:{tmp_path / 'd.sock'}",), device="cpu")
    with (
        caplog.at_level(logging.DEBUG, logger="ddtree"),
        ServerThread(config, engine=engine) as thread,
    ):
        channel = grpc.insecure_channel(thread.addresses[0])
        stub = pb_grpc.TreeSpeculationServiceStub(channel)
        handle = mapper.export(torch.zeros(4096, dtype=torch.uint8))
        token = stub.RegisterMemory(
            pb.RegisterMemoryRequest(
                ipc_handle=handle, device_uuid=uuid, byte_size=4096, client_id="logs"
            ),
            timeout=10,
        ).region_token
        roots = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[1], inline=bytes(8))

        def build(offset: int, region_token: str) -> pb.BuildTreeRequest:
            logits = tensor_pb2.Tensor(
                dtype=tensor_pb2.DTYPE_FLOAT32,
                shape=[1, 2, 8],
                ref=tensor_pb2.TensorRef(region_token=region_token, offset_bytes=offset),
            )
            return pb.BuildTreeRequest(draft_logits=logits, root_tokens=roots, budget=3)

        assert stub.BuildTree(build(0, token), timeout=10).tree.draft_len == 2
        altered = token[:-1] + ("A" if token[-1] != "A" else "B")
        for request, code in (
            (build(2, token), grpc.StatusCode.INVALID_ARGUMENT),  # misaligned
            (build(4096, token), grpc.StatusCode.INVALID_ARGUMENT),  # past the end
            (build(0, altered), grpc.StatusCode.NOT_FOUND),
        ):
            with pytest.raises(grpc.RpcError) as raised:
                stub.BuildTree(request, timeout=10)
            assert raised.value.code() == code
            assert token not in (raised.value.details() or "")
        listed = stub.ListMemory(pb.ListMemoryRequest(client_id="logs"), timeout=10)
        assert len(listed.regions) == 1 and token.encode() not in listed.SerializeToString()
        stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=token), timeout=10)
        with pytest.raises(grpc.RpcError) as raised:
            stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=token), timeout=10)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        channel.close()
    text = "\n".join(record.getMessage() for record in caplog.records)
    for event in ("event=memory_registered", "event=rpc_error", "event=rpc_received"):
        assert event in text
    assert token not in text
    assert token[:12] not in text and altered not in text


# ------------------------------------------------------------------------ identity-bound regions

REGION_BYTES = 4096


@dataclass
class Tenant:
    """One client identity's raw stub on the mTLS server."""

    channel: grpc.Channel
    stub: pb_grpc.TreeSpeculationServiceStub

    def register(self, mapper: HostMapper, uuid: str, byte_size: int = REGION_BYTES) -> str:
        handle = mapper.export(torch.arange(byte_size, dtype=torch.int64).to(torch.uint8))
        request = pb.RegisterMemoryRequest(
            ipc_handle=handle, device_uuid=uuid, byte_size=byte_size, client_id="shared"
        )
        return str(self.stub.RegisterMemory(request, timeout=10).region_token)

    def build(self, token: str) -> pb.BuildTreeResponse:
        logits = tensor_pb2.Tensor(
            dtype=tensor_pb2.DTYPE_FLOAT32,
            shape=[1, 2, 8],
            ref=tensor_pb2.TensorRef(region_token=token, offset_bytes=0),
        )
        roots = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[1], inline=bytes(8))
        request = pb.BuildTreeRequest(draft_logits=logits, root_tokens=roots, budget=3)
        return self.stub.BuildTree(request, timeout=10)

    def listed(self) -> int:
        return len(
            self.stub.ListMemory(pb.ListMemoryRequest(client_id="shared"), timeout=10).regions
        )

    def unregister(self, token: str) -> None:
        self.stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=token), timeout=10)


@dataclass
class Tenancy:
    """An mTLS server with registered memory over host buffers, and alice's and bob's stubs."""

    mapper: HostMapper
    uuid: str
    alice: Tenant
    bob: Tenant


@contextlib.contextmanager
def _tenancy(tmp_path: Path, pki: Pki, **settings: object) -> Iterator[Tenancy]:
    config = _tls_config(tmp_path, pki, mutual=True, **settings)
    mapper = HostMapper()
    engine = Engine(device="cpu", ipc_mapper=mapper, memory_limits=memory_limits(config))
    with ServerThread(config, engine=engine) as thread, contextlib.ExitStack() as stack:
        tenants = []
        for pem in (pki.alice, pki.bob):
            credentials = grpc.ssl_channel_credentials(pki.ca.cert, pem.key, pem.cert)
            channel = stack.enter_context(grpc.secure_channel(thread.addresses[0], credentials))
            tenants.append(Tenant(channel, pb_grpc.TreeSpeculationServiceStub(channel)))
        yield Tenancy(mapper, engine.info().devices[0].uuid, *tenants)


def _refused(call: Callable[[], object], code: str, reason: str, field: str) -> str:
    """Run ``call``; it must fail with ``code`` and ``reason`` naming ``field``; the message."""
    with pytest.raises(grpc.RpcError) as raised:
        call()
    error = _wire.error_from_rpc(raised.value)
    assert (error.code, error.reason) == (code, reason), error.message
    assert field in error.message
    return error.message


def test_a_region_token_reaches_only_the_identity_that_registered_it(
    tmp_path: Path, pki: Pki
) -> None:
    with _tenancy(tmp_path, pki) as t:
        token = t.alice.register(t.mapper, t.uuid)
        expected = t.alice.build(token)
        unknown = "A" * len(token)
        # Bob holding alice's token gets exactly what an unknown token gets.
        field = "build_tree.draft_logits.ref.region_token"
        message = _refused(lambda: t.bob.build(token), "NOT_FOUND", "MEMORY_TOKEN_NOT_FOUND", field)
        assert message == _refused(
            lambda: t.bob.build(unknown), "NOT_FOUND", "MEMORY_TOKEN_NOT_FOUND", field
        )
        assert t.bob.listed() == 0
        field = "unregister_memory.region_token"
        _refused(lambda: t.bob.unregister(token), "NOT_FOUND", "MEMORY_TOKEN_NOT_FOUND", field)
        # Alice's region is untouched by bob's attempts.
        assert t.alice.listed() == 1
        assert t.alice.build(token) == expected
        t.alice.unregister(token)
        assert t.alice.listed() == 0
        assert t.mapper.mapped == 0


def test_without_binding_any_identity_holding_the_token_reaches_the_region(
    tmp_path: Path, pki: Pki
) -> None:
    with _tenancy(tmp_path, pki, bind_regions_to_client=False) as t:
        token = t.alice.register(t.mapper, t.uuid)
        assert t.bob.build(token) == t.alice.build(token)
        assert t.bob.listed() == 1
        t.bob.unregister(token)
        field = "unregister_memory.region_token"
        _refused(lambda: t.alice.unregister(token), "NOT_FOUND", "MEMORY_TOKEN_NOT_FOUND", field)
        assert t.mapper.mapped == 0


def test_per_client_region_and_byte_limits(tmp_path: Path, pki: Pki) -> None:
    limits = {"max_regions_per_client": 2, "max_registered_bytes_per_client": 5000}
    with _tenancy(tmp_path, pki, **limits) as t:
        first = t.alice.register(t.mapper, t.uuid, 2048)
        t.alice.register(t.mapper, t.uuid, 2048)
        message = _refused(
            lambda: t.alice.register(t.mapper, t.uuid, 512),
            "RESOURCE_EXHAUSTED",
            "MEMORY_LIMIT_EXCEEDED",
            "register_memory",
        )
        assert "CN=alice" in message and "max_regions_per_client is 2" in message
        assert t.mapper.mapped == 2  # the refused registration mapped nothing
        # Another identity still registers, up to its own byte limit.
        held = t.bob.register(t.mapper, t.uuid, 4096)
        message = _refused(
            lambda: t.bob.register(t.mapper, t.uuid, 1024),
            "RESOURCE_EXHAUSTED",
            "MEMORY_LIMIT_EXCEEDED",
            "register_memory.byte_size",
        )
        assert "max_registered_bytes_per_client 5000" in message and "CN=bob" in message
        assert t.mapper.mapped == 3
        # Unregistering frees the client's share.
        t.alice.unregister(first)
        t.alice.register(t.mapper, t.uuid, 512)
        t.bob.unregister(held)
        t.bob.register(t.mapper, t.uuid, 1024)
        assert (t.alice.listed(), t.bob.listed()) == (2, 1)


def test_a_failed_mapping_does_not_use_up_the_owners_share() -> None:
    mapper = HostMapper()
    limits = MemoryLimits(max_regions_per_owner=1, max_bytes_per_owner=4096)
    table = RegionTable(
        device=torch.device("cpu"), device_uuid="GPU-test", mapper=mapper, limits=limits
    )
    with pytest.raises(IpcOpenFailed):
        table.register(bytes(64), "GPU-test", 4096, "a", owner="ip:10.0.0.1")
    token, _ = table.register(
        mapper.export(torch.zeros(4096, dtype=torch.uint8)),
        "GPU-test",
        4096,
        "a",
        owner="ip:10.0.0.1",
    )
    with pytest.raises(MemoryLimitExceeded, match="max_regions_per_client is 1"):
        table.register(
            mapper.export(torch.zeros(8, dtype=torch.uint8)),
            "GPU-test",
            8,
            "a",
            owner="ip:10.0.0.1",
        )
    table.register(
        mapper.export(torch.zeros(8, dtype=torch.uint8)), "GPU-test", 8, "a", owner="ip:10.0.0.2"
    )
    # The in-process owner "" is an owner like any other.
    with pytest.raises(MemoryTokenNotFound):
        table.leases().resolve("build_tree.draft_logits", token, 0, torch.uint8, (8,))
    table.close()
    assert mapper.mapped == 0
