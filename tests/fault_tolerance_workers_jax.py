"""Ranks of the JAX trainer's fault-tolerance tests (test_fault_tolerance_jax.py). The first members train with the
native TCP engine (``FT_ENGINE=mpi``: the MPI engine), each its own ``mpiexec -n 1`` job joined through the
fault-tolerant membership (rank 0's store on MASTER_PORT); the last process joins the running job later. Faults are
``{step: (rank, kind)}``: member ``rank`` fails while the others are blocked in step ``step``'s collective, by
``kill`` (SIGKILL), ``stop`` (SIGSTOP: a hang, found by missed heartbeats), ``pause`` (SIGSTOP, then SIGCONT
``PAUSE_SECONDS`` later: taken for dead, it joins again), ``partition`` (run in the network harness's namespaces: its
link down for ``PAUSE_SECONDS``, running; it joins again), ``raise`` (an exception ends the process), ``slow`` (it
starts the step's first attempt ``FT_COMM_TIMEOUT`` + 1.5 s late, alive) or ``stalls`` (every attempt), or, once the
step's collective completed, by ``kill-before-vote``, or, once its vote for the step returned applied, by
``leave-after-vote``: it leaves the job (closes its membership, the job not finished) and its process ends, the others
returning from their votes once it is gone; ``late_vote`` ``(rank, step)`` makes that member vote after it
saw the epoch close (a death closes it). ``FT_STATE_DELAY`` (seconds) makes the holder start sending a joiner's state
that late, and ``FT_STATE_HOLDER_DIES=1`` kills the first holder then; ``FT_KILL_IN_SHRINK`` (a rank) kills that
member in its first recovery's shrink (MPI), ``FT_KILL_IN_REBUILD`` (``rank:start`` or ``rank:connect``) in its first
recovery's rebuild (TCP: before it published its address, or as it connects; MPI, ``rank:meeting``: before it arrived
at the members' meeting before their shrink and grow; the joiner's rank: in its admission),
``FT_KILL_IN_STATE_SPLIT`` (a rank) as the members split the state's communicator at an admission, and
``FT_COMM_TIMEOUT`` (seconds, 60 by default) bounds the communicator's waits. ``FT_ALGORITHM`` (a name, then its
options as JSON) replaces the training's gradient allreduce and SGD (an algorithm that is an optimizer itself takes
SGD's learning rate), and ``FT_HIDDEN`` (a width) adds an unused layer of that width beside the linear model: a
larger step, with the same loss and zero gradients for the layer. ``FT_MLP`` (a width) adds a trained tanh layer of
that width to the linear model's prediction (a matrix PowerSGD compresses; :func:`mlp_params`). ``FT_FLAX=1`` makes
the state a flax ``TrainState``; ``FT_RESTORE=1`` starts the first members from the newest checkpoint in the signals
folder (the last run's final save). ``FT_AWAIT_CLOSE_AT`` (a DiLoCo step) makes every member start that step once its
first epoch closed, and ``FT_START_JOINER_AFTER`` (a step) starts the joiner once it is done instead of the last
fault's step (``train``: even with no member missing). ``FT_ADMITTING_STEP_SECONDS`` makes the first members' step
after the joiner's admission compute that much longer (``FT_STEP_SECONDS``: every step). ``FT_HASH_EVERY`` replaces
the replicas' check every second step (0: only after a change). ``FT_SLOW_EXIT`` (seconds) makes a first member's
process take that much longer to end once its program ended (an exit handler that runs after the library's, as a GPU
runtime's teardown may). ``FT_SAVE_EVERY_STEP=1`` makes the members save a checkpoint after
every step (not only at the end), and ``FT_CUT_OFF_IN_SAVE`` (``rank:step``, run in the network harness's namespaces)
cuts that member's link for ``PAUSE_SECONDS`` in the save after that step, its part written, before the others report
theirs. Every member records each attempt of a step (its transaction, epoch, rank, the members training it and all
the members, sample indices, times), its saves, its state's first and final parameters, its final rank and, under
low-precision decentralized training, the digests of its copies of its own and its ring neighbours' weights (under
asynchronous averaging: the rounds of its last members).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
from harness.links import cut_own_link
from ring_copies import ring_digests

from bagua_common.fault_tolerance import DataPosition, FaultToleranceSettings, Membership
from bagua_common.fault_tolerance.kv_store import advertised_host

SAMPLES, FEATURES, BATCH_PER_RANK, LR = 120, 5, 4, 0.1
ENGINE = os.environ.get("FT_ENGINE", "tcp")
"""The members' engine: ``tcp`` or ``mpi`` (the processes run as their own ``mpiexec -n 1`` jobs either way)."""
TIMING = {"heartbeat_period": 0.1, "dead_after": 1.5, "quorum_timeout": 30.0, "hash_every": 2}
"""The members' FaultToleranceSettings, less the job's secret (read where a member starts, not at import)."""
PAUSE_SECONDS = TIMING["dead_after"] + 3.0
VOTE_FAULTS = ("kill-before-vote", "leave-after-vote")
"""The faults that strike around a member's vote, not in its step."""


