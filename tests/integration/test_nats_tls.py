"""NATS over TLS (`llmesh.deploy.credentials --tls`, `MESH_NATS_TLS`) on a real nats-server: a service whose secrets
hold the mesh's CA connects and does its part; a plaintext client, a client that trusts another CA and a
client without a valid password are refused; a TLS client never shows its password to a server that offers no
TLS; services reconnect over TLS when nats-server restarts (as `make run` restarts it)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from pathlib import Path
from urllib.parse import urlsplit

import nats
import nats.errors
import pytest

from llmesh.deploy.credentials import load_or_create, nats_authorization, nats_tls_block, set_nats_tls
from llmesh.deploy.launcher import free_port, start_nats
from llmesh.wire.bus import Bus
from llmesh.wire.config import WorkerSettings
from llmesh.wire.errors import ServiceUnavailable, Timeout
from llmesh.wire.messages import KvDiscover, Subjects
from llmesh.wire.secrets import MeshSecrets, nats_tls, trusting_nats_ca, with_userinfo
from llmesh_router.settings import RouterSettings

pytestmark = pytest.mark.timeout(60)


def tls_secrets(directory: Path) -> MeshSecrets:
    secrets = load_or_create(directory)
    assert set_nats_tls(directory, True)
    return secrets


def start_tls_nats(work: Path, directory: Path, port: int | None = None):
    return start_nats(
        work,
        port,
        authorization=nats_authorization(MeshSecrets.load(directory)),
        tls=nats_tls_block(directory),
        log_path=work / f"nats-{port}.log",
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A nats-server as `make run --nats-tls` starts it, with the secrets it was started from."""
    work = tmp_path_factory.mktemp("tls")
    secrets = tls_secrets(work / "secrets")
    child, url = start_tls_nats(work, work / "secrets")
    try:
        yield secrets, url, work / "secrets"
    finally:
        child.stop()


def service_url(settings: type[WorkerSettings | RouterSettings], url: str, directory: Path, monkeypatch) -> str:
    """The NATS URL a service resolves from `make run`'s environment (plain URL, secrets directory)."""
    monkeypatch.setenv("MESH_NATS_URL", url)
    monkeypatch.setenv("MESH_SECRETS_DIR", str(directory))
    return settings().nats_url


async def refusal(url: str, context: ssl.SSLContext | None = None, **options) -> str:
    """Why one connection to `url`, with Bus.connect's TLS options (or `context`), fails; no retries."""
    servers, tls = nats_tls(url)
    tls = context or tls
    with pytest.raises((nats.errors.Error, OSError, asyncio.TimeoutError)) as refused:
        nc = await nats.connect(
            servers, tls=tls, tls_handshake_first=tls is not None, allow_reconnect=False, connect_timeout=2, **options
        )
        await nc.close()
    return repr(refused.value)


async def test_a_service_trusting_the_ca_connects_over_tls_and_does_its_part(mesh, monkeypatch):
    secrets, url, directory = mesh
    router_url = service_url(RouterSettings, url, directory, monkeypatch)
    worker_url = service_url(WorkerSettings, url, directory, monkeypatch)
    assert urlsplit(router_url).scheme == "tls" and secrets.nats_passwords["router"] in router_url
    router, worker = await Bus.connect(router_url, "router"), await Bus.connect(worker_url, "decode-worker")
    try:

        async def echo(msg: KvDiscover, blob: memoryview):
            return msg

        async def stream(msg: KvDiscover, blob: memoryview):
            for _ in range(3):
                yield msg

        await worker.serve(Subjects.worker("decode", "w1"), echo)
        await worker.serve(Subjects.worker("decode", "w2"), stream)
        reply, _ = await router.request(Subjects.worker("decode", "w1"), KvDiscover(), KvDiscover, timeout=5)
        assert isinstance(reply, KvDiscover)
        got = [
            r
            async for r, _ in await router.stream(
                Subjects.worker("decode", "w2"), KvDiscover(), deadline=time.time() + 10
            )
        ]
        assert len(got) == 3
    finally:
        await router.close()
        await worker.close()


