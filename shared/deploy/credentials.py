"""The mesh's secrets and who may do what on NATS, generated once per deployment.

Every service connects to NATS as its own user (user and password in its `MESH_NATS_URL`) and may
publish and subscribe only where its part of the protocol needs it:

- only the router publishes work to workers (prefill, decode, generate, tokenizer, abort);
- only the placement service commands migrations, drains, role changes and host agents' activations;
- only workers (and the kv-store itself) reach `mesh.kv.>`, where data-plane tokens are handed out;
- each user reads replies only under its own inbox prefix (`_INBOX.<user>`, `Bus.connect` sets it).

`admin` is the operators' user (the placement CLI, predictor refits, kv-store stats). Redis has a
password, and the router's API keys are stored as digests (llmesh_router.auth); the operator's copy of
the generated key lies beside them. `python -m llmesh.deploy.credentials DIR` writes a set into DIR (mode 0700,
files 0600) or keeps the one already there; the launcher (`make run`) and compose do this themselves.

Several hosts: the control plane's nats-server accepts leaf nodes (`--nats-leafnodes`), and each GPU host
runs its own nats-server as a leaf node of it (`--nats-leaf-of`), with the same users, for its services to
reach locally; the leaf connects with the set's `leaf` password (not a client user), over TLS when the set
has TLS on.

NATS over TLS is one switch of the set (`--tls`, `MESH_NATS_TLS`): a private CA and nats-server's certificate
lie beside the passwords, and a service whose secrets hold that CA reaches NATS over TLS trusting it alone, so
the passwords and everything on the bus cross the network encrypted, to the real server only.

What services need of the set (reading it, their URLs, TLS trust, API-key digests) is `llmesh.wire.secrets`;
this module makes it and nats-server's configuration from it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import sys
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from llmesh.wire.secrets import (
    ADMIN_KEYS_FILE,
    API_KEYS_FILE,
    NATS_CA,
    MeshSecrets,
    inbox_prefix,
    key_digest,
    new_api_key,
    with_userinfo,
)

REPLIES = "_INBOX.>"  # responders answer wherever a request's reply subject points
WORKER_INBOXES = [
    "mesh.prefill.*",
    "mesh.decode.*",
    "mesh.generate.*",
    "mesh.tokenizer.*",
    "mesh.abort.*",
    "mesh.migrate.*",
    "mesh.migrate_in.*",
    "mesh.drain.*",
    "mesh.role.*",
    "mesh.kvctl.*",
    "mesh.lora.*",
]

# user -> (may publish to, may subscribe to), besides its own inbox (subscribe) for every user
PERMISSIONS: dict[str, tuple[list[str], list[str]]] = {
    "router": (
        [
            "mesh.prefill.*",
            "mesh.decode.*",
            "mesh.generate.*",
            "mesh.tokenizer.*",
            "mesh.abort.*",
            "mesh.lora.*",
            "mesh.length.predict",
            "mesh.traffic",
        ],
        ["mesh.heartbeat"],
    ),
    "worker": (
        [
            "mesh.heartbeat",
            "mesh.length.observed.*",
            "mesh.length.remaining",
            "mesh.migrate_in.*",
            "mesh.kvctl.*",
            "mesh.kv.discover",
            "mesh.kv.*.token",
            REPLIES,
        ],
        WORKER_INBOXES + ["mesh.kv.shards"],
    ),
    "kv-store": (["mesh.kv.shards", REPLIES], ["mesh.kv.>"]),
    "length-predictor": (["mesh.length.head", REPLIES], ["mesh.length.>"]),
    "placement": (
        ["mesh.migrate.*", "mesh.role.*", "mesh.drain.*", "mesh.host.activate.*", "mesh.placement.events", REPLIES],
        ["mesh.heartbeat", "mesh.placement", "mesh.traffic", "mesh.host.heartbeat"],
    ),
    "host-agent": (["mesh.host.heartbeat", REPLIES], ["mesh.host.activate.*", "mesh.heartbeat"]),
    "admin": (
        ["mesh.placement", "mesh.length.refit", "mesh.length.stats.*", "mesh.kv.*.stats"],
        ["mesh.placement.events", "mesh.heartbeat"],
    ),
}
# (each service's settings class names its user: `NATS_USER`; both worker roles share one, as a worker
# may switch roles)
EVERYTHING = ([">"], [">"])  # for a test harness that plays every part; never in a deployment


LEAF_USER = "leaf"  # a GPU host's nats-server, connecting to the control plane's as a leaf node

# NATS over TLS: nats-server's certificate and key, beside the CA's certificate (NATS_CA: present, TLS is on)
NATS_CERT, NATS_KEY = "nats-server.pem", "nats-server-key.pem"
NATS_TLS_HOSTS = ("127.0.0.1", "localhost", "nats")  # where `make run` and compose's services reach nats-server
NATS_TLS_VALIDITY = timedelta(days=3650)  # no rotation to keep up with: `--no-tls` then `--tls` makes a new set


def _secret() -> str:
    return secrets.token_urlsafe(24)


def write_private(path: Path, text: str | bytes) -> None:
    """Write `path` readable by its owner alone (0600, also when it was there before)."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(text.encode() if isinstance(text, str) else text)


