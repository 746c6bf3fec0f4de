"""``python -m tests.cluster``: the docs' way to try multi-node on one machine."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.cluster.conftest import leftovers, require_nodes
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster


def test_a_command_runs_on_node_1_with_the_nodes_named_and_its_status_kept():
    """The command sees node 1's hostname and the other nodes by name; its exit status is the module's,
    and nothing of the nodes is left afterwards."""
    require_nodes()
    script = "hostname; getent hosts {n2} >/dev/null && echo found {n2}; exit 3"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.cluster", "2", "--", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    up = re.search(r"nodes up in [\d.]+ s: (mt[0-9a-f]{4})n1, (mt[0-9a-f]{4})n2", proc.stdout)
    assert up, proc.stdout
    tag = up.group(1)
    assert f"{tag}n1\nfound {tag}n2\n" in proc.stdout
    assert leftovers(tag) == []
