"""``hydra/sweeper=mpitrain``, the default sweeper of ``-m``: Hydra's basic grid, extended.

With keys that vary together (``sweep.zip``), no point started after one not ok (``sweep.fail_fast``), the
points left of a sweep that ran before (``resume=SWEEP_DIR``, :mod:`runner.launcher.sweep_resume`), one sweep
per folder (:class:`SweepFolderLock`), and a sweep that a Ctrl-C stops (:mod:`runner.launcher.sweep_stop`).

``sweep.zip=[optim.lr,schedule.warmup_steps]`` pairs the values of the keys it names, in order, instead of
crossing them: ``optim.lr=0.1,0.2 schedule.warmup_steps=10,20`` is then 2 points (0.1 with 10, 0.2 with 20),
not 4. Zipped keys must each be given the same number of values; the pairs are crossed with the other keys'
values as one key would be (at the place of the first zipped key on the command line).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
from collections import OrderedDict
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf, open_dict

from runner.folder_files import ForeignFile, open_fd
from runner.launcher import outcomes, sweep_stop
from runner.launcher.lock import write_holder
from runner.launcher.sweep_resume import MANIFEST, batches, failed_point, plan
from runner.run_folder import EXIT, SWEEP_CONFIG, write_atomic
from runner.schema import provenance
from runner.schema.identity import identity

log = logging.getLogger("runner")

#: The name Hydra knows ``hydra/sweeper=mpitrain``'s class by (it takes plugins only from hydra_plugins).
SWEEPER_CLASS = "hydra_plugins.mpitrain.MpitrainSweeper"
#: The sweep folder's lock, held by the process that runs its sweep (:class:`SweepFolderLock`).
SWEEP_LOCK = "sweep.lock"


def zipped_grid(overrides: list[Override], zipped: list[str]) -> list[list[str]]:
    """Each point's overrides: the product of every key's values, the ``zipped`` keys' values taken together.

    Together means the i-th of each. Raises ValueError when a zipped key is not swept, or their lists differ
    in length."""
    choices: OrderedDict[str, list[list[str]]] = OrderedDict()
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise ValueError(f"{key}: the grid sweeper takes lists of values, not {override.value_type}")
            choices[key] = [[f"{key}={value}"] for value in override.sweep_string_iterator()]
        else:
            choices[key] = [[f"{key}={override.get_value_element_as_str()}"]]
    if zipped:
        swept = {o.get_key_element().lstrip("+~"): o.get_key_element() for o in overrides}
        for name in zipped:
            if name not in swept or len(choices[swept[name]]) < 2:
                raise ValueError(
                    f"sweep.zip names {name}, which this sweep does not vary: give it as many values as "
                    f"the other zipped keys ({name}=A,B,...), or leave it out of sweep.zip"
                )
        keys = [swept[name] for name in zipped]
        lengths = {name: len(choices[key]) for name, key in zip(zipped, keys, strict=True)}
        if len(set(lengths.values())) > 1:
            counts = ", ".join(f"{name}: {n}" for name, n in lengths.items())
            raise ValueError(f"sweep.zip: its keys vary together, so need as many values each ({counts})")
        pairs = [sum(values, []) for values in zip(*(choices[k] for k in keys), strict=True)]
        choices = OrderedDict(
            (k, pairs if k == keys[0] else v) for k, v in choices.items() if k == keys[0] or k not in keys
        )
    return [sum(point, []) for point in itertools.product(*choices.values())]


class SweepFolderLock:
    """A sweep folder's one owner: the process that runs its sweep, holding ``SWEEP_DIR/sweep.lock``.

    It holds the lock (an exclusive ``flock``, as :class:`runner.launcher.lock.RunFolderLock` holds a run
    folder's) while in a ``with`` block.

    A second sweep into the folder while it is held (a sweep running there, or its ``resume=``) is refused,
    naming the holder; so is a new sweep (``fresh``) into a folder that holds one already (its
    ``multirun.yaml`` or ``sweep.json``: a sweep that ended or was cut off), whose points would mix with the
    new ones. The kernel drops the lock however its holder exits. The lock fails closed: one that cannot be
    taken refuses the sweep. Each refusal is a ValueError (exit 2) naming the folder and the fix.
    """

    def __init__(self, sweep_dir: Path, fresh: bool):
        self.sweep_dir, self.fresh = sweep_dir, fresh
        self.fd: int | None = None

    def __enter__(self) -> SweepFolderLock:
        refusal = self._take()  # (raised here, not in an except block: an OSError in its chain is exit 1)
        held = [name for name in (SWEEP_CONFIG, MANIFEST) if os.path.lexists(self.sweep_dir / name)]
        if refusal is None and self.fresh and held:
            refusal = (
                f"{self.sweep_dir} already holds a sweep (its {held[0]}): a new sweep there would mix its "
                f"points with that one's; continue that sweep with resume={self.sweep_dir}, or give this one "
                "another folder (leave hydra.sweep.dir out, or name a new one)"
            )
        if refusal is not None:
            self._close()
            raise ValueError(refusal)
        write_holder(self.fd, "pid")
        return self

    def _take(self) -> str | None:
        """Take the lock; None, or why it cannot be taken (held by another process, or not to be had)."""
        path = self.sweep_dir / SWEEP_LOCK
        try:
            self.sweep_dir.mkdir(parents=True, exist_ok=True)
            self.fd = open_fd(path, os.O_RDWR | os.O_CREAT, 0o644)  # never through a link planted there
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ForeignFile as err:
            return f"{err}. Nothing was started"
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another process"
            return (
                f"{self.sweep_dir} is in use by a running sweep ({holder}): wait for it to end (then "
                f"resume={self.sweep_dir} finishes what it left), or give another folder "
                "(hydra.sweep.dir=...)"
            )
        except OSError as err:
            return (
                f"cannot lock the sweep folder: {path}: {err.strerror or err}; give a folder that can be "
                "written and locked (hydra.sweep.dir=...). Nothing was started: without the lock two sweeps "
                "could run in one folder at once"
            )
        return None

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close()

    def discard(self) -> None:
        """A new sweep refused while it holds the lock: leave no folder that holds the lock alone.

        The folder itself goes only where nothing else is in it. Not held (refused as it was taken):
        nothing."""
        if self.fd is not None and [p.name for p in self.sweep_dir.iterdir()] == [SWEEP_LOCK]:
            (self.sweep_dir / SWEEP_LOCK).unlink(missing_ok=True)
            self._close()
            try:
                self.sweep_dir.rmdir()
            except OSError:
                pass

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


class MpitrainSweeper(BasicSweeper):
    """Hydra's basic sweeper, with ``sweep.zip`` (:func:`zipped_grid`) and ``sweep.fail_fast``.

    ``sweep.fail_fast`` acts between launches. ``resume=true`` (set by ``resume=SWEEP_DIR``): the sweep folder
    ran before, its ``multirun.yaml`` is kept and only the points :func:`runner.launcher.sweep_resume.plan`
    gives are launched, each under its own number."""

    def __init__(
        self, max_batch_size: int | None = None, params: dict[str, str] | None = None, resume: bool = False
    ):
        # (not BasicSweeper.__init__: Hydra's plugin scan loads its module again, and its super() call
        # names the class of that second load, of which this one is no subclass)
        Sweeper.__init__(self)
        self.overrides, self.batch_index, self.max_batch_size = None, 0, max_batch_size
        self.params, self.resume = params or {}, resume
        self.hydra_context, self.config, self.launcher = None, None, None
        self.total = 0  # the sweep's points (its grid's)

    def sweep(self, arguments: list[str]) -> Any:
        """Launch the sweep's points (those left, when resuming); Hydra's list of each launch's returns.

        Raises ValueError before any point starts for a sweep refused (its folder in use, a zip or a point's
        config that does not hold)."""
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        settings = self.config.sweep
        with ExitStack() as held:
            lock = SweepFolderLock(sweep_dir, fresh=not self.resume)
            try:
                held.enter_context(lock)
                # (Ctrl-C stops it, from here on: checking every point's values takes a while)
                held.enter_context(sweep_stop.taking_signals(sweep_dir, 0))
                jobs = self._jobs(sweep_dir, arguments)
                sweep_stop.count_points(self.total)
            except ValueError:
                outcomes.REFUSED.add(sweep_dir)  # nothing started: no report is written into the folder
                if not self.resume:
                    lock.discard()
                raise
            returns = []
            for start, batch in batches(jobs, self.max_batch_size):
                if sweep_stop.requested():
                    break
                if settings.fail_fast and (why := failed_point(sweep_dir, -1)) is not None:
                    log.warning("sweep.fail_fast: %s; the sweep starts no further point", why)
                    break
                self.validate_batch_is_legal(batch)
                with sweep_stop.held_from_new_processes(spawns=self._spawns_workers()):
                    returns.append(
                        self.launcher.launch(sweep_stop.UntilStopped(batch), initial_job_idx=start)
                    )
            if sweep_stop.requested():
                sweep_stop.record_unstarted(sweep_dir, jobs, list(arguments))
        for results in returns:
            for result in results:
                if sweep_stop.requested():
                    self._take_stopped(result, list(arguments))
                else:  # a point that raised (run elsewhere) ends the sweep as Hydra's would
                    _ = result.return_value
        return returns

    def _spawns_workers(self) -> bool:
        """Whether the launcher runs the points in worker processes it starts on this machine (joblib's)."""
        if type(self.launcher).__name__ != "JoblibLauncher":
            return False
        joblib_log = logging.getLogger("hydra_plugins.hydra_joblib_launcher._core")
        if not joblib_log.filters:  # its settings' repr, a line of joblib's internals, is not for the user
            joblib_log.addFilter(lambda record: not record.getMessage().startswith("Joblib.Parallel("))
        return True

    @staticmethod
    def _take_stopped(result: JobReturn, sweep: list[str]) -> None:
        """Take the return of a point of a stopped sweep without raising: the sweep goes on to its report.

        A point that raised (run elsewhere: preempted, as the stop asked, or failed before it) counts for
        the exit status."""
        if result.status != JobStatus.FAILED:
            return
        err = result._return_value  # (its return_value writes "Error executing job ..." for a preemption)
        if isinstance(err, Exception):
            status = str(getattr(err, "status", "failed"))
            name = identity(list(result.overrides), sweep)["name"]
            outcomes.NOT_OK.append((name, status, EXIT.get(status, EXIT["failed"])))

    def _jobs(self, sweep_dir: Path, arguments: list[str]) -> list[tuple[int, list[str]]]:
        """The points to launch, as ``(number, overrides)``.

        Every point of the grid, or, when resuming, those :func:`runner.launcher.sweep_resume.plan` gives (a
        new sweep's config is saved first)."""
        assert self.config is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        parsed = parser.parse_overrides([*self._parse_config(), *arguments])
        grid = zipped_grid(parsed, list(self.config.sweep.zip or ()))
        self.total = len(grid)
        if self.hydra_context.config_loader is not None:
            check_values(grid, self.point_config, list(arguments))
        if not self.resume:
            OmegaConf.save(self.config, sweep_dir / SWEEP_CONFIG)
            text = provenance.sweep_text(OmegaConf.select(self.config, "hydra.overrides", default={}))
            if (own := provenance.mark(sweep_dir, text)) is not None:
                write_atomic(sweep_dir / provenance.MARK, own)
            return list(enumerate(grid))
        # (without Hydra's config loader there is nothing to compose the points' configs with)
        composed = self.point_config if self.hydra_context.config_loader is not None else None
        jobs = plan(sweep_dir, grid, list(arguments), bool(self.config.sweep.retry), composed)
        log.info("resuming the sweep %s: %d of %d points to run", sweep_dir, len(jobs), len(grid))
        return jobs

    def point_config(self, overrides: list[str]) -> DictConfig:
        """The config a point of this sweep with ``overrides`` composes to (without Hydra's node, unresolved).

        It is what the point's ``config.yaml`` holds, resolved, but for keys a resumed run may change."""
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg


def check_values(grid: list[list[str]], composed: Any, sweep: list[str]) -> None:
    """Every point's values checked before the first starts.

    (A bad value of the last point was found hours later.) Raises a ValueError with a line per problem, naming
    the points it is found in where not all. ``composed``: the config a point's overrides compose to. What
    only a point's run can tell (a path the data set fetches, its interpolations of Hydra's node) is left to
    it."""
    from runner.schema import READING_RUN_FOLDER, ConfigErrors
    from runner.schema.config import validate

    found: dict[str, list[str]] = {}
    level, token = log.level, READING_RUN_FOLDER.set(True)
    log.setLevel(logging.ERROR)  # (each point's warnings are said when it runs)
    try:
        for overrides in grid:
            try:
                validate(composed(list(overrides)))
                continue
            except ConfigErrors as err:
                problems = err.problems
            except ValueError as err:
                problems = [str(err).strip()]
            except Exception:  # (said by the point itself when it runs)
                continue
            name = identity(list(overrides), sweep)["name"]
            for problem in problems:
                found.setdefault(problem, []).append(name)
    finally:
        log.setLevel(level)
        READING_RUN_FOLDER.reset(token)
    if found:
        raise ConfigErrors(
            [
                p if len(names) == len(grid) else f"{p} (point {', '.join(names)})"
                for p, names in found.items()
            ]
        )


def register_sweeper() -> None:
    """Make ``hydra/sweeper=mpitrain``'s class known to Hydra (idempotent).

    Its config is ``conf/hydra/sweeper/mpitrain.yaml``. Hydra takes sweepers only from its ``hydra_plugins``
    package, by their config's name."""
    from hydra.core.plugins import Plugins

    Plugins.instance().class_name_to_class[SWEEPER_CLASS] = MpitrainSweeper
