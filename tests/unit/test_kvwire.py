"""kv-store frames over a real socket: a frame of many values, some empty, larger than the socket's
buffer and than one sendmsg's buffer count, arrives whole and in order."""

from __future__ import annotations

import os
import socket
import threading

from llmesh.wire.kvwire import IOV_MAX, recv_header, recv_into, send_frame


def test_a_frame_sent_in_partial_scatter_gather_writes_arrives_whole():
    values = [os.urandom(n) for n in [0, 1, 65536, 0, 300_000] + [517] * (IOV_MAX + 10)]
    writer, reader = socket.socketpair()
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    writer.settimeout(5)  # as the data plane's sockets: non-blocking underneath, so sendmsg sends part of its buffers
    try:
        sender = threading.Thread(
            target=send_frame, args=(writer, {"sizes": [len(v) for v in values]}, [memoryview(v) for v in values])
        )
        sender.start()
        meta, size = recv_header(reader, 1 << 30)
        payload = memoryview(bytearray(size))
        recv_into(reader, payload)
        sender.join(10)
        assert meta == {"sizes": [len(v) for v in values]} and bytes(payload) == b"".join(values)
    finally:
        writer.close()
        reader.close()