def new_secrets(extra_users: dict[str, tuple[list[str], list[str]]] | None = None) -> MeshSecrets:
    """A new set: a password for each NATS user (PERMISSIONS and `extra_users`) and the leaf, Redis's, an API key."""
    permissions = PERMISSIONS | (extra_users or {})
    passwords = {user: _secret() for user in [*permissions, LEAF_USER]}
    return MeshSecrets(passwords, _secret(), new_api_key(), permissions, admin_api_key=new_api_key())


def load_or_create(directory: Path, extra_users: dict[str, tuple[list[str], list[str]]] | None = None) -> MeshSecrets:
    """The set in `directory` (brought up to date: `upgrade`), or a new one written there (with the files
    services read)."""
    if (directory / MeshSecrets.FILE).exists():
        stored = MeshSecrets.load(directory)
        upgrade(stored)
        return stored
    made = new_secrets(extra_users)
    write_secrets(made, directory)
    return made


def write_secrets(mesh_secrets: MeshSecrets, directory: Path) -> None:
    mesh_secrets.directory = directory
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    files = {
        MeshSecrets.FILE: json.dumps(
            {
                "nats_passwords": mesh_secrets.nats_passwords,
                "redis_password": mesh_secrets.redis_password,
                "api_key": mesh_secrets.api_key,
                "permissions": mesh_secrets.permissions,
                "admin_api_key": mesh_secrets.admin_api_key,
            },
            indent=1,
        ),
        API_KEYS_FILE: f"{key_digest(mesh_secrets.api_key)} operator\n",  # what the router reads: the digest only
        "api-key": mesh_secrets.api_key + "\n",  # the operator's copy, for clients
        ADMIN_KEYS_FILE: f"{key_digest(mesh_secrets.admin_api_key)} admin\n",
        "admin-api-key": mesh_secrets.admin_api_key + "\n",  # the operator's, for the admin endpoints
        "redis-password": mesh_secrets.redis_password,
    }  # for a redis-server started apart (compose)
    for name, text in files.items():
        write_private(directory / name, text)


def nats_authorization(mesh_secrets: MeshSecrets) -> str:
    """nats-server's `authorization` block: each user with its password's bcrypt hash and permissions."""
    users = []
    for user, (publish, subscribe) in mesh_secrets.permissions.items():
        subscribe = subscribe + [f"{inbox_prefix(user)}.>"]
        password = json.dumps(_bcrypt(mesh_secrets.nats_passwords[user]))
        allowed = f"publish: {{allow: {json.dumps(publish)}}}, subscribe: {{allow: {json.dumps(subscribe)}}}"
        users.append(f"    {{user: {json.dumps(user)}, password: {password}, permissions: {{{allowed}}}}}")
    return "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"


def upgrade(mesh_secrets: MeshSecrets) -> bool:
    """Give a set made by an older version this version's users and their permissions (passwords of users
    it has are kept; users of its own, a test harness's, too), and write it; False if it had them."""
    changed = not mesh_secrets.admin_api_key
    if changed:
        mesh_secrets.admin_api_key = new_api_key()
    for user, allowed in PERMISSIONS.items():
        if user not in mesh_secrets.nats_passwords:
            mesh_secrets.nats_passwords[user] = _secret()
            changed = True
        if tuple(mesh_secrets.permissions.get(user, ())) != allowed:
            mesh_secrets.permissions[user] = allowed
            changed = True
    if changed and mesh_secrets.directory:
        write_secrets(mesh_secrets, mesh_secrets.directory)
    return changed