async def test_a_plaintext_client_is_refused_and_the_server_says_nothing_in_the_clear(mesh):
    secrets, url, _ = mesh
    plain = with_userinfo(url, "router", secrets.nats_passwords["router"])  # the right password, without TLS
    with pytest.raises(ServiceUnavailable):
        await Bus.connect(plain, "plaintext", connect_timeout=1.5)
    assert "TimeoutError" in await refusal(plain)  # never an INFO to answer
    port = urlsplit(url).port
    with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
        heard = b""
        try:
            heard += raw.recv(4096)  # a server without TLS greets with INFO at once
            raw.sendall(b"CONNECT {}\r\nPING\r\n")
            while chunk := raw.recv(4096):
                heard += chunk
        except (TimeoutError, ConnectionError):
            pass
    assert b"INFO" not in heard and b"PONG" not in heard, heard


async def test_a_client_that_trusts_another_ca_is_refused(mesh, tmp_path):
    secrets, url, _ = mesh
    tls_secrets(tmp_path / "other")  # another deployment's CA
    elsewhere = trusting_nats_ca(secrets.nats_url(url, "router"), tmp_path / "other")
    assert "CERTIFICATE_VERIFY_FAILED" in await refusal(elsewhere)
    with pytest.raises(ServiceUnavailable):  # (it retries until its time is up)
        await Bus.connect(elsewhere, "elsewhere", connect_timeout=1.5)
    # nor does the system's trust store vouch for it
    assert "CERTIFICATE_VERIFY_FAILED" in await refusal(secrets.nats_url(url, "router"), ssl.create_default_context())


async def test_a_client_checks_the_servers_name_against_its_certificate(mesh):
    secrets, url, _ = mesh
    ours = secrets.nats_url(url, "router")  # over TLS: the secrets hold the CA
    assert urlsplit(ours).scheme == "tls"
    assert "mismatch" in await refusal(ours, tls_hostname="elsewhere.example")


async def test_a_client_over_tls_without_a_valid_password_is_refused(mesh):
    secrets, url, directory = mesh
    for attempt in (
        trusting_nats_ca(url, directory),
        secrets.nats_url(url, "router").replace(secrets.nats_passwords["router"], "wrong"),
    ):
        assert "Authorization Violation" in await refusal(attempt)
        with pytest.raises(ServiceUnavailable):
            await Bus.connect(attempt, "intruder", connect_timeout=1.5)


async def test_a_tls_client_never_shows_its_password_to_a_server_without_tls(mesh):
    """Someone in between (or a server set up without TLS) greets as a plaintext nats-server would: a client
    that reads that INFO before any TLS answers with CONNECT and its password."""
    secrets, _, _ = mesh
    received = bytearray()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"x","version":"2.10.0","auth_required":true,"max_payload":1048576}\r\n')
        await writer.drain()
        while data := await reader.read(4096):
            received.extend(data)
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        url = secrets.nats_url(f"nats://127.0.0.1:{port}", "router")
        with pytest.raises(ServiceUnavailable):
            await Bus.connect(url, "fooled", connect_timeout=1.5)
    finally:
        server.close()
    assert received and received[0] == 0x16, bytes(received[:16])  # a TLS handshake record, first
    assert secrets.nats_passwords["router"].encode() not in received and b"CONNECT" not in received


async def test_services_reconnect_over_tls_when_nats_server_restarts(mesh, tmp_path, monkeypatch):
    _, _, directory = mesh
    port = free_port()
    child, url = start_tls_nats(tmp_path, directory, port)
    router = worker = None
    try:
        router = await Bus.connect(service_url(RouterSettings, url, directory, monkeypatch), "router")
        worker = await Bus.connect(service_url(WorkerSettings, url, directory, monkeypatch), "decode-worker")
        reconnected = asyncio.Event()
        router.reconnected.append(reconnected.set)

        async def echo(msg: KvDiscover, blob: memoryview):
            return msg

        await worker.serve(Subjects.worker("decode", "w1"), echo)
        child.kill()
        child.stop()
        child, _ = start_tls_nats(tmp_path, directory, port)
        await asyncio.wait_for(reconnected.wait(), 15)
        give_up = time.monotonic() + 10
        while True:  # until the worker, reconnecting on its own, has its subscription back
            try:
                reply, _ = await router.request(Subjects.worker("decode", "w1"), KvDiscover(), KvDiscover, timeout=1)
                break
            except (ServiceUnavailable, Timeout):
                if time.monotonic() > give_up:
                    raise
                await asyncio.sleep(0.2)
        assert isinstance(reply, KvDiscover)
    finally:
        for bus in (router, worker):
            if bus is not None:
                await bus.close()
        child.stop()
