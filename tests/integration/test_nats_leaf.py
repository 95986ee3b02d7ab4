"""Several hosts on NATS: a GPU host's nats-server as a leaf node of the control plane's
(`llmesh.deploy.credentials --nats-leafnodes` / `--nats-leaf-of`), on real nats-servers. A worker on the
leaf and the router on the hub exchange heartbeats and requests with their own users and
permissions; a leaf with a wrong password is refused; with TLS on, the leaf link uses it too."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import nats
import pytest

from llmesh.deploy.credentials import LEAF_USER, load_or_create, main, set_nats_tls
from llmesh.deploy.launcher import Child, free_port, nats_server_binary, wait_for_port
from llmesh.wire.secrets import MeshSecrets, nats_tls

pytestmark = pytest.mark.timeout(60)


def start_from_credentials(directory: Path, *args: str) -> tuple[Child, str]:
    """nats-server from the config `python -m llmesh.deploy.credentials DIR --nats-listen ...` writes (as compose
    runs it)."""
    port = free_port()
    assert main([str(directory), "--nats-listen", f"127.0.0.1:{port}", *args]) == 0
    child = Child(
        directory.name,
        [nats_server_binary(), "-c", str(directory / "nats.conf")],
        log_path=directory.parent / f"{directory.name}.log",
    )
    wait_for_port(port, 10, child.proc)
    return child, f"nats://127.0.0.1:{port}"


async def connect(secrets: MeshSecrets, url: str, user: str):
    servers, tls = nats_tls(secrets.nats_url(url, user))
    return await nats.connect(
        servers=servers,
        tls=tls,
        tls_handshake_first=tls is not None,
        inbox_prefix=f"_INBOX.{user}".encode(),
        allow_reconnect=False,
    )


async def crossing(hub_secrets: MeshSecrets, hub: str, leaf_secrets: MeshSecrets, leaf: str, within_s: float) -> bool:
    """Whether a worker's heartbeat on the leaf reaches the router on the hub, and the router's request
    reaches the worker and its reply comes back."""
    router, worker = await connect(hub_secrets, hub, "router"), await connect(leaf_secrets, leaf, "worker")
    try:
        heard = asyncio.get_running_loop().create_future()

        async def hear(msg):
            if not heard.done():
                heard.set_result(msg.data)

        await router.subscribe("mesh.heartbeat", cb=hear)

        async def answer(msg):
            await msg.respond(b"prefilled " + msg.data)

        await worker.subscribe("mesh.prefill.gpu-1", cb=answer)
        deadline = asyncio.get_running_loop().time() + within_s
        while not heard.done():  # the leaf link comes up a moment after both servers
            if asyncio.get_running_loop().time() > deadline:
                return False
            await worker.publish("mesh.heartbeat", b"gpu-1")
            await asyncio.sleep(0.2)
        reply = await router.request("mesh.prefill.gpu-1", b"hello", timeout=5)
        return heard.result() == b"gpu-1" and reply.data == b"prefilled hello"
    finally:
        await router.close()
        await worker.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_gpu_hosts_services_reach_the_control_plane_through_its_leaf_node(tmp_path, tls):
    control = tmp_path / "control"
    hub_secrets = load_or_create(control)
    set_nats_tls(control, tls)
    leaf_port = free_port()
    hub, hub_url = start_from_credentials(control, "--nats-leafnodes", f"127.0.0.1:{leaf_port}")
    shutil.copytree(control, tmp_path / "gpu-host")  # as an operator copies the set to each GPU host
    try:
        leaf, leaf_url = start_from_credentials(tmp_path / "gpu-host", "--nats-leaf-of", f"127.0.0.1:{leaf_port}")
        try:
            leaf_secrets = MeshSecrets.load(tmp_path / "gpu-host")
            assert asyncio.run(crossing(MeshSecrets.load(control), hub_url, leaf_secrets, leaf_url, 10))
        finally:
            leaf.stop()
        log = (tmp_path / "gpu-host.log").read_text()
        assert hub_secrets.nats_passwords[LEAF_USER] not in (control / "nats.conf").read_text()  # a hash there
        assert ("TLS" in log) == tls, log
    finally:
        hub.stop()


def test_a_leaf_with_a_wrong_password_is_refused(tmp_path):
    control = tmp_path / "control"
    load_or_create(control)
    leaf_port = free_port()
    hub, hub_url = start_from_credentials(control, "--nats-leafnodes", f"127.0.0.1:{leaf_port}")
    stranger = load_or_create(tmp_path / "stranger")  # its own users, and leaf password
    try:
        leaf, leaf_url = start_from_credentials(tmp_path / "stranger", "--nats-leaf-of", f"127.0.0.1:{leaf_port}")
        try:
            assert not asyncio.run(crossing(MeshSecrets.load(control), hub_url, stranger, leaf_url, 3))
        finally:
            leaf.stop()
        assert "leafnode connection closed: authentication failure" in (tmp_path / "control.log").read_text().lower()
    finally:
        hub.stop()