def add_leaf_password(mesh_secrets: MeshSecrets) -> bool:
    """Give a set made before leaf nodes existed its leaf password (and write it); False if it had one."""
    if LEAF_USER in mesh_secrets.nats_passwords:
        return False
    mesh_secrets.nats_passwords[LEAF_USER] = _secret()
    if mesh_secrets.directory:
        write_secrets(mesh_secrets, mesh_secrets.directory)
    return True


def nats_leafnodes(mesh_secrets: MeshSecrets, listen: str) -> str:
    """The control plane's `leafnodes` block: GPU hosts' servers connect at `listen` with the leaf
    password, over TLS when the set has it (the certificate must name the address they use: --tls-host)."""
    tls = nats_tls_block(mesh_secrets.directory, handshake_first=False) if mesh_secrets.directory else ""
    password = json.dumps(_bcrypt(mesh_secrets.nats_passwords[LEAF_USER]))
    return (
        f"leafnodes {{\n  listen: {json.dumps(listen)}\n"
        f"  authorization {{user: {json.dumps(LEAF_USER)}, password: {password}}}\n{_indent(tls)}}}\n"
    )


def nats_leaf_remote(mesh_secrets: MeshSecrets, hub: str) -> str:
    """A GPU host's `leafnodes` block: a leaf node of the control plane's server at `hub` (HOST:PORT)."""
    url = with_userinfo(f"nats://{hub}", LEAF_USER, mesh_secrets.nats_passwords[LEAF_USER])
    tls = ""
    if mesh_secrets.directory and (mesh_secrets.directory / NATS_CA).exists():
        tls = f"tls {{ca_file: {json.dumps(str((mesh_secrets.directory / NATS_CA).resolve()))}, timeout: 5}}\n"
    return f"leafnodes {{\n  remotes: [{{\n    url: {json.dumps(url)}\n{_indent(tls, 4)}  }}]\n}}\n"


def _bcrypt(password: str) -> str:
    """nats-server takes bcrypt hashes marked `$2a$` (the `$2b$` that the bcrypt package writes is the same
    algorithm, with a fix for passwords over 255 bytes). The cost is bcrypt's least: the passwords are
    192 random bits, beyond any guessing whatever the cost, while nats-server checks one at every
    connection, on the goroutines that route messages: at cost 10 (~60 ms of CPU each), the e2e tests'
    hundreds of connections on a loaded 2-core machine held a connection's read loop for up to 15 s
    and every heartbeat for 3 s."""
    import bcrypt

    return "$2a$" + bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode().removeprefix("$2b$")


def set_nats_tls(directory: Path, on: bool | None, hosts: Iterable[str] = ()) -> bool:
    """Turn NATS's TLS on for the deployment whose secrets are in `directory` (a private CA and a certificate
    for nats-server naming NATS_TLS_HOSTS and `hosts`, made unless those there name them all), off (their
    files removed), or leave it as it is (None: off for a new set). Returns whether it is on."""
    ca = directory / NATS_CA
    if on is None:
        on = ca.exists()
    if not on:
        for name in (NATS_CA, NATS_CERT, NATS_KEY):  # the CA first: it says that TLS is on
            (directory / name).unlink(missing_ok=True)
        return False
    wanted = {_host_name(host) for host in (*NATS_TLS_HOSTS, *hosts)}
    if not (ca.exists() and (directory / NATS_KEY).exists() and wanted <= _certificate_names(directory / NATS_CERT)):
        _make_nats_tls(directory, wanted)
    return True


def _host_name(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()


def _certificate_names(path: Path) -> set[str]:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except OSError:
        return set()
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(name.value) for name in names}


