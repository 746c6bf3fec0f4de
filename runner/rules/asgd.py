"""ASGD / Downpour SGD: asynchronous parameter servers.

Downpour SGD (Dean et al. 2012, "Large Scale Distributed Deep Networks", NeurIPS). ``servers`` extra ranks
hold the parameters, sharded into contiguous slices of the flat parameter vector; each keeps a version counter
for its shard. Workers train with any torch optimizer and, without waiting for each other,

    every ``n_push`` steps:  Δ = x − x_ref (the change the local optimizer made since the last push);
                             send each server its slice of Δ with the version the worker last fetched;
                             x_ref ← x;
    every ``n_fetch`` steps: x_s ← server's shard; x ← x_s + (x − x_ref); x_ref ← x_s
                             (updates not pushed yet are kept, not lost).

A server applies the pushes in arrival order: with staleness τ = (its version now) − (the version the worker
last fetched), ``accept`` adds Δ, ``scale`` adds Δ / (1 + τ), ``drop`` discards Δ when τ > ``max_staleness``;
each applied push increments the version. With one worker, n_push = n_fetch = 1 and plain SGD this is plain
SGD. The reported model is the servers' parameters (BatchNorm statistics: the workers' mean), fetched in
float32. ``comm_dtype: bf16|fp16`` sends Δ and the fetched parameters in 16 bits; servers add in float32.

``momentum_correction``: asynchrony is itself a momentum (Mitliagkas, Zhang, Hadjis, Ré 2016, "Asynchrony
begets momentum, with an application to deep learning", arXiv 1605.09774), so a momentum tuned for one
process (0.9) overshoots. Each server returns, with every fetch, the mean staleness τ̄ of the pushes it has
applied, and the worker sets its optimizer's momentum (SGD's ``momentum``, Adam's β1) from the configured μ:

- ``delay`` (the default, :func:`delay_momentum`): a push τ̄ steps stale reaches the weights τ̄ steps late,
  and momentum μ spreads a gradient over the steps after it with a mean delay of μ/(1 − μ); the momentum
  that keeps one process's mean delay, L/(1 + L) with L = μ/(1 − μ) − τ̄ (0.857 for 0.9 at τ̄ = 3).
- ``momentum`` (:func:`corrected_momentum`, the default until 2026-11-30): μ − τ̄/(1 + τ̄), the paper's
  implicit momentum 1 − 1/M subtracted (0.15 for 0.9 at τ̄ = 3). It also shrinks each gradient's whole move,
  lr/(1 − μ), 8.5-fold there: it lost 14 points on a Markov-chain task nobody tuned on.
- ``none``: plain Downpour.

With staleness 0 (one worker, n_push = n_fetch) μ is kept, and the update is plain ASGD's bit for bit; a
worker's own pushes between its fetches (n_push < n_fetch) count as staleness, as they do for ``scale``.
Measured on four tasks, two of them kept aside (benchmarks/README.md, "Accuracy on tasks nobody tuned on").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.comm.flat import FlatTensors, flat_copy
from runner.comm.tags import ASGD_CHECKPOINT as CHECKPOINT
from runner.comm.tags import ASGD_DONE as DONE
from runner.comm.tags import ASGD_FETCH as FETCH
from runner.comm.tags import ASGD_PUSH as PUSH
from runner.comm.tags import ASGD_PUSH_DATA as PUSH_DATA
from runner.comm.tags import ASGD_REPLY as REPLY
from runner.lazy import lazy_import
from runner.rules.base import Rule, RuleContext, no_grad
from runner.schema import RuleConfig, one_of, require

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


@dataclass
class ASGDConfig(RuleConfig):
    n_push: int = 1
    n_fetch: int = 1
    servers: int = 1
    staleness: str = "accept"
    max_staleness: int | None = None
    momentum_correction: str = "delay"

    def __post_init__(self) -> None:
        super().__post_init__()
        # (earlier releases took a bool: true was today's "momentum")
        legacy = {"true": "momentum", "false": "none"}.get(str(self.momentum_correction).lower())
        self.momentum_correction = legacy or self.momentum_correction
        one_of("momentum_correction", self.momentum_correction, tuple(CORRECTIONS))
        require(self.n_push >= 1, "n_push", self.n_push, "push every N >= 1 steps")
        require(self.n_fetch >= 1, "n_fetch", self.n_fetch, "fetch every N >= 1 steps")
        require(self.servers >= 1, "servers", self.servers, "need at least one parameter-server rank")
        one_of("staleness", self.staleness, ("accept", "drop", "scale"))
        require(
            self.max_staleness is None or self.max_staleness >= 0,
            "max_staleness",
            self.max_staleness,
            "must be >= 0, or null",
        )
        require(
            self.staleness != "drop" or self.max_staleness is not None,
            "max_staleness",
            self.max_staleness,
            "staleness=drop needs a bound, e.g. rule.max_staleness=8",
        )

    def extra_ranks(self) -> int:
        return self.servers

    def asynchronous(self) -> bool:
        return True

    def check_devices(self, devices: int) -> None:
        require(
            self.servers <= devices,
            "servers",
            self.servers,
            f"at most one server per worker (devices={devices}); lower rule.servers or raise devices",
        )

    def build(self, ctx: RuleContext) -> ASGD:
        return ASGD(self, ctx)


def delay_momentum(mu: float, staleness: float) -> float:
    """The momentum with which a push ``staleness`` steps stale delays a gradient as ``mu`` does alone.

    Momentum μ spreads a gradient's effect over the steps after it with a mean delay of μ/(1 − μ) steps (9 at
    0.9); a push τ̄ steps stale adds τ̄ to it. μ' = L/(1 + L) with L = μ/(1 − μ) − τ̄ (at least 0) keeps the
    mean delay; ``mu`` itself at staleness 0."""
    if staleness <= 0 or mu <= 0:
        return mu
    lag = max(0.0, mu / (1.0 - mu) - staleness)
    return lag / (1.0 + lag)


def corrected_momentum(mu: float, staleness: float) -> float:
    """The explicit momentum that, with the implicit momentum of asynchrony, makes up ``mu``.

    At mean staleness ``staleness`` the implicit momentum is 1 − 1/M, M = 1 + τ̄ updates in flight (Mitliagkas
    et al. 2016); the result is μ − τ̄/(1 + τ̄), at least 0; ``mu`` itself at staleness 0."""
    if staleness <= 0:
        return mu
    return max(0.0, mu - staleness / (1.0 + staleness))


#: ``momentum_correction``'s choices: the worker's momentum from the configured one and the mean staleness.
CORRECTIONS = {"delay": delay_momentum, "momentum": corrected_momentum, "none": None}


def mean_of(histogram: Counter) -> float:
    """The mean of a histogram {value: count} (0 when empty)."""
    count = sum(histogram.values())
    return sum(k * v for k, v in histogram.items()) / count if count else 0.0


def group_momentum(group: dict) -> float | None:
    """An optimizer parameter group's momentum: SGD's ``momentum``, Adam's β1; None if it has neither."""
    if "momentum" in group:
        return group["momentum"]
    return group["betas"][0] if "betas" in group else None