def _settings() -> FaultToleranceSettings:
    """The members' settings: :data:`TIMING`, its ``hash_every`` replaced by ``FT_HASH_EVERY`` where set."""
    return FaultToleranceSettings(
        **{**TIMING, "hash_every": int(os.environ.get("FT_HASH_EVERY", TIMING["hash_every"]))}
    )


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """A seeded linear-regression data set (the test's reference uses the same)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal(FEATURES) + 0.1 * rng.standard_normal(SAMPLES)).astype(np.float32)
    return x, y


def mlp_params(width: int) -> dict[str, np.ndarray]:
    """``FT_MLP``'s layer: a seeded ``FEATURES x width`` matrix into tanh, and zero output weights."""
    rng = np.random.default_rng(11)
    return {
        "mlp_in": (0.5 * rng.standard_normal((FEATURES, width))).astype(np.float32),
        "mlp_out": np.zeros(width, np.float32),
    }


def prediction(params, features, xp=np):
    """The model's prediction: linear, plus the tanh layer's where ``params`` has one (``xp``: NumPy or jnp)."""
    out = features @ params["w"] + params["b"]
    if "mlp_in" in params:
        out = out + xp.tanh(features @ params["mlp_in"]) @ params["mlp_out"]
    return out


def linear_loss(params, batch):
    """The model's mean squared error on ``batch`` (features, targets)."""
    import jax.numpy as jnp

    features, targets = batch
    loss = jnp.mean((prediction(params, features, jnp) - targets) ** 2)
    if "hidden" in params:
        loss = loss + 0.0 * jnp.mean(jnp.tanh(features @ params["hidden"]))
    return loss


def _signal(name: str) -> str:
    return os.path.join(os.environ["BAGUA_TEST_SIGNALS"], name)


def _touch(name: str, text: str = "") -> None:
    part = f"{_signal(name)}.{os.getpid()}.part"  # two processes may mark the same name at once (joiners asking)
    with open(part, "w") as f:
        f.write(text)
    os.replace(part, _signal(name))


