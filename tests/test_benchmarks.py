"""Every benchmark still runs: ``python benchmarks/<name>.py --smoke`` (a few steps, tiny sizes, one
repetition, the same code as the real run) exits 0 and prints its result.

The scripts are found by globbing ``benchmarks/*.py`` (less the shared helpers), so a new benchmark is
tested without being listed here; one without ``--smoke`` fails. ``RESULT`` holds, per script, patterns
its output must match (its result table's rows, with numbers in them); a script not in it must at least
print a number.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.cluster.nodes import why_unsupported
from tests.conftest import ROOT

BENCHMARKS = ROOT / "benchmarks"
#: Modules in benchmarks/ that the benchmarks import, not benchmarks themselves.
HELPERS = {"mpijob"}
#: Benchmarks that measure in this process: every other one starts mpirun (itself, or through runner jobs).
IN_PROCESS = {"forwarder", "precision", "reliability", "scaling_model"}
#: Benchmarks on namespaced test nodes (root): in the cluster tier too, skipped where nodes cannot be made.
ON_NODES = {"forwarder", "many_ranks"}
TIMEOUT = 120

NUM = r"-?\d+(?:\.\d+)?(?:e[+-]\d+)?"
#: Per benchmark, patterns (re.MULTILINE) that its --smoke output must match.
RESULT = {
    "allreduce": [
        rf"^\s+0\.25\s+1\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$",
        *(rf"^  overlap={m}\s+{NUM} ms  comm\s+{NUM} ms  vs none\s+{NUM}$" for m in ("none", "thread")),
    ],
    "fault_tolerance": [
        rf"^\| {row} \| {NUM} \| {NUM} \| {NUM} \|$"
        for row in (
            "recovery start",
            r"\(recovery itself\)",
            "first step",
            r"\(the growth itself\)",
            "first step with 3 workers",
        )
    ],
    "many_ranks": [
        rf"^\| bsp \| 4 \| 2 \| {run} \| ok \| {NUM} \| {NUM} \| {NUM} \| {NUM} \| - \| {NUM} \| {NUM} \| "
        for run in ("job", "resume", "heal")
    ],
    "kill_battery": [
        rf"^\| bsp \| heal \| 1/1 \| 0 \| 0 \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|$",
        r"^1/1 draws survived$",
    ],
    "scaling_model": [
        rf"^\| alexnet \| {kind} \| 1 \| 8 \| {NUM} \| {NUM} \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|$"
        for kind in ("staged MPI fp32", "NCCL fp32", "NCCL bf16")
    ],
    "forwarder": [
        rf"^\| {link} \| {NUM} \| {NUM} \| {NUM} \| {frames} \|$"
        for link, frames in (
            ("bridge", "-"),
            ("forwarder, no latency", r"[\d,]+"),
            ("forwarder, 25 ms", r"[\d,]+"),
        )
    ],
    # the cells are right-aligned: under 100 s a total is padded after "="
    "heldout_accuracy": [
        rf"^digits   one process\s+{NUM}\s+{NUM}$",
        rf"^digits   asgd\s+{NUM}\s+[+-]{NUM}\s+{NUM}$",
    ],
    "images_per_5120": [rf"^googlenet-2b\s+{NUM}\s+{NUM} =\s+{NUM} \+\s+{NUM} \({NUM}\)\s+{NUM}$"],
    "lm_step": [
        rf"^\| plain \| {NUM} \| [\d,]+ \| 1\.00 \|$",
        rf"^\| runner \| {NUM} \| [\d,]+ \| {NUM} \|$",
    ],
    "precision": [
        rf"^\| cnn \| fp32 \| {NUM} \| 1\.00 \| {NUM} \|$",
        rf"^\| cnn \| bf16 \| {NUM} \| {NUM} \| ",
    ],
    "reliability": [rf"^\| cnn \|( {NUM} \|){{6}}$"],
    "startup": [rf"^/\S+\s+({NUM} \(1\.00\)\s*){{3}}$"],  # the tree timed: this checkout, wherever it is
    "step_vs_ddp": [
        rf"^\| mlp \| [\d,]+ \| 3×32×32 \| ours auto→\w+ \(.*\) \| 1×\(1\+2\) (\| {NUM} ){{6}}\| {NUM} \|$",
        rf"^  mlp\s+ours auto→\w+\s+{NUM}$",
    ],
    "time_to_accuracy": [
        rf"^\| gosgd \| dynamic \| r1 \+5 ms \| (not hit|{NUM})( \| -){{3}} \| {NUM}( \| {NUM}){{3}} \|$"
    ],
}


def scripts() -> list:
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in HELPERS)
    return [
        pytest.param(
            name,
            marks=[pytest.mark.slow]
            + ([] if name in IN_PROCESS else [pytest.mark.mpi])
            + ([pytest.mark.cluster] if name in ON_NODES else []),
        )
        for name in names
    ]


def smoke(name: str) -> subprocess.CompletedProcess:
    """``python benchmarks/<name>.py --smoke``; past ``TIMEOUT`` its whole process group (mpirun and its
    ranks too) is killed and the test fails."""
    argv = [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{name}.py --smoke ran past {TIMEOUT} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_helpers_exist():
    """The names left out as helpers are still there (else the list is stale)."""
    assert all((BENCHMARKS / f"{h}.py").exists() for h in HELPERS)


@pytest.mark.parametrize("name", scripts())
def test_benchmark_smoke(name):
    source = (BENCHMARKS / f"{name}.py").read_text()
    assert "--smoke" in source, (
        f"benchmarks/{name}.py has no --smoke mode: add one (see the other benchmarks)"
    )
    if name in ON_NODES and (why := why_unsupported()):
        pytest.skip(why)
    proc = smoke(name)
    output = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{name}.py --smoke exited with {proc.returncode}\n{output}"
    for pattern in RESULT.get(name, [NUM]):
        assert re.search(pattern, proc.stdout, re.MULTILINE), f"no line matches {pattern!r}\n{output}"
