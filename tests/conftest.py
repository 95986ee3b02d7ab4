"""Shared fixtures: real nats-server processes on free ports, stopped by their own handles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from llmesh.deploy.launcher import start_nats, start_redis  # noqa: E402


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory):
    child, url = start_nats(tmp_path_factory.mktemp("nats"))
    try:
        yield url
    finally:
        child.stop()


@pytest.fixture(scope="session")
def small_payload_nats_url(tmp_path_factory):
    """A server whose max_payload forces KV transfers to be split."""
    child, url = start_nats(tmp_path_factory.mktemp("nats-small"), max_payload="128KB")
    try:
        yield url
    finally:
        child.stop()


@pytest.fixture(scope="module")
def redis_url():
    """A redis-server (in memory) for one test module."""
    child, url = start_redis()
    try:
        yield url
    finally:
        child.stop()
