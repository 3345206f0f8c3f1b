"""The native MPI engine survives a SIGKILLed rank without a restart: revoke, shrink, grow.

Every rank is its own ``mpiexec -n 1`` job with the world built through a key-value store (MPICH's ULFM is a
stub in its ch4 device and hydra kills a signalled rank's node-mates: see bagua_common/comm/mpi_rendezvous.py).
One job of 3 ranks plus a newcomer: rank 1 is SIGKILLed, the survivors' blocked jitted allreduce is revoked, they
shrink to 2 ranks and run the same compiled step (rank read at run time: survivor 2 becomes rank 1), then the
newcomer joins as rank 2 and gets rank 0's state by broadcast.
"""

from __future__ import annotations

import numpy as np
import pytest
from multiprocess import ONE_CPU_DEVICE, has_mpiexec, run_ranks

from bagua_common.fault_tolerance import KVClient, KVServer, job_secret

pytestmark = pytest.mark.skipif(not has_mpiexec(), reason="needs mpiexec (the mpich wheel)")

VICTIM = 1


def test_a_killed_rank_is_revoked_shrunk_away_and_replaced():
    server = KVServer("127.0.0.1", secret=job_secret())
    client = KVClient("127.0.0.1", server.port, 10.0, secret=job_secret())

    def victim_gone(codes):
        if codes[VICTIM] is not None:
            client.set("test/victim-gone", b"")

    try:
        results = run_ranks(
            "membership_change_workers_jax:shrink_and_grow",
            4,
            VICTIM,
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
    assert results[VICTIM].returncode != 0 and results[VICTIM].value is None, outputs
    survivors = [results[r] for r in (0, 2)]
    assert all(r.returncode == 0 for r in [*survivors, results[3]]), outputs
    for new_rank, (old_rank, result) in enumerate(zip((0, 2), survivors)):
        seen = result.value
        np.testing.assert_array_equal(seen["first"], np.full(4, (0 + 1 + 2) / 3, np.float32))
        assert seen["first_rank"] == old_rank
        # The blocked allreduce ended at the revoke (0.5 s after it started), not at the 60 s timeout.
        assert "revoked: rank 1 died" in seen["blocked_step"], seen["blocked_step"]
        assert seen["revoked_after"] < 10, seen
        assert seen["shrink_seconds"] < 10, seen
        # The same compiled step on the survivors: averaged over 2 ranks, this rank renumbered.
        assert seen["recompiled"] == 0 and seen["size"] == 2
        np.testing.assert_array_equal(seen["second"], np.full(4, (0 + 2) / 2, np.float32))
        assert seen["second_rank"] == new_rank
        assert seen["grown_size"] == 3 and seen["third_rank"] == new_rank
        np.testing.assert_array_equal(seen["third"], np.full(4, (0 + 2 + 3) / 3, np.float32))
        np.testing.assert_array_equal(seen["state"], np.arange(5, dtype=np.float32))
    newcomer = results[3].value
    assert newcomer["rank"] == 2 and newcomer["size"] == 3
    np.testing.assert_array_equal(newcomer["state"], np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(newcomer["third"], np.full(4, (0 + 2 + 3) / 3, np.float32))


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
