"""The mesh's secrets and who may do what on NATS, generated once per deployment.

Every service connects to NATS as its own user (user and password in its `MESH_NATS_URL`) and may
publish and subscribe only where its part of the protocol needs it:

- only the router publishes work to workers (prefill, decode, generate, abort);
- only the placement service commands migrations, drains and role changes;
- only workers (and the kv-store itself) reach `mesh.kv.>`, where data-plane tokens are handed out;
- each user reads replies only under its own inbox prefix (`_INBOX.<user>`, `Bus.connect` sets it).

`admin` is the operators' user (the placement CLI, predictor refits, kv-store stats). Redis has a
password, and the router's API keys are stored as digests (llmesh_router.auth); the operator's copy of
the generated key lies beside them. `python -m llmesh.credentials DIR` writes a set into DIR (mode 0700,
files 0600) or keeps the one already there; the launcher (`make run`) and compose do this themselves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

API_KEYS_FILE = "api-keys"  # in a secrets directory: the digests the router accepts
REPLIES = "_INBOX.>"  # responders answer wherever a request's reply subject points
WORKER_INBOXES = ["mesh.prefill.*", "mesh.decode.*", "mesh.generate.*", "mesh.abort.*", "mesh.migrate.*",
                  "mesh.migrate_in.*", "mesh.drain.*", "mesh.role.*", "mesh.kvctl.*"]

# user -> (may publish to, may subscribe to), besides its own inbox (subscribe) for every user
PERMISSIONS: dict[str, tuple[list[str], list[str]]] = {
    "router": (["mesh.prefill.*", "mesh.decode.*", "mesh.generate.*", "mesh.abort.*", "mesh.length.predict"],
               ["mesh.heartbeat"]),
    "worker": (["mesh.heartbeat", "mesh.length.observed.*", "mesh.migrate_in.*", "mesh.kvctl.*", "mesh.kv.discover",
                "mesh.kv.*.token", REPLIES], WORKER_INBOXES + ["mesh.kv.shards"]),
    "kv-store": (["mesh.kv.shards", REPLIES], ["mesh.kv.>"]),
    "length-predictor": (["mesh.length.head", REPLIES], ["mesh.length.>"]),
    "placement": (["mesh.migrate.*", "mesh.role.*", "mesh.drain.*", "mesh.placement.events", REPLIES],
                  ["mesh.heartbeat", "mesh.placement"]),
    "admin": (["mesh.placement", "mesh.length.refit", "mesh.length.stats.*", "mesh.kv.*.stats"],
              ["mesh.placement.events", "mesh.heartbeat"]),
}
# (each service's settings class names its user: `NATS_USER`; both worker roles share one, as a worker
# may switch roles)
EVERYTHING = ([">"], [">"])  # for a test harness that plays every part; never in a deployment


API_KEY_PREFIX = "sk-mesh-"
DIGEST_PREFIX = "sha256:"


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """How API keys are stored and compared (llmesh_router.auth)."""
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def inbox_prefix(user: str) -> str:
    return f"_INBOX.{user}"


def _secret() -> str:
    return secrets.token_urlsafe(24)


@dataclass
class MeshSecrets:
    nats_passwords: dict[str, str]
    redis_password: str
    api_key: str
    permissions: dict[str, tuple[list[str], list[str]]] = field(default_factory=lambda: dict(PERMISSIONS))

    FILE = "secrets.json"

    @classmethod
    def generate(cls, extra_users: dict[str, tuple[list[str], list[str]]] | None = None) -> MeshSecrets:
        permissions = PERMISSIONS | (extra_users or {})
        return cls({user: _secret() for user in permissions}, _secret(), new_api_key(), permissions)

    @classmethod
    def load(cls, directory: Path) -> MeshSecrets:
        path = directory / cls.FILE
        try:
            raw = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"no mesh secrets at {path} ({exc.strerror}): make them with "
                             f"`python -m llmesh.credentials {directory}`") from None
        return cls(raw["nats_passwords"], raw["redis_password"], raw["api_key"],
                   {user: (pub, sub) for user, (pub, sub) in raw["permissions"].items()})

    @classmethod
    def load_or_create(cls, directory: Path,
                       extra_users: dict[str, tuple[list[str], list[str]]] | None = None) -> MeshSecrets:
        """The set in `directory`, or a new one written there (with the files services read)."""
        if (directory / cls.FILE).exists():
            return cls.load(directory)
        made = cls.generate(extra_users)
        made.write(directory)
        return made

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        directory.chmod(0o700)
        files = {self.FILE: json.dumps({"nats_passwords": self.nats_passwords, "redis_password": self.redis_password,
                                        "api_key": self.api_key, "permissions": self.permissions}, indent=1),
                 API_KEYS_FILE: f"{key_digest(self.api_key)} operator\n",  # what the router reads: the digest only
                 "api-key": self.api_key + "\n",  # the operator's copy, for clients
                 "redis-password": self.redis_password}  # for a redis-server started apart (compose)
        for name, text in files.items():
            target = directory / name
            target.touch(mode=0o600)
            target.chmod(0o600)
            target.write_text(text)

    def nats_authorization(self) -> str:
        """nats-server's `authorization` block: each user with its password's bcrypt hash and permissions."""
        users = []
        for user, (publish, subscribe) in self.permissions.items():
            subscribe = subscribe + [f"{inbox_prefix(user)}.>"]
            users.append("    {user: %s, password: %s, permissions: {publish: {allow: %s}, subscribe: {allow: %s}}}"
                         % (json.dumps(user), json.dumps(_bcrypt(self.nats_passwords[user])), json.dumps(publish),
                            json.dumps(subscribe)))
        return "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"

    def nats_url(self, url: str, user: str) -> str:
        """`url` (one or several, comma-separated) with `user`'s credentials in each."""
        return ",".join(with_userinfo(u, user, self.nats_passwords[user]) for u in url.split(","))

    def redis_url(self, url: str) -> str:
        return with_userinfo(url, "", self.redis_password)


