"""Shared fixtures: real nats-server processes on free ports, stopped by their own handles."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from llmesh.deploy.launcher import start_nats, start_redis  # noqa: E402
from llmesh.engine.models import cpu_dtype  # noqa: E402

# Every engine the suite starts (the meshes' workers and the reference engine read it) in this CPU's fastest dtype.
os.environ.setdefault("MESH_DTYPE", cpu_dtype())


def pytest_addoption(parser):
    parser.addoption(
        "--compose",
        action="store_true",
        help="also run tests/compose: docker-compose.yml in containers under podman (`make compose-test`)",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--compose"):
        skip = pytest.mark.skip(reason="docker-compose.yml in containers: `make compose-test` runs it")
        for item in items:
            if item.get_closest_marker("compose"):
                item.add_marker(skip)


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
