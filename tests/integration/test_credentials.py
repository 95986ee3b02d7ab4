"""The mesh's doors with its generated credentials, on a real nats-server and redis-server: each tried
without and with wrong credentials (refused, logged, nothing changed), and each service user only
where its part of the protocol needs it (llmesh.deploy.credentials)."""

from __future__ import annotations

import asyncio
import time

import nats
import nats.errors
import pytest
import redis

from llmesh.deploy.credentials import EVERYTHING, load_or_create, nats_authorization
from llmesh.deploy.launcher import start_nats, start_redis
from llmesh.wire.bus import Bus
from llmesh.wire.config import WorkerSettings
from llmesh.wire.errors import ServiceUnavailable
from llmesh.wire.messages import KvDiscover, Subjects
from llmesh.wire.secrets import MeshSecrets, inbox_prefix, operator_nats_url, redacted
from llmesh_kvstore.settings import KvStoreSettings
from llmesh_router.settings import RouterSettings

pytestmark = pytest.mark.timeout(60)
HARNESS = {"harness": EVERYTHING}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A nats-server and a redis-server with a generated set of credentials (and a harness user that
    sees everything, to observe what gets through)."""
    work = tmp_path_factory.mktemp("secured")
    secrets = load_or_create(work / "secrets", extra_users=HARNESS)
    nats_child, url = start_nats(work, authorization=nats_authorization(secrets), log_path=work / "nats.log")
    redis_child, redis_url = start_redis(password=secrets.redis_password, log_path=work / "redis.log")
    try:
        yield secrets, url, redis_url, work
    finally:
        nats_child.stop()
        redis_child.stop()


class Observed:
    """What a user's connection was refused (nats-py's error callback) and what reached the harness."""

    def __init__(self):
        self.errors: list[str] = []
        self.delivered: list[str] = []


async def until(condition, timeout: float = 5.0) -> bool:
    give_up = time.monotonic() + timeout
    while not condition() and time.monotonic() < give_up:
        await asyncio.sleep(0.02)
    return condition()


async def connect(url: str, user: str | None, observed: Observed) -> nats.NATS:
    async def on_error(exc):
        observed.errors.append(str(exc))

    return await nats.connect(
        url,
        inbox_prefix=inbox_prefix(user) if user else "_INBOX",
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=2,
    )


async def harness(secrets: MeshSecrets, url: str, observed: Observed) -> nats.NATS:
    nc = await connect(secrets.nats_url(url, "harness"), "harness", observed)

    async def on_msg(msg):
        observed.delivered.append(msg.subject)

    await nc.subscribe(">", cb=on_msg)
    await nc.flush()
    return nc


async def test_no_or_wrong_nats_credentials_cannot_connect(secured):
    secrets, url, _, work = secured
    for attempt in (
        url,
        secrets.nats_url(url, "router").replace(secrets.nats_passwords["router"], "wrong"),
        secrets.nats_url(url, "router").replace("router:", "nobody:"),
    ):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await connect(attempt, None, Observed())
        with pytest.raises(ServiceUnavailable) as refused:  # as services see it, without the password
            await Bus.connect(attempt, "intruder", connect_timeout=1)
        assert secrets.nats_passwords["router"] not in refused.value.message
    await asyncio.sleep(0.2)
    assert (work / "nats.log").read_text().count("authentication error") >= 6


# (user, subject, may publish there); "worker" is both prefill and decode workers
PUBLISH = [
    ("router", "mesh.prefill.w1", True),
    ("router", "mesh.decode.w1", True),
    ("router", "mesh.abort.w1", True),
    ("router", "mesh.migrate.w1", False),
    ("router", "mesh.drain.w1", False),
    ("router", "mesh.placement", False),
    ("router", "mesh.kv.0.token", False),
    ("router", "mesh.kv.shards", False),
    ("router", "mesh.heartbeat", False),
    ("placement", "mesh.migrate.w1", True),
    ("placement", "mesh.drain.w1", True),
    ("placement", "mesh.role.w1", True),
    ("placement", "mesh.decode.w1", False),
    ("placement", "mesh.prefill.w1", False),
    ("worker", "mesh.heartbeat", True),
    ("worker", "mesh.migrate_in.w2", True),
    ("worker", "mesh.kv.discover", True),
    ("worker", "mesh.kv.0.token", True),
    ("worker", "mesh.length.remaining", True),
    ("worker", "mesh.decode.w2", False),
    ("worker", "mesh.generate.w2", False),
    ("worker", "mesh.migrate.w2", False),
    ("worker", "mesh.kv.shards", False),
    ("worker", "mesh.placement", False),
    ("kv-store", "mesh.kv.shards", True),
    ("kv-store", "mesh.decode.w1", False),
    ("kv-store", "mesh.heartbeat", False),
    ("length-predictor", "mesh.length.head", True),
    ("length-predictor", "mesh.decode.w1", False),
    ("router", "mesh.length.remaining", False),
    ("admin", "mesh.placement", True),
    ("admin", "mesh.length.refit", True),
    ("admin", "mesh.migrate.w1", False),
    ("admin", "mesh.decode.w1", False),
    ("admin", "mesh.kv.0.token", False),
]


async def test_each_service_publishes_only_where_its_part_needs(secured):
    secrets, url, _, _ = secured
    seen = Observed()
    watcher = await harness(secrets, url, seen)
    try:
        for user in {user for user, _, _ in PUBLISH}:
            refused = Observed()
            nc = await connect(secrets.nats_url(url, user), user, refused)
            cases = [(subject, allowed) for u, subject, allowed in PUBLISH if u == user]
            for subject, _ in cases:
                await nc.publish(subject, f"from {user}".encode())
            await nc.flush()
            refusals = sum(not allowed for _, allowed in cases)
            await until(lambda: len(refused.errors) >= refusals and len(seen.delivered) >= len(cases) - refusals)
            await asyncio.sleep(0.1)  # and nothing more
            for subject, allowed in cases:
                assert (subject in seen.delivered) == allowed, (user, subject, seen.delivered)
                assert any(subject in e for e in refused.errors) != allowed, (user, subject, refused.errors)
            seen.delivered.clear()
            await nc.close()
    finally:
        await watcher.close()


async def test_a_user_reads_neither_other_users_replies_nor_subjects_outside_its_part(secured):
    secrets, url, _, _ = secured
    for user, subject in [
        ("router", "_INBOX.worker.>"),
        ("router", "mesh.kv.shards"),
        ("router", "mesh.decode.w1"),
        ("worker", "mesh.heartbeat"),
        ("worker", "mesh.placement"),
        ("admin", "mesh.kv.shards"),
        ("placement", "mesh.length.predict"),
        ("kv-store", "mesh.decode.w1"),
    ]:
        refused = Observed()
        nc = await connect(secrets.nats_url(url, user), user, refused)
        await nc.subscribe(subject)
        await nc.flush()
        assert await until(
            lambda: any("permissions violation for subscription" in e.lower() for e in refused.errors)
        ), (user, subject)
        await nc.close()


async def test_request_and_reply_work_across_users_through_their_own_inboxes(secured):
    """The router asks a worker and gets the stream back; a worker asks a shard: each reply comes to
    the asker's own `_INBOX.<user>` (llmesh.wire.bus sets it from the URL's user)."""
    secrets, url, _, _ = secured
    router = await Bus.connect(secrets.nats_url(url, RouterSettings.NATS_USER), "router")
    worker = await Bus.connect(secrets.nats_url(url, WorkerSettings.NATS_USER), "decode-worker")
    shard = await Bus.connect(secrets.nats_url(url, KvStoreSettings.NATS_USER), "kv-store")
    try:

        async def echo(msg: KvDiscover, blob: memoryview):
            return msg

        async def stream(msg: KvDiscover, blob: memoryview):
            for _ in range(3):
                yield msg

        await worker.serve(Subjects.worker("decode", "w1"), stream)
        await shard.serve(Subjects.kv("0", "token"), echo)
        got = [
            reply
            async for reply, _ in await router.stream(
                Subjects.worker("decode", "w1"), KvDiscover(), deadline=time.time() + 10
            )
        ]
        assert len(got) == 3
        reply, _ = await worker.request(Subjects.kv("0", "token"), KvDiscover(), KvDiscover, timeout=5)
        assert isinstance(reply, KvDiscover)
    finally:
        for bus in (router, worker, shard):
            await bus.close()


def test_redis_refuses_clients_without_its_password(secured):
    secrets, _, redis_url, _ = secured
    assert redis.Redis.from_url(redis_url).set("k", "v")
    for url in (
        redis_url.replace(secrets.redis_password, "wrong"),
        redis_url.replace(f":{secrets.redis_password}@", ""),
    ):
        client = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.AuthenticationError):
            client.set("k", "changed")
    assert redis.Redis.from_url(redis_url).get("k") == b"v"


def test_secrets_are_kept_private_and_operators_get_the_admin_user(secured, tmp_path):
    secrets, url, _, work = secured
    directory = work / "secrets"
    assert directory.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in directory.iterdir())
    assert secrets.api_key not in (directory / "api-keys").read_text()  # the router's file holds the digest
    assert load_or_create(directory).api_key == secrets.api_key  # kept, not remade
    assert "admin:" in operator_nats_url(url, directory) and operator_nats_url(url, tmp_path) == url
    assert secrets.nats_passwords["admin"] not in redacted(operator_nats_url(url, directory))
    assert not any(p in nats_authorization(secrets) for p in secrets.nats_passwords.values())  # bcrypt hashes
