"""What a fault-tolerant job raises when its membership changes or its replicas disagree."""

from __future__ import annotations

__all__ = [
    "NO_JOB_STATUS",
    "Evicted",
    "ExchangeInterrupted",
    "JobFinished",
    "MembershipChanged",
    "NoJobToJoin",
    "NoProgress",
    "NoQuorum",
    "ReplicaMismatch",
]

NO_JOB_STATUS = 75
"""The exit status of a joiner that found no member left (:class:`NoJobToJoin`; ``EX_TEMPFAIL``): its launcher slot
then ends with it, so that the launcher restarts the whole job."""


class MembershipChanged(RuntimeError):
    """The transaction in flight (a step, an outer exchange) was abandoned because the members changed.

    Raised inside a step; the front end's step scope catches it, waits for the next epoch and
    runs the step again with the survivors. Nothing of the abandoned transaction was applied.
    """


class ExchangeInterrupted(MembershipChanged):
    """An outer exchange (DiLoCo's) was interrupted by a change of members after the step's own work was done.

    The step counts: the survivors take the next epoch and retry the exchange among themselves with
    their own pseudo-gradients, so no completed inner step is lost.
    """


class Evicted(RuntimeError):
    """The other members formed an epoch without this process (it was taken for dead, e.g. after a long stop).

    Its state may be behind the job's: it can only come back as a joiner, receiving state from a member.
    """


class JobFinished(SystemExit):
    """The job this process asked to join has finished: its members trained every step and left.

    A ``SystemExit`` with status 0: a replacement started as the job ended exits cleanly, without running
    the training script's code after its loop on a model it never trained (the message is printed first).
    """

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message


class NoJobToJoin(SystemExit):
    """No member of the job this process asked to join answered for ``quorum_timeout`` seconds: every member is gone.

    A ``SystemExit`` with status :data:`NO_JOB_STATUS` (the message is printed first). Under ``bagua-launch
    --fault-tolerant`` the slot ends with it instead of starting another joiner, so the launcher restarts the whole
    job (the elastic restart, within ``--max-restarts``), whose first members go on from their last checkpoint.
    """

    def __init__(self, message: str):
        super().__init__(NO_JOB_STATUS)
        self.message = message


class NoQuorum(RuntimeError):
    """The survivors reachable from here are not a majority of the last epoch's members that may be alive.

    Either the others are dead but not confirmed (hung, or cut off by a partition) or this side is
    the minority of a partition; continuing could split the job in two. The process stops; the
    launcher may restart it as a joiner.
    """


class NoProgress(RuntimeError):
    """The same members failed the same transaction several times in a row, nobody lost: it cannot complete as it is.

    A member slower than the collective timeout at every attempt makes every retry time out alike. Every member
    raises it at the same recovery (they see the same epochs); the message names the last failure and the timeout.
    """


class ReplicaMismatch(RuntimeError):
    """The replicated state (parameters, optimizer or algorithm state) differs between members.

    Raised on every member after a hash check (after each membership change and every
    ``hash_every`` transactions); the message names the ranks that differ from the majority and the
    parts that differ. It is never averaged away.
    """
