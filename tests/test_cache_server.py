"""The real redis-server: private socket, no TCP, noeviction, lifetime bound to the launcher."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from cache_datasets import REDIS_SERVER_MARKS, CountingDataset, reads

from bagua_common.data.cache_stores import RedisStore
from bagua_common.data.cached_dataset import CachedDataset
from bagua_common.data.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent

pytestmark = REDIS_SERVER_MARKS


def listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed since the listing: not one of its sockets any more
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def gone(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` ended within ``within_s`` seconds: reaped, or a zombie none of whose threads still
    runs (a killed redis-server's leader turns zombie first; its other threads hold its sockets until they end)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z" and os.listdir(f"/proc/{pid}/task") == [str(pid)]:
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_server_is_private_and_listens_on_no_tcp_port():
    with RedisServer(1 << 26) as server:
        assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(server.socket_path).st_mode) == 0o700
        assert not socket_inodes(server.pid) & listening_tcp_inodes()
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        os.utime(server.directory, (0, 0))  # old, but alive: another start leaves it alone
        with RedisServer(1 << 24):
            assert client.ping() and os.path.exists(server.socket_path)
        pid = server.pid
    assert gone(pid, 10) and not os.path.exists(server.socket_path if server.directory else "/x")


def test_full_server_stops_admission_and_keeps_serving(tmp_path):
    with RedisServer(3 << 20) as server:
        log = str(tmp_path / "reads")
        data = CachedDataset(
            CountingDataset(300, log, size=4096), RedisStore(server.url, digest_key=server.digest_key), name="oom"
        )
        for i in range(300):
            data[i]
        stats = data.stats()
        assert stats["rejected"] > 0 and 0 < stats["puts"] < 300 and stats["errors"] == 0
        before = reads(log)
        for i in range(300):
            np.testing.assert_array_equal(
                data[i],
                np.random.default_rng(i).standard_normal(4096).astype(np.float32),
            )
        assert reads(log) - before == 300 - stats["puts"]


RANK_SCRIPT = """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import redis
    from cache_datasets import CountingDataset, epoch_reads
    from bagua_common.data.cached_dataset import CachedDataset

    url = os.environ["BAGUA_CACHE_URL"]
    pid = redis.Redis.from_url(url).info("server")["process_id"]
    print("SERVER", pid, url, flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(120)
    log = os.path.join({tmp!r}, "reads")
    dataset = CachedDataset(CountingDataset(96, log), name="launched")
    print("READS", *epoch_reads(dataset, log, num_workers=2, context="fork"), flush=True)
"""


@pytest.fixture
def launch(tmp_path):
    started = []

    def start(mode: str) -> subprocess.Popen:
        started.append(launch_job(tmp_path, mode))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


def launch_job(tmp_path, mode: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT.format(tests=str(ROOT / "tests"), tmp=str(tmp_path))))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("BAGUA_CACHE_URL", None)
    command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "1", "--cache-server",
               "redis", "--cache-capacity", "64M", str(script), mode]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def server_line(proc: subprocess.Popen) -> tuple[int, str]:
    for line in proc.stdout:
        if "SERVER" in line:
            _, pid, url = line.split()[-3:]
            return int(pid), url
    raise AssertionError(proc.stderr.read())


def test_launcher_serves_the_cache_and_stops_the_server(launch):
    proc = launch("train")
    pid, url = server_line(proc)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    first, second = (int(x) for x in out.split("READS")[1].split())
    assert first == 96 and second <= 0.01 * 96  # hit rate of epoch 2 >= 0.99 with 2 workers
    assert url.startswith("unix://")
    assert gone(pid, 30) and not os.path.exists(url.removeprefix("unix://"))


def test_killed_launcher_leaves_no_server(launch):
    proc = launch("sleep")
    pid, url = server_line(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert gone(pid, 30), f"the server {pid} outlived its SIGKILLed launcher by 30 s"
    # A SIGKILLed launcher cannot remove the server's directory: the next server start does.
    directory = os.path.dirname(url.removeprefix("unix://"))
    assert os.path.isdir(directory)
    os.utime(directory, (0, 0))
    with RedisServer(1 << 24):
        assert not os.path.exists(directory), f"the next server left the stale {directory}: {os.listdir(directory)}"


def test_missing_binary_says_how_to_install(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        BAGUA_REDIS_SERVER=str(tmp_path / "none"),
        PATH="/nonexistent",
    )
    result = subprocess.run(
        [sys.executable, "-m", "bagua_launch", "--cache-server", "redis", "x.py"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "apt-get install redis-server" in result.stderr
