"""`runtime.spawn.free_port`: the port a driver job's store binds, drawn where no socket the
kernel numbers itself can take it first (a job that lost that race failed with EADDRINUSE)."""
from __future__ import annotations

import socket

from megatron_mesh.runtime.spawn import PORTS_FROM, PORTS_TO, _ephemeral_low, free_port


def test_ports_are_free_and_below_the_ephemeral_range() -> None:
    """... and below the Slurm scripts' rendezvous ports (20000 + job id), which a test's
    Slurm job binds while driver tests draw theirs."""
    low = min(_ephemeral_low(), PORTS_TO)
    ports = [free_port() for _ in range(20)]
    for port in ports:
        with socket.socket() as s:  # free: it binds
            s.bind(("127.0.0.1", port))
        if low > PORTS_FROM + 1024:  # the kernel says where its own ports start
            assert PORTS_FROM <= port < low, (port, low)
    assert len(set(ports)) > 1  # drawn, not one fixed port


def test_a_port_in_use_is_not_drawn() -> None:
    held = []
    try:
        for _ in range(50):  # hold ports, then draw: never one held
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {free_port() for _ in range(50)}
    finally:
        for s in held:
            s.close()
