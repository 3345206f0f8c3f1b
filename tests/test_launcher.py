"""bagua-launch (the ``bagua_launch`` package): rank variables, output prefixes, failures, signals.

Every test starts the launcher as its own process (``python -m bagua_launch``, the console
script for ``--help``) on tiny scripts written to a temporary folder, plus one real
``jax.distributed`` job and one ``torch.distributed`` gloo job with two ranks each.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from multiprocess import has_mpiexec

from bagua_common.job.local_launch import free_port

ROOT = Path(__file__).resolve().parent.parent
VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
LINE = re.compile(r"^\[rank (\d+)\] (.*)$")

ENV_SCRIPT = """
import json, os, sys
print("ENV " + json.dumps({k: os.environ.get(k) for k in %r}))
print("ARGS " + json.dumps(sys.argv[1:]))
for i in range(3):
    print(f"out {i}")
    print(f"err {i}", file=sys.stderr)
""" % (VARIABLES,)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES and k != "XLA_FLAGS"}
    # The launcher and its MPI wrapper import this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env | extra


def launch(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "bagua_launch", *args],
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def by_rank(text: str) -> dict[int, list[str]]:
    """Every line must carry a rank prefix; the lines of each rank, prefixes removed."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = LINE.match(line)
        assert match, f"line without a rank prefix: {line!r}\n{text}"
        lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


def reported_env(stdout: str) -> dict[int, dict[str, str]]:
    envs = {}
    for rank, lines in by_rank(stdout).items():
        [env_line] = [l for l in lines if l.startswith("ENV ")]
        envs[rank] = json.loads(env_line[4:])
        assert envs[rank]["RANK"] == str(rank), "the prefix names another rank than RANK"
    return envs


needs_mpi = pytest.mark.skipif(not has_mpiexec(), reason="no mpiexec")


@pytest.mark.parametrize(
    "nproc, options, first_rank, world, node",
    [
        (2, [], 0, 2, 0),
        (3, ["--master-port", "29777"], 0, 3, 0),
        # Node 1 of two: only its own ranks run here (nothing needs node 0 to exist).
        (2, ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port", "29611"], 2, 4, 1),
        (3, ["--nnodes", "3", "--node_rank", "2", "--master_addr", "localhost"], 6, 9, 2),
    ],
)
def test_rank_variables(tmp_path, nproc, options, first_rank, world, node):
    script = write(tmp_path, "env.py", ENV_SCRIPT)
    result = launch("--nproc-per-node", str(nproc), *options, str(script), "--nnodes", "7", "-x", "a b")
    assert result.returncode == 0, result.stderr
    envs = reported_env(result.stdout)
    assert sorted(envs) == list(range(first_rank, first_rank + nproc))
    addr = (
        options[options.index("--master-addr") + 1]
        if "--master-addr" in options
        else (options[options.index("--master_addr") + 1] if "--master_addr" in options else "127.0.0.1")
    )
    port = options[options.index("--master-port") + 1] if "--master-port" in options else None
    for rank, env in envs.items():
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank - first_rank)
        assert env["WORLD_SIZE"] == str(world)
        assert env["LOCAL_WORLD_SIZE"] == str(nproc)
        assert env["NODE_RANK"] == str(node)
        assert env["MASTER_ADDR"] == addr
        if port is not None:
            assert env["MASTER_PORT"] == port
        elif world > nproc:
            assert env["MASTER_PORT"] == "29500", "every node must agree on the default port"
    assert len({env["MASTER_PORT"] for env in envs.values()}) == 1
    assert 0 < int(envs[first_rank]["MASTER_PORT"]) < 65536
    # The script's own arguments pass through untouched, launcher-like options included.
    args = {json.dumps(["--nnodes", "7", "-x", "a b"])}
    assert {l[5:] for lines in by_rank(result.stdout).values() for l in lines if l.startswith("ARGS ")} == args


@pytest.mark.parametrize("given", [None, "3"])
def test_openmp_threads_share_the_cores_unless_set(tmp_path, given):
    script = write(tmp_path, "omp.py", "import os\nprint('OMP', os.environ.get('OMP_NUM_THREADS'))\n")
    env = {k: v for k, v in _env().items() if k != "OMP_NUM_THREADS"} | ({"OMP_NUM_THREADS": given} if given else {})
    result = launch("--nproc-per-node", "2", str(script), env=env)
    assert result.returncode == 0, result.stderr
    expected = given or str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert {lines[0] for lines in by_rank(result.stdout).values()} == {f"OMP {expected}"}


