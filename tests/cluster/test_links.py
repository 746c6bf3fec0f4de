"""Emulated links tell the truth about real ones (issue 35, item 2): a job's mean step time on 2 namespaced
nodes whose links ``tc tbf`` limits, beside the same job on one machine with the links emulated at that rate
(``benchmarks/links.py``, whose table is in benchmarks/README.md), agree within 25%.

Timed, unlike the rest of the suite, since agreeing in time is the claim: one short run a side, the real
side unbound (``benchmarks.links.UNBOUND``), each rank one thread (the nodes share the machine's cores).
On this project's 2-core machine single runs gave 0.85-1.05 (load 1.4-2.9); before each rank took one
thread, with 2 threads a rank on 2 shared cores, they swung 0.69-1.36: a failure under heavy load
(``uptime`` above 6) is worth a rerun before it is believed.
"""

from __future__ import annotations

import pytest

from benchmarks.links import MLP, cell, job

pytestmark = pytest.mark.cluster

#: The band of emulated / real step time the issue asks for.
BAND = (0.75, 1.25)
#: Steps a run: BSP exchanges every step, DiLoCo every 4th (the mean leaves out the first three).
STEPS = {"bsp": 10, "diloco": 16}


@pytest.mark.parametrize("rate", ["100mbit", "1gbit"])
@pytest.mark.parametrize("rule", ["bsp", "diloco"])
def test_emulated_step_time_is_within_25_percent_of_real_links(cluster, tmp_path, rule, rate):
    """BSP and DiLoCo on the MLP 3x1024 (8.7 MB of gradients or parameters an exchange), 2 nodes of 1 rank,
    at 100 Mbit/s and 1 Gbit/s."""
    true, fake = cell(cluster, tmp_path, job(rule, MLP, steps=STEPS[rule]), rate, repeats=1)
    assert true is not None
    ratio = fake / true
    assert BAND[0] <= ratio <= BAND[1], (
        f"{rule} at {rate}: emulated {fake:.1f} ms, real {true:.1f} ms ({ratio:.2f})"
    )
