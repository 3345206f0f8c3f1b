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
    "left the communicator unusable",  # the MPI engine's: a call failed (MPICH gave up a send to a dead peer)
    "was abandoned",  # the TCP engine's build: the members changed again while it connected them
)


_COMMUNICATOR_PREFIX = "communicator/"
"""Where, in an epoch's store keys (:meth:`Epoch.prefix`), its communicator is built."""


def communication_failure(error: BaseException) -> bool:
    """Whether ``error`` means the work cannot finish with these members (retried in the next epoch): a membership
    change, a failed collective, or the coordinator's store gone with its process; or was caused by one (a background
    thread's error, such as an asynchronous averaging round's, is raised again wrapped)."""
    return _failed_communication(error) is not None


def fail_epoch(membership: Membership, epoch: Epoch, error: Exception) -> None:
    """Raise ``error`` unless it is a :func:`communication_failure`; else close ``epoch`` as failed, if nobody has
    yet (the next epoch is where the work is retried), giving the failed communication as the reason."""
    failure = _failed_communication(error)
    if failure is None:
        raise error
    if not epoch.closed.is_set():
        membership.fail(epoch, str(failure).splitlines()[0])


def _failed_communication(error: BaseException | None) -> BaseException | None:
    """The communication failure ``error`` is, or the first of its causes that is one; else None."""
    while error is not None:
        if isinstance(error, (MembershipChanged, StoreUnreachable, BuildIncomplete)):
            return error
        if any(text in str(error) for text in _COMMUNICATION_FAILURES):
            return error
        error = error.__cause__
    return None


def follow_members(communicator: NativeCommunicator, membership: Membership, closed: Epoch) -> tuple[Membership, Epoch]:
    """The epoch after ``closed`` (whose members ``communicator`` spans), with ``communicator`` the new members' (the
    survivors', and its joiners), and the membership it is an epoch of: ``membership``, unless the others went on
    without this member (it was stopped, cut off or starved past ``dead_after``), which then joins the job again as a
    new member (an epoch that lists it among its joiners, to be given the state), over the stores of ``closed``'s
    other members.

    Over TCP the communicator is built afresh through the new epoch's store, and a member lost meanwhile closes that
    epoch, abandons the build and makes the survivors take the next one. MPI shrinks the communicator to the
    survivors (rebuilds it over all of them where a failure lost nobody: a slow collective timed out, say) and grows
    it by the joiners. MPICH can abandon neither a pending ``MPI_Comm_create_group`` nor an accept that a member of
    the group never reaches, so every member of the new epoch, joiners too, first meets the others in its store: a
    member lost before it arrives (or later than the communicator's timeout) fails that epoch, and they take the next
    one. So does a joiner lost after the meeting, before it connected: the group accepts it a few seconds at a time
    (:func:`~bagua_common.comm.mpi_rendezvous.assemble`) and gives it up together once the epoch closed. One lost
    inside the shrink, or in the grow once connected, makes the others raise once the timeout passed, and they stop
    there, naming it (the job restarts from its last checkpoint)."""
    return _followed(communicator, membership, closed, [member.id for member in closed.members])


def _followed(
    communicator: NativeCommunicator, membership: Membership, closed: Epoch, spanned: list[str] | None
) -> tuple[Membership, Epoch]:
    """:func:`follow_members`, where ``communicator`` spans the members whose ids ``spanned`` lists in rank order
    (MPI: a shrink updates it), or none yet (None: a joiner's, of this process alone)."""
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
            _connected(communicator, spanned, new)
            return membership, new
        except Exception as error:  # noqa: BLE001 - communication failures only; the rest is raised
            _fail_or_raise(communicator, membership, new, error)
            closed = new


def _connected(communicator: NativeCommunicator, spanned: list[str] | None, new: Epoch) -> None:
    """Put the communicator of ``new``'s members in ``communicator``'s slot, which spans the members ``spanned``
    lists (None: a joiner's)."""
    prefix = new.prefix(_COMMUNICATOR_PREFIX)
    if communicator.can_rebuild:
        communicator.rebuild(new.store, prefix, new.rank, new.size, new.closed)
        return
    # MPICH cannot abandon a shrink, or an accept, that a member of the group never reaches (it died, or it is still
    # in its step): they meet in the store first, where such a member fails this epoch instead and the next one is
    # tried.
    meet(new.store, new.prefix(f"{_COMMUNICATOR_PREFIX}meeting/"), new.rank, new.size, communicator.timeout, new.closed)
    if spanned is None:
        communicator.join(new.store, prefix, new.rank, new.size, abandoned=new.closed)
        return
    kept = [spanned.index(member.id) for member in new.members if member.id in spanned]
    if len(kept) < len(spanned) or new.size == len(kept):  # no joiner to grow a new one: the closed one is revoked
        communicator.shrink(kept)
        spanned[:] = [spanned[i] for i in kept]  # should the grow fail, the next epoch starts from the survivors
    if new.size > len(kept):
        communicator.grow(new.store, prefix, new.size, abandoned=new.closed)


def _fail_or_raise(communicator: NativeCommunicator, membership: Membership, epoch: Epoch, error: Exception) -> None:
    """Close ``epoch`` as failed for ``error`` if its change of members can be made again in the next one; else raise
    it. MPI's cannot past the members' meeting, where a shrink or grow that failed cannot be made again, unless the
    grow gave up a joiner that never connected (:class:`BuildIncomplete`)."""
    if not (communicator.can_rebuild or isinstance(error, BuildIncomplete)):
        raise error
    fail_epoch(membership, epoch, error)


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
    out of); returns the membership. A member lost during the admission fails that epoch, and this process takes its
    place in the next one's communicator instead."""
    membership = Membership.join(settings, *master, peers, timeout=timeout)
    epoch = membership.epoch
    try:
        _connected(communicator, None, epoch)
        return membership
    except Exception as error:  # noqa: BLE001 - communication failures only: the admission goes on in the next epoch
        _fail_or_raise(communicator, membership, epoch, error)
    membership, _ = _followed(communicator, membership, epoch, None)
    return membership


def _rejoined(communicator: NativeCommunicator, evicted: Membership, closed: Epoch) -> Membership:
    settings, me = evicted.settings, evicted.me.id
    evicted.close()
    first, *others = [member for member in closed.members if member.id != me]
    peers = [f"{member.host}:{member.port}" for member in others]
    return join_members(communicator, settings, (first.host, first.port), peers, settings.quorum_timeout)
