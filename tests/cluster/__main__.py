"""Try multi-node on one Linux machine (as root): bring up test nodes, run a command on node 1, tear down.

    python -m tests.cluster 2 -- python -m runner devices=4 hardware=cluster 'hardware.hosts=[{n1}:2,{n2}:2]'
    python -m tests.cluster 2 --slurm -- sbatch --wait job.sbatch       # Slurm on the nodes
    python -m tests.cluster 2 --rate 100mbit -- python -m runner ...    # every node's link limited
    python -m tests.cluster 3                                           # hold them until Ctrl-C

``{n1}``, ``{n2}``... in the command are the nodes' names (``{nodes}``: all of them, comma-separated). The
command runs on node 1 with Open MPI's launch agent set (and Slurm's configuration with ``--slurm``); its
exit status is this one's. Everything is torn down at the end, also after Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import sys

from tests.cluster.nodes import Nodes


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the command after ``--`` (empty: hold the nodes)."""
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("nodes", type=int, nargs="?", default=2, help="how many nodes (default 2)")
    parser.add_argument("--slurm", action="store_true", help="slurmctld on node 1, a slurmd on each node")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs Slurm gives each node (default 2)")
    parser.add_argument("--rate", help="limit every node's outgoing link, e.g. 1gbit, 100mbit")
    return parser.parse_args(argv), command


def main(argv: list[str] | None = None) -> int:
    """Bring the nodes up, run the command (or wait for Ctrl-C), tear them down; the command's status."""
    args, command = parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear down on SIGTERM too
    with Nodes.up(args.nodes, slurm=args.slurm, cpus=args.cpus) as nodes:
        if args.rate:
            for name in nodes.names:
                nodes.rate(name, args.rate)
        names = {f"n{i}": name for i, name in enumerate(nodes.names, 1)} | {"nodes": ",".join(nodes.names)}
        print(f"nodes up in {nodes.timings['up']:.2f} s: {', '.join(nodes.names)}", flush=True)
        if not command:
            print("holding them; Ctrl-C tears them down", flush=True)
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
            return 0
        env = nodes.slurm_env() if args.slurm else None
        argv = [word.format(**names) for word in command]
        return nodes.popen(0, argv, env=env).wait()


if __name__ == "__main__":
    sys.exit(main())
