"""GoSGD's ``peers=by_link`` (runner/rules/gosgd.py): a peer whose pushes go through slowly is drawn less.

The draw alone: ``uniform``'s, number for number, while no peer is slow; a slow peer drawn as often as its
weight says. In process on tests/helpers/fakecomm.py: with every link alike the workers push to the peers
``uniform`` pushes to; with one worker's link slow (its messages timed 100× longer, by a fake clock) the
others push to it less, and push-sum's invariants (Σ a_i = 1, the consensus x̄ at lr = 0) hold all the same."""

from __future__ import annotations

import random
import threading

import pytest

from runner.rules import gosgd
from runner.rules.gosgd import GoSGDConfig, choose_peer, peer_weights
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import B, assert_close, batch, build, fit, mlp, params, sgd, vector


@pytest.mark.parametrize(
    "seconds", [[0.0] * 4, [0.1, 0.0, 0.2, 0.3], [0.1, 0.1, 0.39, 0.1], [0.0001, 0.0001, 0.0079, 0.0001]]
)
def test_with_no_slow_peer_the_draw_is_uniforms(seconds):
    """Not measured, within ``slow_factor`` of the median, or under the floor of jitter (2 ms × 4)."""
    for me in range(4):
        by_link, uniform = random.Random(7), random.Random(7)
        for _ in range(500):
            peer = uniform.randrange(3)
            assert choose_peer(by_link, me, seconds, slow_factor=4.0) == peer + (peer >= me)


def test_a_slow_peer_is_drawn_as_often_as_its_weight_says():
    seconds, draws = [0.05, 1.0, 0.05, 0.05], 40_000
    rng = random.Random(1)
    counts = [0] * 4
    for _ in range(draws):
        counts[choose_peer(rng, 0, seconds, slow_factor=4.0)] += 1
    assert counts[0] == 0, "a worker drew itself"
    assert peer_weights(0, seconds, 4.0) == pytest.approx([0.0, 1 / 20, 1.0, 1.0])
    expected = (1 / 20) / (2 + 1 / 20)  # 0.0244; the binomial's deviation over 40,000 draws: 0.0008
    assert counts[1] / draws == pytest.approx(expected, abs=0.004), counts


class Link:
    """A fake clock per thread, moved on by each receive: ``slow_s`` for a message from ``slow``, else 1 ms"""

    def __init__(self, slow: int | None, slow_s: float = 0.1):
        self.slow, self.slow_s, self.local = slow, slow_s, threading.local()

    def __call__(self) -> float:
        return getattr(self.local, "now", 0.0)

    def over(self, comm) -> None:
        """Time ``comm``'s receives by this clock."""
        recv = comm.recv

        def timed(t, source=-1, tag=-1, wire=None):
            self.local.now = self() + (self.slow_s if source == self.slow else 0.001)
            return recv(t, source, tag, wire)

        comm.recv = timed


def run(n: int, steps: int, peers: str, link: Link, known: bool = False, lr: float = 0.1):
    """``n`` workers of GoSGD (p = 0.5) for ``steps`` steps over ``link``.

    ``known``: each worker starts with the link's seconds per push measured (the pushes before), so that
    the draws do not depend on when the first push from the slow worker is received."""

    def main(comm):
        model = mlp(seed=comm.rank)
        optimizer = sgd(model, lr=lr)
        rule = build(comm, GoSGDConfig(p=0.5, seed=5, peers=peers), model, optimizer)
        link.over(rule.comm)
        if known:
            messages = 1 + len(rule.incoming)
            rule.push_s = [0.0 if j == comm.rank else 0.001 * messages for j in range(n)]
            if link.slow is not None and link.slow != comm.rank:
                rule.push_s[link.slow] = link.slow_s * messages
        fit(rule, model, optimizer, [batch(B, comm.rank)] * steps)
        consensus = params(rule.eval_models()[""])
        slow_peers = rule.metrics().get("slow_peers")
        rule.finish()
        return params(model), list(rule.sent_to), rule.weight, consensus, slow_peers

    return FakeWorld(n).run(main)


def test_a_push_is_timed_by_its_receive_into_a_running_mean(monkeypatch):
    link = Link(slow=1, slow_s=0.1)
    monkeypatch.setattr(gosgd, "clock", link)

    def main(comm):
        rule = build(comm, GoSGDConfig(p=0.0, peers="by_link"), vector(1.0, 2.0))
        link.over(rule.comm)
        seen = []
        for _ in range(2):
            if comm.rank == 1:
                rule.push()
            comm.barrier()
            rule.drain()
            seen.append(list(rule.push_s))
        rule.finish()
        return seen, 1 + len(rule.incoming)

    (seen, messages), (theirs, _) = FakeWorld(2).run(main)
    push = 0.1 * messages
    assert seen == [[0.0, pytest.approx(push)], [0.0, pytest.approx(push)]]  # the same again: its mean
    assert theirs == [[0.0, 0.0], [0.0, 0.0]], "a worker that received nothing measured something"


def test_with_every_link_alike_by_link_pushes_where_uniform_does(monkeypatch):
    """The same pushes to the same peers (the merges' order is the threads', in either run)."""
    link = Link(slow=None)
    monkeypatch.setattr(gosgd, "clock", link)
    uniform, by_link = run(4, 12, "uniform", link), run(4, 12, "by_link", link)
    for (_, sent_u, _, _, _), (_, sent_b, _, _, slow) in zip(uniform, by_link, strict=True):
        assert sent_u == sent_b
        assert slow == 0


def test_a_slow_link_is_pushed_to_less_and_the_invariants_hold(monkeypatch):
    n, slow = 4, 3
    link = Link(slow=slow, slow_s=0.1)  # 100× the others: drawn 1/100 as often
    monkeypatch.setattr(gosgd, "clock", link)
    ranks = run(n, 40, "by_link", link, known=True, lr=0.0)
    uniform = run(n, 40, "uniform", link, lr=0.0)
    to_slow = [sent[slow] for _, sent, _, _, _ in ranks[:slow]]
    to_slow_uniform = sum(sent[slow] for _, sent, _, _, _ in uniform[:slow])
    assert sum(to_slow) <= 2 and to_slow_uniform >= 10, (to_slow, to_slow_uniform)
    assert ranks[0][4] == slow, "the workers that push to the slow one do not all count it slow"
    mean = sum(params(mlp(seed=r)) for r in range(n)) / n
    assert sum(a for _, _, a, _, _ in ranks) == pytest.approx(1.0, abs=1e-15)
    for _, _, _, consensus, _ in ranks:
        assert_close(consensus, mean)