def _wait_for(name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(_signal(name)) and time.monotonic() < deadline:
        time.sleep(0.02)


def _fail(kind: str, step: int) -> None:
    if kind in ("slow", "stalls"):  # alive, heartbeats going on, past the others' collective timeout (slow: once)
        if kind == "stalls" or not os.path.exists(_signal(f"slow-{step}")):
            _touch(f"slow-{step}")
            time.sleep(float(os.environ["FT_COMM_TIMEOUT"]) + 1.5)
        return
    if os.path.exists(_signal(f"fault-time-{step}")):  # once: back from a pause or a partition, it may run it again
        return
    time.sleep(0.5)  # the others are blocked in the step's collective by now
    if kind == "kill-once-asked":  # the joiner's request is in before this death is noticed
        _wait_for("joiner-asked")
        time.sleep(0.3)  # its request reaches the coordinator
        kind = "kill"
    _touch(f"fault-time-{step}", repr(time.time()))
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "pause":  # stopped past dead_after, then on again: the others went on without it, and it joins again
        subprocess.Popen(["sh", "-c", f"sleep {PAUSE_SECONDS}; kill -CONT {os.getpid()}"])
        _say_when_asking_to_join()
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if kind == "partition":  # its link down past dead_after, running: then up again
        cut_own_link(PAUSE_SECONDS)
        _say_when_asking_to_join()
        return
    raise RuntimeError("the victim fails on purpose")


def _say_when_asking_to_join() -> None:
    """Signal ``joiner-asked`` as this process asks to be admitted, and ``admitting-epoch`` (its number) once it was:
    the members wait for the request (a joiner compiles first; a member taken for dead asks once it went on)."""
    join = Membership.join

    def asking(*args, **kwargs):
        _touch("joiner-asked")
        membership = join(*args, **kwargs)
        _touch("admitting-epoch", str(membership.epoch.number))
        return membership

    Membership.join = asking


def _compilations() -> list[tuple[float, str, float, str]]:
    """From now on, each XLA compilation in this process: when it ended, the function, its seconds and its thread."""
    import logging

    import jax

    jax.config.update("jax_log_compiles", True)
    done: list[tuple[float, str, float, str]] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            words = record.getMessage().split()
            if words[:4] == ["Finished", "XLA", "compilation", "of"]:
                done.append((time.time(), words[4], float(words[6]), record.threadName))

    logging.getLogger("jax._src.dispatch").addHandler(Record())
    return done


def _start(start_size: int, make_trainer, data: DataPosition, params, example_batch, restore_from=None):
    """This process's FaultTolerantTrainer, its state, and when it was admitted: a first member (its state restored
    from the newest checkpoint under ``restore_from``, if given), or (rank >= start_size) a joiner, which compiles its
    step for ``example_batch`` before it asks."""
    from bagua_jax.fault_tolerance import FaultTolerantTrainer
    from bagua_jax.native_communicator import NativeCommunicator

    rank = int(os.environ["RANK"])
    master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    _touch(f"pid{rank}", str(os.getpid()))
    if rank >= start_size:
        _wait_for("start-joiner")
        _say_when_asking_to_join()
        alone = (
            NativeCommunicator.tcp_self(advertised_host(master[0]), timeout=60)
            if ENGINE == "tcp"
            else NativeCommunicator.mpi_self(timeout=60)
        )
        trainer = make_trainer(alone)
        ft = FaultTolerantTrainer.joiner(trainer, data, _settings(), master, timeout=60)
        state = ft.init(params, example_batch)
        return ft, state, ft.admission["admitted"]
    if "FT_SLOW_EXIT" in os.environ:  # registered before the membership's: runs after it
        atexit.register(time.sleep, float(os.environ["FT_SLOW_EXIT"]))
    membership = Membership.start(_settings(), rank, start_size, *master, timeout=60)
    seconds = float(os.environ.get("FT_COMM_TIMEOUT", "60"))  # a collective's, and a shrink's, longest wait
    store = membership.epoch.store
    comm = (
        NativeCommunicator.tcp_through_store(store, "world/", rank, start_size, membership.me.host, timeout=seconds)
        if ENGINE == "tcp"
        else NativeCommunicator.mpi_through_store(store, "world/", rank, start_size, timeout=seconds)
    )
    ft = FaultTolerantTrainer(make_trainer(comm), membership, data)
    state = ft.init(params) if restore_from is None else ft.restore(restore_from, params)
    return ft, state, time.time()


def _hold_up_the_state(holder_seconds: float, holder_dies: bool, joiner_seconds: float) -> None:
    """Make the state's holder start sending it to a joiner ``holder_seconds`` late (a slow link; ``holder_dies``: the
    first holder is SIGKILLed instead of sending it, the joiner waiting for it), and the first joiner start its side
    ``joiner_seconds`` late."""
    if not (holder_seconds or joiner_seconds):
        return
    from bagua_jax import state_transfer

    transfer = state_transfer.transfer_in_group

    def late(group, epoch, *args):
        if holder_seconds and epoch.rank == epoch.state_holder:
            time.sleep(holder_seconds)
            if holder_dies and not os.path.exists(_signal("holder-died")):
                _touch("holder-died")
                os.kill(os.getpid(), signal.SIGKILL)
        if joiner_seconds and epoch.is_joiner() and not os.path.exists(_signal("receiver-late")):
            _touch("receiver-late")
            time.sleep(joiner_seconds)
        return transfer(group, epoch, *args)

    state_transfer.transfer_in_group = late


def _die_while_a_joiner_is_late(victim: int) -> None:
    """Make member ``victim`` SIGKILL itself while the first joiner is late for its state (:func:`_hold_up_the_state`):
    a death while the holder waits for the joiner on their group."""
    if int(os.environ["RANK"]) != victim:
        return

    def die_then() -> None:
        _wait_for("receiver-late", timeout=600)
        time.sleep(0.2)
        _touch("victim-died")
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_then, daemon=True).start()


