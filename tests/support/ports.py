"""Ports for test servers on 127.0.0.1.

A port the OS hands out for ``bind(0)`` comes from the ephemeral range (Linux: 32768-60999), the
same range it draws from for outgoing connections; between the test choosing such a port and the
server binding it, a client socket, a gloo rendezvous or another rank could take it ("address
already in use"). So ports are drawn below that range, checked to be free, and never handed out
twice in one session.
"""
from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32767  # below the ephemeral range
_given: set[int] = set()
_rng = random.Random()


def free_port() -> int:
    for _ in range(1000):
        port = _rng.randint(LOW, HIGH)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {LOW}..{HIGH} after 1000 tries")
