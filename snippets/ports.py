"""free_port: a TCP port on this machine that no one is listening on now.

Its own module, without torch, so the fake multi-node launcher and the tests can use it without
the seconds of start-up that importing torch costs. The port is free when asked; a program that
binds it later can still lose it to another, which is why the launchers bind it at once.
"""

import socket


def free_port() -> int:
    """A TCP port no one is listening on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
