"""GoSGD: gossip SGD by push-sum (Blot, Picard, Cord, Thome 2016, arXiv 1611.09726).

Every worker i holds parameters x_i and a weight a_i, starting at a_i = 1/N. After each local step, with
probability ``p``, worker i picks a peer j ≠ i uniformly at random, halves its weight and pushes:

    a_i ← a_i / 2;   send (x_i, a_i) to j;
    on receipt:  x_j ← (a_j·x_j + a_i·x_i) / (a_j + a_i);   a_j ← a_j + a_i.

No worker waits for another: incoming pushes are drained (merged) with non-blocking probes before each step
and before each push; a push is sent from its own copy of x_i (up to ``max_inflight`` pushes in flight per
worker), and whenever a worker must wait for one of its pushes it keeps draining, so two workers pushing to
each other cannot deadlock. Σ_i a_i = 1 whenever no push is in flight, and the weighted mean
x̄ = Σ_i a_i·x_i (the consensus model, which this rule reports) is left unchanged by every push. Before each
validation and at the end the workers reach quiescence (they sum up how many pushes each worker was sent and
drain until all have arrived), then compute x̄ and its spread sqrt(Σ_i a_i·|x_i − x̄|²), which pushes can
only decrease. ``comm_dtype: bf16|fp16`` pushes x_i as a 16-bit copy (the weights stay float64); the merge is
computed in float32, so x̄ moves by at most the copy's rounding, a_i/(a_i + a_j) of it, per push.

``peers: by_link`` draws the peer by how fast the link to it is: each worker keeps, per peer, a running mean
of the seconds its receives of that peer's pushes took (the transfer over the pair's links, which is taken to
cost the same both ways; under ``simulate.link_gbps``, the emulated links). A peer whose mean exceeds
``slow_factor`` times the median of the peers measured (and :data:`FLOOR_S`) is drawn with its weight scaled
by median/mean (behind a link 20× slower, 1/20 as often), the others alike; while no peer is slow the draw is
``uniform``'s, number for number. Any choice of peer keeps x̄ and Σ a_i (push-sum's invariants); only how
fast the workers mix changes. The means follow timing, so a ``by_link`` run where a peer turns slow does not
replay bit for bit.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.comm.flat import FlatTensors
from runner.comm.tags import GOSGD_PARAMS as PARAMS
from runner.comm.tags import GOSGD_WEIGHT as WEIGHT
from runner.lazy import lazy_import
from runner.rules.base import Rule, RuleContext, no_grad
from runner.schema import RuleConfig, require

if TYPE_CHECKING:
    import torch

    from runner.comm import Request
else:
    torch = lazy_import("torch")


#: How a worker draws the peer it pushes to.
PEERS = ("uniform", "by_link")
#: The weight of a push's seconds in its peer's running mean (a single stall moves the mean a quarter).
EMA = 0.25
#: The clock a push's receive is timed by.
clock = time.perf_counter
#: Receives under this many seconds are on time whatever the others' (their jitter is not a link's speed).
FLOOR_S = 0.002


def peer_weights(me: int, push_s: list[float], slow_factor: float) -> list[float]:
    """How likely ``me`` draws each worker, unnormalized: 1, a slow peer median/mean, itself 0.

    ``push_s``: the running mean of the seconds a push from each worker took to receive (0: not measured,
    not slow)."""
    measured = [s for j, s in enumerate(push_s) if j != me and s > 0]
    median = max(statistics.median_low(measured), FLOOR_S) if measured else 0.0
    slow = slow_factor * median
    return [0.0 if j == me else (median / s if s > slow else 1.0) for j, s in enumerate(push_s)]


def choose_peer(rng: random.Random, me: int, push_s: list[float], slow_factor: float) -> int:
    """A peer of ``me`` by :func:`peer_weights`: ``uniform``'s draw, number for number, while none is slow."""
    weights = peer_weights(me, push_s, slow_factor)
    if all(w == 1.0 for j, w in enumerate(weights) if j != me):
        peer = rng.randrange(len(weights) - 1)
        return peer + (peer >= me)
    pick = rng.random() * sum(weights)
    for j, w in enumerate(weights):
        pick -= w
        if pick < 0 and w > 0:
            return j
    return max(j for j, w in enumerate(weights) if w > 0)  # (rounding at the top end)


