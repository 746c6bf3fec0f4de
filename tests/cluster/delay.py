"""A switch that holds each frame for its link's delay: latency on the namespaced nodes' real links.

This machine's kernel has no ``netem`` (only ``tbf`` and ``htb``), so latency cannot be a queueing
discipline. Instead each node's ``eth0`` is a TAP device whose other end is a file descriptor of this
forwarder, a learning switch in the run's switch namespace: a frame from node *i* to node *j* leaves
``max(latency_i, latency_j)`` after it arrived (the emulation's one-way latency, ``runner/comm/links.py``).
Rates stay ``tbf`` on each node's ``eth0`` (:meth:`tests.cluster.nodes.Nodes.rate`).

Run as a script in the switch namespace (:func:`start` does it and moves the TAP devices into the nodes)::

    python delay.py CONTROL_DIR tap1 tap2 ...

``CONTROL_DIR/control.json`` holds ``{"latency_ms": [per port], "down": [ports]}``, read at the start and
again on SIGUSR1 (a port down drops every frame to or from it: an unplugged cable); the forwarder writes
``CONTROL_DIR/stats.json`` each second (frames, bytes, drops, how late it released frames). It prints
``ready`` once its devices exist. Only the standard library: it runs before and beside everything else.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MTU = 9000  # jumbo frames: a sixth of the frames per byte, so the forwarder's own cost stays small
#: TCP buffers of up to 32 MB, as hosts on long links are tuned: with the kernel's 4 MB one stream made
#: 440 Mbit/s at a 50 ms round trip (the window over the round trip), with these 1.5 Gbit/s.
WINDOWS = ("net.ipv4.tcp_wmem=4096 16384 33554432", "net.ipv4.tcp_rmem=4096 131072 33554432")
IDLE_S = 0.05  # the longest wait for a frame (a reload or a stats write waits at most this)


def open_tap(name: str) -> int:
    """A new TAP device ``name``; its file descriptor (non-blocking, frames without a header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Switch:
    """The forwarder: learns which port each MAC address is behind and delays frames by port pair."""

    def __init__(self, fds: list[int], control: Path):
        self.fds, self.control = fds, control
        self.port_of = {fd: p for p, fd in enumerate(fds)}
        self.latency = [0.0] * len(fds)
        self.down: set[int] = set()
        self.macs: dict[bytes, int] = {}
        self.queue: list[tuple[float, int, int, bytes]] = []  # (release time, order, port, frame)
        self.order = 0
        self.stats = {"frames_in": 0, "frames_out": 0, "bytes_out": 0, "dropped": 0, "late_max_ms": 0.0}
        self.late_sum = 0.0
        self.reload = True

    def load(self) -> None:
        data = json.loads((self.control / "control.json").read_text())
        latency = data.get("latency_ms", 0.0)
        per_port = latency if isinstance(latency, list) else [latency] * len(self.fds)
        self.latency = [float(per_port[min(p, len(per_port) - 1)]) / 1000 for p in range(len(self.fds))]
        self.down = set(data.get("down", []))
        self.reload = False

    def receive(self, port: int, frame: bytes, now: float) -> None:
        """Switch one frame that came in on ``port``."""
        self.stats["frames_in"] += 1
        if port in self.down or len(frame) < 14:
            self.stats["dropped"] += 1
            return
        self.macs[frame[6:12]] = port
        to = self.macs.get(frame[0:6])
        unicast = to is not None and not frame[0] & 1  # (else a broadcast, or not learnt yet: flooded)
        targets = [to] if unicast else [p for p in range(len(self.fds)) if p != port]
        for target in targets:
            if target == port or target in self.down:
                continue
            delay = max(self.latency[port], self.latency[target])
            self.order += 1
            heapq.heappush(self.queue, (now + delay, self.order, target, frame))

    def release(self, now: float) -> None:
        """Send every frame whose time has come (a full device queue drops it, as a switch would)."""
        queue = self.queue
        while queue and queue[0][0] <= now:
            due, _, port, frame = heapq.heappop(queue)
            try:
                os.write(self.fds[port], frame)
            except BlockingIOError:
                self.stats["dropped"] += 1
                continue
            late = now - due
            self.late_sum += late
            self.stats["frames_out"] += 1
            self.stats["bytes_out"] += len(frame)
            self.stats["late_max_ms"] = max(self.stats["late_max_ms"], late * 1000)

    def write_stats(self) -> None:
        out = dict(self.stats, late_mean_ms=1000 * self.late_sum / max(1, self.stats["frames_out"]))
        tmp = self.control / "stats.json.tmp"
        tmp.write_text(json.dumps(out))
        tmp.replace(self.control / "stats.json")

    def run(self) -> None:
        poller = select.epoll()
        for fd in self.fds:
            poller.register(fd, select.EPOLLIN)
        next_stats = time.monotonic() + 1
        while True:
            if self.reload:
                self.load()
            now = time.monotonic()
            wait = min(IDLE_S, max(0.0, self.queue[0][0] - now)) if self.queue else IDLE_S
            events = poller.poll(wait)
            now = time.monotonic()
            for fd, _ in events:
                port = self.port_of[fd]
                while True:  # everything waiting on this port, stamped with one clock reading
                    try:
                        frame = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    self.receive(port, frame, now)
            self.release(time.monotonic())
            if now >= next_stats:
                self.write_stats()
                next_stats = now + 1


def start(
    ip: str,
    switch: str,
    names: list[str],
    addrs: list[str],
    control: Path,
    latency_ms: float | list,
    mtu: int = MTU,
) -> subprocess.Popen:
    """Start the forwarder in namespace ``switch`` and give node ``names[i]`` its end as ``eth0`` (address
    ``addrs[i]``/24, ``mtu``); returns the forwarder's process (it ends with the switch namespace)."""
    control.mkdir(parents=True, exist_ok=True)
    (control / "control.json").write_text(json.dumps({"latency_ms": latency_ms, "down": []}))
    taps = [f"{name}t" for name in names]
    with open(control / "forwarder.log", "w") as log:
        proc = subprocess.Popen(
            [ip, "netns", "exec", switch, sys.executable, __file__, str(control), *taps],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        why = (control / "forwarder.log").read_text()[-2000:]
        raise RuntimeError(f"the delaying forwarder did not start: {line.strip()} {why}")
    for name, tap, addr in zip(names, taps, addrs, strict=True):
        steps = (
            ["-n", switch, "link", "set", tap, "netns", name],
            ["-n", name, "link", "set", tap, "name", "eth0"],
            ["-n", name, "link", "set", "eth0", "mtu", str(mtu)],
            ["-n", name, "addr", "add", f"{addr}/24", "dev", "eth0"],
            ["-n", name, "link", "set", "eth0", "up"],
            ["netns", "exec", name, "sysctl", "-qw", *WINDOWS],
        )
        for step in steps:
            subprocess.run([ip, *step], check=True, capture_output=True, timeout=30)
    return proc


def set_control(
    proc: subprocess.Popen,
    control: Path,
    latency_ms: float | list | None = None,
    down: set[int] | None = None,
) -> None:
    """Change the latencies (ms: one, or one per node) or the ports down, at once (SIGUSR1)."""
    data = json.loads((control / "control.json").read_text())
    if latency_ms is not None:
        data["latency_ms"] = latency_ms
    if down is not None:
        data["down"] = sorted(down)
    tmp = control / "control.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(control / "control.json")
    os.killpg(proc.pid, signal.SIGUSR1)


def main(argv: list[str]) -> None:
    control, taps = Path(argv[0]), argv[1:]
    switch = Switch([open_tap(name) for name in taps], control)
    signal.signal(signal.SIGUSR1, lambda *_: setattr(switch, "reload", True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    switch.run()


if __name__ == "__main__":
    main(sys.argv[1:])