def _cut_off_in_a_save(victim: int, step: int) -> None:
    """Make member ``victim`` lose its link (for ``PAUSE_SECONDS``, running) in the save after ``step``, its part
    written, before the others say theirs are (rank 0 commits each save once every part is): they wait for it to be
    cut off first."""
    from bagua_jax import checkpoint

    wait, rank = checkpoint._wait_for_every_rank, int(os.environ["RANK"])

    def cut_off_before_the_others_wrote(trainer, what: str) -> None:
        if what == f"bagua checkpoint {step} written" and not os.path.exists(_signal("fault-time-save")):
            if rank == victim:
                cut_own_link(PAUSE_SECONDS)
                _touch("fault-time-save", repr(time.time()))
                _say_when_asking_to_join()
            else:
                _wait_for("fault-time-save")
        wait(trainer, what)

    checkpoint._wait_for_every_rank = cut_off_before_the_others_wrote


def _slow_the_admitting_step(seconds: float, ft, final_size: int) -> None:
    """Make a first member's step after the joiner's admission (the first with ``final_size`` members) compute
    ``seconds`` longer."""
    if not seconds:
        return
    from bagua_jax.trainer import DataParallel

    step, slowed = DataParallel.step, []

    def slow(self, *args, **kwargs):
        if ft.admission is None and ft.epoch.size == final_size and not slowed:
            slowed.append(True)
            time.sleep(seconds)
        return step(self, *args, **kwargs)

    DataParallel.step = slow


def _die_in_the_state_split() -> None:
    """SIGKILL this member as the members split the state's communicator at an admission (a death in it)."""
    from bagua_jax import state_transfer

    def dying(communicator, epoch):
        os.kill(os.getpid(), signal.SIGKILL)

    state_transfer.transfer_group = dying


def _die_in_the_first_shrink() -> None:
    """SIGKILL this member inside its first shrink of the communicator (a death during a recovery)."""
    from bagua_jax.native_communicator import NativeCommunicator

    def dying(self, members):
        os.kill(os.getpid(), signal.SIGKILL)

    NativeCommunicator.shrink = dying


