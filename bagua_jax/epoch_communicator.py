"""The native communicator follows the job's members from epoch to epoch, in place.

When an epoch closes, the survivors shrink the communicator to themselves and grow it by the epoch's joiners, in
the same handle (a step whose shapes do not depend on the world size is not compiled again). The torch front end
builds its groups per epoch instead (:mod:`bagua_torch.communicator.epoch_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence

from bagua_common.comm.key_value_store import BuildIncomplete, meet
from bagua_common.fault_tolerance import (
    Epoch,
    Evicted,
    FaultToleranceSettings,
    Membership,
    MembershipChanged,
    StoreUnreachable,
)
from bagua_jax.native_collectives import forget_failed_calls
from bagua_jax.native_communicator import NativeCommunicator

__all__ = ["communication_failure", "fail_epoch", "follow_members", "join_members"]

# Errors of the native engines that mean "the communicator cannot finish this collective": the step is retried
# in the next epoch. Anything else is the program's own error and is raised.
_COMMUNICATION_FAILURES = (
    "was revoked",
    "did not complete within",
    "unusable after an earlier failure",
    "closed its connection",  # the TCP engine's: a peer died, or its own collective failed
    "the connection to rank",
    "was abandoned",  # the TCP engine's build: the members changed again while it connected them
)


_COMMUNICATOR_PREFIX = "communicator/"
"""Where, in an epoch's store keys (:meth:`Epoch.prefix`), its communicator is built."""


def communication_failure(error: Exception) -> bool:
    """Whether ``error`` means the work cannot finish with these members (retried in the next epoch): a membership
    change, a failed collective, or the coordinator's store gone with its process."""
    if isinstance(error, (MembershipChanged, StoreUnreachable, BuildIncomplete)):
        return True
    return any(text in str(error) for text in _COMMUNICATION_FAILURES)


def fail_epoch(membership: Membership, epoch: Epoch, error: Exception) -> None:
    """Raise ``error`` unless it is a :func:`communication_failure`; else close ``epoch`` as failed, if nobody has
    yet (the next epoch is where the work is retried)."""
    if not communication_failure(error):
        raise error
    if not epoch.closed.is_set():
        membership.fail(epoch, str(error).splitlines()[0])


def follow_members(communicator: NativeCommunicator, membership: Membership, closed: Epoch) -> tuple[Membership, Epoch]:
    """The epoch after ``closed`` (whose members ``communicator`` spans), with ``communicator`` the new members' (the
    survivors', and its joiners), and the membership it is an epoch of: ``membership``, unless the others went on
    without this member (it was stopped, cut off or starved past ``dead_after``), which then joins the job again as a
    new member (an epoch that lists it among its joiners, to be given the state), over the stores of ``closed``'s
    other members.

    Over TCP the communicator is built afresh through the new epoch's store, and a member lost meanwhile closes that
    epoch, abandons the build and makes the survivors take the next one. MPI shrinks the communicator to the
    survivors (rebuilds it over all of them where a failure lost nobody: a slow collective timed out, say) and grows
    it by the joiners. MPICH cannot abandon a pending ``MPI_Comm_create_group``, and every later communicator waits
    for it, so the survivors first meet in the epoch's store: a survivor lost before it arrives (or later than the
    communicator's timeout) fails that epoch, and they take the next one; one lost inside the shrink makes the others'
    shrink raise once the timeout passed, and they stop there, naming it (the job restarts from its last
    checkpoint)."""
    spanned = closed  # the epoch whose members the communicator spans (MPI: until it shrinks)
    while True:
        try:
            new = membership.recover(closed).epoch
        except Evicted:
            membership = _rejoined(communicator, membership, closed)
            return membership, membership.epoch
        except BaseException:  # the job stops (NoProgress, NoQuorum): JAX's exit would raise the abandoned step's error
            forget_failed_calls()  # again, from the ordering tokens it waits for, burying this one
            raise
        try:
            if communicator.can_rebuild:
                communicator.rebuild(new.store, new.prefix(_COMMUNICATOR_PREFIX), new.rank, new.size, new.closed)
            else:
                _shrunk_and_grown(communicator, spanned, new)
            return membership, new
        except Exception as error:  # noqa: BLE001 - communication failures only; the rest is raised
            if not (communicator.can_rebuild or isinstance(error, BuildIncomplete)):
                raise  # MPI: past the survivors' meeting, where a shrink or grow that failed cannot be made again
            fail_epoch(membership, new, error)
            closed = new


def _shrunk_and_grown(communicator: NativeCommunicator, spanned: Epoch, new: Epoch) -> None:
    ids = [member.id for member in spanned.members]
    survivors = [member for member in new.members if member.id in ids]
    kept = [ids.index(member.id) for member in survivors]
    if len(kept) < len(ids) or new.size == len(kept):  # no joiner to grow a new one: the closed one is revoked
        # MPICH cannot abandon a shrink that a survivor never reaches (it died, or it is still in its step): they meet
        # in the store first, where such a survivor fails this epoch instead and the next one is tried.
        place = survivors.index(new.members[new.rank])
        prefix = new.prefix(f"{_COMMUNICATOR_PREFIX}shrink/")
        meet(new.store, prefix, place, len(survivors), communicator.timeout, new.closed)
        communicator.shrink(kept)
    if new.size > len(kept):
        communicator.grow(new.store, new.prefix(_COMMUNICATOR_PREFIX), new.size)


def join_members(
    communicator: NativeCommunicator,
    settings: FaultToleranceSettings,
    master: tuple[str, int],
    peers: Sequence[str] | None,
    timeout: float,
) -> Membership:
    """Ask a live member's store at ``master`` (host, port), then ``peers``, to be admitted into the running job,
    waiting up to ``timeout`` seconds, and take the admitting epoch's communicator in ``communicator``'s slot (one of
    :meth:`NativeCommunicator.tcp_self` or :meth:`~NativeCommunicator.mpi_self`, or of an epoch this process was taken
    out of); returns the membership."""
    membership = Membership.join(settings, *master, peers, timeout=timeout)
    epoch = membership.epoch
    if not communicator.can_rebuild:
        communicator.join(epoch.store, epoch.prefix(_COMMUNICATOR_PREFIX), epoch.rank, epoch.size, timeout)
        return membership
    try:
        communicator.rebuild(epoch.store, epoch.prefix(_COMMUNICATOR_PREFIX), epoch.rank, epoch.size, epoch.closed)
    except Exception as error:  # noqa: BLE001 - communication failures only: the admission goes on in the next epoch
        fail_epoch(membership, epoch, error)
        membership, _ = follow_members(communicator, membership, epoch)
    return membership


def _rejoined(communicator: NativeCommunicator, evicted: Membership, closed: Epoch) -> Membership:
    settings, me = evicted.settings, evicted.me.id
    evicted.close()
    first, *others = [member for member in closed.members if member.id != me]
    peers = [f"{member.host}:{member.port}" for member in others]
    return join_members(communicator, settings, (first.host, first.port), peers, settings.quorum_timeout)