def test_output_lines_prefixed_stdout_and_stderr_apart(tmp_path):
    script = write(tmp_path, "env.py", ENV_SCRIPT)
    result = launch("--nproc-per-node", "3", str(script))
    assert result.returncode == 0, result.stderr
    out, err = by_rank(result.stdout), by_rank(result.stderr)
    assert sorted(out) == sorted(err) == [0, 1, 2]
    for rank in range(3):
        assert [l for l in out[rank] if l.startswith("out ")] == ["out 0", "out 1", "out 2"]
        assert err[rank] == ["err 0", "err 1", "err 2"]
    assert result.stderr.count("bagua-launch") == 0, "a successful job prints nothing of the launcher's own"


def test_module_form_and_python_m(tmp_path):
    write(tmp_path, "envmod.py", ENV_SCRIPT)
    result = launch("--nproc-per-node", "2", "-m", "envmod", "--flag", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    envs = reported_env(result.stdout)
    assert sorted(envs) == [0, 1] and {e["WORLD_SIZE"] for e in envs.values()} == {"2"}


def test_console_script_help():
    candidates = [Path(sys.executable).parent / "bagua-launch", shutil.which("bagua-launch")]
    found = next((str(c) for c in candidates if c and Path(c).exists()), None)
    if found is None:
        pytest.skip("bagua-launch console script not installed (pip install -e .)")
    result = subprocess.run([found, "--help"], capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stderr
    for option in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--mpi", "-m"):
        assert option in result.stdout


def test_usage_errors():
    result = launch("--nnodes", "2", "--nproc-per-node", "1", "x.py")
    assert result.returncode == 2 and "--master-addr is required" in result.stderr
    result = launch("--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "x.py")
    assert result.returncode == 2 and "--node-rank" in result.stderr


FAIL_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} started", flush=True)
if rank == 1:
    time.sleep(0.5)
    raise RuntimeError("distinctive failure zebra-42")
time.sleep(60)
print("should have been stopped")
"""


@pytest.mark.parametrize("mpi", [False, pytest.param(True, marks=needs_mpi)], ids=["local", "mpi"])
def test_failing_rank_stops_the_job(tmp_path, mpi):
    script = write(tmp_path, "fail.py", FAIL_SCRIPT)
    start = time.monotonic()
    result = launch("--nproc-per-node", "3", "--grace", "5", *(["--mpi"] if mpi else []), str(script))
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"the other ranks were not stopped ({elapsed:.1f} s)"
    assert result.returncode == 1, result.stderr
    assert "should have been stopped" not in result.stdout
    # Live output keeps its prefixes; the summary comes last and repeats the failing rank's error.
    assert "[rank 1] RuntimeError: distinctive failure zebra-42" in result.stderr
    summary = result.stderr[result.stderr.index("bagua-launch: rank 1 failed") :]
    assert "exit code 1" in summary.splitlines()[0]
    assert "last lines of rank 1" in summary
    assert "RuntimeError: distinctive failure zebra-42" in summary
    assert re.search(r"ranks? 0, 2: killed by SIGTERM \(stopped by the launcher\)", summary), summary
    assert summary.rstrip().endswith("=" * 20)


def test_exit_code_and_signal_death_reported(tmp_path):
    script = write(
        tmp_path,
        "die.py",
        """
        import os, signal, time
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """,
    )
    result = launch("--nproc-per-node", "2", "--grace", "5", str(script))
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 0 failed (killed by SIGKILL)" in result.stderr


def test_timeout(tmp_path):
    script = write(tmp_path, "sleep.py", "import time; print('sleeping', flush=True); time.sleep(60)\n")
    start = time.monotonic()
    result = launch("--nproc-per-node", "2", "--timeout", "1", "--grace", "5", str(script))
    assert time.monotonic() - start < 15
    assert result.returncode == 124
    assert "timed out after 1 s" in result.stderr


SIGNAL_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
folder, rank = Path(sys.argv[1]), os.environ["RANK"]

def on_signal(signum, frame):
    with open(folder / f"got{rank}", "a") as f:
        f.write(f"{signum}\\n")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
(folder / f"ready{rank}").write_text("")
time.sleep(60)
"""


@pytest.mark.parametrize(
    "sig, mpi",
    [
        (signal.SIGTERM, False),
        (signal.SIGINT, False),
        pytest.param(signal.SIGTERM, True, marks=needs_mpi),
    ],
    ids=["SIGTERM", "SIGINT", "SIGTERM-mpi"],
)
def test_signals_are_forwarded(tmp_path, sig, mpi):
    nproc = 3
    script = write(tmp_path, "wait.py", SIGNAL_SCRIPT)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bagua_launch",
                "--nproc-per-node",
                str(nproc),
                "--grace",
                "5",
                *(["--mpi"] if mpi else []),
                str(script),
                str(tmp_path),
            ],
            env=_env(),
            stdout=out,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 30
            while not all((tmp_path / f"ready{r}").exists() for r in range(nproc)):
                assert launcher.poll() is None, (tmp_path / "err").read_text()
                assert time.monotonic() < deadline, "the ranks did not start"
                time.sleep(0.05)
            start = time.monotonic()
            launcher.send_signal(sig)
            code = launcher.wait(timeout=20)
            assert time.monotonic() - start < 5, "the launcher did not stop promptly"
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    assert code == 128 + sig
    for r in range(nproc):
        # Every rank got the signal, exactly once.
        assert (tmp_path / f"got{r}").read_text() == f"{int(sig)}\n"
    assert f"stopped by {sig.name}" in (tmp_path / "err").read_text()


@needs_mpi
@pytest.mark.parametrize("nproc", [2])
def test_mpi_rank_variables(tmp_path, nproc):
    script = write(
        tmp_path,
        "env.py",
        ENV_SCRIPT + "print('PMI ' + os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK', '?')))\n",
    )
    result = launch("--nproc-per-node", str(nproc), "--master-port", "29613", "--mpi", str(script), "x")
    assert result.returncode == 0, result.stderr
    envs = reported_env(result.stdout)
    assert sorted(envs) == list(range(nproc))
    lines = by_rank(result.stdout)
    for rank, env in envs.items():
        assert env == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29613",
        }
        assert f"PMI {rank}" in lines[rank], "RANK must come from the MPI launcher"
    assert by_rank(result.stderr)[0] == ["err 0", "err 1", "err 2"]


