"""Settings take each service's own credentials from a secrets directory (llmesh.deploy.credentials), and its NATS CA
where NATS uses TLS."""

from __future__ import annotations

import ssl
from urllib.parse import parse_qs, urlsplit

import pytest
from pydantic import ValidationError

from llmesh.deploy.credentials import (
    NATS_CERT,
    NATS_KEY,
    PERMISSIONS,
    env_switch,
    load_or_create,
    main,
    nats_tls_block,
    new_secrets,
    set_nats_tls,
    write_secrets,
)
from llmesh.wire.config import CommonSettings, WorkerSettings
from llmesh.wire.secrets import NATS_CA, MeshSecrets, nats_tls, operator_nats_url, redacted, with_userinfo
from llmesh_hostagent.settings import HostAgentSettings
from llmesh_kvstore.settings import KvStoreSettings
from llmesh_lengthpred.settings import LengthPredictorSettings
from llmesh_placement.settings import PlacementSettings
from llmesh_router.settings import RouterSettings


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("secrets") / "s"
    write_secrets(new_secrets(), directory)
    return directory


@pytest.mark.parametrize(
    "settings, user",
    [
        (RouterSettings, "router"),
        (WorkerSettings, "worker"),
        (KvStoreSettings, "kv-store"),
        (LengthPredictorSettings, "length-predictor"),
        (PlacementSettings, "placement"),
        (HostAgentSettings, "host-agent"),
        (CommonSettings, "admin"),
    ],
)
def test_each_service_connects_as_its_own_user(secrets_dir, settings, user, monkeypatch):
    monkeypatch.setenv("MESH_SECRETS_DIR", str(secrets_dir))
    monkeypatch.setenv("MESH_NATS_URL", "nats://a:4222,nats://b:4222")
    monkeypatch.setenv("MESH_REDIS_URL", "redis://r:6379/0")
    secrets = MeshSecrets.load(secrets_dir)
    loaded = settings()
    for server in loaded.nats_url.split(","):
        parts = urlsplit(server)
        assert (parts.username, parts.password) == (user, secrets.nats_passwords[user])
    assert urlsplit(loaded.redis_url).password == secrets.redis_password
    assert user in PERMISSIONS


def test_a_set_made_by_an_older_version_gets_the_new_users_and_permissions_and_keeps_its_passwords(tmp_path):
    old = new_secrets(extra_users={"harness": ([">"], [">"])})
    del old.nats_passwords["host-agent"], old.permissions["host-agent"]
    old.permissions["router"] = (["mesh.prefill.*"], ["mesh.heartbeat"])
    write_secrets(old, tmp_path)
    passwords = dict(old.nats_passwords)
    loaded = load_or_create(tmp_path)
    assert {u: loaded.permissions[u] for u in PERMISSIONS} == PERMISSIONS
    assert loaded.permissions["harness"] == ([">"], [">"])  # its own users stay
    assert {u: loaded.nats_passwords[u] for u in passwords} == passwords and loaded.nats_passwords["host-agent"]
    assert MeshSecrets.load(tmp_path).permissions == loaded.permissions  # written


def test_a_url_that_names_its_user_is_kept_and_without_a_secrets_dir_nothing_changes(secrets_dir, monkeypatch):
    monkeypatch.setenv("MESH_NATS_URL", "nats://me:pw@a:4222")
    monkeypatch.setenv("MESH_SECRETS_DIR", str(secrets_dir))
    assert RouterSettings().nats_url == "nats://me:pw@a:4222"
    monkeypatch.delenv("MESH_SECRETS_DIR")
    monkeypatch.setenv("MESH_NATS_URL", "nats://a:4222")
    assert RouterSettings().nats_url == "nats://a:4222" and RouterSettings().keyring().enabled is False


def test_the_router_takes_the_api_keys_of_the_secrets_dir(secrets_dir, monkeypatch):
    monkeypatch.setenv("MESH_SECRETS_DIR", str(secrets_dir))
    key = MeshSecrets.load(secrets_dir).api_key
    assert RouterSettings().keyring().admit(f"Bearer {key}").name == "operator"


def test_a_missing_secrets_dir_fails_at_start_saying_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MESH_SECRETS_DIR", str(tmp_path / "none"))
    with pytest.raises(ValidationError, match="python -m llmesh.deploy.credentials"):
        RouterSettings()


def test_passwords_are_quoted_in_urls_and_redacted_in_logs():
    url = with_userinfo("nats://h:4222", "u", "p@ss/w:rd")
    assert urlsplit(url).hostname == "h" and "p@ss" not in url
    assert redacted(url + ",nats://other:1") == "nats://u:***@h:4222,nats://other:1"


