"""``mpitrain`` (``python -m runner``): compose the config with Hydra and run one mpirun job.

A sweep runs one job per sweep point.

This process composes, checks, starts and supervises; it imports neither torch nor MPI. Its exit status says
how a single run ended (the table is :mod:`runner.launcher.launch`'s): 0 ok, 1 failed, 2 invalid input
(Hydra's own compose errors included), 3 diverged, 4 stalled, 5 preempted, 130 interrupted. A sweep runs every
point whatever the others did (``sweep.fail_fast``: none after one not ok), and exits with the status of its
first point not ok; ``resume=SWEEP_DIR`` finishes a sweep (:mod:`runner.launcher.sweep_resume`). A sweep
stopped by a signal (Ctrl-C: :mod:`runner.launcher.sweep_stop`) exits 130, its last line the ``resume=``
command.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from runner.folder_files import read_text, unwritten
from runner.launcher import outcomes, sweep_stop
from runner.launcher.help import CONF, PRIMARY, register_help
from runner.launcher.launch import JobEnded, launch
from runner.launcher.lock import RunFolderLock
from runner.launcher.outcomes import invalid_input, os_error
from runner.launcher.register import check_folders, check_plugins, register
from runner.launcher.sweep_resume import (
    changed_overrides,
    end_point,
    resumed_argv,
    start_point,
)
from runner.launcher.sweeper import register_sweeper
from runner.run_folder import (
    CONFIG,
    EVAL,
    EXIT,
    HYDRA_CONFIG,
    HYDRA_OVERRIDES,
    MODEL,
    SWEEP_CONFIG,
    TTY_ENV,
)
from runner.schema.identity import command_line_overrides, concurrent_points, identity, sweep_overrides
from runner.schema.secrets import hide_file

log = logging.getLogger("runner")
register()
register_sweeper()
register_help()
# A log file that cannot be written (full disk) must not print a traceback per message: the console
# handler still shows them, and the launcher reports the run folder's I/O errors itself.
logging.raiseExceptions = False


# An absolute path: the console script imports this module as runner.launcher.cli, for which Hydra would look
# for a package runner.conf (with an __init__.py) instead of the folder next to this file.
@hydra.main(config_path=str(CONF), config_name=PRIMARY, version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train; returns the final value of the monitored metric (``train.monitor``, e.g. ``val_acc``).

    The value is returned so that sweepers (e.g. Optuna) can optimise it."""
    hydra_cfg = HydraConfig.get()
    single = hydra_cfg.mode == RunMode.RUN
    hide_hydra_records(hydra_cfg, single)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep = None if single else sweep_overrides(Path(hydra_cfg.sweep.dir))
    if sweep is None and not single and in_process(hydra_cfg.launcher):  # Optuna writes no multirun.yaml
        sweep = command_line_overrides(sys.argv[1:])
    ident = identity(list(hydra_cfg.overrides.task), sweep)
    share = 1 if single else concurrent_points(hydra_cfg.launcher, sweep)
    if share > 1:  # sweep points that run at once must not draw their progress bars over each other
        os.environ[TTY_ENV] = "0"
    point = None if single or cfg.eval else (Path(hydra_cfg.sweep.dir), hydra_cfg.job.num)
    if point is not None and not point_starts(point, ident, run_dir, hydra_cfg, cfg.sweep.fail_fast):
        return float("nan")
    status, reason = "failed", None
    try:
        if cfg.eval:
            return evaluate(cfg)
        if cfg.resume:
            run_dir = Path(cfg.resume).expanduser()
        with RunFolderLock(run_dir, fresh=not cfg.resume):  # one job per run folder
            if cfg.resume:  # the run's own folder, config and identity; the command line may change safe keys
                from runner.launcher.resume import Finished, resume_config

                given = list(hydra_cfg.overrides.task)  # a sweep point's: less its own (and sweep.*)
                try:
                    cfg, run_dir = resume_config(cfg, given if single else changed_overrides(run_dir, given))
                except Finished as done:
                    log.info("%s", done)
                    status = "ok"
                    return None
                if single:  # (a resumed sweep point keeps its name: resume= is not part of it)
                    ident = None
            summary = launch(cfg, run_dir, ident, label=None if single else ident["name"], share=share)
            status = "ok"
    except (ValueError, OmegaConfBaseException) as err:  # a user error, named with its key and fix
        status, reason = "invalid", outcomes.one_line(err)
        log.error("%sinvalid input, nothing was started: %s", tag(single, ident), err)
        if not single and not in_process(hydra_cfg.launcher):
            raise
        return not_ok(single, ident, "invalid", EXIT["invalid"])
    except JobEnded as err:
        status = err.status
        (log.warning if err.status == "preempted" else log.error)(
            "%sjob %s: %s", tag(single, ident), err.status, err
        )
        if not single and not in_process(hydra_cfg.launcher):
            raise  # the sweep's own process hears of it only so
        return not_ok(single, ident, err.status, err.code)
    finally:
        if point is not None:
            end_point(*point, status, reason)
    return summary.get(f"final_{summary.get('monitor', 'val_acc')}")


