"""`python -m llmesh.deploy.healthcheck URL` (the compose files' health checks) against a real HTTP server."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from llmesh.deploy.healthcheck import main
from llmesh.deploy.launcher import free_port


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/ok" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthy_only_on_200_and_never_when_nothing_listens(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main([f"{url}/ok"]) == 0
        assert main([f"{url}/health"]) == 1 and "503" in capsys.readouterr().err
    finally:
        server.shutdown()
    assert main([f"http://127.0.0.1:{free_port()}/metrics"]) == 1 and "refused" in capsys.readouterr().err.lower()
