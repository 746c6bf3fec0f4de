"""A SIGTERM to pytest tears its fixtures down (tests/helpers/sigterm.py): the cluster tier's nodes too."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SESSION = """
import time
import pytest

@pytest.fixture(scope="session")
def held(tmp_path_factory):
    yield
    open({marker!r}, "w").write("torn down")

def test_waits(held):
    open({started!r}, "w").write("started")
    time.sleep(60)
"""


@pytest.mark.slow  # (a pytest of its own: about 3 s)
def test_a_sigterm_ends_the_run_with_its_session_fixtures_torn_down(tmp_path):
    marker, started = tmp_path / "torn_down", tmp_path / "started"
    (tmp_path / "test_hold.py").write_text(SESSION.format(marker=str(marker), started=str(started)))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.sigterm", "-p", "no:cacheprovider"]
    proc = subprocess.Popen(
        [*argv, "--rootdir", str(tmp_path), str(tmp_path / "test_hold.py")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert started.exists(), proc.communicate(timeout=10)[0]
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert marker.read_text() == "torn down", out
    assert proc.returncode != 0 and "KeyboardInterrupt" in out, out