def point_starts(
    point: tuple[Path, int], ident: dict[str, Any], run_dir: Path, hydra_cfg: DictConfig, fail_fast: bool
) -> bool:
    """Whether this sweep point starts.

    It does not once the sweep was stopped (Ctrl-C), nor, with ``sweep.fail_fast``, once another point failed.
    From here on the point follows the sweep's stops."""
    sweep_stop.follow(point[0], elsewhere=not in_process(hydra_cfg.launcher))
    subdir = hydra_cfg.output_subdir  # (Hydra's records of the point: .hydra/)
    if sweep_stop.not_started(point, ident, run_dir, run_dir / subdir if subdir else None):
        return False
    return start_point(*point, ident, fail_fast=fail_fast)


def hide_hydra_records(hydra_cfg: DictConfig, single: bool) -> None:
    """Hide ``hardware.env``'s values (:mod:`runner.schema.secrets`) in Hydra's records of this job.

    The records are this job's (``.hydra/``) and its sweep's (``multirun.yaml``), written before this function
    runs."""
    if hydra_cfg.output_subdir:
        records = Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir
        for name in (CONFIG, HYDRA_CONFIG, HYDRA_OVERRIDES):  # (Hydra's config.yaml: named as the run's)
            hide_file(records / name)
    if not single:
        hide_file(Path(hydra_cfg.sweep.dir) / SWEEP_CONFIG)


def tag(single: bool, ident: dict[str, Any] | None) -> str:
    """A sweep point's label for the launcher's lines about it (points may run at once)."""
    return "" if single or not ident else f"[{ident['name']}] "


def in_process(launcher: DictConfig) -> bool:
    """Whether a sweep's points run in this process (Hydra's basic launcher), one after the other."""
    return str(launcher.get("_target_", "")).endswith("BasicLauncher")


def not_ok(single: bool, ident: dict[str, Any] | None, status: str, code: int) -> float:
    """A run that did not end ok: a single run exits with its status at once.

    A sweep point run in this process is recorded (the sweep exits with it after its other points) and gives
    the sweeper NaN (Optuna: a failed trial), not an exception, which would stop the sweep with a traceback.
    (Points run in other processes raise: their sweep hears of them only so.)"""
    if single:
        raise SystemExit(code) from None
    outcomes.NOT_OK.append((ident["name"] if ident else "?", status, code))
    return float("nan")


def evaluate(cfg: DictConfig) -> float:
    """``eval=RUN_DIR``: the metrics of the run's saved model on its validation data.

    Computed by :mod:`runner.rank.evaluate` (one process, no MPI), printed and written to
    ``RUN_DIR/eval.json``; returns the run's monitored metric."""
    run_dir = Path(cfg.eval)
    if cfg.resume:
        raise ValueError(f"eval={cfg.eval} and resume={cfg.resume}: give one of them")
    for name in (CONFIG, MODEL):
        if not (run_dir / name).is_file():
            raise ValueError(
                f"eval={cfg.eval}: there is no {run_dir / name}; give the folder of a run that ended with "
                "its model saved (train.save_model=rank0 or all)"
            )
    done = subprocess.run([sys.executable, "-m", "runner.rank.evaluate", str(run_dir)])
    if done.returncode == EXIT["invalid"]:
        raise SystemExit(EXIT["invalid"])
    if done.returncode != 0:
        log.error("evaluation of %s failed (exit %d): the error is above", run_dir, done.returncode)
        raise SystemExit(EXIT["failed"])
    record = json.loads(read_text(run_dir / EVAL))
    return record[record["monitor"]]


def os_cause(err: OSError) -> str:
    """An OS error before the job started, in one line.

    A full disk's (Hydra's write of the run folder's ``.hydra/``) is named with its file and the fix."""
    return unwritten(err, "hydra.run.dir") or str(err.strerror or err)


