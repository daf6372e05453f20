"""Free loopback ports for tests that start workers (one helper for every test file)."""

import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct ports nothing listens on now.

    All are held open while choosing: the OS hands a port just closed out
    again, so ports chosen one at a time can repeat.
    """
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_addresses(count: int) -> list[str]:
    """`free_ports` as ``127.0.0.1:port`` addresses."""
    return [f"127.0.0.1:{port}" for port in free_ports(count)]
