"""Asynchronous DiLoCo: asynchronous local SGD with Delayed Nesterov and Dynamic Local Updates.

Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato 2024, "Asynchronous Local-SGD Training for
Language Modeling", arXiv 2401.09135. The parameters x live on ``servers`` extra ranks, sharded as ASGD's
(runner/rules/asgd.py, whose servers this rule reuses). Each worker, without waiting for the others, takes H_i
steps of the loop's (inner) optimizer from the parameters x_start it last fetched, reaching x_i; it pushes its
outer gradient g = x_start − x_i, fetches the servers' x and continues from it (x_start ← x). A server applies
the pushes in arrival order, the t-th (t = 1, 2, ...) with **Delayed Nesterov** (the paper's Algorithm;
momentum β = ``outer_momentum``, outer lr η, buffer delay N = ``delay``, momentum activation c =
``momentum_activation``):

    A ← A + g
    if t mod N = 0:  m ← β·m + A/N;  x ← x − η·((1 − cN + c)·β·m + g/N);  A ← 0
    else:            x ← x − η·(c·β·m + g/N)

so the momentum moves once per N pushes, on their mean, and stale pushes in between are plain SGD-like steps.
With N = 1 it is Nesterov, ``torch.optim.SGD(nesterov=True)``'s update as DiLoCo takes it (b ← μ·b + Δ;
x ← x − η·(Δ + μ·b)), bit for bit (tested); with one worker (N = 1 by default) it is DiLoCo with one worker.

**Dynamic Local Updates**: each worker measures its speed s_i (steps per second of training, over its recent
rounds: the mean of the last round's and the previous estimate) and sends it with its pushes; the first
server keeps every worker's latest and answers each fetch with the fastest, s_max; the worker's next round
has H_i = max(1, round(H·s_i/s_max)) steps (at most H), so that all workers push at about the same rate
(``dynamic_steps: false``: H for all); a speed within ``dynamic_tolerance`` of s_max takes H (noise). The
speed counts the time from a step's end to the next's, not a validation's or a checkpoint's.

Data: the workers do not step together (``asynchronous``), so they take batches by dynamic assignment
(``data.assignment=auto``). The reported model is the servers' x (BatchNorm statistics: the workers' mean);
a validation that all workers make (epoch ends) first pushes each worker's steps of the round so far, as
ASGD does; worker 0 validates alone otherwise (``train.val_every`` < 1). Checkpoints, 16-bit exchange,
lost workers and growth: as ASGD's.

Choose it over ``rule=diloco`` when workers differ in speed: nobody waits for the slowest at each round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.lazy import lazy_import
from runner.rules.asgd import ASGD, ASGDConfig
from runner.rules.base import RuleContext, no_grad
from runner.rules.diloco import DiLoCoConfig
from runner.schema import RuleConfig, require

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


@dataclass
class AsyncDiLoCoConfig(RuleConfig):
    inner_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    delay: int | None = None
    momentum_activation: float = 0.0
    dynamic_steps: bool = True
    dynamic_tolerance: float = 0.25
    servers: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        # DiLoCo's checks of the keys the two share
        shared = {"inner_steps": self.inner_steps, "outer_lr": self.outer_lr}
        DiLoCoConfig(**shared, outer_momentum=self.outer_momentum, nesterov=False)
        require(
            self.delay is None or self.delay >= 1,
            "delay",
            self.delay,
            "pushes per momentum update (N), >= 1, or null for the number of workers",
        )
        require(
            0 <= self.momentum_activation <= 1 / (self.delay or 1),
            "momentum_activation",
            self.momentum_activation,
            "c must be in [0, 1/N] (the paper's default 0)",
        )
        require(self.servers >= 1, "servers", self.servers, "need at least one parameter-server rank")
        require(
            0 <= self.dynamic_tolerance < 1,
            "dynamic_tolerance",
            self.dynamic_tolerance,
            "a share of the fastest worker's speed in [0, 1): speeds within it of the fastest take H steps",
        )

    def extra_ranks(self) -> int:
        return self.servers

    def asynchronous(self) -> bool:
        return True

    def check_devices(self, devices: int) -> None:
        ASGDConfig(servers=self.servers).check_devices(devices)
        require(
            self.momentum_activation <= 1 / (self.delay or devices),
            "momentum_activation",
            self.momentum_activation,
            f"c must be in [0, 1/N]; N = rule.delay, or devices ({devices}) when null",
        )

    def build(self, ctx: RuleContext) -> AsyncDiLoCo:
        return AsyncDiLoCo(self, ctx)


@no_grad
def delayed_nesterov(
    cfg: AsyncDiLoCoConfig,
    delay: int,
    t: int,
    x: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    g: torch.Tensor,
) -> None:
    """The t-th push's (t = 1, 2, ...) Delayed Nesterov update of ``x`` in place with outer gradient ``g``.

    ``state``: the momentum m and the accumulated outer gradients A (the module's docstring)."""
    momentum, accumulated = state
    beta, c = cfg.outer_momentum, cfg.momentum_activation
    accumulated.add_(g)
    step = g / delay
    if t % delay == 0:
        momentum.mul_(beta).add_(accumulated / delay)
        step = step.add(momentum, alpha=beta * (1 - c * delay + c))
        accumulated.zero_()
    elif c > 0:
        step = step.add(momentum, alpha=c * beta)
    x.add_(step, alpha=-cfg.outer_lr)


def local_steps(cfg: AsyncDiLoCoConfig, speed: float, fastest: float) -> int:
    """H_i, a worker's steps in its next round, from its speed and the fastest worker's (DyLU).

    A speed within ``dynamic_tolerance`` of the fastest takes H: equal workers on a shared machine measure
    0.8-0.9 of the fastest's (the fastest of noisy speeds is high), and H_i of 8-9 out of 10 cost async
    DiLoCo 2 points of accuracy on the held-out signals task (benchmarks/README.md)."""
    share = min(1.0, speed / fastest)
    if share >= 1 - cfg.dynamic_tolerance:
        return cfg.inner_steps
    return max(1, round(cfg.inner_steps * share))


class AsyncDiLoCo(ASGD):
    """H_i local steps, then push the outer gradient to ASGD's servers (Delayed Nesterov there) and fetch."""

    def __init__(self, cfg: AsyncDiLoCoConfig, ctx: RuleContext):
        plain = ASGDConfig(servers=cfg.servers, comm_dtype=cfg.comm_dtype, momentum_correction="none")
        super().__init__(plain, ctx)
        self.cfg = cfg
        self.delay = cfg.delay or self.num_workers
        self.push_header = torch.zeros(2, dtype=torch.float64)  # version fetched, this worker's speed
        self.reply = torch.zeros(2, dtype=torch.float64)  # version, the fastest worker's speed
        # workers
        self.local_steps = cfg.inner_steps  # H_i
        self.round_step = 0
        # the speed counts the time from one step's end to the next's, not a validation's or a checkpoint's
        # (on a machine where one takes a round's time, H_i fell for whoever had one in its round)
        self.busy, self.timed = 0.0, 0  # the round's timed seconds and steps
        self.paused = True  # the next step's interval is not timed (the first's holds the start)
        self.tick = time.perf_counter()  # the last step's end (after its push and fetch)
        self.speed = self.fastest = 0.0  # steps per second: this worker's last round, the fastest worker's
        # servers
        zeros = torch.zeros_like(self.shard) if self.is_server else None
        self.outer = (zeros, zeros.clone()) if self.is_server else None  # m, A
        self.speeds: dict[int, float] = {}  # the first server: each worker's latest speed, by launch id

    def after_step(self, step: int) -> None:
        if not self.paused:
            self.busy, self.timed = self.busy + time.perf_counter() - self.tick, self.timed + 1
        self.paused = False
        self.round_step += 1
        if self.round_step >= self.local_steps:
            if self.timed:
                rate = self.timed / max(self.busy, 1e-9)
                self.speed = rate if self.speed == 0 else (self.speed + rate) / 2  # recent rounds, halved
            self.push()
            self.fetch()
            self.round_step, self.busy, self.timed = 0, 0.0, 0
            if self.cfg.dynamic_steps and self.fastest > 0:
                self.local_steps = local_steps(self.cfg, self.speed, self.fastest)
        self.tick = time.perf_counter()

    def pause(self) -> None:
        """A validation or a checkpoint comes before the next step: its time is not the worker's speed."""
        self.paused = True

    def eval_models(self) -> dict[str, torch.nn.Module]:
        self.pause()
        return super().eval_models()

    def solo_model(self) -> torch.nn.Module:
        self.pause()
        return super().solo_model()

    def before_checkpoint(self, step: int) -> None:
        self.pause()
        super().before_checkpoint(step)

    # -- the hooks of ASGD's protocol ------------------------------------------------------------------
    def _push_header(self, version: int) -> None:
        self.push_header[0], self.push_header[1] = version, self.speed

    def _read_reply(self, server: int) -> None:
        if server == self.server_ranks[0]:
            self.fastest = float(self.reply[1])

    def _reply_header(self) -> None:
        self.reply[0], self.reply[1] = self.version, max(self.speeds.values(), default=0.0)

    def _apply_push(self, delta: torch.Tensor, staleness: int, source: int) -> None:
        """Delayed Nesterov with the outer gradient g = x_start − x_i = −Δ (Δ: what the worker pushed)."""
        self.speeds[self.comm.launch_rank(source)] = float(self.push_header[1])
        delayed_nesterov(self.cfg, self.delay, self.version + 1, self.shard, self.outer, delta.neg())

    # -- records and checkpoints -----------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """ASGD's pushes and fetches, and the workers' fewest and most local steps per round now."""
        fewest = self.workers.allreduce_values([self.local_steps], "min")[0]
        most = self.workers.allreduce_values([self.local_steps], "max")[0]
        return {**super().metrics(), "local_steps_min": fewest, "local_steps_max": most}

    def state_dict(self) -> dict[str, Any]:
        """ASGD's, the servers' m and A, the workers' place in the round and H_i.

        The speeds are measurements, not state: they are measured afresh after a resumption (until then H_i
        stays)."""
        state = super().state_dict()
        if self.is_server:
            return {**state, "outer": [t.clone() for t in self.outer]}
        return {**state, "round_step": self.round_step, "local_steps": self.local_steps}

    @no_grad
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.is_server:
            for mine, saved in zip(self.outer, state["outer"], strict=True):
                mine.copy_(saved)
        else:
            self.round_step, self.local_steps = state["round_step"], state["local_steps"]
