"""The check of ``hardware.extra_args`` runs mpirun as the job would (``--allow-run-as-root`` where the job
runs as root, as CI does) and reports what mpirun said: a word that is no option is named as the program
mpirun would run, not as "an attempt to run as root"."""

from __future__ import annotations

import subprocess

import pytest

from runner.hardware import extra_args
from runner.hardware.extra_args import check_extra_args


def test_a_word_that_is_no_option_is_named_with_what_mpirun_said(openmpi):
    with pytest.raises(ValueError) as refused:
        check_extra_args(openmpi, "openmpi", ["--display-map", "no-such-program-of-mpitrain"])
    said = str(refused.value)
    assert said.startswith(
        "hardware.extra_args=['--display-map', 'no-such-program-of-mpitrain']: mpirun took"
    )
    assert "'no-such-program-of-mpitrain' as the program to run" in said
    assert "unable to find the specified executable" in said and "run as root" not in said
    assert "give only options and their values" in said


class Ran:
    """A stand-in for ``subprocess.run``: records the command line, answers with ``stdout``."""

    def __init__(self, stdout: str, code: int = 0):
        self.stdout, self.code, self.argv = stdout, code, []

    def __call__(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        self.argv = argv
        return subprocess.CompletedProcess(argv, self.code, self.stdout, "")


@pytest.mark.parametrize("uid", [0, 1000])
def test_the_check_runs_as_root_where_the_job_does(monkeypatch, uid):
    ran = Ran("mpirun (Open MPI) 5.0.11\n")
    monkeypatch.setattr(extra_args.subprocess, "run", ran)
    monkeypatch.setattr(extra_args.os, "geteuid", lambda: uid)
    check_extra_args("/x/mpirun", "openmpi", ["--display-map"])
    root = ["--allow-run-as-root"] if uid == 0 else []
    assert ran.argv == ["/x/mpirun", *root, "--display-map", "--version"]


def test_a_program_run_in_place_of_mpiruns_version_is_refused(monkeypatch):
    """A word that names a program mpirun finds: it runs it with --version (exit 0), and says no version
    of its own."""
    monkeypatch.setattr(extra_args.subprocess, "run", Ran("hostname 3.23\nhostname 3.23\n"))
    with pytest.raises(ValueError, match=r"mpirun ran a word of them as the program.*'hostname 3.23'"):
        check_extra_args("/x/mpirun", "openmpi", ["--display-map", "hostname"])
