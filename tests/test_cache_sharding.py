"""The cache sharded over nodes: two real redis-servers on 127.0.0.1 stand for two nodes."""

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import redis
from cache_datasets import REDIS_SERVER_MARKS
from redis.backoff import NoBackoff
from redis.retry import Retry

from bagua_common.data.cache_stores import (
    ENV_CACHE_KEY_FILE,
    ENV_CACHE_PASSWORD_FILE,
    ENV_CACHE_URL,
    RedisStore,
    sharded_store,
)
from bagua_common.data.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent

pytestmark = REDIS_SERVER_MARKS


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(IPv4 address, port) of every TCP socket ``pid`` listens on (IPv6 ones as ('v6', port))."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed since the listing (the server opens and closes files as it starts)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # TCP_LISTEN
                address, port = fields[1].split(":")
                ip = ".".join(str(b) for b in bytes.fromhex(address)[::-1]) if table.endswith("tcp") else "v6"
                found.add((ip, int(port, 16)))
    return found


def command_lines() -> list[bytes]:
    lines = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                lines.append(Path(f"/proc/{entry}/cmdline").read_bytes())
            except OSError:
                pass  # gone meanwhile
    return lines


def exchanged(servers: list[RedisServer], ranks_per_node: int = 2):
    """An allgather over 2 ranks per node that stacks what each rank of the job contributes."""
    rows = []
    for server in servers:
        entry = json.dumps({"url": server.url, "password": server.password, "key": server.digest_key.hex()}).encode()
        rows += [np.frombuffer(entry.ljust(1024, b"\0"), np.uint8)] * ranks_per_node
    return lambda mine: np.stack(rows)


@pytest.fixture
def two_nodes():
    with RedisServer(1 << 26, bind="127.0.0.1") as first, RedisServer(1 << 26, bind="127.0.0.1") as second:
        yield [first, second]


def test_password_is_generated_private_and_required(two_nodes):
    first, second = two_nodes
    assert first.password != second.password and len(first.password) == 64
    assert not any(first.password.encode() in line or second.password.encode() in line for line in command_lines())
    # redis-server overwrites its /proc cmdline with a title once started: check what it was started with too.
    assert all(first.password not in arg for arg in first.process.args)
    for path in (first.password_file, os.path.join(first.directory, "redis.conf")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Path(first.password_file).read_text() == first.password
    assert listening_addresses(first.pid) == {("127.0.0.1", first.port)}  # there, and only there
    # redis-py retries an AuthenticationError (a ConnectionError) 3 times with backoff by default (5 s): ask once.
    once = Retry(NoBackoff(), 0)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=first.port, socket_timeout=5, retry=once).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=first.port, password=second.password, socket_timeout=5, retry=once).ping()
    with pytest.raises(ConnectionError, match="cannot reach the Redis cache"):
        RedisStore(first.url, digest_key=first.digest_key)
    assert redis.Redis(port=first.port, password=first.password, socket_timeout=5).ping()


def test_default_server_still_has_no_tcp_listener():
    with RedisServer(1 << 24) as server:
        assert server.url.startswith("unix://") and server.password is None
        assert listening_addresses(server.pid) == set()


@pytest.mark.parametrize("address", ["192.0.2.1", "not-an-address", "127.0.0.1:6379"])
def test_bind_address_must_be_an_address_of_this_node(address):
    with pytest.raises(ValueError, match="address of this node"):
        RedisServer(1 << 24, bind=address)


