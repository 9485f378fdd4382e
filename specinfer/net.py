"""Network settings every process shares, servers and the client SDK alike (grpcio only):
message size limits, and a free loopback port for processes started on this machine."""

from __future__ import annotations

import socket

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Channel and server options alike.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A channel retries a dead address with growing waits (up to 120 s by default), so a
    # service restarted after a long load would be seen only that much later: cap them.
    ("grpc.max_reconnect_backoff_ms", 2000),
]


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking, and not one this process handed
    out before: ports asked for in a row (before the services bind them) must differ, and
    the kernel may offer a just-closed one again."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError("no free loopback port that this process has not handed out already")
