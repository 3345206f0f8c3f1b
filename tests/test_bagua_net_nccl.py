"""Real NCCL loads Bagua-Net and allreduces through it: two ranks on one GPU (needs a GPU).

The job itself is ``bagua_net_nccl_job.py`` (``benchmarks/gpu_check.py`` runs it at full
size for the bandwidth); here it runs small, and every check it makes must hold.
"""

import bagua_net_nccl_job as job
import pytest

pytestmark = pytest.mark.gpu


def test_nccl_allreduces_through_bagua_net_between_two_ranks_on_one_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device visible to torch")
    report = job.launch([1, 16], iterations=2)
    assert job.failures(report) == [], "\n".join(report["logs"])


def test_the_debug_checks_see_another_transport():
    """The checks fail on the output of a job that went through NCCL's own sockets."""
    socket_log = (
        "NCCL INFO NET/Plugin: Could not find: libnccl-net.so\n"
        "NCCL INFO Using network Socket\n"
        "NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0\n"
    )
    assert job.debug_checks(socket_log) == {
        "plugin loaded": False,
        "network in use is Bagua": False,
        "channels connected": True,
        "every channel via NET/Bagua": False,
    }
    assert all(job.debug_checks(socket_log, "Socket").values())
    bagua_log = (
        "NCCL INFO NET/Plugin: Loaded net plugin Bagua (v8)\n"
        "NCCL INFO Using network Bagua\n"
        "NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Bagua/0\n"
        "NCCL INFO Channel 01/0 : 1[0] -> 0[0] [receive] via NET/Bagua/0\n"
    )
    assert all(job.debug_checks(bagua_log).values())
    assert not any(
        job.debug_checks(bagua_log, "Socket")[k] for k in ("network in use is Socket", "every channel via NET/Socket")
    )
