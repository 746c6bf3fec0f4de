"""Shared helpers: run the real command line (launcher + mpirun) in a temporary run folder."""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests import hydra_cache

pytest_plugins = ["tests.helpers.sigterm"]  # a SIGTERM tears the fixtures down (the cluster tier's nodes)

if os.environ.get("PYTEST_XDIST_WORKER"):  # the fast tier's processes (-n 2) share the cores: one torch
    torch.set_num_threads(1)  # thread each (two each on 2 cores spin against each other: 3-7x slower tests)
hydra_cache.install()  # every compose of a test process loads each config once (a copy each time)
# Fewer runs of the cyclic garbage collector: with torch, Hydra and the tests' configs in memory a full one
# costs ~0.1-0.15 s, and under the default thresholds (700, 10, 10) each of the fast tier's two processes
# spent 8-10 s collecting (about half of it halved here); cycles are still collected, less often.
gc.set_threshold(20_000, 50, 100)
ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
#: A test outside the slow tier that takes longer (setup, call and teardown) is named at the end of the run:
#: the fast tier must stay under 2 minutes on 2 cores (README). A report, not a failure.
FAST_BUDGET_S = 3.0
_fast_times: dict[str, float] = {}  # test id -> seconds, for the tests outside the slow tier


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every ``mpi`` test is also ``slow``: the fast tier never starts ``mpirun``."""
    for item in items:
        if item.get_closest_marker("mpi") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up the time of each test outside the slow tier (its setup, call and teardown)."""
    if "slow" not in report.keywords:
        _fast_times[report.nodeid] = _fast_times.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the tests outside the slow tier that took over :data:`FAST_BUDGET_S`, slowest first."""
    over = sorted(((t, n) for n, t in _fast_times.items() if t > FAST_BUDGET_S), reverse=True)
    if over:
        terminalreporter.write_sep("=", f"fast-tier tests over {FAST_BUDGET_S:.0f} s", yellow=True)
        for seconds, nodeid in over:
            terminalreporter.write_line(f"WARNING {seconds:.1f} s {nodeid}: make it smaller, or mark it slow")


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path):
        self.proc, self.dir = proc, run_dir
        self.returncode, self.output = proc.returncode, proc.stdout + proc.stderr

    @property
    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    def records(self, kind: str) -> list[dict]:
        lines = (self.dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]


def cli_argv(run_dir: Path, *overrides: str, multirun: bool = False) -> list[str]:
    """``python -m runner OVERRIDES`` with the run folder at ``run_dir`` and no progress bar."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    return [
        sys.executable,
        "-m",
        "runner",
        *(["-m"] if multirun else []),
        f"{key}={run_dir}",
        "train.progress=false",
        *overrides,
    ]


def run_cli(
    run_dir: Path, *overrides: str, timeout: float = 180, multirun: bool = False, env: dict | None = None
) -> Run:
    """``python -m runner OVERRIDES`` with the run folder at ``run_dir``; a hang fails after ``timeout``.

    ``env`` replaces the environment (default: this process's)."""
    argv = cli_argv(run_dir, *overrides, multirun=multirun)
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return Run(proc, run_dir)


@pytest.fixture
def cli(tmp_path):
    """Call as ``cli(*overrides)``; each call gets a fresh run folder under tmp_path."""
    count = iter(range(1000))

    def call(*overrides: str, **kwargs) -> Run:
        return run_cli(tmp_path / f"run{next(count)}", *overrides, **kwargs)

    return call


@functools.cache
def _session_base() -> str:
    """This test process's folder for the session folders of its mpiruns, removed when it exits."""
    base = tempfile.mkdtemp(prefix="mpitrain-tests-mpi.")
    atexit.register(shutil.rmtree, base, True)
    return base


def mpi_session_base() -> str:
    """A new folder for one mpirun's session files, as the launcher gives each job's (a killed mpirun's
    leftovers in ``$TMPDIR/ompi.<pid>`` stop a later mpirun given its pid: ``runner.launcher.session_dir``);
    all are removed when this test process exits."""
    return tempfile.mkdtemp(dir=_session_base())


def plain_mpirun_argv(n: int, *args: str) -> list[str]:
    """An mpirun command line for ``n`` ranks on this machine (oversubscribed, root allowed)."""
    from runner.hardware.mpirun import find_mpirun

    argv = [find_mpirun(None), "-n", str(n), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    return argv + list(args)


def mpirun_argv(n: int, *args: str) -> list[str]:
    """:func:`plain_mpirun_argv` with its session files in a folder of its own (:func:`mpi_session_base`)."""
    from runner.launcher.session_dir import LOCAL_TMPDIR_ENV

    [mpirun, *rest] = plain_mpirun_argv(n, *args)
    parameter = LOCAL_TMPDIR_ENV.removeprefix("PRTE_MCA_")  # the launcher's, given on the command line
    return [mpirun, "--prtemca", parameter, mpi_session_base(), *rest]


STEPS = 6
COMMON = ["train.epochs=1", f"train.max_steps={STEPS}", "optim.lr=0.1", "optim.momentum=0.9"]


@pytest.fixture(scope="module")
def openmpi() -> str:
    """Open MPI's mpirun (tests of what it says skip under another MPI)."""
    from runner.hardware.mpirun import find_mpirun, mpi_flavor

    mpirun = find_mpirun(None)
    if mpi_flavor(mpirun) != "openmpi":
        pytest.skip("the check asks Open MPI's mpirun")
    return mpirun


def _compose(overrides: list[str]):
    """Hydra's composition of ``overrides`` onto conf/config.yaml, with the runner's registration."""
    from hydra import compose, initialize_config_dir

    from runner.launcher.register import register

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def compose_config(overrides: list[str] | tuple[str, ...] = ()):
    """The config ``python -m runner OVERRIDES`` would compose (not yet checked: see ``checked_config``).

    Each caller gets a config of its own: the same overrides compose once per test process
    (``hydra_cache.compose_memo``)."""
    return hydra_cache.compose_memo(overrides, _compose)


def checked_config(overrides: list[str] | tuple[str, ...] = ()):
    """The composed config as checked schema objects (``runner.schema.config.validate``)."""
    from runner.schema.config import validate

    return validate(compose_config(overrides))


def initial_model(overrides: list[str], rank: int = 0) -> torch.nn.Module:
    """The model rank ``rank`` builds before training with ``train.same_init=false``."""
    cfg = checked_config(overrides)
    torch.manual_seed(cfg.train.seed + rank)
    return cfg.model.build()


def reference_params(
    global_batch: int, overrides: list[str], steps: int = STEPS, clip: float | None = None
) -> dict[str, torch.Tensor]:
    """One process, no MPI, plain PyTorch: ``steps`` steps with batch ``global_batch`` on the same samples
    (the gradient's norm clipped to ``clip``, if given)."""
    cfg = checked_config(overrides)
    torch.manual_seed(cfg.train.seed)
    model = cfg.model.build()
    data = cfg.data.build()
    optimizer = cfg.optim.build(model.parameters())
    loader = data.train_loader(0, 1, global_batch, cfg.train.seed)
    loader.sampler.set_epoch(0)
    for _, (x, y) in zip(range(steps), loader, strict=False):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return dict(model.named_parameters())


def params_of(path) -> dict[str, torch.Tensor]:
    state = torch.load(path)
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


def assert_close(ours: dict, ref: dict, atol: float = 1e-5) -> None:
    assert ours.keys() == ref.keys()
    for k in ref:
        diff = (ours[k] - ref[k].detach()).abs().max().item()
        assert diff <= atol, f"{k}: max |diff| {diff:.3g} > {atol}"
