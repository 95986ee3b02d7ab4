"""`python -m llmesh.deploy.healthcheck URL`: exit 0 when URL answers 200 within 5 s, else 1 with the
reason on stderr (the compose files' health checks; the image has no curl)."""

from __future__ import annotations

import sys
import urllib.request


def main(argv: list[str] | None = None) -> int:
    (url,) = argv if argv is not None else sys.argv[1:]
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return 0 if response.status == 200 else 1
    except Exception as exc:  # refused, timed out, or an HTTP error status
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
