"""Round trips and throughput between two test nodes over plain TCP (no ``ping`` or ``iperf3`` here).

python probe.py serve PORT                 # on one node: answers both kinds of client, one at a time
python probe.py ping HOST PORT COUNT       # prints "rtt_ms MEDIAN MIN MAX" (1-byte round trips)
python probe.py stream HOST PORT MB        # prints "mbit_s RATE SECONDS" (MB megabytes one way)
"""

from __future__ import annotations

import socket
import statistics
import sys
import time


def serve(port: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(4)
    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = conn.recv(1)
        if kind == b"p":  # echo each byte back
            while data := conn.recv(64):
                conn.sendall(data)
        else:  # count what comes until the client shuts its side, then say how much
            total = 0
            while data := conn.recv(1 << 20):
                total += len(data)
            conn.sendall(str(total).encode())
        conn.close()


def connect(host: str, port: int, kind: bytes) -> socket.socket:
    for _ in range(50):  # the server may still be starting
        try:
            conn = socket.create_connection((host, port), timeout=30)
            break
        except ConnectionRefusedError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"no server at {host}:{port}")
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(kind)
    return conn


def ping(host: str, port: int, count: int) -> str:
    conn = connect(host, port, b"p")
    rtts = []
    for _ in range(count):
        t0 = time.perf_counter()
        conn.sendall(b"x")
        conn.recv(64)
        rtts.append((time.perf_counter() - t0) * 1000)
    return f"rtt_ms {statistics.median(rtts):.3f} {min(rtts):.3f} {max(rtts):.3f}"


def stream(host: str, port: int, mb: int) -> str:
    conn = connect(host, port, b"s")
    block = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    for _ in range(mb):
        conn.sendall(block)
    conn.shutdown(socket.SHUT_WR)
    total = int(conn.recv(64))
    seconds = time.perf_counter() - t0
    return f"mbit_s {8 * total / seconds / 1e6:.1f} {seconds:.3f}"


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "serve":
        serve(int(args[0]))
    else:
        print({"ping": ping, "stream": stream}[mode](args[0], int(args[1]), int(args[2])), flush=True)