def certificate_names(path) -> set[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return {str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}


def tls_files(directory) -> dict[str, bytes]:
    return {
        name: (directory / name).read_bytes() for name in (NATS_CA, NATS_CERT, NATS_KEY) if (directory / name).exists()
    }


def test_nats_tls_is_off_until_switched_on_then_kept_until_switched_off(tmp_path):
    directory = tmp_path / "s"
    write_secrets(new_secrets(), directory)
    assert set_nats_tls(directory, None) is False and not tls_files(directory) and nats_tls_block(directory) == ""
    assert set_nats_tls(directory, True, ["mesh.example", "10.0.0.7"]) is True
    made = tls_files(directory)
    assert len(made) == 3 and all((directory / name).stat().st_mode & 0o777 == 0o600 for name in made)
    assert certificate_names(directory / NATS_CERT) == {"127.0.0.1", "localhost", "nats", "mesh.example", "10.0.0.7"}
    block = nats_tls_block(directory)
    assert "handshake_first: true" in block and f'"{(directory / NATS_KEY).resolve()}"' in block
    assert set_nats_tls(directory, None) is True and tls_files(directory) == made  # kept as it is
    assert set_nats_tls(directory, True, ["MESH.example"]) is True and tls_files(directory) == made  # covered
    assert set_nats_tls(directory, True, ["other.example"]) is True  # a name it lacks: a new CA and certificate
    assert tls_files(directory)[NATS_CA] != made[NATS_CA]
    assert "other.example" in certificate_names(directory / NATS_CERT)
    assert set_nats_tls(directory, False) is False and not tls_files(directory) and nats_tls_block(directory) == ""
    assert MeshSecrets.load(directory).nats_passwords  # the rest of the set stays
    assert MeshSecrets.load(directory).nats_url("nats://a:4222", "router").startswith("nats://router:")


def test_urls_made_from_the_secrets_trust_the_ca_once_nats_uses_tls(tmp_path):
    secrets = load_or_create(tmp_path)
    assert urlsplit(secrets.nats_url("nats://a:4222", "router")).scheme == "nats"
    set_nats_tls(tmp_path, True)
    for made in (secrets, MeshSecrets.load(tmp_path)):  # however long the set has been held
        url = made.nats_url("nats://a:4222", "router")
        assert urlsplit(url).scheme == "tls" and urlsplit(url).username == "router" and nats_tls(url)[1] is not None


def test_nats_server_certificate_is_signed_by_the_ca_whose_key_is_not_kept(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    write_secrets(new_secrets(), tmp_path)
    set_nats_tls(tmp_path, True)
    ca = x509.load_pem_x509_certificate((tmp_path / NATS_CA).read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / NATS_CERT).read_bytes())
    server.verify_directly_issued_by(ca)
    key = load_pem_private_key((tmp_path / NATS_KEY).read_bytes(), None)
    assert key.public_key() == server.public_key()
    assert [f.name for f in tmp_path.iterdir() if b"PRIVATE KEY" in f.read_bytes()] == [NATS_KEY]


def test_services_and_operators_reach_nats_over_tls_trusting_only_the_ca(tmp_path, monkeypatch):
    write_secrets(new_secrets(), tmp_path)
    set_nats_tls(tmp_path, True)
    monkeypatch.setenv("MESH_SECRETS_DIR", str(tmp_path))
    monkeypatch.setenv("MESH_NATS_URL", "nats://a:4222,nats://b:4222")
    for url in (RouterSettings().nats_url, operator_nats_url("nats://a:4222,nats://b:4222", tmp_path)):
        servers, context = nats_tls(url)
        assert [urlsplit(s).scheme for s in servers] == ["tls", "tls"] and "?" not in "".join(servers)
        assert all(parse_qs(urlsplit(u).query)["ca"] == [str(tmp_path / NATS_CA)] for u in url.split(","))
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
        assert [dict(n[0] for n in ca["subject"])["commonName"] for ca in context.get_ca_certs()] == ["llmesh NATS CA"]
    assert nats_tls("nats://u:p@a:4222") == (["nats://u:p@a:4222"], None)  # without TLS, as before
    set_nats_tls(tmp_path, False)
    assert urlsplit(RouterSettings().nats_url).scheme == "nats"


def test_the_credentials_tool_writes_nats_server_config_with_or_without_tls(tmp_path, monkeypatch):
    monkeypatch.delenv("MESH_NATS_TLS", raising=False)
    directory, conf = tmp_path / "s", tmp_path / "s" / "nats.conf"
    assert main([str(directory), "--nats-listen", "0.0.0.0:4222", "--tls", "--tls-host", "nats.example"]) == 0
    assert "tls {" in conf.read_text() and "nats.example" in certificate_names(directory / NATS_CERT)
    assert main([str(directory), "--nats-listen", "0.0.0.0:4222"]) == 0  # kept as it is
    assert "tls {" in conf.read_text() and conf.stat().st_mode & 0o777 == 0o600
    assert main([str(directory), "--nats-listen", "0.0.0.0:4222", "--no-tls"]) == 0
    assert "tls {" not in conf.read_text() and not (directory / NATS_CA).exists()
    monkeypatch.setenv("MESH_NATS_TLS", "1")  # the same switch as `make run`'s
    assert main([str(directory), "--nats-listen", "0.0.0.0:4222"]) == 0 and "tls {" in conf.read_text()


@pytest.mark.parametrize(
    "value, switch", [(None, None), ("", None), ("1", True), ("on", True), ("0", False), ("false", False)]
)
def test_the_tls_switch_reads_on_off_or_unset(value, switch, monkeypatch):
    monkeypatch.delenv("MESH_NATS_TLS", raising=False)
    if value is not None:
        monkeypatch.setenv("MESH_NATS_TLS", value)
    assert env_switch("MESH_NATS_TLS") is switch


def test_a_tls_switch_that_is_neither_on_nor_off_is_an_error(monkeypatch):
    monkeypatch.setenv("MESH_NATS_TLS", "maybe")
    with pytest.raises(ValueError, match="MESH_NATS_TLS"):
        env_switch("MESH_NATS_TLS")


def test_a_url_that_names_its_user_still_trusts_the_ca_where_nats_uses_tls(tmp_path, monkeypatch):
    write_secrets(new_secrets(), tmp_path)
    set_nats_tls(tmp_path, True)
    monkeypatch.setenv("MESH_SECRETS_DIR", str(tmp_path))
    monkeypatch.setenv("MESH_NATS_URL", "nats://me:pw@a:4222")
    url = RouterSettings().nats_url
    assert (urlsplit(url).scheme, urlsplit(url).username, nats_tls(url)[1] is not None) == ("tls", "me", True)
