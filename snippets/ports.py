"""free_port: a TCP port on this machine that no one is listening on now.

Its own module, without torch, so the fake multi-node launcher and the tests can use it without
the seconds of start-up that importing torch costs.

The port is free when asked, and the program that binds it does so seconds later (a rank that
imports torch first). So it is drawn from below the kernel's ephemeral range: a port there is
never handed out by the kernel, neither to a socket bound to port 0 (every gloo connection
listens on one) nor as the source port of an outgoing connection, so only another free_port()
caller can take it in between. A port the kernel picked (bind to port 0) lies inside that range,
where the other jobs on the machine keep taking ports: measured during the test suite, about
three new listening sockets a second.
"""

import random
import socket

LOWEST = 20000
_draw = random.SystemRandom()  # not the seeded global generator: jobs seeded alike would collide
TORCHRUN_DEFAULT = 29500  # where a plain `torchrun` on this machine would listen


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere, below macOS's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port no one is listening on now, below the ephemeral range where it has one."""
    top = min(ephemeral_start(), 32768)
    for _ in range(50 if top > LOWEST + 1000 else 0):
        port = _draw.randrange(LOWEST, top)
        if port != TORCHRUN_DEFAULT and is_free(port):
            return port
    with socket.socket() as s:  # no room below the range: let the kernel pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
