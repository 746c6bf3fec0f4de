"""Every rule survives a worker killed (SIGKILL) at a moment drawn from the whole run, under ``continue`` and
``heal``: real ``mpirun`` jobs of 4 workers, two draws per rule and mode (tests/helpers/kill_battery.py draws
the victim, rank 0 included, and the moment: a step and a delay after it, a validation, two workers at once).
The seeds are fixed (0 and 1, then 2 and 3 where a draw was void), so CI runs the same draws each time;
``MPITRAIN_KILL_SEEDS=random`` draws new ones and ``MPITRAIN_KILL_SEEDS=3,17`` replays, as does ``python
benchmarks/kill_battery.py --rules RULE --modes MODE --seeds SEED``: its 20 new draws per rule and mode are
where new failures are looked for. A stalled draw's message holds where each rank waited. A worker lost while
a replacement joins is drawn by the benchmark only: the job comes through it or ends within seconds naming it,
not always survived (tests/jobs/test_loss_during_growth.py).

A rule and mode's two draws run side by side (two jobs on the machine's cores: their imports, most of a
job's CPU, overlap the other's waits); nothing here is timed but the stall watchdog's minute. A draw whose
moment came after the victim's run ended killed nobody (void); another is drawn, up to :data:`ATTEMPTS`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.kill_battery import MODES, cases, draw, run_draw, seeds

DRAWS = 2
ATTEMPTS = 4


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(cases()))
def test_a_worker_killed_at_a_drawn_moment_is_survived(tmp_path, case, mode):
    failed, tried, left = [], 0, seeds(ATTEMPTS, fixed=True)
    wanted = min(DRAWS, len(left))  # (a replay of one seed: one)
    with ThreadPoolExecutor(DRAWS) as pool:
        while left and tried < DRAWS:
            batch, left = left[: DRAWS - tried], left[DRAWS - tried :]
            draws = [draw(case, mode, seed, join=False) for seed in batch]
            runs = [pool.submit(run_draw, d, tmp_path / f"run{d.seed}", timeout=240) for d in draws]
            for d, out in zip(draws, (r.result() for r in runs), strict=True):
                if out.void:
                    continue
                tried += 1
                if out.problems:
                    failed.append(f"{d.describe()}: {'; '.join(out.problems)}\n{out.tail[-6000:]}")
    assert not failed, "replay with MPITRAIN_KILL_SEEDS=...:\n" + "\n\n".join(failed)
    assert tried == wanted, f"{wanted - tried} of {wanted} draws were void (no kill came): {case} {mode}"
