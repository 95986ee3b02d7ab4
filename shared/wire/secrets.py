"""The mesh's secrets as services use them: the set's file (read, never written, here), NATS and Redis URLs
with a service's credentials, NATS's TLS trust, reply inboxes, API-key digests, and URLs without passwords
for logs. `llmesh.deploy.credentials` makes the set and nats-server's configuration from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, quote, urlencode, urlsplit, urlunsplit

API_KEYS_FILE = "api-keys"  # in a secrets directory: the digests the router accepts
ADMIN_KEYS_FILE = "admin-api-keys"  # the digests its admin endpoints accept (loading LoRA adapters)
NATS_CA = "nats-ca.pem"  # in a secrets directory: the CA's certificate (present: NATS uses TLS)

API_KEY_PREFIX = "sk-mesh-"
DIGEST_PREFIX = "sha256:"


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """How API keys are stored and compared (llmesh_router.auth)."""
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def inbox_prefix(user: str) -> str:
    return f"_INBOX.{user}"


@dataclass
class MeshSecrets:
    """A deployment's set of secrets, as `llmesh.deploy.credentials` wrote it into a directory."""

    nats_passwords: dict[str, str]
    redis_password: str
    api_key: str
    # user -> (may publish to, may subscribe to): nats-server's (llmesh.deploy.credentials.PERMISSIONS)
    permissions: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    admin_api_key: str = ""  # for the router's admin endpoints ("": a set made before they existed)
    directory: Path | None = None  # where the set lies (`load`, `write_secrets`), with NATS's CA if NATS uses TLS

    FILE = "secrets.json"

    @classmethod
    def load(cls, directory: Path) -> MeshSecrets:
        path = directory / cls.FILE
        try:
            raw = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(
                f"no mesh secrets at {path} ({exc.strerror}): "
                f"make them with `python -m llmesh.deploy.credentials {directory}`"
            ) from None
        return cls(
            raw["nats_passwords"],
            raw["redis_password"],
            raw["api_key"],
            {user: (pub, sub) for user, (pub, sub) in raw["permissions"].items()},
            raw.get("admin_api_key", ""),
            directory,
        )

    def nats_url(self, url: str, user: str) -> str:
        """`url` (one or several, comma-separated) with `user`'s credentials in each, over TLS trusting the
        deployment's CA if NATS uses TLS (`llmesh.deploy.credentials.set_nats_tls`)."""
        url = ",".join(with_userinfo(u, user, self.nats_passwords[user]) for u in url.split(","))
        return trusting_nats_ca(url, self.directory) if self.directory else url

    def redis_url(self, url: str) -> str:
        return with_userinfo(url, "", self.redis_password)


def with_userinfo(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def redacted(url: str) -> str:
    """`url` (or several, comma-separated) without passwords, for logs and errors."""
    out = []
    for one in url.split(","):
        parts = urlsplit(one)
        if parts.password is None:
            out.append(one)
            continue
        userinfo, _, host = parts.netloc.rpartition("@")
        out.append(urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}")))
    return ",".join(out)


def operator_nats_url(url: str, secrets_dir: Path | None = None) -> str:
    """For operators' commands: `url` with the `admin` user's credentials from `secrets_dir` (default:
    MESH_SECRETS_DIR, else `.mesh-secrets` where `make run` keeps them), unless `url` names a user or
    there are no secrets there (an open mesh), and over TLS trusting the CA there, if NATS uses TLS."""
    directory = secrets_dir or Path(os.environ.get("MESH_SECRETS_DIR") or ".mesh-secrets")
    if not (directory / MeshSecrets.FILE).exists():
        return url
    return trusting_nats_ca(url, directory) if url_user(url) else MeshSecrets.load(directory).nats_url(url, "admin")


def url_user(url: str) -> str | None:
    """The user named in the first of `url`'s servers, if any."""
    return urlsplit(url.split(",")[0]).username


def trusting_nats_ca(url: str, directory: Path) -> str:
    """`url` (one or several, comma-separated) over TLS, trusting only the CA in `directory` (`?ca=` on each
    server, which `Bus.connect` reads), if NATS uses TLS there; else `url` itself."""
    ca = directory / NATS_CA
    if not ca.exists():
        return url
    query = urlencode({"ca": str(ca.resolve())}, safe="/")
    return ",".join(urlunsplit(urlsplit(one)._replace(scheme="tls", query=query)) for one in url.split(","))


def nats_tls(url: str) -> tuple[list[str], ssl.SSLContext | None]:
    """`url`'s servers as nats-py takes them, and, if they name a CA (`trusting_nats_ca`), a TLS context that
    trusts it alone (not the system's CAs) and checks the server's name against its certificate."""
    servers, cas = [], set()
    for one in url.split(","):
        parts = urlsplit(one)
        cas.update(parse_qs(parts.query).get("ca", []))
        servers.append(urlunsplit(parts._replace(query="")))
    if not cas:
        return servers, None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for ca in sorted(cas):
        context.load_verify_locations(ca)
    return servers, context
