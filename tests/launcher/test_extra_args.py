"""hardware.extra_args: an option mpirun does not know is refused before anything starts, naming the key."""

from __future__ import annotations

import pytest

from runner.hardware.extra_args import check_extra_args
from runner.launcher.launch import prepare
from tests.conftest import compose_config


def test_an_unknown_option_is_named_with_its_key(openmpi):
    with pytest.raises(ValueError, match=r"hardware\.extra_args=.*does not know the option '--bogus-flag'"):
        check_extra_args(openmpi, "openmpi", ["--display-map", "--bogus-flag"])


def test_known_options_with_their_values_pass(openmpi):
    check_extra_args(openmpi, "openmpi", ["--display-map", "--map-by", "core", "-x", "FOO=1"])


def test_the_launch_is_refused_before_the_run_folder_is_written(openmpi, tmp_path):
    with pytest.raises(ValueError, match=r"^hardware\.extra_args=\['--bogus-flag'\]"):
        prepare(compose_config(["hardware.extra_args=[--bogus-flag]"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()
