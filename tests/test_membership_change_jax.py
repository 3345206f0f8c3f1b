"""The native MPI engine survives a SIGKILLed rank without a restart: revoke, shrink, grow.

Every rank is its own ``mpiexec -n 1`` job with the world built through a key-value store (MPICH's ULFM is a
stub in its ch4 device and hydra kills a signalled rank's node-mates: see bagua_common/comm/mpi_rendezvous.py).
One job of 3 ranks plus a newcomer: rank 1 or 2 is SIGKILLed, the survivors' blocked jitted allreduce is revoked,
they shrink to 2 ranks and run the same compiled step (rank read at run time: survivor 2 becomes rank 1), give up
together a grow that no newcomer connects to when one of them is told to, then the newcomer joins as rank 2 and gets
rank 0's state by broadcast; last, a call that fails on the grown communicator.
"""

from __future__ import annotations

import numpy as np
import pytest
from multiprocess import ONE_CPU_DEVICE, has_mpiexec, run_ranks

from bagua_common.comm.mpi_rendezvous import ACCEPT_WAIT_SECONDS
from bagua_common.fault_tolerance import KVClient, KVServer, job_secret

pytestmark = pytest.mark.skipif(not has_mpiexec(), reason="needs mpiexec (the mpich wheel)")


@pytest.mark.parametrize("victim", [1, 2])
def test_a_killed_rank_is_revoked_shrunk_away_and_replaced(victim: int):
    # Rank 2's death holds rank 1 inside MPICH as the revoke comes, retrying a send to the dead rank its provider
    # cannot issue: up to the bound a fault-tolerant rank sets on those retries (mpi_rendezvous.DEAD_PEER_ENVIRONMENT),
    # 1.5-2 s at the bound of 100000 on a 2-core machine, where rank 0 waits for it in the shrink.
    survivors = [rank for rank in range(3) if rank != victim]
    server = KVServer("127.0.0.1", secret=job_secret())
    client = KVClient("127.0.0.1", server.port, 10.0, secret=job_secret())

    def victim_gone(codes):
        if codes[victim] is not None:
            client.set("test/victim-gone", b"")

    try:
        results = run_ranks(
            "membership_change_workers_jax:shrink_and_grow",
            4,
            victim,
            launcher="mpiexec-per-rank",
            timeout=240,
            env={**ONE_CPU_DEVICE, "BAGUA_TEST_STORE_PORT": str(server.port)},
            check=False,
            watch=victim_gone,
        )
    finally:
        client.close()
        server.close()
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert results[victim].returncode != 0 and results[victim].value is None, outputs
    assert all(results[r].returncode == 0 for r in [*survivors, 3]), outputs
    for new_rank, old_rank in enumerate(survivors):
        seen = results[old_rank].value
        np.testing.assert_array_equal(seen["first"], np.full(4, (0 + 1 + 2) / 3, np.float32))
        assert seen["first_rank"] == old_rank
        # The blocked allreduce ended at the revoke (0.5 s after it started), and the shrink at once after it.
        assert f"revoked: rank {victim} died" in seen["blocked_step"], seen["blocked_step"]
        assert seen["revoked_after"] < 1.5, seen
        assert seen["shrink_seconds"] < 1.0, seen
        # The same compiled step on the survivors: averaged over 2 ranks, renumbered (survivor 2 becomes rank 1).
        assert seen["recompiled"] == 0 and seen["size"] == 2
        np.testing.assert_array_equal(seen["second"], np.full(4, sum(survivors) / 2, np.float32))
        assert seen["second_rank"] == new_rank
        # Both gave up the grow within one wait for the newcomer of the moment survivor 1 did, and grew after it.
        message, retried = seen["abandoned_grow"]
        assert "MPI accept into 'world': the newcomer did not connect" in message and retried, message
        assert seen["abandoned_grow_seconds"] < 0.5 + ACCEPT_WAIT_SECONDS + 1.0, seen
        assert seen["grown_size"] == 3 and seen["third_rank"] == new_rank
        np.testing.assert_array_equal(seen["third"], np.full(4, (sum(survivors) + 3) / 3, np.float32))
        np.testing.assert_array_equal(seen["state"], np.arange(5, dtype=np.float32))
    newcomer = results[3].value
    assert newcomer["rank"] == 2 and newcomer["size"] == 3
    np.testing.assert_array_equal(newcomer["state"], np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(newcomer["third"], np.full(4, (sum(survivors) + 3) / 3, np.float32))
    # Rank 1 of the grown world received 8 elements into 2: that call and the next failed, each retried by the
    # fault-tolerant loop in its next epoch.
    receiver = results[survivors[1]].value
    (failed, retried), (unusable, retried_next) = receiver["failed_call"], receiver["next_call"]
    assert "MPI recv on communicator 'world' (rank 1 of 3): the call failed and left the communicator" in failed
    assert "truncated" in failed.lower() and retried, failed
    assert "unusable after an earlier failure" in unusable and retried_next, unusable


@pytest.mark.parametrize("build", ["mpi_self", "mpi_through_store", "mpi_join"])
def test_a_process_that_no_mpiexec_started_is_refused_naming_how_to_start_it(monkeypatch, build):
    # Started without mpiexec, MPI gives every process the same identity and their MPI_Comm_connect fails ("both
    # contain process 0"): refused before MPI starts, with the launcher's command.
    from bagua_common.comm.mpi_rendezvous import PROCESS_MANAGER_VARIABLES
    from bagua_jax import NativeCommunicator

    for name in PROCESS_MANAGER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    arguments = () if build == "mpi_self" else (None, "world/", 1, 2)
    with pytest.raises(RuntimeError, match=r"own `mpiexec -n 1` job.*`bagua-launch --fault-tolerant --mpi \.\.\.`"):
        getattr(NativeCommunicator, build)(*arguments)