def test_launcher_rejects_a_foreign_bind_address():
    result = subprocess.run(
        [sys.executable, "-m", "bagua_launch", "--cache-server", "redis", "--cache-bind", "192.0.2.1", "x.py"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "--cache-bind" in result.stderr and "not an address of this node" in result.stderr


ROUTING_SCRIPT = """
    import json, os, sys
    import numpy as np
    from bagua_common.data.cache_stores import sharded_store

    rows = [np.frombuffer(line.encode().ljust(1024, b"\\0"), np.uint8) for line in sys.stdin.read().splitlines()]
    store = sharded_store(lambda mine: np.stack(rows))
    keys = [f"sample-{i}".encode() for i in range(200)]
    if sys.argv[1] == "put":
        assert all(store.put(k, k[::-1]) for k in keys)
    else:
        print(json.dumps(sum(store.get(k) == k[::-1] for k in keys)))
"""


def run_rank(server: RedisServer, servers: list[RedisServer], action: str, hash_seed: str) -> str:
    """One rank of node ``server`` in its own process; the gathered entries come on stdin, not argv."""
    entries = "\n".join(
        json.dumps({"url": s.url, "password": s.password, "key": s.digest_key.hex()}) for s in servers for _ in range(2)
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED=hash_seed, **server.environment())
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ROUTING_SCRIPT), action],
        input=entries, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_routing_is_stable_across_processes_and_spreads_keys(two_nodes):
    run_rank(two_nodes[0], two_nodes, "put", hash_seed="1")
    assert run_rank(two_nodes[1], two_nodes, "get", hash_seed="2").strip() == "200"
    held = [
        {k.decode() for k in redis.Redis(port=s.port, password=s.password).keys("*")} for s in two_nodes
    ]  # fmt: skip
    expected = [set(), set()]
    for i in range(200):
        key = f"sample-{i}"
        expected[int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % 2].add(key)
    assert held == expected
    assert all(60 <= len(keys) <= 140 for keys in held)


def test_sharded_store_lists_each_node_once_in_rank_order(two_nodes, monkeypatch):
    first, second = two_nodes
    for server in (second, first):  # any rank of any node sees the same list
        monkeypatch.setenv(ENV_CACHE_URL, server.url)
        monkeypatch.setenv(ENV_CACHE_PASSWORD_FILE, server.password_file)
        monkeypatch.setenv(ENV_CACHE_KEY_FILE, server.environment()[ENV_CACHE_KEY_FILE])
        store = sharded_store(exchanged(two_nodes))
        assert store.urls == [first.url, second.url] and store.passwords == [first.password, second.password]
        assert store.digest_key == first.digest_key  # rank 0's: every process signs alike
        assert store.put(b"k", b"v") and store.get(b"k") == b"v"
    os.chmod(first.password_file, 0o644)
    monkeypatch.setenv(ENV_CACHE_PASSWORD_FILE, first.password_file)
    with pytest.raises(ValueError, match="readable by nobody else"):
        sharded_store(exchanged(two_nodes))


LAUNCHED_SCRIPT = """
    import os
    from pathlib import Path
    from bagua_common.data.cache_stores import store_from_environment

    password = Path(os.environ["BAGUA_CACHE_PASSWORD_FILE"]).read_text()
    lines = []
    for entry in os.listdir("/proc"):
        try:
            lines.append(Path(f"/proc/{entry}/cmdline").read_bytes())
        except OSError:
            pass
    assert all(password.encode() not in line for line in lines), "password on a command line"
    store = store_from_environment("launched", "")
    assert store.put(b"k", b"v") and store.get(b"k") == b"v"
    print("URL", os.environ["BAGUA_CACHE_URL"], oct(os.stat(os.environ["BAGUA_CACHE_PASSWORD_FILE"]).st_mode & 0o777))
"""


def test_launcher_serves_a_password_protected_cache_on_the_bind_address(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(LAUNCHED_SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(ENV_CACHE_URL, None)
    result = subprocess.run(
        [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--cache-server", "redis",
         "--cache-capacity", "64M", "--cache-bind", "127.0.0.1", str(script)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [line.split()[-2:] for line in result.stdout.splitlines() if "URL" in line]
    assert len(lines) == 2 and all(u.startswith("redis://127.0.0.1:") and mode == "0o600" for u, mode in lines)