JAX_SCRIPT = """
import os
import random
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
jax.distributed.initialize(
    coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    num_processes=world, process_id=rank, initialization_timeout=60,
)
assert jax.process_count() == world and jax.device_count() == world, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("p",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), np.array([rank + 1.0], np.float32))
total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "p"), mesh=mesh, in_specs=P("p"), out_specs=P()))(x)
print(f"PSUM {float(np.asarray(total.addressable_shards[0].data)[0])}", flush=True)
jax.distributed.shutdown()
"""

TORCH_SCRIPT = """
import os
import random
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
assert dist.get_rank() == int(os.environ["RANK"]) and dist.get_world_size() == int(os.environ["WORLD_SIZE"])
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"ALLREDUCE {t.item()}", flush=True)
dist.destroy_process_group()
"""


def _framework_job(tmp_path, name: str, source: str, marker: str) -> dict[int, float]:
    script = write(tmp_path, name, source)
    env = _env(JAX_PLATFORMS="cpu")  # XLA_FLAGS unset: one CPU device per process
    result = launch("--nproc-per-node", "2", "--grace", "5", "--timeout", "300", str(script), env=env, timeout=360)
    assert result.returncode == 0, result.stdout + result.stderr
    values = {}
    for rank, lines in by_rank(result.stdout).items():
        [line] = [l for l in lines if l.startswith(marker)]
        values[rank] = float(line.split()[1])
    return values


def test_jax_distributed_job(tmp_path):
    pytest.importorskip("jax")
    assert _framework_job(tmp_path, "jax_job.py", JAX_SCRIPT, "PSUM") == {0: 3.0, 1: 3.0}


def test_torch_distributed_gloo_job(tmp_path):
    pytest.importorskip("torch")
    assert _framework_job(tmp_path, "torch_job.py", TORCH_SCRIPT, "ALLREDUCE") == {0: 3.0, 1: 3.0}


def test_launcher_imports_no_framework():
    code = "import sys, bagua_launch, bagua_launch.rank_env\nassert not {'jax', 'torch'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), timeout=300)


