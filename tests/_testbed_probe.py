"""One rank of the testbed's link tests (plain sockets, no torch): throughput and round-trip time.

``tput --bytes N --peers 1,2``: rank 0 serves; each listed peer in turn sends N bytes to it; rank 0
prints ``{peer: Mbit/s}`` as JSON. ``rtt --count K``: rank 1 sends 1-byte pings to rank 0 and prints
the median round trip in ms. Ranks with no part exit at once. Addresses come from the testbed's env.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import time


def _connect(addr: str, port: int, timeout: float = 20.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _listen(port: int) -> socket.socket:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(16)
    return srv


def _recv_exact(s: socket.socket, n: int) -> None:
    while n > 0:
        chunk = s.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed early")
        n -= len(chunk)


def tput(rank: int, addr: str, port: int, nbytes: int, peers: list[int]) -> None:
    if rank == 0:
        srv = _listen(port)
        conns = {}
        while len(conns) < len(peers):
            c, _ = srv.accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            (peer,) = struct.unpack("!i", c.recv(4))
            conns[peer] = c
        out = {}
        for peer in peers:
            c = conns[peer]
            start = time.perf_counter()
            c.sendall(b"g")
            _recv_exact(c, nbytes)
            out[peer] = nbytes * 8 / (time.perf_counter() - start) / 1e6
            c.sendall(b"d")
            c.close()
        print(json.dumps(out), flush=True)
    elif rank in peers:
        s = _connect(addr, port)
        s.sendall(struct.pack("!i", rank))
        assert s.recv(1) == b"g"
        s.sendall(b"x" * nbytes)
        assert s.recv(1) == b"d"
        s.close()


def rtt(rank: int, addr: str, port: int, count: int) -> None:
    if rank == 0:
        c, _ = _listen(port).accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while b := c.recv(1):
            c.sendall(b)
    elif rank == 1:
        s = _connect(addr, port)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            s.sendall(b"p")
            assert s.recv(1) == b"p"
            times.append((time.perf_counter() - start) * 1e3)
        s.close()
        print(json.dumps({"rtt_ms": statistics.median(times)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["tput", "rtt"])
    p.add_argument("--bytes", type=int, default=4 << 20)
    p.add_argument("--peers", default="1")
    p.add_argument("--count", type=int, default=20)
    a = p.parse_args()
    rank, addr, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if a.mode == "tput":
        tput(rank, addr, port, a.bytes, [int(x) for x in a.peers.split(",")])
    else:
        rtt(rank, addr, port, a.count)


if __name__ == "__main__":
    main()
