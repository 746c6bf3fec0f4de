"""What the delaying forwarder (tests/cluster/delay.py) adds itself, and its ceiling: two namespaced nodes
joined by a bridge (the reference), then by the forwarder without latency and with ``--latency-ms``.

    python benchmarks/forwarder.py                   # 500 round trips and 400 MB a link, 25 ms one way
    python benchmarks/forwarder.py --latency-ms 50
    python benchmarks/forwarder.py --smoke           # 20 round trips and 20 MB a link

Per link: the median TCP round trip of one byte, what it adds to twice the one-way latency, one TCP stream's
rate, and the frames per second the forwarder moved during the stream (both directions; its frames are up
to 9,000 bytes, the TAP devices' MTU). Without root or network namespaces it says why in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.nodes import Nodes, why_unsupported  # noqa: E402

PROBE = [sys.executable, str(ROOT / "tests" / "cluster" / "probe.py")]
PORT = "5302"


def frames(nodes: Nodes) -> int | None:
    """Frames the forwarder has sent so far (None: a bridge); its statistics are written each second."""
    if nodes.forwarder is None:
        return None
    time.sleep(1.1)
    return json.loads((nodes.control / "stats.json").read_text())["frames_out"]


def link(latency_ms: float | None, pings: int, mb: int) -> tuple[float, float, float | None]:
    """(median round trip ms, stream Mbit/s, forwarder frames/s or None) between two fresh nodes."""
    with Nodes.up(2, latency_ms=latency_ms) as nodes:
        nodes.popen(1, [*PROBE, "serve", PORT])
        server = nodes.addrs[1]
        rtt = nodes.run(0, [*PROBE, "ping", server, PORT, str(pings)], timeout=300, check=True).stdout
        before = frames(nodes)
        out = nodes.run(0, [*PROBE, "stream", server, PORT, str(mb)], timeout=600, check=True).stdout
        rate, seconds = map(float, out.split()[1:3])
        after = frames(nodes)
        per_s = None if before is None else (after - before) / seconds
        return float(rtt.split()[1]), rate, per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=25.0, help="one way, each node")
    parser.add_argument("--pings", type=int, default=500)
    parser.add_argument("--mb", type=int, default=400, help="megabytes streamed a link")
    parser.add_argument("--smoke", action="store_true", help="20 round trips and 20 MB a link")
    args = parser.parse_args()
    if args.smoke:
        args.pings, args.mb = 20, 20
    reason = why_unsupported()
    if reason:
        print(f"no test nodes here: {reason}")
        return
    lines = [
        "| link | round trip ms | added ms | stream Mbit/s | forwarder frames/s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    links = [
        ("bridge", None),
        ("forwarder, no latency", 0.0),
        (f"forwarder, {args.latency_ms:g} ms", args.latency_ms),
    ]
    for name, latency in links:
        rtt, rate, per_s = link(latency, args.pings, args.mb)
        added = rtt - 2 * (latency or 0.0)
        shown = "-" if per_s is None else f"{per_s:,.0f}"
        lines.append(f"| {name} | {rtt:.3f} | {added:.3f} | {rate:.0f} | {shown} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