def _die_in_the_first_rebuild(where: str) -> None:
    """SIGKILL this member in its first rebuild of the communicator: TCP, at its ``start`` (the others wait for its
    address in the store) or as it would ``connect`` (the ranks above it connect to it, those below wait for it);
    MPI, as it would arrive at the ``meeting`` before the shrink and the grow (the others wait for it in the store),
    or, a joiner, as it would ``connect`` to the port the group accepts on."""
    from bagua_jax import epoch_communicator
    from bagua_jax.native_communicator import NativeCommunicator

    if where == "meeting":
        epoch_communicator.meet = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        return

    class DyingAsItConnects:
        def __init__(self, engine):
            self._engine = engine

        def __getattr__(self, name):
            return getattr(self._engine, name)

        def build(self, *args):  # TCP
            os.kill(os.getpid(), signal.SIGKILL)

        connect = build  # MPI

    def dying(build):
        def dying_build(self, *args, **kwargs):
            if where == "start":
                os.kill(os.getpid(), signal.SIGKILL)
            self.engine = DyingAsItConnects(self.engine)
            build(self, *args, **kwargs)

        return dying_build

    NativeCommunicator.rebuild = dying(NativeCommunicator.rebuild)
    NativeCommunicator.join = dying(NativeCommunicator.join)


