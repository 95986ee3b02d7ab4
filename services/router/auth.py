"""Who may use the router's OpenAI API: API keys sent as `Authorization: Bearer <key>` (OpenAI's way).

Keys are held as SHA-256 digests only: a key file lists digests, one key per line, with a name and an
optional rate limit; `MESH_API_KEYS` may also give keys or digests. A missing or unknown key is a 401
and a key past its rate is a 429 with `Retry-After`, both in OpenAI's error shape; each refusal is
logged with the key's name (never the key). `python -m llmesh_router.auth new NAME` makes a key.

Key file lines: `sha256:<hex digest>  <name>  [<requests per minute>]`; `#` starts a comment.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from llmesh.wire.errors import InvalidApiKey, MissingApiKey, Overloaded
from llmesh.wire.secrets import DIGEST_PREFIX, key_digest, new_api_key

log = logging.getLogger(__name__)


@dataclass
class ApiKey:
    """One client's key: its name (in logs and metrics) and its optional rate limit."""

    name: str
    digest: str
    requests_per_minute: float | None = None
    # a token bucket holding up to a minute's requests, refilled continuously
    _tokens: float = field(default=0.0, repr=False)
    _refilled: float | None = field(default=None, repr=False)

    def take(self, now: float) -> float:
        """Count a request; return 0, or how many seconds until one more is allowed (then it is not counted)."""
        rate = self.requests_per_minute
        if rate is None:
            return 0.0
        if self._refilled is None:
            self._tokens = rate
        else:
            self._tokens = min(rate, self._tokens + (now - self._refilled) * rate / 60)
        self._refilled = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) * 60 / rate


def parse_entries(lines: Iterable[str], source: str) -> list[ApiKey]:
    """Key entries, one per line (`digest-or-key [name] [requests per minute]`); a plain key is hashed
    here and named by its position. Raises ValueError naming `source` and the line."""
    keys = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 3:
            raise ValueError(f"{source} line {number}: expected 'DIGEST NAME [REQUESTS_PER_MINUTE]'")
        secret, name = fields[0], fields[1] if len(fields) > 1 else f"{source}#{number}"
        if secret.startswith(DIGEST_PREFIX):
            hexpart = secret.removeprefix(DIGEST_PREFIX)
            if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
                raise ValueError(f"{source} line {number}: a digest is sha256: and 64 lowercase hex digits")
        else:
            secret = key_digest(secret)
        try:
            rate = float(fields[2]) if len(fields) > 2 else None
        except ValueError:
            raise ValueError(
                f"{source} line {number}: requests per minute must be a number, not {fields[2]!r}"
            ) from None
        if rate is not None and rate <= 0:
            raise ValueError(f"{source} line {number}: requests per minute must be above 0")
        keys.append(ApiKey(name, secret, rate))
    return keys


class KeyRing:
    """The keys the router accepts; with none, the API is open (as a plain vLLM server without --api-key)."""

    def __init__(self, keys: Iterable[ApiKey], clock: Callable[[], float] = time.monotonic):
        self._by_digest: dict[str, ApiKey] = {}
        for key in keys:
            if key.digest in self._by_digest:
                raise ValueError(f"API keys {self._by_digest[key.digest].name!r} and {key.name!r} are the same key")
            self._by_digest[key.digest] = key
        self._clock = clock

    @classmethod
    def load(cls, env_entries: str, file: Path | None) -> KeyRing:
        """From `MESH_API_KEYS` (entries separated by commas) and the key file, if any."""
        keys = parse_entries(env_entries.split(","), "MESH_API_KEYS")
        if file is not None:
            keys += parse_entries(file.read_text().splitlines(), str(file))
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    def admit(self, authorization: str | None) -> ApiKey | None:
        """The key the `Authorization` header carries, counted against its rate; None when the API is
        open. Raises MissingApiKey, InvalidApiKey (401) or Overloaded (429)."""
        if not self._by_digest:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise MissingApiKey("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
        presented = key_digest(token.strip())
        key = self._by_digest.get(presented)
        # the dictionary lookup is by digest; compare again in constant time all the same
        if key is None or not hmac.compare_digest(key.digest, presented):
            log.warning("refused a request with an unknown API key")
            raise InvalidApiKey("Incorrect API key provided.")
        wait_s = key.take(self._clock())
        if wait_s:
            log.warning("API key %r is over its %g requests per minute", key.name, key.requests_per_minute)
            raise Overloaded(
                f"Rate limit reached for API key {key.name!r}: {key.requests_per_minute:g} requests per minute.",
                retry_after_s=wait_s,
            )
        return key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmesh_router.auth", description="Make an API key.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("new", help="print a new key once, and add its digest to a key file")
    make.add_argument("name", help="who the key is for (in logs; no spaces)")
    make.add_argument("--file", type=Path, required=True, help="the key file (MESH_API_KEYS_FILE)")
    make.add_argument("--rpm", type=float, default=None, help="requests per minute allowed (default: no limit)")
    args = parser.parse_args(argv)
    if not args.name or any(c.isspace() or c == "#" for c in args.name):
        parser.error("the name must not be empty or hold spaces or '#'")
    key = new_api_key()
    entry = f"{key_digest(key)} {args.name}" + (f" {args.rpm:g}" if args.rpm else "")
    existing = args.file.read_text() if args.file.exists() else ""
    KeyRing(parse_entries((existing + entry).splitlines(), str(args.file)))  # refuse a broken file
    args.file.touch(mode=0o600)
    with args.file.open("a") as out:
        out.write(("" if not existing or existing.endswith("\n") else "\n") + entry + "\n")
    print(key)
    print(f"(added {args.name!r} to {args.file}; the key is not stored and cannot be shown again)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