def _make_nats_tls(directory: Path, hosts: set[str]) -> None:
    """A new CA and nats-server's certificate for `hosts`. The CA's key signs that one certificate and is not
    kept: no service that reads the secrets can make a certificate the others trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.now(UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmesh NATS CA")])
    ca_id = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())

    def certificate(
        subject: x509.Name, key: ec.EllipticCurvePrivateKey, ca: bool, extensions: list[x509.ExtensionType]
    ) -> x509.Certificate:
        usage = dict.fromkeys(
            [
                "content_commitment",
                "key_encipherment",
                "data_encipherment",
                "key_agreement",
                "encipher_only",
                "decipher_only",
            ],
            False,
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + NATS_TLS_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
            .add_extension(
                x509.KeyUsage(digital_signature=not ca, key_cert_sign=ca, crl_sign=ca, **usage), critical=True
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_id), critical=False)
        )
        for extension in extensions:
            builder = builder.add_extension(extension, critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    def names(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    server = certificate(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats-server")]),
        server_key,
        False,
        [
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
            x509.SubjectAlternativeName([names(host) for host in sorted(hosts)]),
        ],
    )
    pem = serialization.Encoding.PEM
    write_private(
        directory / NATS_KEY,
        server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    write_private(directory / NATS_CERT, server.public_bytes(pem))
    write_private(directory / NATS_CA, certificate(ca_name, ca_key, True, []).public_bytes(pem))  # last: TLS is on


def _indent(block: str, spaces: int = 2) -> str:
    return "".join(" " * spaces + line + "\n" for line in block.splitlines())


def nats_tls_block(directory: Path, handshake_first: bool = True) -> str:
    """nats-server's `tls` block for the deployment whose secrets are in `directory` ("" without TLS). Clients
    must start with the TLS handshake, before the server's INFO: none ever sends its password in the clear, not
    even to a server (or someone in between) that offers no TLS; a plaintext client gets nothing. Users and
    passwords are checked as without TLS; clients show no certificate. A handshake may take 5 s (nats-server's
    default is 2): the mesh's hosts often run loaded."""
    if not (directory / NATS_CA).exists():
        return ""
    first = "  handshake_first: true\n" if handshake_first else ""
    cert, key = (json.dumps(str((directory / name).resolve())) for name in (NATS_CERT, NATS_KEY))
    return f"tls {{\n  cert_file: {cert}\n  key_file: {key}\n{first}  timeout: 5\n}}\n"


def env_switch(name: str) -> bool | None:
    """An on/off environment variable (1/0, true/false, yes/no, on/off); None when unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: set it to 1 or 0")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmesh.deploy.credentials", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the secrets go (kept if already there)")
    parser.add_argument(
        "--nats-listen",
        metavar="HOST:PORT",
        help="also write DIRECTORY/nats.conf, a whole nats-server config listening there",
    )
    parser.add_argument(
        "--nats-leafnodes",
        metavar="HOST:PORT",
        default="",
        help="with --nats-listen: also accept GPU hosts' nats-servers as leaf nodes there",
    )
    parser.add_argument(
        "--nats-leaf-of",
        metavar="HOST:PORT",
        default="",
        help="with --nats-listen: this host's nats-server is a leaf node of the control plane's, "
        "whose leaf-node port is HOST:PORT",
    )
    parser.add_argument(
        "--nats-monitor",
        metavar="HOST:PORT",
        default="",
        help="with --nats-listen: nats-server's monitoring endpoint (/healthz) there",
    )
    parser.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=env_switch("MESH_NATS_TLS"),
        help="NATS over TLS only: a private CA and nats-server's certificate in DIRECTORY, trusted by "
        "every service that reads it (--no-tls removes them); default: MESH_NATS_TLS, else as "
        "DIRECTORY has it (off for a new set)",
    )
    parser.add_argument(
        "--tls-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name or IP address by which clients reach nats-server, for its certificate "
        f"(besides {', '.join(NATS_TLS_HOSTS)}); repeatable",
    )
    args = parser.parse_args(argv)
    existed = (args.directory / MeshSecrets.FILE).exists()
    secrets = load_or_create(args.directory)
    tls = set_nats_tls(args.directory, args.tls, args.tls_host)
    if args.nats_leafnodes and args.nats_leaf_of:
        parser.error("a server either accepts leaf nodes (the control plane) or is one (a GPU host), not both")
    if args.nats_listen:
        from llmesh.deploy.launcher import nats_server_config

        if (args.nats_leafnodes or args.nats_leaf_of) and add_leaf_password(secrets):
            print("added a leaf-node password to the set: copy it to the GPU hosts again", file=sys.stderr)
        leafnodes = (
            nats_leafnodes(secrets, args.nats_leafnodes)
            if args.nats_leafnodes
            else nats_leaf_remote(secrets, args.nats_leaf_of)
            if args.nats_leaf_of
            else ""
        )
        write_private(
            args.directory / "nats.conf",
            nats_server_config(
                args.nats_listen,
                authorization=nats_authorization(secrets),
                tls=nats_tls_block(args.directory),
                monitor=args.nats_monitor,
                leafnodes=leafnodes,
            ),
        )
    print(
        f"{'kept' if existed else 'wrote'} the mesh's secrets in {args.directory} "
        f"(NATS {'over TLS' if tls else 'without TLS'})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