@dataclass
class GoSGDConfig(RuleConfig):
    p: float = 0.02
    seed: int = 0
    max_inflight: int = 4
    peers: str = "uniform"
    slow_factor: float = 4.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.peers in PEERS, "peers", self.peers, f"one of {', '.join(PEERS)} (by_link: slow links less)"
        )
        require(
            self.slow_factor > 1,
            "slow_factor",
            self.slow_factor,
            "a peer is slow past this many times the peers' median seconds per push, > 1 (e.g. 4)",
        )
        require(
            0 <= self.p <= 1, "p", self.p, "the push probability must be in [0, 1] (e.g. 0.02; 0: no gossip)"
        )
        require(
            self.max_inflight >= 1, "max_inflight", self.max_inflight, "pushes in flight per worker, >= 1"
        )

    def asynchronous(self) -> bool:
        return True

    def check_devices(self, devices: int) -> None:
        require(devices >= 2 or self.p == 0, "p", self.p, "gossip needs devices >= 2 (or rule.p=0)")

    def build(self, ctx: RuleContext) -> GoSGD:
        return GoSGD(self, ctx)


class GoSGD(Rule):
    """Push-sum gossip between workers, with probability ``p`` after each step."""

    def __init__(self, cfg: GoSGDConfig, ctx: RuleContext):
        super().__init__(ctx, comm_dtype=cfg.comm_dtype)
        self.synchronous = False
        self.p, self.max_inflight = cfg.p, cfg.max_inflight
        self.by_link, self.slow_factor = cfg.peers == "by_link", cfg.slow_factor
        self.push_s = [0.0] * self.comm.size  # by_link: running mean of seconds to receive a push, by peer
        self.rng = random.Random(cfg.seed * 100_003 + self.comm.rank)
        self.weight = 1.0 / self.comm.size
        self.pushes = self.merges = 0
        self.received = 0  # pushes merged since the workers last changed (sent_to counts the same span)
        self.sent_to = [0] * self.comm.size
        self.inflight: list[tuple[list[Request], list[torch.Tensor]]] = []
        self.free: list[list[torch.Tensor]] = []
        self.spread = float("nan")
        self.weight_sum = 1.0
        self.local = FlatTensors(self.model.parameters())
        self.incoming = [torch.empty_like(b, dtype=self.wire or b.dtype) for b in self.local.buffers]
        self.weight_in = torch.zeros(1, dtype=torch.float64)

    @no_grad
    def drain(self) -> None:
        """Merge every push that has arrived."""
        while (found := self.comm.iprobe(tag=WEIGHT)) is not None:
            source, start = found[0], clock()
            self.comm.recv(self.weight_in, source, WEIGHT)
            for buf in self.incoming:  # all of the push before any of it is merged (its sender may die)
                self.comm.recv(buf, source, PARAMS)
            if self.by_link:
                seconds, mean = clock() - start, self.push_s[source]
                self.push_s[source] = seconds if mean == 0 else (1 - EMA) * mean + EMA * seconds
            theirs = float(self.weight_in)
            total = self.weight + theirs
            for x, buf in zip(self.local.buffers, self.incoming, strict=True):
                x.mul_(self.weight / total).add_(buf, alpha=theirs / total)
            self.weight = total
            self.merges += 1
            self.received += 1

    def _reap(self, keep: int) -> None:
        """Recycle the buffers of received pushes; drain until at most ``keep`` pushes are in flight."""
        while True:
            still = []
            for requests, buffers in self.inflight:
                if all(r.test() for r in requests):
                    self.free.append(buffers)
                else:
                    still.append((requests, buffers))
            self.inflight = still
            if len(self.inflight) <= keep:
                return
            self.drain()

    @no_grad
    def push(self) -> None:
        self._reap(self.max_inflight - 1)
        # (uniform: nothing is measured, so no peer is slow and the draw is uniform's)
        peer = choose_peer(self.rng, self.comm.rank, self.push_s, self.slow_factor)
        self.weight /= 2
        buffers = (
            self.free.pop()
            if self.free
            else [torch.empty(1, dtype=torch.float64)]
            + [torch.empty_like(b, dtype=self.wire or b.dtype) for b in self.local.buffers]
        )
        buffers[0].fill_(self.weight)
        requests = [self.comm.isend(buffers[0], peer, WEIGHT)]
        for x, buf in zip(self.local.buffers, buffers[1:], strict=True):
            buf.copy_(x)
            requests.append(self.comm.isend(buf, peer, PARAMS))
        self.inflight.append((requests, buffers))
        self.sent_to[peer] += 1
        self.pushes += 1

    def before_step(self, step: int) -> None:
        self.drain()

    def after_step(self, step: int) -> None:
        self.drain()
        if self.p > 0 and self.rng.random() < self.p:
            self.push()

    def quiesce(self) -> None:
        """Return once no push is in flight anywhere: every push sent so far has been received and merged.

        The workers sum, per destination, how many pushes were sent (a non-blocking all-reduce, draining
        meanwhile, since a rank may be waiting for us to receive its push), then each drains until it has
        merged all the pushes sent to it. A barrier ends it: a worker that sees the sum late would otherwise
        still be draining when a faster one, already past its quiesce (saved, stepped), pushes again, and
        would merge that push into the state it is about to save.
        """
        counts = torch.tensor(self.sent_to, dtype=torch.float64)
        request = self.comm.iallreduce(counts)
        while not request.test():
            self.drain()
        expected = int(counts[self.comm.rank])
        while self.received < expected:
            self.drain()
        self._reap(0)
        self.comm.barrier()

    @no_grad
    def eval_models(self) -> dict[str, torch.nn.Module]:
        """The consensus model Σ a_i·x_i, after quiescence; also measures the spread around it."""
        self.quiesce()
        self.weight_sum = self.comm.allreduce_values([self.weight])[0]
        consensus_model, consensus = self._workers_mean(self.local, self.weight / self.weight_sum)
        sq = sum(
            float((x.double() - c.double()).pow(2).sum())
            for x, c in zip(self.local.buffers, consensus.buffers, strict=True)
        )
        self.spread = self.comm.allreduce_values([self.weight / self.weight_sum * sq])[0] ** 0.5
        return {"": consensus_model}

    def metrics(self) -> dict[str, float]:
        pushes, merges = self.comm.allreduce_values([self.pushes, self.merges])
        return {
            "pushes": pushes,
            "merges": merges,
            "spread": self.spread,
            "weight_sum": self.weight_sum,
            "weight": self.weight,
            **({"slow_peers": self._slow_peers()} if self.by_link else {}),
        }

    def _slow_peers(self) -> float:
        """Collective: the (worker, peer) pairs whose pushes are slow, summed over the workers."""
        weights = peer_weights(self.comm.rank, self.push_s, self.slow_factor)
        return self.comm.allreduce_values([sum(0 < w < 1 for w in weights)])[0]

    def before_checkpoint(self, step: int) -> None:
        """No push in flight when the weights and parameters are saved (so Σ a_i = 1 over the saved parts)."""
        self.quiesce()

    def state_dict(self) -> dict[str, object]:
        version, internal, gauss = self.rng.getstate()
        return {
            "weight": self.weight,
            "rng": [version, list(internal), gauss],
            "pushes": self.pushes,
            "merges": self.merges,
            "received": self.received,
            "sent_to": list(self.sent_to),
            "push_s": list(self.push_s),
            "spread": self.spread,
            "weight_sum": self.weight_sum,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.weight, self.pushes, self.merges = state["weight"], state["pushes"], state["merges"]
        self.received = state.get("received", self.merges)
        self.sent_to = list(state["sent_to"])
        push_s = list(state.get("push_s", []))  # (measured by the ranks of the job that saved it)
        kept = self.by_link and len(push_s) == self.comm.size  # (uniform measures nothing: all stay 0)
        self.push_s = push_s if kept else [0.0] * self.comm.size
        self.spread, self.weight_sum = state["spread"], state["weight_sum"]

    def abandon(self) -> None:
        """Pushes in flight on the revoked communicator are lost, with their weight."""
        from runner.comm import PeerLost

        for requests, buffers in self.inflight:
            for r in requests:
                try:
                    r.wait()
                except PeerLost:
                    pass
            self.free.append(buffers)
        self.inflight = []

    def before_grow(self) -> None:
        """No push may be in flight when the communicators are replaced (its weight would be lost)."""
        self.quiesce()

    def grow(self, joined: bool) -> None:
        """Worker 0 shares its weight with the k new workers, which took its parameters.

        Each of the k+1 gets a_0 / (k+1), so Σ a_i stays 1 and the consensus x̄ = Σ a_i·x_i does not move."""
        super().grow(joined)
        grown = int(self.comm.allreduce_values([float(joined)])[0])
        if self.comm.rank == 0 or joined:
            self.weight = self.weight / (grown + 1)
        if joined:
            self.pushes = self.merges = 0
            self.rng.seed(self.rng.random() + self.comm.rank)
        self.sent_to, self.received = [0] * self.comm.size, 0
        self.push_s = [0.0] * self.comm.size  # (the ranks are the new communicator's)
        self.weight_sum = self.comm.allreduce_values([self.weight])[0]

    def recover(self) -> None:
        """The survivors divide their weights by the sum of what is left, so that Σ a_i = 1 again.

        What is gone: the weight mass of the lost worker and of the pushes lost in flight. Peers are drawn
        among the survivors."""
        self.sent_to, self.received = [0] * self.comm.size, 0
        self.push_s = [0.0] * self.comm.size  # (the ranks are the new communicator's)
        total = self.comm.allreduce_values([self.weight])[0]
        self.weight /= total
        self.weight_sum = self.comm.allreduce_values([self.weight])[0]

    def finish(self) -> None:
        self.quiesce()
        self.weight_sum = self.comm.allreduce_values([self.weight])[0]
        assert self.comm.iprobe() is None, "a push was left in flight"

    def final_metrics(self) -> dict[str, object]:
        pushes, merges = self.comm.allreduce_values([self.pushes, self.merges])
        return {"pushes": pushes, "merges": merges, "weight_sum": self.weight_sum, "spread": self.spread}
