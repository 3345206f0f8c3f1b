"""The key-value store every member of a fault-tolerant job hosts: a small TCP server and its client.

Framework-free (no torch, no jax), so both front ends share it and a member's store lives as
long as its process. Values are bytes; nothing is ever unpickled. Operations: ``set``, ``get``
(waiting server-side up to a timeout for the key to appear), ``add`` (an integer counter; it may also read
another key in the same round trip),
``compare_set``, ``delete``, ``ping`` and ``hello`` (registers the connection as a member's:
when it closes, the server's ``on_disconnect`` is called with the member's id at once, which is
how a killed member is noticed within milliseconds; with several connections registered under one
id, when the last of them closes).

Only the job's processes may use a store: both sides hold the job's secret (see
:func:`~bagua_common.fault_tolerance.settings.job_secret`) and prove it before the first request, without sending
it. The server sends a random nonce; the client answers with its own nonce and the tag of the server's nonce for the
purpose "kv-store client" (see :mod:`bagua_common.job.message_tag`); the server checks it (a wrong or missing proof
is answered ``denied`` and the connection closed, before any operation) and answers the tag of the client's nonce
for "kv-store server", which the client checks (a process squatting on a member's port is not taken for the member).

Wire format, both directions: a frame is ``!BII`` (operation or status, key length, value
length), then the key and the value. ``get``'s value is its wait in seconds (``!d``),
``add``'s the amount (``!q``) then the key to read, if any (its reply: the total, ``!q``, then, for that key, a byte
1 and its value, or 0), ``compare_set``'s ``!I`` + expected + desired.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from bagua_common.job.message_tag import message_tag, tag_matches

__all__ = [
    "InProcessClient",
    "KVClient",
    "KVServer",
    "StoreClient",
    "StoreUnreachable",
    "advertised_host",
    "connect",
    "wait_for",
]

_HEADER = struct.Struct("!BII")
_SET, _GET, _ADD, _CAS, _DELETE, _PING, _HELLO, _CHECK, _AUTH = range(1, 10)
_OK, _MISSING, _DENIED = 0, 1, 2
_MAX_FRAME = 1 << 30
_NONCE_BYTES = 32
_AUTH_FRAME = 64  # the longest key or value of a frame before the client proved the secret
_AUTH_SECONDS = 10.0  # how long a new connection may take to prove it
_MIN_SECRET_BYTES = 16


class StoreUnreachable(ConnectionError):
    """A member's store did not answer (refused, closed, or silent past the timeout)."""

    def __init__(self, address: tuple[str, int], why: str, refused: bool = False):
        super().__init__(f"the store at {address[0]}:{address[1]} {why}")
        self.address = address
        self.refused = refused
        """True when nothing listens there: its process is gone (not merely hung or cut off)."""


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive_frame(sock: socket.socket, limit: int = _MAX_FRAME) -> tuple[int, bytes, bytes]:
    kind, key_length, value_length = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    if key_length > limit or value_length > limit:
        raise EOFError  # not our protocol: drop the connection
    key = _receive_exactly(sock, key_length)
    return kind, key, _receive_exactly(sock, value_length)


def _frame(kind: int, key: bytes, value: bytes) -> bytes:
    return _HEADER.pack(kind, len(key), len(value)) + key + value


def _checked_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"fault tolerance: the job's secret must be at least {_MIN_SECRET_BYTES} bytes")
    return bytes(secret)


