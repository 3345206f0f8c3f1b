"""The round protocol of asynchronous model averaging, driven by either front end.

A background thread runs rounds; the training thread calls :meth:`AveragingRounds.after_step`
after every optimizer step. A round: the thread waits until the last round's result has been
applied, ``interval_s`` has passed and the training thread has handed over a snapshot of the
weights; all ranks' threads then allreduce (max) a stop flag, so every rank stops before the
same round, and, unless stopping, allreduce (sum) the snapshot. The training thread applies
the sums at its next step. The front end supplies the four framework-specific parts:

* ``take_snapshot()`` (training thread): a copy of the weights for the next round;
* ``agree_to_stop(stop)`` (thread): the allreduce-max of the flag, True if any rank stops;
* ``allreduce_sum(snapshot)`` (thread): the snapshot summed over the ranks;
* ``apply(sums, snapshot)`` (training thread): weights ``+ sums / n - snapshot``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

TakeSnapshot = Callable[[], Any]
AgreeToStop = Callable[[bool], bool]
AllreduceSum = Callable[[Any], Any]
Apply = Callable[[Any, Any], None]
Failed = Callable[[BaseException], None]


class AveragingRounds:
    """Background averaging rounds and the training thread's side of them (see the module doc).

    ``interval_s`` is the least time between the end of one round and the start of the next;
    the thread starts once ``steps`` reaches ``warmup_steps``. ``name`` prefixes the errors.
    ``failed``, if given, is told a round's error from the thread as it happens (the training
    thread raises it at its next :meth:`after_step`).
    """

    def __init__(
        self,
        name: str,
        interval_s: float,
        warmup_steps: int,
        steps: int,
        *,
        take_snapshot: TakeSnapshot,
        agree_to_stop: AgreeToStop,
        allreduce_sum: AllreduceSum,
        apply: Apply,
        failed: Failed | None = None,
    ) -> None:
        self._name = name
        self._failed = failed
        self._interval = interval_s
        self._warmup_steps = warmup_steps
        self._take_snapshot, self._agree_to_stop = take_snapshot, agree_to_stop
        self._allreduce_sum, self._apply = allreduce_sum, apply
        self._cv = threading.Condition()
        # Shared with the thread, guarded by _cv.
        self._want_snapshot = False
        self._snapshot: Any = None
        self._result: tuple[Any, Any] | None = None  # (sums, snapshot)
        self._stop = False
        self._error: BaseException | None = None
        self._rounds = 0
        # Used by the training thread only.
        self._steps = steps
        self._aborted = False
        self._thread: threading.Thread | None = None
        self._maybe_start()

    @property
    def steps(self) -> int:
        """Training steps counted so far (warm-up included)."""
        return self._steps

    @property
    def in_warmup(self) -> bool:
        """Whether the step count is still below ``warmup_steps`` (no rounds yet)."""
        return self._steps < self._warmup_steps

    @property
    def rounds(self) -> int:
        """The rounds completed so far (equal on all ranks once the thread has stopped)."""
        with self._cv:
            return self._rounds

    @property
    def running(self) -> bool:
        """Whether the background thread is alive (it ends on :meth:`abort`, on any rank's)."""
        return self._thread is not None and self._thread.is_alive()

    def restore_steps(self, steps: int) -> None:
        """Continue from a checkpoint's step count (starts the thread if warm-up is over)."""
        self._steps = steps
        self._maybe_start()

    def after_step(self) -> None:
        """After every step: apply a finished round, hand over a snapshot if asked; never waits.

        Raises the thread's error if a round failed.
        """
        self._raise_error()
        with self._cv:
            result = self._result
        if result is not None:
            self._apply(*result)
        with self._cv:
            # The next snapshot is taken only after this round's correction is in the weights;
            # one from before it would have the correction counted twice.
            if result is not None:
                self._result = None
            if self._want_snapshot and self._snapshot is None:
                self._snapshot = self._take_snapshot()
            self._cv.notify_all()
        self._steps += 1
        self._maybe_start()

    def abort(self) -> None:
        """Stop the rounds on every rank and wait for this rank's thread to end.

        The stop request travels with the next round's flag allreduce, so every rank's thread
        stops before the same round, even when the ranks call ``abort`` at different times (or
        only one rank does: the others' threads stop too, and their ``abort`` just joins). A
        round already finished but not applied is applied by the next :meth:`after_step`.
        Before warm-up ends it keeps the thread from starting. Safe to call twice. Raises the
        thread's error if a round failed.
        """
        self._end_thread()
        self._raise_error()

    def abandon(self) -> None:
        """Stop the rounds of members that changed (a fault-tolerant job): wait for this rank's thread to end (its
        collectives give up with the members), drop its error and a round it finished but did not apply, and start
        no other (a rebuild for the new members starts them again)."""
        self._end_thread()
        with self._cv:
            self._error = self._result = None
            self._want_snapshot = False

    def resume(self) -> None:
        """Restart the rounds after :meth:`abort` (now, or when warm-up ends); on every rank."""
        if not self._aborted:
            raise RuntimeError(f"{self._name}: resume() restarts averaging stopped by abort(); call abort() first")
        self._aborted = False
        with self._cv:
            self._stop = False
        self._maybe_start()

    def _end_thread(self) -> None:
        """Ask this rank's thread to stop before its next round, wait for it to end, and start no other."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._aborted = True

    def _raise_error(self) -> None:
        with self._cv:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"{self._name}: model averaging failed in its background thread") from error

    def _maybe_start(self) -> None:
        if self._thread is None and not self._aborted and not self.in_warmup:
            self._thread = threading.Thread(target=self._run, name="bagua-async-model-average", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        next_round = time.monotonic()
        try:
            while True:
                with self._cv:
                    self._wait_for_round(next_round)
                    stop = self._stop
                    snapshot, self._snapshot, self._want_snapshot = self._snapshot, None, False
                # Every rank's thread reaches this allreduce once per round whatever its loop
                # does, so all agree to stop before the same round and none is left waiting.
                if self._agree_to_stop(stop):
                    return
                sums = self._allreduce_sum(snapshot)
                with self._cv:
                    self._result = (sums, snapshot)
                    self._rounds += 1
                next_round = time.monotonic() + self._interval
        except Exception as error:  # noqa: BLE001 - handed to the training thread, which raises it
            with self._cv:
                self._error = error
            if self._failed is not None:
                self._failed(error)

    def _wait_for_round(self, not_before: float) -> None:
        """With ``_cv`` held: return once a stop is requested, or once the last result is applied,
        ``not_before`` has passed and the training thread has handed over a snapshot."""
        while not self._stop:
            if self._result is not None:
                self._cv.wait()
                continue
            remaining = not_before - time.monotonic()
            if remaining > 0:
                self._cv.wait(remaining)
                continue
            if self._snapshot is not None:
                return
            self._want_snapshot = True
            self._cv.wait()


class RoundsControl:
    """The user's view of the rounds a front end's object drives through its ``_protocol``.

    Mixed into ``bagua_jax``'s ``AsyncModelAverager`` and ``bagua_torch``'s
    ``AsyncModelAverageImpl``, so both offer the same properties and controls.
    """

    _protocol: AveragingRounds

    @property
    def steps(self) -> int:
        """Training steps counted so far (warm-up included)."""
        return self._protocol.steps

    @property
    def rounds(self) -> int:
        """The averaging rounds completed so far (equal on all ranks once the thread has stopped)."""
        return self._protocol.rounds

    @property
    def running(self) -> bool:
        """Whether the background thread is alive (it ends on :meth:`abort`, on any rank's)."""
        return self._protocol.running

    def abort(self) -> None:
        """Stop the rounds on every rank and wait for this rank's thread to end.

        See :meth:`AveragingRounds.abort`: every rank's thread stops before the same round; a
        round finished but not applied is still applied after the next step. Safe to call twice.
        Raises the thread's error if a round failed.
        """
        self._protocol.abort()

    def resume(self) -> None:
        """Restart the rounds after :meth:`abort` (at once, or when warm-up ends); every rank must call it."""
        self._protocol.resume()

    def abandon(self) -> None:
        """Stop the rounds of members that changed (a fault-tolerant job): see :meth:`AveragingRounds.abandon`; a
        round finished but not applied is dropped, and a failed round's error too."""
        self._protocol.abandon()
