"""A pytest plugin: a SIGTERM (``timeout``, ``kill``) ends the run as Ctrl-C does: its fixtures torn down.

Python's default for SIGTERM ends the process at once, so a session fixture's teardown never ran: the cluster
tier's test nodes (namespaces, Slurm daemons) and their jobs stayed on the machine until the next run swept
them. As a KeyboardInterrupt, pytest stops the test under way (its ``subprocess.run`` kills its child) and
tears down every fixture."""

from __future__ import annotations

import signal
import threading

import pytest


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread():  # (signals reach the main thread only)
        signal.signal(signal.SIGTERM, _interrupt)