class KVServer:
    """A store served on ``host:port`` (port 0: a free one, see :attr:`port`) by one thread per connection, to
    clients that prove they hold ``secret`` (the job's; see the module docstring).

    ``on_disconnect(member_id)`` is called (on the connection's thread) when the last open connection that said
    ``hello`` with that id closes. :meth:`close` stops it; it also stops when the process ends.
    """

    def __init__(self, host: str, port: int = 0, on_disconnect: Callable[[str], None] | None = None, *, secret: bytes):
        self._secret = _checked_secret(secret)
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self.on_disconnect = on_disconnect
        self._data: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._closing = False
        self._connections: set[socket.socket] = set()
        self._registered: dict[str, int] = {}  # member id -> its open registered connections
        self._thread = threading.Thread(target=self._accept, name=f"bagua-kv:{self.port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._changed:
                if self._closing:
                    sock.close()
                    return
                self._connections.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name=f"bagua-kv:{self.port}:conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        member = None
        try:
            if not self._admit(sock):
                return
            while True:
                kind, key, value = _receive_frame(sock)
                if kind == _HELLO:
                    member = key.decode()
                    with self._changed:
                        self._registered[member] = self._registered.get(member, 0) + 1
                    status, reply = _OK, b""
                else:
                    status, reply = self._apply(kind, key, value)
                sock.sendall(_frame(status, b"", reply))
        except (EOFError, OSError, struct.error, ValueError):
            pass
        finally:
            with self._changed:
                self._connections.discard(sock)
                closing = self._closing
                last = member is not None and self._registered.get(member) == 1
                if member is not None:
                    self._registered[member] -= 1
            sock.close()
            if last and not closing and self.on_disconnect is not None:
                self.on_disconnect(member)

    def _admit(self, sock: socket.socket) -> bool:
        """Whether the client on ``sock`` proved the secret (answered with this store's own proof); a client that
        did not is answered ``denied``."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sock.settimeout(_AUTH_SECONDS)
        sock.sendall(_frame(_AUTH, b"", nonce))
        kind, their_nonce, proof = _receive_frame(sock, limit=_AUTH_FRAME)
        if kind != _AUTH or not tag_matches(proof, self._secret, b"kv-store client", nonce):
            sock.sendall(_frame(_DENIED, b"", b""))
            return False
        sock.settimeout(None)
        sock.sendall(_frame(_OK, b"", message_tag(self._secret, b"kv-store server", their_nonce)))
        return True

    def _apply(self, kind: int, key: bytes, value: bytes) -> tuple[int, bytes]:
        with self._changed:
            if kind == _SET:
                self._data[key] = value
                self._changed.notify_all()
                return _OK, b""
            if kind == _GET:
                (wait,) = struct.unpack("!d", value)
                deadline = time.monotonic() + wait
                while key not in self._data and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return _MISSING, b""
                    self._changed.wait(left)
                return (_OK, self._data[key]) if key in self._data else (_MISSING, b"")
            if kind == _CHECK:
                return (_OK, self._data[key]) if key in self._data else (_MISSING, b"")
            if kind == _ADD:
                (amount,), other = struct.unpack("!q", value[:8]), value[8:]
                total = int(self._data.get(key, b"0")) + amount
                self._data[key] = str(total).encode()
                self._changed.notify_all()
                if not other:
                    return _OK, struct.pack("!q", total)
                seen = b"\x01" + self._data[other] if other in self._data else b"\x00"
                return _OK, struct.pack("!q", total) + seen
            if kind == _CAS:
                (length,) = struct.unpack("!I", value[:4])
                expected, desired = value[4 : 4 + length], value[4 + length :]
                if self._data.get(key, b"") == expected:
                    self._data[key] = desired
                    self._changed.notify_all()
                return _OK, self._data.get(key, b"")
            if kind == _DELETE:
                return (_OK if self._data.pop(key, None) is not None else _MISSING), b""
            if kind == _PING:
                return _OK, b""
        raise ValueError(f"unknown store operation {kind}")

    def in_process_client(self) -> InProcessClient:
        """A client of this store for its own process: the same operations as :class:`KVClient`, without a socket
        (the coordinator reads and writes its own store at every heartbeat and vote)."""
        return InProcessClient(self)

    def close(self) -> None:
        """Stop serving: close the listener and every connection (no ``on_disconnect`` calls)."""
        with self._changed:
            self._closing = True
            connections = list(self._connections)
            self._changed.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class StoreClient:
    """The operations on a :class:`KVServer`'s data, whichever way the store is reached: :class:`KVClient` over a
    socket, :class:`InProcessClient` from the server's own process. ``address`` names the store in errors; a store
    that cannot be reached raises :class:`StoreUnreachable`."""

    address: tuple[str, int]

    def _request(self, kind: int, key: bytes, value: bytes, wait: float = 0.0) -> tuple[int, bytes]:
        raise NotImplementedError

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key`` (waking every ``get`` waiting for it)."""
        self._request(_SET, key.encode(), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str, wait: float = 0.0) -> bytes | None:
        """The value of ``key``, waiting up to ``wait`` seconds for it to be set; None if it is not."""
        status, reply = self._request(_GET, key.encode(), struct.pack("!d", max(0.0, wait)), wait=max(0.0, wait))
        return reply if status == _OK else None

    def check(self, key: str) -> bytes | None:
        """The value of ``key`` now, or None."""
        status, reply = self._request(_CHECK, key.encode(), b"")
        return reply if status == _OK else None

    def add(self, key: str, amount: int = 1) -> int:
        """Add ``amount`` to the integer counter ``key`` (0 if unset); return the new total."""
        return struct.unpack("!q", self._request(_ADD, key.encode(), struct.pack("!q", amount))[1])[0]

    def add_and_check(self, key: str, amount: int, other: str) -> tuple[int, bytes | None]:
        """:meth:`add`, and :meth:`check` of ``other`` as it was then, in one round trip: the new total and
        ``other``'s value (None if unset)."""
        reply = self._request(_ADD, key.encode(), struct.pack("!q", amount) + other.encode())[1]
        (total,) = struct.unpack("!q", reply[:8])
        return total, reply[9:] if reply[8:9] == b"\x01" else None

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (b"" matches an unset key); return its value after."""
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired = desired.encode() if isinstance(desired, str) else bytes(desired)
        return self._request(_CAS, key.encode(), struct.pack("!I", len(expected)) + expected + desired)[1]

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        return self._request(_DELETE, key.encode(), b"")[0] == _OK

    def ping(self) -> None:
        """Return once the store answers (raises :class:`StoreUnreachable` otherwise)."""
        self._request(_PING, b"", b"")

    def close(self) -> None:
        """Let go of the store (a client that needs no closing does nothing)."""


class KVClient(StoreClient):
    """One connection to a :class:`KVServer`; thread-safe (one request at a time).

    ``timeout`` bounds connecting and each request's answer beyond a ``get``'s own wait; a store
    that does not answer, refuses or closes raises :class:`StoreUnreachable`, and the client is
    then closed. ``member`` registers the connection as that member's (see :class:`KVServer`). Client and store
    prove to each other that they hold ``secret`` first: a store that does not (not this job's) raises
    :class:`StoreUnreachable`, and so does a store that refuses this client's proof.
    """

    def __init__(self, host: str, port: int, timeout: float, member: str | None = None, *, secret: bytes):
        secret = _checked_secret(secret)
        self.address = (host, int(port))
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        try:
            self._sock: socket.socket | None = socket.create_connection(self.address, timeout=self.timeout)
        except ConnectionRefusedError:
            raise StoreUnreachable(self.address, "refused the connection (nothing listens)", refused=True) from None
        except OSError as error:
            raise StoreUnreachable(self.address, f"could not be reached ({error})") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._authenticate(secret)
        if member is not None:
            self._request(_HELLO, member.encode(), b"")

    def _authenticate(self, secret: bytes) -> None:
        sock = self._sock
        assert sock is not None
        try:
            kind, _, nonce = _receive_frame(sock, limit=_AUTH_FRAME)
        except (OSError, EOFError, struct.error) as error:
            self.close()
            raise StoreUnreachable(self.address, f"did not greet as a store does ({error!r})") from None
        if kind != _AUTH:
            self.close()
            raise StoreUnreachable(self.address, "did not greet as a store does")
        mine = secrets.token_bytes(_NONCE_BYTES)
        status, proof = self._request(_AUTH, mine, message_tag(secret, b"kv-store client", nonce))
        if status == _DENIED:
            self.close()
            raise StoreUnreachable(self.address, "refused this client: it does not hold the job's secret")
        if not tag_matches(proof, secret, b"kv-store server", mine):
            self.close()
            raise StoreUnreachable(self.address, "did not prove the job's secret: it is not this job's store")

    def _request(self, kind: int, key: bytes, value: bytes, wait: float = 0.0) -> tuple[int, bytes]:
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreUnreachable(self.address, "was closed by this client")
            try:
                sock.settimeout(self.timeout + wait)
                sock.sendall(_frame(kind, key, value))
                status, _, reply = _receive_frame(sock)
                return status, reply
            except (OSError, EOFError, struct.error) as error:
                self._sock = None
                sock.close()
                why = "timed out" if isinstance(error, TimeoutError) else f"closed the connection ({error!r})"
                raise StoreUnreachable(self.address, why) from None

    def close(self) -> None:
        """Close the connection (a member's registered connection then counts as gone); a request waiting on
        another thread raises :class:`StoreUnreachable`."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class InProcessClient(StoreClient):
    """:meth:`KVServer.in_process_client`: the store's operations applied to the server's data directly. Any number
    of threads may use it at once; once the server is closed it raises :class:`StoreUnreachable`."""

    def __init__(self, server: KVServer):
        self._server = server
        self.address = ("in-process", server.port)

    def _request(self, kind: int, key: bytes, value: bytes, wait: float = 0.0) -> tuple[int, bytes]:
        if self._server._closing:
            raise StoreUnreachable(self.address, "was closed")
        return self._server._apply(kind, key, value)


def connect(host: str, port: int, timeout: float, member: str | None = None, *, secret: bytes) -> KVClient:
    """A client to ``host:port``, retrying refusals for ``timeout`` seconds (the store may not listen yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return KVClient(host, port, timeout, member, secret=secret)
        except StoreUnreachable as error:
            if not error.refused or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def wait_for(store: KVClient, key: str, timeout: float) -> bytes:
    """The value of ``key``, waiting up to ``timeout`` seconds for it (a TimeoutError if it is not set)."""
    value = store.get(key, wait=timeout)
    if value is None:
        raise TimeoutError(f"fault tolerance: {key} was not set within {timeout:g} s")
    return value


def advertised_host(toward: str) -> str:
    """This machine's address as seen from ``toward`` (``toward``'s own address when it is a loopback one): where
    this member's store listens, and only there."""
    try:
        infos = socket.getaddrinfo(toward, None, type=socket.SOCK_DGRAM)
    except OSError:
        return socket.gethostname()
    family, _, _, _, address = infos[0]
    if ipaddress.ip_address(address[0]).is_loopback:
        return address[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address[0], 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostname()