def _vote_with_faults(membership: Membership, rank: int, faults: dict, late_vote: tuple[int, int] | None) -> None:
    """Make ``membership``'s votes ahead (replicas identical) and one ahead (steps that exchange weights or nothing)
    fail as ``faults`` (``kill-before-vote``) and ``late_vote`` say for ``rank``."""

    def with_faults(vote):
        def voting(epoch, transaction):
            if faults.get(transaction) == (rank, "kill-before-vote"):
                _touch(f"fault-time-{transaction}", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if late_vote == (rank, transaction):  # once this member saw the epoch close
                epoch.closed.wait(60)
                time.sleep(0.5)
            applied = vote(epoch, transaction)
            if faults.get(transaction, (None, None))[1] == "leave-after-vote":
                if faults[transaction][0] == rank:
                    membership.close()
                    _touch(f"fault-time-{transaction}", repr(time.time()))
                    os._exit(0)
                _wait_for(f"fault-time-{transaction}")
                time.sleep(0.2)  # its sockets closed
            return applied

        return voting

    membership.vote_ahead = with_faults(membership.vote_ahead)
    membership.vote_one_ahead = with_faults(membership.vote_one_ahead)


def train(
    faults: dict[int, tuple[int, str]],
    start_size: int,
    final_size: int,
    steps: int,
    late_vote: tuple[int, int] | None = None,
) -> dict:
    """Gradient allreduce (or ``FT_ALGORITHM``) on a linear model until ``steps`` committed steps and ``final_size``
    members (a joiner starts once the last fault's step committed; the members wait a little each step until it is
    admitted). Returns this member's record (a victim never returns)."""
    import jax.numpy as jnp
    import optax

    from bagua_jax.algorithms import is_optimizer, make_algorithm
    from bagua_jax.trainer import DataParallel

    rank = int(os.environ["RANK"])
    x, y = dataset()

    def make_trainer(comm):
        name, _, options = os.environ.get("FT_ALGORITHM", "gradient_allreduce").partition(" ")
        algorithm = make_algorithm(name, **json.loads(options or "{}"))
        return DataParallel(linear_loss, None if is_optimizer(name) else optax.sgd(LR), algorithm, communicator=comm)

    if os.environ.get("FT_KILL_IN_SHRINK") == os.environ["RANK"]:
        _die_in_the_first_shrink()
    victim, _, where = os.environ.get("FT_KILL_IN_REBUILD", "").partition(":")
    if victim == os.environ["RANK"]:
        _die_in_the_first_rebuild(where)
    if os.environ.get("FT_KILL_IN_STATE_SPLIT") == os.environ["RANK"]:
        _die_in_the_state_split()
    cut_off, _, save_step = os.environ.get("FT_CUT_OFF_IN_SAVE", "").partition(":")
    if cut_off:
        _cut_off_in_a_save(int(cut_off), int(save_step))
    save_every_step = os.environ.get("FT_SAVE_EVERY_STEP") == "1"
    holder_dies = os.environ.get("FT_STATE_HOLDER_DIES") == "1"
    victim_while_late = os.environ.get("FT_KILL_WHILE_STATE_TRAVELS")
    _hold_up_the_state(float(os.environ.get("FT_STATE_DELAY", "0")), holder_dies, 1.5 if victim_while_late else 0.0)
    if victim_while_late:
        _die_while_a_joiner_is_late(int(victim_while_late))
    death_in_admission = holder_dies or bool(victim_while_late) or "FT_KILL_IN_STATE_SPLIT" in os.environ
    data = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    params = {"w": jnp.zeros(FEATURES, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    if os.environ.get("FT_HIDDEN"):
        params["hidden"] = jnp.zeros((FEATURES, int(os.environ["FT_HIDDEN"])), jnp.float32)
    if os.environ.get("FT_MLP"):
        params.update({k: jnp.asarray(v) for k, v in mlp_params(int(os.environ["FT_MLP"])).items()})
    if os.environ.get("FT_FLAX") == "1":
        from flax.training import train_state

        params = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(LR))
    started = time.time()
    compilations = _compilations()
    example = (x[:BATCH_PER_RANK], y[:BATCH_PER_RANK])
    restore_from = _signal("checkpoints") if os.environ.get("FT_RESTORE") == "1" else None
    ft, state, admitted = _start(start_size, make_trainer, data, params, example, restore_from)
    first_params = {k: np.asarray(v) for k, v in state.params.items()}
    # the others train two steps without a member cut off in a save before they wait for its return
    last_fault = max([*faults, int(save_step) + 2 if cut_off else 1])
    start_joiner_after = int(os.environ.get("FT_START_JOINER_AFTER", last_fault))
    joins_early = "FT_START_JOINER_AFTER" in os.environ  # whatever the members' number
    attempts = []
    _vote_with_faults(ft.membership, rank, faults, late_vote)

    _slow_the_admitting_step(float(os.environ.get("FT_ADMITTING_STEP_SECONDS", "0")), ft, final_size)
    step_seconds = float(os.environ.get("FT_STEP_SECONDS", "0"))

    def batch_of(indices):
        transaction = ft.committed + 1
        if transaction in faults and faults[transaction][0] == rank and faults[transaction][1] not in VOTE_FAULTS:
            _fail(faults[transaction][1], transaction)
        if transaction > start_joiner_after and (ft.epoch.size < final_size or death_in_admission or joins_early):
            if ft.epoch.rank == 0:  # the survivors of the last fault recovered: the joiner compiles for their size
                _touch("start-joiner")
            _wait_for("joiner-asked")
            time.sleep(0.05)  # the commit after the joiner's request admits it
        attempts.append(
            {
                "transaction": transaction,
                "epoch": ft.epoch.number,
                "size": ft.trainers,
                "members": ft.epoch.size,
                "rank": ft.epoch.rank,
                "indices": indices.tolist(),
                "start": time.time(),
            }
        )
        time.sleep(step_seconds)
        return x[indices], y[indices]

    last_size, saves = None, []  # the members' step that admits the joiner is retried with it: every rank ends there
    while ft.committed < steps or last_size != final_size:
        recovered = len(ft.recoveries)
        state, loss = ft.step(state, batch_of)
        last_size = ft.epoch.size
        alone = any(r["caught_up"] for r in ft.recoveries[recovered:])  # the step the others applied, by itself
        attempts[-1].update(committed=ft.committed, loss=float(loss), end=time.time(), alone=alone)
        if save_every_step:
            folder = ft.save(_signal("checkpoints"), state)
            saves.append({"step": ft.committed, "folder": None if folder is None else str(folder)})
    params = {k: np.asarray(v) for k, v in state.params.items()}
    ring = [node for node in state.opt_state if type(node).__name__ == "LowPrecisionDecentralizedState"]
    copies = ring_digests({k: getattr(ring[0], k) for k in ("weights", "left", "right")}) if ring else None
    if not save_every_step:
        ft.save(_signal("checkpoints"), state)  # the members' checkpoint after the changes of members
    rounds = ft.averaging_rounds  # before finished() ends them
    ft.finished()
    ft.membership.close()
    return {
        "steps": [a for a in attempts if "committed" in a],
        "attempts": attempts,
        "params": params,
        "first_params": first_params,
        "rank": ft.epoch.rank,  # at the end
        "copies": copies,
        "state_class": type(state).__module__ + "." + type(state).__name__,
        "recoveries": ft.recoveries,
        "saves": saves,
        "started": started,
        "admitted": admitted,
        "asked": ft.admission["asked"] if ft.admission else None,  # a joiner's request, its step compiled
        "compilations": compilations,
        "rounds": rounds,
    }


def train_and_save(start_size: int, steps: int, victim: int, restart: bool = False, diloco: bool = False) -> dict:
    """Gradient allreduce (``diloco``: DiLoCo, H = 2) on the linear model until state step ``steps``, every member
    saving a checkpoint (``FaultTolerantTrainer.save``) after step 2 and after the last; ``victim`` dies in the first
    save, having written its part. ``restart``: the members start from the newest checkpoint
    (``FaultTolerantTrainer.restore``) instead. Returns the saves' folders (None: not committed), the steps' sizes,
    the final parameters and, under DiLoCo, the round start."""
    import jax.numpy as jnp
    import optax

    from bagua_jax import checkpoint
    from bagua_jax.algorithms import DiLoCo
    from bagua_jax.trainer import DataParallel

    rank = int(os.environ["RANK"])
    x, y = dataset()
    if rank == victim:
        checkpoint._wait_for_every_rank = lambda trainer, what: os.kill(os.getpid(), signal.SIGKILL)

    def make_trainer(comm):
        algorithm = DiLoCo(sync_every=2) if diloco else "gradient_allreduce"
        return DataParallel(linear_loss, optax.sgd(LR), algorithm, communicator=comm)

    params = {"w": jnp.zeros(FEATURES, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    root = _signal("checkpoints")
    data = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    ft, state, _ = _start(start_size, make_trainer, data, params, None, restore_from=root if restart else None)
    saved, sizes = [], {}
    while int(state.step) < steps:
        state, _ = ft.step(state, lambda indices: (x[indices], y[indices]))
        sizes[int(state.step)] = ft.epoch.size
        if int(state.step) in (2, steps):
            folder = ft.save(root, state)
            saved.append(None if folder is None else str(folder))
    ft.finished()
    ft.membership.close()
    result = {"saved": saved, "sizes": sizes, "params": {k: np.asarray(v) for k, v in state.params.items()}}
    if diloco:
        result["round_start"] = {k: np.asarray(v) for k, v in state.opt_state[1].round_start.items()}
    return result


DILOCO_ROUND = 4


def train_diloco(
    faults: dict[int, tuple[int, str]],
    start_size: int,
    final_size: int,
    steps: int,
    options: dict,
    flax_state: bool = False,
) -> dict:
    """DiLoCo (H = ``DILOCO_ROUND``, its other ``options``, SGD inside, the default outer Nesterov SGD) on the
    linear model until at least ``steps`` inner steps, ``final_size`` members and a round's end. ``faults`` are keyed
    by inner step: member ``rank`` fails as it starts that step (mid-round, or in an exchange while the others are
    blocked in it). A joiner starts once the last fault's step is done; the members wait a little each step until it
    is admitted. With ``flax_state`` the state is a flax ``TrainState``. Returns this member's record (a victim never
    returns): each attempt's place among the ranks that train it (``rank``, 0 for one sitting the round out) and their
    number (``trainers``), and the class of the state it ended with."""
    import jax.numpy as jnp
    import optax

    from bagua_jax.algorithms import DiLoCo
    from bagua_jax.trainer import DataParallel

    rank = int(os.environ["RANK"])
    x, y = dataset()

    def make_trainer(comm):
        algorithm = DiLoCo(sync_every=DILOCO_ROUND, **options)
        return DataParallel(linear_loss, optax.sgd(LR), algorithm, communicator=comm)

    victim, _, where = os.environ.get("FT_KILL_IN_REBUILD", "").partition(":")
    if victim == os.environ["RANK"]:
        _die_in_the_first_rebuild(where)
    data = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    params = {"w": jnp.zeros(FEATURES, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    if flax_state:
        from flax.training import train_state

        params = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(LR))
    ft, state, admitted = _start(start_size, make_trainer, data, params, (x[:BATCH_PER_RANK], y[:BATCH_PER_RANK]))
    last_fault = max(faults)
    start_joiner_after = int(os.environ.get("FT_START_JOINER_AFTER", last_fault))
    attempts = []
    await_close = int(os.environ.get("FT_AWAIT_CLOSE_AT", "0"))

    def batch_of(indices, step):
        if faults.get(step, (None,))[0] == rank:
            _fail(faults[step][1], step)
        if step == await_close and ft.epoch.number == 0:  # the step then starts in a closed epoch: it is not run
            ft.epoch.closed.wait(60)
        if step > start_joiner_after and ft.epoch.size < final_size:
            _wait_for("joiner-asked")
            time.sleep(0.1)  # the exchange after the joiner's request admits it
        place, trainers = ft._training_place(ft.epoch)
        attempts.append(
            {"step": step, "epoch": ft.epoch.number, "size": ft.epoch.size, "rank": place, "trainers": trainers}
            | {"indices": indices.tolist(), "start": time.time()}
        )
        return x[indices], y[indices]

    done = int(state.step)
    while done < steps or ft.epoch.size < final_size or done % DILOCO_ROUND:
        state, loss = ft.step(state, lambda indices: batch_of(indices, done + 1))
        done = int(state.step)
        attempts[-1].update(committed=ft.committed, loss=float(loss), end=time.time())
        if done == start_joiner_after and ft.epoch.rank == 0:
            _touch("start-joiner")
    ft.finished()
    ft.membership.close()
    return {
        "steps": [a for a in attempts if "end" in a],
        "attempts": attempts,
        "params": {k: np.asarray(v) for k, v in state.params.items()},
        "round_start": {k: np.asarray(v) for k, v in state.opt_state[1].round_start.items()},
        "committed": ft.committed,
        "recoveries": ft.recoveries,
        "admitted": admitted,
        "asked": ft.admission["asked"] if ft.admission else None,  # a joiner's request, its step compiled
        "state_class": type(state).__module__ + "." + type(state).__name__,
    }


def train_diloco_saving(start_size: int, final_size: int, steps: int) -> dict:
    """DiLoCo (H = ``DILOCO_ROUND``) on the linear model, every member saving a checkpoint
    (``FaultTolerantTrainer.save``) after every step; a joiner starts after step 2 and sits out the round it is
    admitted in. Runs until at least ``steps`` inner steps, ``final_size`` members and a round's end. Returns each
    save's step and folder (None: not written) and each step's member count."""
    import jax.numpy as jnp
    import optax

    from bagua_jax.algorithms import DiLoCo
    from bagua_jax.trainer import DataParallel

    x, y = dataset()

    def make_trainer(comm):
        return DataParallel(linear_loss, optax.sgd(LR), DiLoCo(sync_every=DILOCO_ROUND), communicator=comm)

    data = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    params = {"w": jnp.zeros(FEATURES, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    ft, state, _ = _start(start_size, make_trainer, data, params, (x[:BATCH_PER_RANK], y[:BATCH_PER_RANK]))
    root, saves, sizes = _signal("checkpoints"), [], {}
    done = int(state.step)
    while done < steps or ft.epoch.size < final_size or done % DILOCO_ROUND:
        if done >= 2 and ft.epoch.size < final_size:
            _wait_for("joiner-asked")
        state, _ = ft.step(state, lambda indices: (x[indices], y[indices]))
        done = int(state.step)
        sizes[done] = ft.epoch.size
        folder = ft.save(root, state)
        saves.append((done, None if folder is None else str(folder)))
        if done == 2 and ft.epoch.rank == 0:
            _touch("start-joiner")
    ft.finished()
    ft.membership.close()
    return {"saves": saves, "sizes": sizes}
