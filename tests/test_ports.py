"""free_port draws from below the kernel's ephemeral range, where no port-0 bind and no outgoing
connection can take the port in the seconds before a rank binds it (snippets/ports.py)."""

import random
import socket

import pytest

from snippets import ports

pytestmark = pytest.mark.kernel_independent("port numbers and sockets")


def test_free_port_is_free_and_below_the_ephemeral_range():
    low = ports.ephemeral_start()
    drawn = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST <= p < min(low, 32768) and p != ports.TORCHRUN_DEFAULT for p in drawn)
    assert len(drawn) > 15  # drawn at random: two jobs asking at once get different ports
    with socket.socket() as s:  # the kernel's own pick lies in the range free_port avoids
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= low


def test_a_seeded_global_generator_does_not_repeat_the_port():
    """Every course script seeds Python's `random` (set_seed): two jobs seeded alike must still
    draw different ports."""
    random.seed(1337)
    first = [ports.free_port() for _ in range(5)]
    random.seed(1337)
    assert [ports.free_port() for _ in range(5)] != first


def test_a_port_someone_listens_on_is_never_returned(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.free_port()))
        busy.listen()
        taken = busy.getsockname()[1]
        spare = next(p for p in range(taken + 1, 32768)
                     if p != ports.TORCHRUN_DEFAULT and ports.is_free(p))
        draws = iter([taken, ports.TORCHRUN_DEFAULT, spare])
        monkeypatch.setattr(ports._draw, "randrange", lambda low, high: next(draws))
        assert ports.free_port() == spare  # the busy port and torchrun's are passed over