def completion_query(argv: list[str]) -> bool:
    """Whether ``argv`` is a shell's tab-completion query (``-sc query=bash``).

    Such a query is made by the function that ``-sc install=bash`` installs, and reads the command line typed
    so far from ``COMP_LINE``."""
    flags = ("-sc", "--shell-completion")
    return any(
        (a in flags and i + 1 < len(argv) and argv[i + 1].startswith("query="))
        or a.startswith(tuple(f"{f}=query=" for f in flags))
        for i, a in enumerate(argv)
    )


def unquoted(line: str) -> str:
    """``COMP_LINE`` as Hydra's completion reads it, a word per space.

    Each word is as the shell would give it to the command, without its quotes (the documented
    ``'hydra.searchpath=[file://conf]'``, quoted for zsh, which would glob the brackets, is otherwise no
    override to Hydra). A quote still open (the word being typed) is closed; a space at the end (a new word
    begun) is kept."""
    for closing in ("", "'", '"'):
        try:
            words = shlex.split(line + closing)
        except ValueError:
            continue
        return " ".join(words) + (" " if line.endswith(" ") and not closing else "")
    return line


#: Hydra's flags that take a value (the next word); the others take none (``-m``, ``--resolve``).
VALUED_FLAGS = ("-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd")
VALUED_FLAGS += ("--config-dir", "-sc", "--shell-completion", "--experimental-rerun")


def flags_first(argv: list[str]) -> list[str]:
    """``argv`` with Hydra's flags (and their values) before the overrides, in their order.

    argparse takes no override after a flag that follows an override (``a=1 -m b=2``: "unrecognized arguments:
    b=2"). Unchanged where ``-i``/``--info`` (whose value is optional) is given."""
    if any(a in ("-i", "--info") or a.startswith("--info=") for a in argv):
        return argv
    flags, overrides, i = [], [], 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("-"):  # (no override starts with "-")
            takes = word in VALUED_FLAGS and i + 1 < len(argv)
            flags += argv[i : i + 1 + takes]
            i += 1 + takes
        else:
            overrides.append(word)
            i += 1
    return flags + overrides


def run() -> None:
    """:func:`main`, with a config Hydra could not compose named in one line, exit status 2."""
    # The console script's sys.path starts with its own folder, python -m runner's with the working folder,
    # where a project's own packages are (data.train._target_=my_project...): both must find them.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if Path(sys.argv[0]).resolve() == Path(__file__).resolve().parents[1] / "__main__.py":
        sys.argv[0] = "mpitrain"  # python -m runner: named as Hydra's help and completion name it
    traceback_wanted = "HYDRA_FULL_ERROR" in os.environ
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors here instead of printing its advice
    completing = completion_query(sys.argv[1:])
    if completing:
        os.environ["COMP_LINE"] = unquoted(os.environ.get("COMP_LINE", ""))
    sys.argv[1:] = flags_first(sys.argv[1:])
    try:
        resumed = resumed_argv(sys.argv[1:])  # resume=SWEEP_DIR: the sweep's own command line
        if resumed is not None:
            sys.argv[1:] = resumed
        check_folders(sys.argv[1:])
        check_plugins(sys.argv[1:])  # hydra/launcher=joblib without the joblib extra: say so
        main()
    except KeyboardInterrupt:  # a Ctrl-C before the run or the sweep took the signals: no job started
        if traceback_wanted:
            raise
        print("interrupted (SIGINT) while starting: no job was started", file=sys.stderr)
        sys.exit(EXIT["interrupted"])
    except BrokenPipeError:  # `mpitrain --help | head`: the reader has gone, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as err:
        if traceback_wanted:
            raise
        if completing:  # the shell prints what we print on stderr into the user's prompt: no candidates
            sys.exit(1)
        if (cause := os_error(err)) is not None:  # not the input's fault: status failed, in one line
            print(f"error: nothing was started: {os_cause(cause)}", file=sys.stderr)
            sys.exit(EXIT["failed"])
        if not invalid_input(err):
            raise
        from runner.launcher.explain import explain

        print(f"error: invalid input, nothing was started: {explain(err, sys.argv[1:])}", file=sys.stderr)
        sys.exit(EXIT["invalid"])
    if outcomes.NOT_OK:
        ended = ", ".join(f"{name} {status}" for name, status, _ in outcomes.NOT_OK)
        log.error("%d sweep point(s) did not end ok: %s", len(outcomes.NOT_OK), ended)
    if (stopped := sweep_stop.last_line()) is not None:  # Ctrl-C: the command that finishes it, last
        log.warning(stopped)
        sys.exit(EXIT["interrupted"])
    if outcomes.NOT_OK:
        sys.exit(outcomes.NOT_OK[0][2])


if __name__ == "__main__":
    run()
