"""EASGD: elastic averaging SGD (Zhang, Choromanska, LeCun 2015, arXiv 1412.6651).

Each of the N workers trains its own parameters x_i; a center variable x̃ ties them together. Every ``tau``
local steps worker i takes an elastic step with moving rate ``alpha``, computed from the values read before
either is written:

    d_i = alpha · (x_i − x̃);    x_i ← x_i − d_i;    x̃ ← x̃ + d_i.

``variant: sync`` (the paper's synchronous EASGD): all workers exchange at once and the center takes the sum
of their pulls, x̃ ← x̃ + Σ_i d_i, by one all-reduce; every worker keeps an identical replica of x̃ and no
extra rank is needed. The paper's β = N·alpha may be given instead of ``alpha``; with neither, β = 0.9, the
paper's choice. The center's recursion x̃ ← (1 − β)·x̃ + β·mean(x_i) diverges for β ≥ 2, so such settings
are refused.

``variant: async`` (the paper's asynchronous EASGD, Algorithm 1): one extra rank holds x̃ and serves the
workers in arrival order; a worker sends x_i, receives the x̃ the server held before this exchange, and both
sides apply the elastic step above (the server with ``center_alpha``, default ``alpha``).

``comm_dtype: bf16|fp16`` sends the pulls (sync: summed in float32, runner/comm/wire.py) and the exchanged
parameters (async) in 16 bits; the center's replicas stay identical on all workers.

The reported model is the center x̃ (BatchNorm statistics: the workers' mean); ``worker_mean`` is also
validated. The center starts at rank 0's initial parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.comm.flat import FlatTensors, flat_copy
from runner.comm.tags import EASGD_CHECKPOINT as CHECKPOINT
from runner.comm.tags import EASGD_DONE as DONE
from runner.comm.tags import EASGD_EXCHANGE as EXCHANGE
from runner.comm.tags import EASGD_FETCH as FETCH
from runner.lazy import lazy_import
from runner.rules.base import Rule, RuleContext, no_grad
from runner.rules.period import PeriodicConfig, Periods, rate
from runner.schema import RuleConfig, one_of, require

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")

DEFAULT_BETA = 0.9


@dataclass
class EASGDConfig(PeriodicConfig, RuleConfig):
    alpha: float | None = None
    beta: float | None = None
    tau: int = 10
    variant: str = "sync"
    center_alpha: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.alpha is None or self.beta is None,
            "alpha",
            self.alpha,
            "give rule.alpha or rule.beta (beta = devices × alpha), not both; set the other to null",
        )
        if self.alpha is not None:
            require(0 < self.alpha <= 1, "alpha", self.alpha, "the moving rate must be in (0, 1], e.g. 0.5")
        if self.beta is not None:
            require(self.beta > 0, "beta", self.beta, "must be > 0 (alpha = beta / devices), e.g. 0.9")
        require(self.tau >= 1, "tau", self.tau, "local steps between exchanges, >= 1 (e.g. 10)")
        one_of("variant", self.variant, ("sync", "async"))
        require(
            self.center_alpha is None or 0 < self.center_alpha <= 1,
            "center_alpha",
            self.center_alpha,
            "the center's moving rate must be in (0, 1], or null for alpha",
        )

    def extra_ranks(self) -> int:
        return 1 if self.variant == "async" else 0

    def asynchronous(self) -> bool:
        return self.variant == "async"

    def alpha_for(self, workers: int) -> float:
        """The moving rate: ``alpha``, else ``beta`` / workers (beta defaults to the paper's 0.9)."""
        return self.alpha if self.alpha is not None else (self.beta or DEFAULT_BETA) / workers

    def check_devices(self, devices: int) -> None:
        """Sync: the center moves by beta·(mean of workers − center) per exchange, unstable for beta >= 2.

        ``devices`` is a count of workers the job has, or may grow to: the messages say which count."""
        require(
            0 < self.alpha_for(devices) <= 1,
            "beta",
            self.beta,
            f"with {devices} workers alpha = beta / {devices} = {self.alpha_for(devices):.3g} is outside "
            f"(0, 1]; choose rule.beta <= {devices}",
        )
        beta = devices * self.alpha_for(devices)
        require(
            self.variant == "async" or beta < 2,
            "alpha" if self.beta is None else "beta",
            self.alpha if self.beta is None else self.beta,
            f"sync EASGD with {devices} workers has beta = {devices} × alpha = {beta:g} >= 2, which makes "
            f"the center diverge; use rule.alpha <= {1 / devices:.3g}, or rule.alpha=null rule.beta=0.9 "
            "(alpha = beta / workers)",
        )

    def build(self, ctx: RuleContext) -> EASGD:
        return EASGD(self, ctx)


class EASGD(Rule):
    """Elastic averaging: workers pulled toward a center every ``tau`` steps, the center toward them."""

    def __init__(self, cfg: EASGDConfig, ctx: RuleContext):
        super().__init__(ctx, servers=cfg.extra_ranks(), comm_dtype=cfg.comm_dtype)
        self.cfg = cfg
        self.alpha = cfg.alpha_for(self.num_workers)
        self.center_alpha = self.alpha if cfg.center_alpha is None else cfg.center_alpha
        self.synchronous = not cfg.asynchronous()
        self.solo_validation = cfg.asynchronous()  # worker 0 fetches the center alone
        self.exchanges = 0
        self.periods = Periods(cfg, cfg.tau)  # (``rule.period_schedule`` of tau)
        self.served, self.done_sent = 0, False
        self.center_model, self.center = self._init_center()
        self.local = None if self.is_server else FlatTensors(self.model.parameters())

    def _init_center(self) -> tuple[torch.nn.Module, FlatTensors]:
        """The center as a model (a copy of this rank's), set to rank 0's parameters on every rank."""
        center_model, center = flat_copy(self.model)
        for buf in center.buffers if not self.joined else []:  # joined: the center comes with the state
            self.comm.broadcast(buf, root=0)
        return center_model, center

    @property
    def server(self) -> int:
        """Async: the center's rank, the last (renumbered when lost workers are dropped from the job)."""
        return self.comm.size - 1

    # -- workers -------------------------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        if self.periods.due(step, rate(self.optimizer)):
            self.exchange()

    @no_grad
    def exchange(self) -> None:
        """One elastic step between this worker and the center."""
        self.exchanges += 1
        if self.cfg.variant == "sync":
            pulls = [
                (x - c).mul_(self.alpha) for x, c in zip(self.local.buffers, self.center.buffers, strict=True)
            ]
            sums = [self.comm.allreduce(d.clone(), wire=self.wire) for d in pulls]  # a loss: nothing applied
            for x, c, d, total in zip(self.local.buffers, self.center.buffers, pulls, sums, strict=True):
                x.sub_(d)
                c.add_(total)
            return
        for x, c in zip(self.local.buffers, self.center.buffers, strict=True):
            self.comm.send(x, self.server, EXCHANGE, wire=self.wire)
            self.comm.recv(c, self.server, EXCHANGE, wire=self.wire)
            x.sub_((x - c).mul_(self.alpha))

    def _fetch_center(self) -> None:
        """Async: once all workers stopped, worker 0 asks the server for the center and gives it to all."""
        if self.cfg.variant == "async":
            self.workers.barrier()
            if self.workers.rank == 0:
                self.comm.send(torch.zeros(1, dtype=torch.float64), self.server, FETCH)
                for c in self.center.buffers:
                    self.comm.recv(c, self.server, FETCH)
            for c in self.center.buffers:
                self.workers.broadcast(c, root=0)

    @no_grad
    def solo_model(self) -> torch.nn.Module:
        """Async: the server's center as it is now, with this worker's BatchNorm statistics."""
        self.comm.send(torch.zeros(1, dtype=torch.float64), self.server, FETCH)
        for c in self.center.buffers:
            self.comm.recv(c, self.server, FETCH)
        for mine, theirs in zip(self.model.buffers(), self.center_model.buffers(), strict=True):
            theirs.copy_(mine)
        return self.center_model

    @no_grad
    def eval_models(self) -> dict[str, torch.nn.Module]:
        self._fetch_center()
        self._average_buffers_into(self.center_model)
        mean, _ = self._workers_mean(self.local, 1.0 / self.workers.size)
        return {"": self.center_model, "worker_mean": mean}

    def metrics(self) -> dict[str, float]:
        """Distance of this worker to the center (mean over workers), and exchanges so far."""
        sq = sum(
            float((x - c).pow(2).sum()) for x, c in zip(self.local.buffers, self.center.buffers, strict=True)
        )
        mean_sq = self.workers.allreduce_values([sq])[0] / self.workers.size
        return {"center_distance": mean_sq**0.5, "exchanges": self.exchanges}

    def finish(self) -> None:
        if self.cfg.variant == "async" and not self.done_sent:
            self.comm.send(torch.zeros(1, dtype=torch.float64), self.server, DONE)
        self.done_sent = True  # (once: finish is called again after a recovery)

    def before_checkpoint(self, step: int) -> None:
        """Async: tell the server; it saves the center once every worker's earlier exchanges are applied."""
        if self.cfg.variant == "async":
            self.comm.send(torch.tensor([float(step)], dtype=torch.float64), self.server, CHECKPOINT)

    def state_dict(self) -> dict[str, object]:
        """The center (sync: this worker's replica; async: the server's) and the exchange counts."""
        return {
            "center": [c.clone() for c in self.center.buffers],
            "exchanges": self.exchanges,
            "served": self.served,
            "periods": self.periods.state_dict(),
        }

    @no_grad
    def load_state_dict(self, state: dict[str, object]) -> None:
        for c, saved in zip(self.center.buffers, state["center"], strict=True):
            c.copy_(saved)
        self.exchanges, self.served = state["exchanges"], state["served"]
        self.periods.load_state_dict(state.get("periods"))

    def grow(self, joined: bool) -> None:
        """The new workers took worker 0's center (sync: its replica).

        ``alpha`` is the configured one for the workers there now (with ``beta``, or the default beta = 0.9:
        beta / N, so the center's pull stays beta). Async: the server serves them from now on."""
        super().grow(joined)
        self.alpha = self.cfg.alpha_for(self.num_workers)  # beta (default 0.9) stays: alpha = beta / N
        if joined:
            self.exchanges = 0

    @no_grad
    def recover(self) -> None:
        """Sync: the survivors' center replicas are made identical; async: a lost worker is no longer served.

        Sync: the lowest survivor's replica is broadcast, and the center goes on with their pulls only (alpha
        unchanged: beta = alpha × survivors). Async: the server counts the lost worker out."""
        if self.cfg.variant == "sync":
            for c in self.center.buffers:
                self.comm.broadcast(c, root=0)

    # -- server (async) ------------------------------------------------------------------------------------
    @no_grad
    def serve(self) -> None:
        """Hold the center; answer exchanges and fetches in arrival order until every worker is done.

        An exchange with a worker lost midway is not applied (the center moves once all of it has arrived)."""
        center = self.center
        incoming = [torch.empty_like(c) for c in center.buffers]

        def handle(source: int, tag: int) -> None:
            if tag == FETCH:
                self.comm.recv(torch.empty(1, dtype=torch.float64), source, FETCH)
                for c in center.buffers:
                    self.comm.send(c, source, FETCH)
                return
            for c, x in zip(center.buffers, incoming, strict=True):
                self.comm.recv(x, source, EXCHANGE, wire=self.wire)
                self.comm.send(c, source, EXCHANGE, wire=self.wire)
            for c, x in zip(center.buffers, incoming, strict=True):
                c.add_((x - c).mul_(self.center_alpha))
            self.served += 1

        self._serve_workers(handle, DONE, CHECKPOINT)

    def final_metrics(self) -> dict[str, object]:
        if self.cfg.variant != "async":
            return {"exchanges_per_worker": self.exchanges}
        served = self.comm.broadcast_object(self.served, root=self.server)
        each = self.comm.allgather_object(None if self.is_server else self.exchanges)[: self.num_workers]
        return {"exchanges_per_worker": self.exchanges, "worker_exchanges": each, "server_exchanges": served}