def set_group_momentum(group: dict, mu: float) -> None:
    """Set what :func:`group_momentum` reads."""
    if "momentum" in group:
        group["momentum"] = mu
    else:
        group["betas"] = (mu, *group["betas"][1:])


class ASGD(Rule):
    """Workers push accumulated updates to sharded parameter servers and fetch fresh parameters."""

    def __init__(self, cfg: ASGDConfig, ctx: RuleContext):
        super().__init__(ctx, servers=cfg.servers, comm_dtype=cfg.comm_dtype)
        self.synchronous = False
        self.solo_validation = True  # worker 0 fetches the servers' model alone
        self.n_push, self.n_fetch = cfg.n_push, cfg.n_fetch
        self.policy, self.max_staleness = cfg.staleness, cfg.max_staleness
        self.pushes = self.fetches = 0
        self.done_sent = False
        flat = FlatTensors(self.model.parameters())
        if len(flat.buffers) != 1:
            raise ValueError("rule=asgd needs all parameters of one dtype and device")
        self.x = flat.buffers[0]
        if not self.joined:  # joined: it fetches the servers' parameters when it grows
            self.comm.broadcast(self.x, root=0)
        bounds = [round(i * flat.numel / self.num_servers) for i in range(self.num_servers + 1)]
        self.slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.header = torch.zeros(1, dtype=torch.float64)
        # a push's header: the version fetched (and a subclass's numbers, _push_header); a fetch's answer: the
        # version, and with momentum_correction the mean staleness (_reply_header)
        self.correct = CORRECTIONS[cfg.momentum_correction]
        self.push_header = torch.zeros(1, dtype=torch.float64)
        self.reply = torch.zeros(1 if self.correct is None else 2, dtype=torch.float64)
        # workers
        self.momenta = [group_momentum(g) for g in self.optimizer.param_groups] if self.optimizer else []
        self.mean_staleness = 0.0
        self.ref = self.x.clone()
        self.fetched = torch.empty_like(self.x)
        self.versions = [0] * self.num_servers
        self.server_model: tuple[torch.nn.Module, FlatTensors] | None = None
        # servers
        self.shard = (
            self.x[self.slices[self.comm.rank - self.num_workers]].clone() if self.is_server else None
        )
        self.version, self.dropped, self.histogram = 0, 0, Counter()

    @property
    def server_ranks(self) -> list[int]:
        """The servers: the last ranks (renumbered when lost workers are dropped from the job)."""
        return list(range(self.comm.size - self.num_servers, self.comm.size))

    def after_step(self, step: int) -> None:
        if (step + 1) % self.n_push == 0:
            self.push()
        if (step + 1) % self.n_fetch == 0:
            self.fetch()

    @no_grad
    def push(self) -> None:
        delta = self.x - self.ref
        for s, (server, part) in enumerate(zip(self.server_ranks, self.slices, strict=True)):
            self._push_header(self.versions[s])
            self.comm.send(self.push_header, server, PUSH)
            self.comm.send(delta[part], server, PUSH_DATA, wire=self.wire)
        self.ref.copy_(self.x)
        self.pushes += 1

    def _fetch_into(self, target: torch.Tensor, exact: bool = False) -> list[int]:
        """The servers' parameters into ``target``; returns the shards' versions.

        ``exact``: in float32 even with a 16-bit ``comm_dtype``, asked for by a negative header."""
        versions = []
        for server, part in zip(self.server_ranks, self.slices, strict=True):
            self.header.fill_(-1.0 if exact else 0.0)
            self.comm.send(self.header, server, FETCH)
            self.comm.recv(self.reply, server, REPLY)
            versions.append(int(self.reply[0]))
            self._read_reply(server)
            self.comm.recv(target[part], server, REPLY, wire=None if exact else self.wire)
        return versions

    def _push_header(self, version: int) -> None:
        """Worker: fill the header of a push to a server (the version last fetched from it)."""
        self.push_header.fill_(version)

    def _read_reply(self, server: int) -> None:
        """Worker: read a server's answer to a fetch beyond its version.

        With momentum_correction: the servers' mean staleness, averaged over them."""
        if self.correct is not None:
            first = server == self.server_ranks[0]
            self.mean_staleness = (0.0 if first else self.mean_staleness) + float(
                self.reply[1]
            ) / self.num_servers

    @no_grad
    def fetch(self) -> None:
        self.versions = self._fetch_into(self.fetched)
        self.x.sub_(self.ref).add_(self.fetched)
        self.ref.copy_(self.fetched)
        self.fetches += 1
        if self.correct is not None:
            for group, mu in zip(self.optimizer.param_groups, self.momenta, strict=True):
                if mu is not None:
                    set_group_momentum(group, self.correct(mu, self.mean_staleness))

    @no_grad
    def solo_model(self) -> torch.nn.Module:
        """The servers' parameters as they are now (fetched exactly), with this worker's BatchNorm statistics.

        Nothing is pushed."""
        if self.server_model is None:
            self.server_model = flat_copy(self.model)
        model, flat = self.server_model
        self._fetch_into(flat.buffers[0], exact=True)
        for mine, theirs in zip(self.model.buffers(), model.buffers(), strict=True):
            theirs.copy_(mine)
        return model

    @no_grad
    def eval_models(self) -> dict[str, torch.nn.Module]:
        """The servers' model, fetched by worker 0 once every worker has pushed its updates and stopped."""
        if not torch.equal(self.x, self.ref):
            self.push()
        if self.server_model is None:
            self.server_model = flat_copy(self.model)
        model, flat = self.server_model
        self.workers.barrier()
        if self.workers.rank == 0:
            self._fetch_into(flat.buffers[0], exact=True)
        self.workers.broadcast(flat.buffers[0], root=0)
        self._average_buffers_into(model)
        return {"": model}

    def metrics(self) -> dict[str, float]:
        pushes, fetches = self.workers.allreduce_values([self.pushes, self.fetches])
        return {"pushes": pushes, "fetches": fetches}

    def finish(self) -> None:
        if not torch.equal(self.x, self.ref):
            self.push()
        if not self.done_sent:  # (once: finish is called again after a recovery)
            for server in self.server_ranks:
                self.comm.send(self.header, server, DONE)
        self.done_sent = True

    def before_grow(self) -> None:
        """A fetch from every server.

        Each answers after the pushes this worker sent before (messages between two ranks arrive in order), so
        none is left unread when the communicators are replaced."""
        self.fetch()

    @no_grad
    def grow(self, joined: bool) -> None:
        """A new worker starts from the servers' parameters, with nothing of its own to push."""
        super().grow(joined)
        if joined:
            self.versions = self._fetch_into(self.fetched)
            self.x.copy_(self.fetched)
            self.ref.copy_(self.fetched)
            self.pushes = self.fetches = 0

    def before_checkpoint(self, step: int) -> None:
        """Tell every server; each saves its shard once all workers' earlier pushes are applied.

        Messages between two ranks arrive in order. The updates not yet pushed are saved with the worker."""
        self.header.fill_(step)
        for server in self.server_ranks:
            self.comm.send(self.header, server, CHECKPOINT)

    def state_dict(self) -> dict[str, object]:
        if self.is_server:
            return {
                "shard": self.shard.clone(),
                "version": self.version,
                "dropped": self.dropped,
                "histogram": {str(k): v for k, v in self.histogram.items()},
            }
        return {
            "ref": self.ref.clone(),
            "versions": list(self.versions),
            "pushes": self.pushes,
            "fetches": self.fetches,
        }

    @no_grad
    def load_state_dict(self, state: dict[str, object]) -> None:
        if self.is_server:
            self.shard.copy_(state["shard"])
            self.version, self.dropped = state["version"], state["dropped"]
            self.histogram = Counter({int(k): v for k, v in state["histogram"].items()})
        else:
            self.ref.copy_(state["ref"])
            self.versions = list(state["versions"])
            self.pushes, self.fetches = state["pushes"], state["fetches"]

    # -- servers -------------------------------------------------------------------------------------------
    @no_grad
    def serve(self) -> None:
        """Hold one shard; apply pushes and answer fetches in arrival order until every worker is done."""
        incoming = torch.empty_like(self.shard)

        def handle(source: int, tag: int) -> None:
            self.comm.recv(self.header if tag == FETCH else self.push_header, source, tag)
            if tag == FETCH:
                wire = None if float(self.header) < 0 else self.wire
                self._reply_header()
                self.comm.send(self.reply, source, REPLY)
                self.comm.send(self.shard, source, REPLY, wire=wire)
                return
            assert tag == PUSH, f"unexpected message tag {tag} from rank {source}"
            self.comm.recv(incoming, source, PUSH_DATA, wire=self.wire)
            staleness = self.version - int(self.push_header[0])
            self.histogram[staleness] += 1
            if self.policy == "drop" and staleness > self.max_staleness:
                self.dropped += 1
                return
            self._apply_push(incoming, staleness, source)
            self.version += 1

        self._serve_workers(handle, DONE, CHECKPOINT)

    def _apply_push(self, delta: torch.Tensor, staleness: int, source: int) -> None:
        """Server: apply a worker's Δ to the shard (``staleness=scale``: Δ / (1 + τ)).

        ``self.push_header`` holds the push's header."""
        self.shard.add_(delta, alpha=1.0 / (1 + staleness) if self.policy == "scale" else 1.0)

    def _reply_header(self) -> None:
        """Server: fill the answer to a fetch (the version; with momentum_correction the mean staleness)."""
        self.reply[0] = self.version
        if self.correct is not None:
            self.reply[1] = mean_of(self.histogram)

    def final_metrics(self) -> dict[str, object]:
        """Collective: the servers' staleness histogram, drops and versions, the workers' pushes and fetches.

        The histogram and the drops count shard pushes.

        Over all ranks alone: the job-wide barrier before it goes on without a rank lost meanwhile, which the
        workers' communicator would still hold."""
        mine = (self.histogram, self.dropped, self.version) if self.is_server else (self.pushes, self.fetches)
        everyone = self.comm.allgather_object((self.is_server, mine))
        stats = [s for server, s in everyone if server]
        histogram: Counter = sum((h for h, _, _ in stats), Counter())
        pushes, fetches = (sum(s[i] for server, s in everyone if not server) for i in (0, 1))
        return {
            "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
            "dropped_pushes": sum(d for _, d, _ in stats),
            "server_versions": [v for _, _, v in stats],
            "pushes": pushes,
            "fetches": fetches,
        }
