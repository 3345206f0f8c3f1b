"""bagua-launch in elastic mode (torch's elastic agent): usage, output, restarts, the JAX coordinator's port.

Every job runs the real launcher (``python -m bagua_launch``) with the c10d rendezvous on
127.0.0.1; the agent tests with two nodes, failures and resizes are in
``test_elastic_agent.py``.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys

import pytest
from multiprocess import free_port
from test_launcher import _env, by_rank, launch, write

from bagua_common.job.local_launch import mpiexec as find_mpiexec
from bagua_launch.command_line import parse_args

pytest.importorskip("torch")

RESTART_SCRIPT = """
import os, sys
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"START rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} restart={restart} "
      f"elastic={os.environ.get('BAGUA_ELASTIC')} master={os.environ['MASTER_ADDR']} "
      f"omp={os.environ.get('OMP_NUM_THREADS')}", flush=True)
print("to stderr", file=sys.stderr, flush=True)
if restart == 0 and os.environ["RANK"] == "1":
    print("distinctive failure okapi-7", file=sys.stderr, flush=True)
    sys.exit(5)
"""


def usage_error(*argv: str) -> str:
    """What the launcher's command line says of ``argv``, which it must refuse as a usage error (exit status 2)."""
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(stderr):
        parse_args(list(argv))
    assert exited.value.code == 2, stderr.getvalue()
    return stderr.getvalue()


def test_usage_errors():
    assert "cannot change size" in usage_error("--nnodes", "1:2", "--mpi", "x.py")
    assert "--mpi cannot be elastic" in usage_error("--max-restarts", "1", "--mpi", "x.py")
    assert "--rdzv-endpoint" in usage_error("--nnodes", "1:2", "x.py")
    assert "MIN <= MAX" in usage_error("--nnodes", "2:1", "x.py")
    assert "KEY=VALUE" in usage_error("--max-restarts", "1", "--rdzv-conf", "join_timeout", "x.py")
    assert "not available in elastic mode" in usage_error("--max-restarts", "1", "--master-port", "29999", "x.py")
    assert "--timeout is not available" in usage_error("--max-restarts", "1", "--timeout", "60", "x.py")
    assert "--cache-dir is not available" in usage_error("--max-restarts", "1", "--cache-dir", "/tmp", "x.py")
    unclosed = usage_error("--fault-tolerant", "--mpi", "--mpi-args", "'-genv", "x.py")
    assert "--mpi-args: No closing quotation" in unclosed


def test_a_fault_tolerant_mpi_job_runs_each_rank_as_its_own_mpiexec_job():
    config = parse_args(["--fault-tolerant", "--mpi", "--mpi-args", "-bind-to none", "--nproc-per-node", "3", "x.py"])
    assert config.command == [find_mpiexec(), "-n", "1", "-bind-to", "none", sys.executable, "x.py"]
    assert (config.mode, config.fault_tolerant, config.nproc_per_node) == ("program", True, 3)


