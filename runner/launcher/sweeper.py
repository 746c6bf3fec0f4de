"""``hydra/sweeper=mpitrain``, the default sweeper of ``-m``: Hydra's basic grid, with keys that vary
together (``sweep.zip``), no point started after one not ok (``sweep.fail_fast``), and the points left of
a sweep that ran before (``resume=SWEEP_DIR``, :mod:`runner.launcher.sweep_resume`).

``sweep.zip=[optim.lr,schedule.warmup_steps]`` pairs the values of the keys it names, in order, instead
of crossing them: ``optim.lr=0.1,0.2 schedule.warmup_steps=10,20`` is then 2 points (0.1 with 10, 0.2
with 20), not 4. Zipped keys must each be given the same number of values; the pairs are crossed with the
other keys' values as one key would be (at the place of the first zipped key on the command line).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf

from runner.launcher.sweep_resume import batches, failed_point, plan
from runner.run_folder import SWEEP_CONFIG

log = logging.getLogger("runner")

#: The name Hydra knows ``hydra/sweeper=mpitrain``'s class by (it takes plugins only from hydra_plugins).
SWEEPER_CLASS = "hydra_plugins.mpitrain.MpitrainSweeper"


def zipped_grid(overrides: list[Override], zipped: list[str]) -> list[list[str]]:
    """Each point's overrides: the product of every key's values, the ``zipped`` keys' values taken
    together (the i-th of each). Raises ValueError when a zipped key is not swept, or their lists differ
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


class MpitrainSweeper(BasicSweeper):
    """Hydra's basic sweeper, with ``sweep.zip`` (:func:`zipped_grid`) and ``sweep.fail_fast`` between
    launches; ``resume=true`` (set by ``resume=SWEEP_DIR``): the sweep folder ran before, its
    ``multirun.yaml`` is kept and only the points :func:`runner.launcher.sweep_resume.plan` gives are
    launched, each under its own number."""

    def __init__(
        self, max_batch_size: int | None = None, params: dict[str, str] | None = None, resume: bool = False
    ):
        # (not BasicSweeper.__init__: Hydra's plugin scan loads its module again, and its super() call
        # names the class of that second load, of which this one is no subclass)
        Sweeper.__init__(self)
        self.overrides, self.batch_index, self.max_batch_size = None, 0, max_batch_size
        self.params, self.resume = params or {}, resume
        self.hydra_context, self.config, self.launcher = None, None, None

    def sweep(self, arguments: list[str]) -> Any:
        """Launch the sweep's points (those left, when resuming); Hydra's list of each launch's returns."""
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        settings = self.config.sweep
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        parsed = parser.parse_overrides([*self._parse_config(), *arguments])
        grid = zipped_grid(parsed, list(settings.zip or ()))
        if self.resume:
            jobs = plan(sweep_dir, grid, list(arguments), bool(settings.retry))
            log.info("resuming the sweep %s: %d of %d points to run", sweep_dir, len(jobs), len(grid))
        else:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(self.config, sweep_dir / SWEEP_CONFIG)
            jobs = list(enumerate(grid))
        returns = []
        for start, batch in batches(jobs, self.max_batch_size):
            if settings.fail_fast and (why := failed_point(sweep_dir, -1)) is not None:
                log.warning("sweep.fail_fast: %s; the sweep starts no further point", why)
                break
            self.validate_batch_is_legal(batch)
            returns.append(self.launcher.launch(batch, initial_job_idx=start))
        for results in returns:
            for result in results:
                _ = result.return_value  # a point that raised (run elsewhere) ends the sweep as Hydra's would
        return returns


def register_sweeper() -> None:
    """Make ``hydra/sweeper=mpitrain``'s class (``conf/hydra/sweeper/mpitrain.yaml``) known to Hydra
    (idempotent), which takes sweepers only from its ``hydra_plugins`` package, by their config's name."""
    from hydra.core.plugins import Plugins

    Plugins.instance().class_name_to_class[SWEEPER_CLASS] = MpitrainSweeper