def _bcrypt(password: str) -> str:
    """nats-server takes bcrypt hashes marked `$2a$` (the `$2b$` that the bcrypt package writes is the same
    algorithm, with a fix for passwords over 255 bytes). The cost is bcrypt's least: the passwords are
    192 random bits, beyond any guessing whatever the cost, while nats-server checks one at every
    connection, on the goroutines that route messages: at cost 10 (~60 ms of CPU each), the e2e tests'
    hundreds of connections on a loaded 2-core machine held a connection's read loop for up to 15 s
    and every heartbeat for 3 s."""
    import bcrypt

    return "$2a$" + bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode().removeprefix("$2b$")


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
    there are no secrets there (an open mesh)."""
    directory = secrets_dir or Path(os.environ.get("MESH_SECRETS_DIR") or ".mesh-secrets")
    if url_user(url) or not (directory / MeshSecrets.FILE).exists():
        return url
    return MeshSecrets.load(directory).nats_url(url, "admin")


def url_user(url: str) -> str | None:
    """The user named in the first of `url`'s servers, if any."""
    return urlsplit(url.split(",")[0]).username


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmesh.credentials", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the secrets go (kept if already there)")
    parser.add_argument("--nats-listen", metavar="HOST:PORT",
                        help="also write DIRECTORY/nats.conf, a whole nats-server config listening there")
    args = parser.parse_args(argv)
    existed = (args.directory / MeshSecrets.FILE).exists()
    secrets = MeshSecrets.load_or_create(args.directory)
    if args.nats_listen:
        from llmesh.launcher import nats_server_config

        conf = args.directory / "nats.conf"
        conf.touch(mode=0o600)
        conf.write_text(nats_server_config(args.nats_listen, authorization=secrets.nats_authorization()))
    print(f"{'kept' if existed else 'wrote'} the mesh's secrets in {args.directory}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
