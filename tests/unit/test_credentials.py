"""Settings take each service's own credentials from a secrets directory (llmesh.credentials)."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from pydantic import ValidationError

from llmesh.config import CommonSettings, WorkerSettings
from llmesh.credentials import PERMISSIONS, MeshSecrets, redacted, with_userinfo
from llmesh_kvstore.settings import KvStoreSettings
from llmesh_lengthpred.settings import LengthPredictorSettings
from llmesh_placement.settings import PlacementSettings
from llmesh_router.settings import RouterSettings


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("secrets") / "s"
    MeshSecrets.generate().write(directory)
    return directory


@pytest.mark.parametrize("settings, user", [
    (RouterSettings, "router"), (WorkerSettings, "worker"), (KvStoreSettings, "kv-store"),
    (LengthPredictorSettings, "length-predictor"), (PlacementSettings, "placement"), (CommonSettings, "admin")])
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
    with pytest.raises(ValidationError, match="python -m llmesh.credentials"):
        RouterSettings()


def test_passwords_are_quoted_in_urls_and_redacted_in_logs():
    url = with_userinfo("nats://h:4222", "u", "p@ss/w:rd")
    assert urlsplit(url).hostname == "h" and "p@ss" not in url
    assert redacted(url + ",nats://other:1") == "nats://u:***@h:4222,nats://other:1"
