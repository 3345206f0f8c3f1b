"""A private Redis server for the cache: a child process on a 0700 unix socket, no TCP.

``bagua-launch --cache-server redis`` starts one per node and passes its address to the ranks
in ``BAGUA_CACHE_URL``; without the launcher, :func:`node_redis_store` starts one per node from
the job's first rank there (Bagua's ``backend="redis"``). The server listens on no TCP port,
keeps nothing on disk, refuses writes when full (``noeviction``) and dies with its parent. Only
this user can reach the socket, which is what makes it safe for the cache to unpickle what it reads.

For a cache sharded over the nodes (``bagua-launch --cache-bind ADDR``) the server also
listens on TCP at ``ADDR`` and requires a password it generates itself. The password is never
on a command line: redis-server reads it from a 0600 configuration file and the ranks from the
0600 file named in ``BAGUA_CACHE_PASSWORD_FILE``. The digest key that signs the cached values is
generated at start too, in the 0600 file named in ``BAGUA_CACHE_KEY_FILE``.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from bagua_common.data.cache_stores import (
    ENV_CACHE_KEY_FILE,
    ENV_CACHE_PASSWORD_FILE,
    ENV_CACHE_URL,
    RedisStore,
    checked_capacity,
    connect_redis,
)
from bagua_common.data.private_files import (
    DIGEST_KEY_FILE,
    digest_key_in,
    private_directory,
    read_private_file,
    write_private_file,
)
from bagua_common.job.child_process import die_with_parent
from bagua_common.job.local_launch import free_port
from bagua_common.job.signature import AllGather, gather_bytes

ENV_BINARY = "BAGUA_REDIS_SERVER"
DIRECTORY_PREFIX = "bagua-redis-"
STALE_AFTER_S = 60.0
INSTALL_HINT = "install it with 'apt-get install redis-server' or set BAGUA_REDIS_SERVER"
_DIRECTORY_ENTRY_BYTES = 4096  # one rank's server directory in node_redis_store's exchange


def find_redis_server() -> str:
    """Return the ``redis-server`` binary: ``$BAGUA_REDIS_SERVER``, else the one on PATH."""
    binary = os.environ.get(ENV_BINARY) or shutil.which("redis-server")
    if binary is None or not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"no redis-server binary found ({INSTALL_HINT})")
    return binary


def checked_bind_address(address: str) -> str:
    """Return ``address`` if it is an IP address of this machine; else raise a ``ValueError``.

    Checked by binding a throwaway socket to it, so a typo or another node's address fails here
    with a clear message instead of in redis-server's log.
    """
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    except ValueError:
        raise ValueError(f"cache bind address must be an IP address of this node, got {address!r}") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as e:
            raise ValueError(f"cache bind address {address!r} is not an address of this node: {e.strerror}") from None
    return address


class RedisServer:
    """One ``redis-server`` child holding at most ``capacity_bytes`` (default a quarter of RAM).

    Use as a context manager, or call :meth:`start` and :meth:`stop`. ``url`` is the address
    clients connect to; ``pid`` the server's process id. By default the server listens only on
    a unix socket. With ``bind`` (an IP address of this node) it listens on TCP there too, on a
    free port, and requires ``password``, generated at start and kept in ``password_file`` (0600).
    ``digest_key``, generated at start, signs the values (see :class:`~bagua_common.data.cache_stores.RedisStore`).
    """

    def __init__(
        self, capacity_bytes: int | None = None, *, bind: str | None = None, start_timeout_s: float = 30.0
    ) -> None:
        self.capacity_bytes = checked_capacity(capacity_bytes)
        self.bind = None if bind is None else checked_bind_address(bind)
        self.binary = find_redis_server()
        self.start_timeout_s = start_timeout_s
        self.directory: str | None = None
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.password: str | None = None
        self.digest_key: bytes | None = None

    @property
    def socket_path(self) -> str:
        """The unix socket's path (valid once started)."""
        if self.directory is None:
            raise RuntimeError("the Redis server is not started")
        return os.path.join(self.directory, "redis.sock")

    @property
    def url(self) -> str:
        """The server's address: ``unix://`` by default, ``redis://ADDR:PORT/0`` with ``bind``."""
        if self.bind is None:
            return "unix://" + self.socket_path
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"redis://{host}:{self.port}/0"

    @property
    def password_file(self) -> str:
        """The 0600 file holding the password (with ``bind``; valid once started)."""
        return os.path.join(self.directory or "", "password")

    def environment(self) -> dict[str, str]:
        """The variables that lead a rank's :func:`~bagua_common.data.cache_stores.store_from_environment` here."""
        env = {ENV_CACHE_URL: self.url, ENV_CACHE_KEY_FILE: os.path.join(self.directory or "", DIGEST_KEY_FILE)}
        if self.password is not None:
            env[ENV_CACHE_PASSWORD_FILE] = self.password_file
        return env

    @property
    def pid(self) -> int | None:
        """The server's process id, None when not running."""
        return None if self.process is None else self.process.pid

    def start(self) -> RedisServer:
        """Start the server and wait (bounded) until it answers PING."""
        import redis

        remove_stale_directories()
        self.directory = tempfile.mkdtemp(prefix=DIRECTORY_PREFIX)  # mode 0700
        self.digest_key = digest_key_in(self.directory)
        command = [self.binary]
        if self.bind is not None:
            # The config file comes first on redis-server's command line; the options after it
            # are added to it. The password stays in files only this user can read.
            self.password = secrets.token_hex(32)
            self.port = free_port(self.bind)
            config = os.path.join(self.directory, "redis.conf")
            write_private_file(config, f"bind {self.bind}\nport {self.port}\nrequirepass {self.password}\n".encode())
            write_private_file(self.password_file, self.password.encode())
            command.append(config)
        command += [
            "--unixsocket", self.socket_path,
            "--unixsocketperm", "700", "--maxmemory", str(self.capacity_bytes),
            "--maxmemory-policy", "noeviction", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--protected-mode", "yes", "--dir", self.directory,
            "--loglevel", "warning",
        ]  # fmt: skip
        if self.bind is None:
            command += ["--port", "0"]
        log_path = os.path.join(self.directory, "redis.log")
        with open(log_path, "wb") as log:  # a file, not a pipe nobody drains while training
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(signal.SIGKILL),  # noqa: PLW1509 (before threads)
            )  # fmt: skip
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.process.poll() is not None:
                with open(log_path, "rb") as log:
                    error = log.read().decode(errors="replace")
                self.stop()
                raise RuntimeError(f"redis-server exited at start: {error.strip()}")
            try:
                connect_redis(self.url, self.password, 1.0).ping()
                return self
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer within {self.start_timeout_s} s") from None
                time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout_s``) and remove its directory."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout_s)
            self.process = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        self.password, self.port, self.digest_key = None, 0, None

    def __enter__(self) -> RedisServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def remove_stale_directories() -> None:
    """Remove directories that servers of SIGKILLed launchers left in the temporary directory.

    A directory counts as stale when it is this user's, older than ``STALE_AFTER_S`` and its
    socket is missing or refuses connections (its server is gone).
    """
    root = tempfile.gettempdir()
    for entry in os.scandir(root):
        if not entry.name.startswith(DIRECTORY_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        info = entry.stat(follow_symlinks=False)
        if info.st_uid != os.getuid() or time.time() - info.st_mtime < STALE_AFTER_S:
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(os.path.join(entry.path, "redis.sock"))
        except (FileNotFoundError, ConnectionRefusedError):
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            pass  # unsure: leave it
        finally:
            probe.close()


_node_server: RedisServer | None = None
_node_store: RedisStore | None = None


def node_redis_store(allgather: AllGather | None, rank: int = 0, local_size: int = 1) -> RedisStore:
    """A :class:`RedisStore` on this node's private server for the job, started on first use (Bagua's
    ``backend="redis"`` without ``bagua-launch --cache-server redis``).

    The node's first rank (world rank ``rank - rank % local_size``, ranks laid out node by node)
    starts a :class:`RedisServer` (a 0700 unix socket, no TCP, no disk), which dies with that
    process and is stopped at its exit; the node's other ranks learn its directory through
    ``allgather`` (every rank of the job calls this, the first time, at the same point; None for a
    job of one process) and read its socket and digest key there, files that must be this user's
    alone. Later calls return the same store.
    """
    global _node_server, _node_store
    if _node_store is not None:
        return _node_store
    first = rank - rank % local_size == rank
    if first:
        _node_server = RedisServer().start()
        atexit.register(_node_server.stop)
    mine = _node_server.directory.encode() if first else b""
    if len(mine) > _DIRECTORY_ENTRY_BYTES:
        raise ValueError(f"the cache server's directory path is too long: {mine!r}")
    rows = [mine] if allgather is None else gather_bytes(allgather, mine, _DIRECTORY_ENTRY_BYTES)
    directory = private_directory(rows[rank - rank % local_size].rstrip(b"\0").decode())
    key = read_private_file(os.path.join(directory, DIGEST_KEY_FILE))
    _node_store = RedisStore("unix://" + os.path.join(directory, "redis.sock"), digest_key=key)
    return _node_store
