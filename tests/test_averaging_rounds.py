"""bagua_common.algorithms.averaging_rounds.AveragingRounds without processes.

Several simulated ranks share one process: their allreduces meet at a barrier and combine
the ranks' NumPy values, the weights are NumPy arrays, and one test thread plays every
rank's training loop (``after_step`` never waits, so round-robin calls make progress).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from bagua_common.algorithms.averaging_rounds import AveragingRounds

DEADLINE_S = 30.0


class Group:
    """An in-process stand-in for a communicator: every rank's call returns ``combine(values)``."""

    def __init__(self, n: int) -> None:
        self.values: list[object] = [None] * n
        self.barrier = threading.Barrier(n, timeout=DEADLINE_S)

    def allreduce(self, rank: int, value: object, combine) -> object:
        self.values[rank] = value
        self.barrier.wait()
        result = combine(self.values)
        self.barrier.wait()  # nobody overwrites a value before every rank has combined
        return result


class Rank:
    def __init__(self, rank: int, group: Group, weights: np.ndarray, warmup_steps: int = 0, fail=None):
        self.rank, self.group, self.weights, self.fail = rank, group, weights.copy(), fail
        self.n = len(group.values)
        self.protocol = AveragingRounds(
            "async",
            0.0,
            warmup_steps,
            0,
            take_snapshot=lambda: self.weights.copy(),
            agree_to_stop=lambda stop: self.group.allreduce(self.rank, stop, any),
            allreduce_sum=self.allreduce_sum,
            apply=self.apply,
        )

    def allreduce_sum(self, snapshot: np.ndarray) -> np.ndarray:
        if self.fail is not None:
            raise self.fail
        return self.group.allreduce(self.rank, snapshot, lambda values: np.sum(values, axis=0))

    def apply(self, sums: np.ndarray, snapshot: np.ndarray) -> None:
        self.weights = self.weights + sums / self.n - snapshot


def drive(ranks: list[Rank], until) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not until():
        assert time.monotonic() < deadline, "the rounds made no progress"
        for r in ranks:
            r.protocol.after_step()
        time.sleep(0.001)


def step(ranks: list[Rank]) -> None:
    for r in ranks:
        r.protocol.after_step()


def stop_all(ranks: list[Rank], how: str = "abort") -> None:
    """Every rank stops its rounds at once (``abort`` or ``abandon``), as separate processes would (a stop waits for
    the others); none raises."""
    raised: list[BaseException] = []

    def stop(rank: Rank) -> None:
        try:
            getattr(rank.protocol, how)()
        except BaseException as error:  # noqa: BLE001 - asserted below
            raised.append(error)

    stoppers = [threading.Thread(target=stop, args=(r,)) for r in ranks]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join(DEADLINE_S)
    assert not any(stopper.is_alive() for stopper in stoppers), f"{how} did not return"
    assert not raised, raised


@pytest.mark.parametrize("n", [2, 3])
def test_a_round_replaces_constant_weights_by_their_mean(n):
    group = Group(n)
    ranks = [Rank(r, group, np.full(4, 3.0 * r)) for r in range(n)]
    drive(ranks, lambda: all(r.protocol.rounds >= 1 for r in ranks))
    stop_all(ranks)
    rounds = {r.protocol.rounds for r in ranks}
    assert len(rounds) == 1, rounds
    expected = np.full(4, 3.0 * (n - 1) / 2)
    step(ranks)  # apply a round finished before the stop, if any
    for r in ranks:
        np.testing.assert_allclose(r.weights, expected, rtol=0, atol=1e-12)


def test_one_rank_aborting_stops_every_rank_at_the_same_round():
    group = Group(3)
    ranks = [Rank(r, group, np.full(2, float(r))) for r in range(3)]
    drive(ranks, lambda: ranks[0].protocol.rounds >= 2)
    stopper = threading.Thread(target=ranks[0].protocol.abort)
    stopper.start()
    drive(ranks[1:], lambda: not stopper.is_alive() and not any(r.protocol.running for r in ranks))
    stopper.join()
    assert len({r.protocol.rounds for r in ranks}) == 1
    stop_all(ranks[1:])
    with pytest.raises(RuntimeError, match=r"async: resume\(\) restarts averaging stopped by abort"):
        Rank(0, Group(1), np.zeros(1)).protocol.resume()
    for r in ranks:
        r.protocol.resume()
    before = ranks[0].protocol.rounds
    drive(ranks, lambda: all(r.protocol.rounds > before for r in ranks))
    stop_all(ranks)


def test_no_round_during_warmup():
    group = Group(2)
    ranks = [Rank(r, group, np.zeros(1), warmup_steps=3) for r in range(2)]
    step(ranks)
    step(ranks)
    assert not any(r.protocol.running for r in ranks) and all(r.protocol.in_warmup for r in ranks)
    step(ranks)
    assert all(r.protocol.running and not r.protocol.in_warmup for r in ranks)
    stop_all(ranks)
    assert [r.protocol.steps for r in ranks] == [3, 3]


def test_a_failed_round_is_raised_at_the_next_step():
    failure = OSError("link down")
    rank = Rank(0, Group(1), np.zeros(1), fail=failure)
    deadline = time.monotonic() + DEADLINE_S
    with pytest.raises(RuntimeError, match="async: model averaging failed in its background thread") as info:
        while time.monotonic() < deadline:
            rank.protocol.after_step()
            time.sleep(0.001)
    assert info.value.__cause__ is failure
    rank.protocol.abort()


@pytest.mark.parametrize("fail", [None, OSError("the members changed")], ids=["finished", "failed"])
def test_abandoning_the_rounds_drops_their_last_result_or_error_and_starts_none(fail):
    # Fault-tolerant survivors that take a step by themselves after a change: their threads end, a round they
    # finished (or their round's failure) is neither applied nor raised, and their next steps start no other round.
    group = Group(2)
    ranks = [Rank(r, group, np.full(2, 4.0 * r), fail=fail) for r in range(2)]
    deadline = time.monotonic() + DEADLINE_S
    for r in ranks:
        while not r.protocol._want_snapshot:  # the thread asks for the weights
            assert time.monotonic() < deadline, "no round began"
            time.sleep(0.001)
        r.protocol.after_step()  # hands them over
    while any(r.protocol.rounds < 1 and r.protocol._error is None for r in ranks):  # done, not applied (or failed)
        assert time.monotonic() < deadline, "no round ended"
        time.sleep(0.001)
    stop_all(ranks, "abandon")
    for r in ranks:
        r.protocol.after_step()
        r.protocol.after_step()
        assert not r.protocol.running
        r.protocol.abort()  # nothing left to raise
    # the round's correction would have moved each to the mean, 2
    np.testing.assert_array_equal([r.weights for r in ranks], [np.zeros(2), np.full(2, 4.0)])