@pytest.mark.parametrize(
    "variables, expected",
    [
        ({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}, (5, 1, 8, 4, 1)),
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            (2, 0, 4, 2, 1),
        ),
        (
            {
                "SLURM_PROCID": "7",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "3",
                "SLURM_NODEID": "1",
                "BAGUA_LAUNCH_NPROC_PER_NODE": "4",
            },
            (7, 3, 8, 4, 1),
        ),
        ({"PMI_RANK": "3", "PMI_SIZE": "6", "BAGUA_LAUNCH_NPROC_PER_NODE": "2"}, (3, 1, 6, 2, 1)),
    ],
    ids=["hydra", "openmpi", "slurm", "no-local-variables"],
)
def test_rank_env_reads_mpi_launchers(variables, expected):
    from bagua_common.job.rank_environment import mpi_rank_environment

    env = mpi_rank_environment(variables | {"MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert env == dict(
        zip(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"), map(str, expected))
    ) | {
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1234",
    }
    with pytest.raises(RuntimeError, match="no MPI rank"):
        mpi_rank_environment({})


CACHE_SCRIPT = """
import os, stat, sys, time
from bagua_common.data.cached_dataset import CachedDataset

class Squares:
    counting = False  # wrapping reads items for the dataset's fingerprint: only the reads after it count

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if Squares.counting:
            print("READ", i, flush=True)
        return i * i

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
directory = os.environ["BAGUA_CACHE_DIR"]
print("DIR", directory, oct(stat.S_IMODE(os.stat(directory).st_mode)))
data = CachedDataset(Squares(), name="squares")
Squares.counting = True
assert [data[i] for i in range(rank, 8, world)] == [i * i for i in range(rank, 8, world)]
open(os.path.join(directory, f"done-{rank}"), "w").close()
while not all(os.path.exists(os.path.join(directory, f"done-{r}")) for r in range(world)):
    time.sleep(0.05)
assert [data[i] for i in range(8)] == [i * i for i in range(8)]  # the other ranks' samples too
print("STATS", data.stats()["hits"])
"""


def cache_job(tmp_path: Path, *args: str) -> tuple[set[str], int, list[str]]:
    """Run CACHE_SCRIPT on 2 ranks; return the directories they saw, the samples read and the hits."""
    script = write(tmp_path, "cache.py", CACHE_SCRIPT)
    env = _env()
    env.pop("BAGUA_CACHE_DIR", None)
    env.pop("BAGUA_CACHE_URL", None)
    result = launch("--nproc-per-node", "2", *args, str(script), env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [m.group(2) for m in map(LINE.match, result.stdout.splitlines()) if m]
    directories = {line.split(maxsplit=1)[1] for line in lines if line.startswith("DIR")}
    hits = [line.split()[1] for line in lines if line.startswith("STATS")]
    return directories, sum(line.startswith("READ") for line in lines), hits


def test_launcher_gives_the_node_one_cache_directory_for_the_job(tmp_path):
    directories, read, hits = cache_job(tmp_path)
    (directory,) = directories  # both ranks, one directory, private
    path, mode = directory.split()
    assert mode == "0o700" and not os.path.exists(path)  # removed with the job
    assert read == 8 and hits == ["8", "8"]  # each rank read the other's 4 samples from the cache
    kept = tmp_path / "kept"
    assert cache_job(tmp_path, "--cache-dir", str(kept))[1] == 8
    assert cache_job(tmp_path, "--cache-dir", str(kept))[1:] == (0, ["12", "12"])  # the next job reads it all
    for rank in range(2):
        (kept / f"done-{rank}").unlink()
    kept.chmod(0o777)
    result = launch("--cache-dir", str(kept), "x.py")
    assert result.returncode == 2 and "--cache-dir" in result.stderr and "writable by others" in result.stderr


def test_environment_int_reads_the_launcher_then_mpi():
    """Launcher variables win; under MPI the rank comes from its variables and LOCAL_RANK from the node size."""
    from bagua_common.job.rank_environment import environment_int

    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}
    assert [environment_int(k, hydra) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")] == [3, 4, 3]
    two_nodes = hydra | {"LOCAL_WORLD_SIZE": "2"}
    assert [environment_int(k, two_nodes) for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")] == [2, 1]
    assert environment_int("RANK", hydra | {"RANK": "0"}) == 0
    assert environment_int("RANK", {}) is None
    assert environment_int("MASTER_PORT", hydra) is None
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        environment_int("RANK", {"RANK": "zero"})


def test_a_free_port_is_drawn_below_the_range_outgoing_connections_take():
    """The master's port (``free_port``) must not be one the kernel may hand to a rank's outgoing connection before
    the store binds it, and two processes that seeded ``random`` alike must not draw the same ports."""
    first_outgoing = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    seeded = random.getstate()  # this test's seeding must not change what other tests draw
    try:
        random.seed(0)
        drawn = [free_port() for _ in range(5)]
        random.seed(0)
        again = [free_port() for _ in range(5)]
    finally:
        random.setstate(seeded)
    assert all(10000 <= port < first_outgoing for port in drawn + again) and drawn != again
