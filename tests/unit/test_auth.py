"""API keys: parsing, refusal and per-key rate limits (llmesh_router.auth), without a router."""

from __future__ import annotations

import pytest

from llmesh.wire.errors import InvalidApiKey, MissingApiKey, Overloaded
from llmesh.wire.secrets import key_digest as digest
from llmesh_router.auth import KeyRing, main, parse_entries


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_keys_are_held_as_digests_and_plain_keys_are_hashed_on_load():
    keys = parse_entries([f"{digest('sk-a')} alice 30  # a comment", "", "# only a comment", "sk-b"], "F")
    assert [(k.name, k.digest, k.requests_per_minute) for k in keys] == [
        ("alice", digest("sk-a"), 30.0),
        ("F#4", digest("sk-b"), None),
    ]
    assert all("sk-" not in k.digest for k in keys)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("sha256:abc alice", "64 lowercase hex"),
        (f"{digest('k')} alice fast", "must be a number"),
        (f"{digest('k')} alice 0", "above 0"),
        (f"{digest('k')} alice 1 2", "expected"),
    ],
)
def test_a_broken_key_line_is_refused_with_its_line_number(line, problem):
    with pytest.raises(ValueError, match=rf"F line 2: .*{problem}"):
        parse_entries(["# keys", line], "F")


def test_the_same_key_twice_is_refused():
    with pytest.raises(ValueError, match="'a' and 'b' are the same key"):
        KeyRing(parse_entries(["sk-x a", f"{digest('sk-x')} b"], "F"))


@pytest.mark.parametrize(
    "header, error",
    [
        (None, MissingApiKey),
        ("", MissingApiKey),
        ("Basic sk-a", MissingApiKey),
        ("Bearer ", MissingApiKey),
        ("Bearer sk-wrong", InvalidApiKey),
        ("Bearer " + digest("sk-a"), InvalidApiKey),  # the digest is not the key
    ],
)
def test_a_missing_or_wrong_key_is_401(header, error):
    ring = KeyRing.load("sk-a alice", None)
    with pytest.raises(error) as raised:
        ring.admit(header)
    assert raised.value.http_status == 401


def test_a_right_key_is_admitted_by_name_and_without_keys_the_api_is_open():
    assert KeyRing.load("sk-a alice,sk-b bob", None).admit("Bearer sk-b").name == "bob"
    assert KeyRing.load("sk-a alice", None).admit("bearer  sk-a ").name == "alice"
    assert KeyRing.load("", None).admit(None) is None and not KeyRing.load(" , ", None).enabled


def test_a_key_past_its_rate_is_429_until_its_bucket_refills():
    clock = Clock()
    ring = KeyRing(parse_entries(["sk-a alice 2", "sk-b bob"], "F"), clock=clock)
    ring.admit("Bearer sk-a"), ring.admit("Bearer sk-a")  # a minute's worth at once
    with pytest.raises(Overloaded) as raised:
        ring.admit("Bearer sk-a")
    assert raised.value.http_status == 429 and raised.value.retry_after_s == pytest.approx(30)
    for _ in range(50):  # other keys are not limited by it
        ring.admit("Bearer sk-b")
    clock.now += 29
    with pytest.raises(Overloaded):
        ring.admit("Bearer sk-a")
    clock.now += 1.5  # refused requests did not count
    assert ring.admit("Bearer sk-a").name == "alice"


def test_new_prints_a_key_once_and_stores_only_its_digest(tmp_path, capsys):
    file = tmp_path / "keys"
    assert main(["new", "alice", "--file", str(file), "--rpm", "60"]) == 0
    assert main(["new", "bob", "--file", str(file)]) == 0
    alice, bob = capsys.readouterr().out.split()
    assert alice not in file.read_text() and file.stat().st_mode & 0o777 == 0o600
    ring = KeyRing.load("", file)
    assert ring.admit(f"Bearer {alice}").requests_per_minute == 60 and ring.admit(f"Bearer {bob}").name == "bob"
    with pytest.raises(SystemExit):
        main(["new", "has space", "--file", str(file)])