def test_a_fault_tolerant_job_over_several_nodes_is_refused_without_the_jobs_secret(tmp_path):
    # one node can make the secret for its ranks; nodes apart must be given the same one, so none is made up
    script = write(tmp_path, "x.py", "print('ran')")
    env = {k: v for k, v in _env().items() if k != "BAGUA_FT_SECRET_FILE"}
    nodes = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    done = launch("--fault-tolerant", *nodes, str(script), env=env, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "--fault-tolerant over several nodes needs BAGUA_FT_SECRET_FILE" in done.stderr and "ran" not in done.stdout


def this_machines_address() -> str:
    """The address this machine sends from on its default route (no packet is sent), or 127.0.0.1 without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: a route is looked up, nothing leaves
        except OSError:
            return "127.0.0.1"
        return probe.getsockname()[0]


def test_restart_after_a_failure_keeps_the_output_format(tmp_path):
    """Also: the ranks' MASTER_ADDR is the address the rendezvous was reached at, not this machine's name (which
    may resolve to 127.0.0.1, as "localhost", where other nodes would look for it on themselves); OMP_NUM_THREADS
    shares the cores this launcher may run on between its ranks."""
    script = write(tmp_path, "restart.py", RESTART_SCRIPT)
    address = this_machines_address()
    # is_host: this agent serves the rendezvous (torch looks for the endpoint among the addresses of this machine's
    # name, which may list 127.0.0.1 alone)
    endpoint = ("--rdzv-endpoint", f"{address}:{free_port()}", "--rdzv-conf", "is_host=1")
    env = {name: value for name, value in _env().items() if name != "OMP_NUM_THREADS"}
    result = launch("--nproc-per-node", "2", "--max-restarts", "1", *endpoint, str(script), env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = by_rank(result.stdout)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for rank in (0, 1):
        starts = [line for line in lines[rank] if line.startswith("START")]
        assert starts[-1] == f"START rank={rank} world=2 restart=1 elastic=1 master={address} omp={threads}", starts
    assert "[rank 1] distinctive failure okapi-7" in result.stderr


def test_failed_run_ends_with_a_summary(tmp_path):
    script = write(tmp_path, "restart.py", RESTART_SCRIPT)
    result = launch("--nproc-per-node", "2", "--max-restarts", "0", str(script), timeout=300)
    assert result.returncode == 5, result.stdout + result.stderr
    summary = result.stderr[result.stderr.index("bagua-launch: rank 1 failed (exit code 5)") :]
    assert "last lines of rank 1" in summary and "distinctive failure okapi-7" in summary, summary


JAX_SCRIPT = """
import os
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bagua_jax.distributed import initialize

initialize(timeout=60)
rank, world = jax.process_index(), jax.process_count()
mesh = Mesh(np.array(jax.devices()), ("p",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), np.array([rank + 1.0], np.float32))
total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "p"), mesh=mesh, in_specs=P("p"), out_specs=P()))(x)
print(f"PSUM {float(np.asarray(total.addressable_shards[0].data)[0])} PORT {os.environ['MASTER_PORT']}", flush=True)
jax.distributed.shutdown()
"""


def test_jax_coordinator_gets_a_port_of_its_own(tmp_path):
    """Under c10d ``MASTER_PORT`` would be the agent's store; the launcher gives JAX a free port instead."""
    pytest.importorskip("jax")
    script = write(tmp_path, "jax_job.py", JAX_SCRIPT)
    endpoint_port = "29431"
    result = launch(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--rdzv-endpoint",
        f"127.0.0.1:{endpoint_port}",
        str(script),
        env=_env(JAX_PLATFORMS="cpu"),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    values = {
        rank: [line for line in lines if line.startswith("PSUM")] for rank, lines in by_rank(result.stdout).items()
    }
    assert {rank: line[0].split()[1] for rank, line in values.items()} == {0: "3.0", 1: "3.0"}
    assert all(line[0].split()[3] != endpoint_port for line in values.values())


def test_launcher_imports_no_framework_outside_elastic_mode():
    code = (
        "import sys\n"
        "from bagua_launch import command_line, elastic\n"
        "config = command_line.parse_args(['--nproc-per-node', '2', 'x.py'])\n"
        "assert not isinstance(config, elastic.ElasticConfig)\n"
        "assert elastic.requested.__module__ == 'bagua_launch.elastic'\n"
        "assert 'jax' not in sys.modules and 'torch' not in sys.modules, 'a framework was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=300)


def test_the_native_mpi_engine_runs_in_an_elastic_job_only_with_fault_tolerance():
    code = (
        "from bagua_common.comm.engines import load_engine\n"
        "try:\n"
        "    print('loaded', load_engine('mpi').__name__)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    for extra, expected in (({}, "only with fault tolerance"), ({"BAGUA_FAULT_TOLERANCE": "1"}, "loaded _bagua_mpi")):
        run = subprocess.run(
            [sys.executable, "-c", code],
            env=_env(BAGUA_ELASTIC="1", **extra),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert expected in run.stdout, run.stdout + run.stderr


def test_an_unreachable_rendezvous_is_reported_not_hung(tmp_path):
    script = write(tmp_path, "never.py", "raise SystemExit('never started')\n")
    port = str(free_port())  # nothing listens there, and this agent must not host the store
    result = launch(
        "--nnodes",
        "2:2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "is_host=0,read_timeout=1,join_timeout=1",  # nothing listens: a longer wait only delays the report
        str(script),
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"bagua-launch: the rendezvous at 127.0.0.1:{port} failed" in result.stderr, result.stderr


def test_elastic_summary_words_exit_statuses_as_the_launcher_does(tmp_path):
    """One wording for an exit status in both modes: ``killed by SIGTERM``, not ``killed by signal 15``."""
    from types import SimpleNamespace

    from bagua_launch import elastic

    failures = {0: SimpleNamespace(exitcode=-15, local_rank=0), 1: SimpleNamespace(exitcode=3, local_rank=1)}
    error = SimpleNamespace(failures=failures, get_first_failure=lambda: (1, failures[1]))
    text = elastic._summary(error, str(tmp_path), 5)
    assert "bagua-launch: rank 1 failed (exit code 3)" in text, text
    assert "rank 0: killed by SIGTERM" in text, text
