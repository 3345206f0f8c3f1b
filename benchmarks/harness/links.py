"""The shaped links: an emulated network of ranks on one machine, one network namespace per rank.

What it builds (root only; nothing is attached to the host's interfaces, and the host's
own namespace, routes and addresses are never touched):

* a namespace ``bagua-br`` holding a Linux bridge ``br0`` (no address, no uplink);
* for each rank ``i`` a namespace ``bagua-r<i>`` with ``lo`` up and one interface
  ``eth0``, the end of a veth pair whose other end ``v<i>`` sits on the bridge inside
  ``bagua-br``. The pair is created inside ``bagua-br`` with its peer put straight into
  ``bagua-r<i>``, so it never appears in the host's namespace. ``eth0`` gets the
  private address ``10.88.0.<i+1>/24`` (only inside that namespace), and
  ``/etc/netns/bagua-r<i>/hosts`` (which ``ip netns exec`` mounts over ``/etc/hosts``)
  maps the machine's hostname to that address, so gloo advertises a reachable address;
* with a rate: a token-bucket filter (``tc qdisc ... tbf``) on both ends of every pair,
  so each rank's link carries at most ``rate`` in each direction (full duplex);
* with a delay, and where the kernel has ``sch_netem``: a ``netem`` delay on the
  rank's end (one-way; the round trip gets it once). Where the kernel lacks ``netem``
  the harness says so and shapes bandwidth only.

Traffic between the ranks only flows over these links; rank 0 (the master, at
``10.88.0.1``) reaches itself over its own loopback.

Clean-up: everything created is removed (the namespaces, and with them the bridge and
the veth pairs) when the :class:`Network` context ends, on an exception, on SIGINT /
SIGTERM / SIGHUP, and at interpreter exit; processes started with
:meth:`Network.popen` are killed (their whole process group) first. Leftovers of a
killed run (``kill -9``) are removed with ``--cleanup``, which deletes every namespace
named ``bagua-br`` or ``bagua-r<N>`` (the harness's own names, nothing else) and their
``/etc/netns/`` entries.

Command line::

    python benchmarks/harness/links.py --check                 # what this kernel supports
    python benchmarks/harness/links.py --cleanup               # remove leftovers
    python benchmarks/harness/links.py --ranks 2 --rate 100mbit -- python -c "import os; print(os.environ['RANK'])"

The last form runs the command once per rank, inside the rank's namespace, with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``, ``NODE_RANK``,
``MASTER_ADDR=10.88.0.1``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME=eth0`` set (what
``bagua-launch --nnodes N --node-rank i --nproc-per-node 1 --master-addr 10.88.0.1``
would set), and removes the network afterwards.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

PREFIX = os.environ.get("BAGUA_NETNS_PREFIX", "bagua-")
"""The namespaces' names start with this: a second study on the same machine runs beside the first with its own
(e.g. ``BAGUA_NETNS_PREFIX=lm-``); letters, digits and dashes only."""
if not re.fullmatch(r"[a-z0-9-]{1,8}", PREFIX):
    raise SystemExit(f"links: BAGUA_NETNS_PREFIX must be 1-8 of a-z, 0-9, '-', got {PREFIX!r}")
BRIDGE_NS = f"{PREFIX}br"
RANK_NS = f"{PREFIX}r{{}}"
OUR_NS = re.compile(rf"^{re.escape(PREFIX)}(br|r\d+)$")
SUBNET = "10.88.0"
MAX_RANKS = 64
RANK_IF = "eth0"
NETNS_ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*


class HarnessError(RuntimeError):
    pass


def parse_rate(text: str | None) -> int | None:
    """'100mbit', '1gbit', '300Mbit', '2.5gbit', '500kbit', and :func:`rate_label`'s '100 Mbit/s' -> bits/s;
    None / 'none' / 'max' / 'unshaped' -> None (unshaped)."""
    if text is None or str(text).lower() in ("", "none", "max", "unlimited", "inf", "unshaped"):
        return None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)?\s*", str(text).lower().replace("bit/s", "bit"))
    if not m:
        raise ValueError(f"cannot read the rate {text!r} (e.g. 100mbit, 1gbit, none)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    if m.group(3) == "bps":
        value *= 8
    if value < 1e5:
        raise ValueError(f"rate {text!r} is below 100 kbit/s")
    return int(value)


def link_name(text: str | int | None) -> str:
    """A link rate's one spelling, as ``--links`` takes it: ``100mbit``, ``2.5gbit``, ``none`` (unshaped), from any
    spelling :func:`parse_rate` reads or a number of bits per second."""
    bits = parse_rate(text) if isinstance(text, str) or text is None else int(text)
    if bits is None:
        return "none"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


def rate_label(bits: int | None) -> str:
    if bits is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits} bit/s"


def _sent(column: int, loopback: bool) -> int:
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            interface, counters = line.split(":", 1)
            if (interface.strip() == "lo") == loopback:
                total += int(counters.split()[column])
    return total


def bytes_sent(loopback: bool = False) -> int:
    """Bytes this network namespace sent so far on its interfaces other than loopback (from ``/proc/net/dev``): in a
    :class:`Network` each rank has its own namespace, so this is the rank's traffic. With ``loopback``, the bytes sent
    on loopback alone: the traffic between processes of one machine."""
    return _sent(8, loopback)


def packets_sent() -> int:
    """Packets this network namespace sent so far on its interfaces other than loopback, as :func:`bytes_sent`."""
    return _sent(9, loopback=False)


def add_link_options(parser: argparse.ArgumentParser) -> None:
    """``--ranks N`` (default 4) and ``--rate R`` (default 100 Mbit/s): the emulated network a study's jobs run on."""
    parser.add_argument("--ranks", type=int, default=4, help="ranks, one namespace each")
    parser.add_argument("--rate", default="100mbit", help="per-rank link rate ('none': unshaped)")


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise HarnessError(
            f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def cut_own_link(seconds: float | None = None) -> None:
    """Cut the calling rank off, as a network partition does: take its namespace's link down, for good or, given
    ``seconds``, for that long (a shell of its own brings it back, whatever the rank does meanwhile). A HarnessError
    outside a rank's namespace: the machine's own link is never touched."""
    namespace = _run(["ip", "netns", "identify", str(os.getpid())], check=False).stdout.strip()
    if not re.fullmatch(rf"{re.escape(PREFIX)}r\d+", namespace):
        raise HarnessError(f"cut_own_link: this process is not in a rank's namespace (it is in {namespace!r})")
    _run(["ip", "link", "set", RANK_IF, "down"])
    if seconds:
        subprocess.Popen(["sh", "-c", f"sleep {seconds}; ip link set {RANK_IF} up"])


def require_root() -> None:
    if os.geteuid() != 0:
        sys.exit(
            "links: creating network namespaces, veth pairs and tc qdiscs needs root "
            "(CAP_NET_ADMIN). Run it as root (e.g. with sudo), or run the benchmarks without "
            "network emulation (benchmarks/synthetic.py)."
        )
    if shutil.which("ip") is None or shutil.which("tc") is None:
        sys.exit("links: the `ip` and `tc` commands are missing; install iproute2 (apt-get install -y iproute2)")


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup_leftovers(verbose: bool = True) -> list[str]:
    """Delete every namespace with one of the harness's names (bagua-br, bagua-r<N>)."""
    removed = []
    for ns in list_namespaces():
        if OUR_NS.match(ns):
            _kill_namespace_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    if os.path.isdir(NETNS_ETC):
        for ns in os.listdir(NETNS_ETC):
            if OUR_NS.match(ns):
                _remove_etc(ns)
                removed.append(f"{NETNS_ETC}/{ns}")
    if verbose:
        print("removed: " + (", ".join(removed) if removed else "nothing (no bagua-br / bagua-r<N> namespaces)"))
    return removed


def _remove_etc(ns: str) -> None:
    d = os.path.join(NETNS_ETC, ns)
    if OUR_NS.match(ns) and os.path.isdir(d):
        shutil.rmtree(d, ignore_errors=True)


def _kill_namespace_processes(ns: str) -> None:
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


def probe() -> dict[str, Any]:
    """What this machine supports: root, iproute2, namespaces, veth, bridge, tbf, netem (tried in a scratch netns)."""
    info: dict[str, Any] = {
        "root": os.geteuid() == 0,
        "ip": shutil.which("ip") is not None,
        "tc": shutil.which("tc") is not None,
    }
    if not (info["root"] and info["ip"] and info["tc"]):
        return info
    ns = f"{PREFIX}r{MAX_RANKS + 1}"  # a harness name, so --cleanup would find it
    try:
        _run(["ip", "netns", "add", ns])
        info["netns"] = True
        info["bridge"] = _run(["ip", "-n", ns, "link", "add", "br0", "type", "bridge"], check=False).returncode == 0
        info["veth"] = (
            _run(["ip", "-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "b0"], check=False).returncode
            == 0
        )
        if info["veth"]:
            _run(["ip", "-n", ns, "link", "set", "a0", "up"], check=False)
            info["tbf"] = (
                _run(
                    [
                        "tc",
                        "-n",
                        ns,
                        "qdisc",
                        "add",
                        "dev",
                        "a0",
                        "root",
                        "tbf",
                        "rate",
                        "100mbit",
                        "burst",
                        "128kb",
                        "latency",
                        "100ms",
                    ],
                    check=False,
                ).returncode
                == 0
            )
            info["netem"] = (
                _run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", "b0", "root", "netem", "delay", "1ms"], check=False
                ).returncode
                == 0
            )
    except HarnessError as error:
        info["netns"] = False
        info["error"] = str(error)
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    return info


def mpi_environment() -> dict[str, str]:
    """MPICH's settings that keep a rank's traffic on its shaped link: no shared memory between the ranks (the
    namespaces share one kernel and hostname), UCX over TCP on the rank's interface only, every message sent eagerly
    (:meth:`Network.run_mpi` says why), and libfabric's TCP provider (a fault-tolerant job's ports) on that
    interface too."""
    return {
        "MPIR_CVAR_NOLOCAL": "1",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": RANK_IF,
        "UCX_RNDV_THRESH": "inf",
        "FI_TCP_IFACE": RANK_IF,
    }


def tbf_args(rate: int) -> list[str]:
    # The bucket must hold at least one GSO super-packet (64 KiB) and a few timer ticks of traffic.
    burst = max(256 * 1024, int(rate / 8 * 0.004))
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "200ms"]


class Network:
    """Build the namespaces and shaped links of ``ranks`` ranks; a context manager that always removes them."""

    _live: list["Network"] = []
    _handlers_installed = False

    def __init__(self, ranks: int, rate: int | str | None = None, delay_ms: float = 0.0, verbose: bool = True):
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"ranks must be 1..{MAX_RANKS}, got {ranks}")
        self.ranks = ranks
        self.rate = parse_rate(rate) if isinstance(rate, str) or rate is None else int(rate)
        self.delay_ms = float(delay_ms)
        self.verbose = verbose
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.netem: bool | None = None
        self.notes: list[str] = []
        self._made_etc = False

    # -- names
    def ns(self, rank: int) -> str:
        return RANK_NS.format(rank)

    def addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def master_addr(self) -> str:
        return self.addr(0)

    # -- life cycle
    def __enter__(self) -> "Network":
        Network._install_handlers()
        Network._live.append(self)
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()

    def setup(self) -> None:
        require_root()
        stale = [ns for ns in list_namespaces() if OUR_NS.match(ns)]
        if stale:
            raise HarnessError(
                f"namespaces of an earlier run are still there ({', '.join(stale)}); "
                "remove them with: python benchmarks/harness/links.py --cleanup"
            )
        _run(["ip", "netns", "add", BRIDGE_NS])
        self.created.append(BRIDGE_NS)
        br = ["ip", "-n", BRIDGE_NS]
        _run(br + ["link", "add", "br0", "type", "bridge"])
        _run(br + ["link", "set", "br0", "up"])
        _run(br + ["link", "set", "lo", "up"])
        for i in range(self.ranks):
            ns = self.ns(i)
            _run(["ip", "netns", "add", ns])
            self.created.append(ns)
            # created inside bagua-br, peer moved straight into the rank's namespace
            _run(br + ["link", "add", f"v{i}", "type", "veth", "peer", "name", RANK_IF, "netns", ns])
            _run(br + ["link", "set", f"v{i}", "master", "br0"])
            _run(br + ["link", "set", f"v{i}", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", RANK_IF])
            _run(["ip", "-n", ns, "link", "set", RANK_IF, "up"])
            self._write_hosts(i)
            self._shape(i)
        if self.verbose:
            shaped = rate_label(self.rate) + (
                f", +{self.delay_ms:g} ms one-way" if self.delay_ms and self.netem else ""
            )
            print(
                f"[network] {self.ranks} ranks in namespaces {self.ns(0)}..{self.ns(self.ranks - 1)} on bridge "
                f"{BRIDGE_NS}/br0, {SUBNET}.0/24, per-rank link {shaped}",
                file=sys.stderr,
                flush=True,
            )
        self._wait_link()

    def _write_hosts(self, i: int) -> None:
        """Inside rank i's namespace the machine's hostname resolves to the rank's address, and every rank's
        address, IPv4-mapped too, to a name.

        Gloo (JAX's CPU collectives, torch without GLOO_SOCKET_IFNAME) advertises the address of
        ``gethostname()``; on the host that is often 127.0.0.1, which the other ranks cannot reach. torch's
        TCPStore names each client it accepts on its dual-stack socket (``::ffff:10.88.0.2``): without the
        mapped names the lookup went to DNS, which a namespace cannot reach, and c10d warned "The hostname of the
        client socket cannot be retrieved" for each. ``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``
        over ``/etc/hosts``; the file is removed with the namespace.
        """
        host = socket.gethostname()
        d = os.path.join(NETNS_ETC, self.ns(i))
        if not os.path.isdir(NETNS_ETC):
            os.makedirs(NETNS_ETC)
            self._made_etc = True
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n::1 localhost\n{self.addr(i)} {host}\n")
            for j in range(self.ranks):
                f.write(f"{self.addr(j)} {self.ns(j)}\n::ffff:{self.addr(j)} {self.ns(j)}\n")

    def _shape(self, i: int) -> None:
        ns = self.ns(i)
        if self.rate is not None:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", RANK_IF, "root", "handle", "1:", *tbf_args(self.rate)])
            _run(["tc", "-n", BRIDGE_NS, "qdisc", "add", "dev", f"v{i}", "root", *tbf_args(self.rate)])
        if self.delay_ms > 0:
            parent = ["parent", "1:1"] if self.rate is not None else ["root"]
            proc = _run(
                ["tc", "-n", ns, "qdisc", "add", "dev", RANK_IF, *parent, "netem", "delay", f"{self.delay_ms}ms"],
                check=False,
            )
            if proc.returncode != 0 and self.netem is None:
                self.netem = False
                note = (
                    f"netem is not available in this kernel ({proc.stderr.strip()}); no latency added, "
                    "bandwidth shaping only"
                )
                self.notes.append(note)
                print(f"[network] {note}", file=sys.stderr, flush=True)
            elif proc.returncode == 0:
                self.netem = True

    def reshape(self, rate: int | str | None) -> None:
        """Change every rank's link to ``rate`` (None: unshaped) while the ranks run: the tbf filters on both ends
        of each pair are removed and, with a rate, added anew (a changed link drops what its queue held; call it
        while the ranks are quiet)."""
        self.rate = parse_rate(rate) if isinstance(rate, str) or rate is None else int(rate)
        for i in range(self.ranks):
            _run(["tc", "-n", self.ns(i), "qdisc", "del", "dev", RANK_IF, "root"], check=False)
            _run(["tc", "-n", BRIDGE_NS, "qdisc", "del", "dev", f"v{i}", "root"], check=False)
            self._shape(i)

    def _wait_link(self, timeout: float = 10.0) -> None:
        """Bounded wait until every rank's eth0 is up (the bridge ports leave 'listening' at once without STP)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                _run(["ip", "-n", self.ns(i), "-o", "link", "show", RANK_IF], check=False).stdout
                for i in range(self.ranks)
            ]
            if all("state UP" in s or "LOWER_UP" in s for s in states):
                return
            time.sleep(0.2)
        raise HarnessError("the ranks' links did not come up within 10 s")

    def env(self, rank: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.ranks),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            NODE_RANK=str(rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=RANK_IF,
            TP_SOCKET_IFNAME=RANK_IF,
        )
        for key in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
            env.pop(key, None)
        return env

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside rank ``rank``'s namespace, in its own process group (killed on teardown)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(rank), *argv], env=env, start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def run_all(
        self, argv: Sequence[str], port: int, timeout: float, base_env: dict[str, str] | None = None, stdout: Any = None
    ) -> list[int | None]:
        """Run ``argv`` once per rank; return the exit codes (None: killed at the timeout, or after a rank failed)."""
        procs = [
            self.popen(
                i,
                argv,
                self.env(i, port, base_env),
                stdout=stdout,
                stderr=subprocess.STDOUT if stdout is not None else None,
            )
            for i in range(self.ranks)
        ]
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * len(procs)
        while time.monotonic() < deadline:
            for i, p in enumerate(procs):
                codes[i] = p.poll()
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
        finished = list(codes)
        self.kill(procs)
        return finished

    def run_mpi(
        self, argv: Sequence[str], timeout: float, base_env: dict[str, str] | None = None, stdout: Any = None
    ) -> list[int | None]:
        """Run the script ``argv[1:]`` (``argv[0]`` is the Python) as one MPI job with a rank per namespace.

        ``bagua-launch --mpi`` runs in rank 0's namespace; its mpiexec (hydra) starts a proxy
        per "host" (a rank's address) through this module's ``--ssh``, which enters the
        namespace that owns the address. MPI's traffic is kept on the shaped links: no shared
        memory between the ranks (``MPIR_CVAR_NOLOCAL``; the namespaces share one kernel and
        hostname) and UCX over TCP on ``eth0`` only. UCX sends every message eagerly: with its
        rendezvous protocol, the handshake of one direction of a pairwise exchange queued behind
        the other direction's data on the same TCP connection, and about 40% of 7.4 MB exchanges
        between alternating pairs took twice the wire time at 100 Mbit/s (ring steps, which send
        and receive on different connections, were not affected). Returns the job's exit code
        once per rank (``None``: killed at the timeout).
        """
        addrs = [self.addr(i) for i in range(self.ranks)]
        env = self.env(0, 0, base_env)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
            env.pop(key)  # rank_env sets them from MPI's
        env.update(BAGUA_NETNS_HOSTS=",".join(f"{a}={self.ns(i)}" for i, a in enumerate(addrs)), **mpi_environment())
        with tempfile.TemporaryDirectory(prefix=f"{PREFIX}ssh-") as tmp:
            shim = os.path.join(tmp, "netns-ssh")
            with open(shim, "w") as f:
                f.write(
                    f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(__file__))} "
                    '--ssh "$@"\n'
                )
            os.chmod(shim, 0o755)
            hydra = f"-launcher ssh -launcher-exec {shim} -localhost {addrs[0]} -hosts {','.join(addrs)} -ppn 1"
            proc = self.popen(
                0,
                [
                    argv[0],
                    "-m",
                    "bagua_launch",
                    "--nnodes",
                    str(self.ranks),
                    "--nproc-per-node",
                    "1",
                    "--master-addr",
                    self.master_addr,
                    "--mpi",
                    "--mpi-args",
                    hydra,
                    *argv[1:],
                ],
                env,
                stdout=stdout,
                stderr=subprocess.STDOUT if stdout is not None else None,
            )
            try:
                code: int | None = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
            self.kill([proc])
        return [code] * self.ranks

    def kill(self, procs: Sequence[subprocess.Popen] | None = None) -> None:
        procs = list(self.procs if procs is None else procs)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait(timeout=5)
        self.procs = [p for p in self.procs if p not in procs]

    def teardown(self) -> None:
        try:
            self.kill()
        finally:
            for ns in reversed(self.created):
                _kill_namespace_processes(ns)
                _run(["ip", "netns", "del", ns], check=False)
                _remove_etc(ns)
            if self._made_etc:
                try:
                    os.rmdir(NETNS_ETC)  # only if empty
                except OSError:
                    pass
            if self.created and self.verbose:
                print(f"[network] removed {', '.join(self.created)}", file=sys.stderr, flush=True)
            self.created = []
            if self in Network._live:
                Network._live.remove(self)

    # -- signals / exit
    @classmethod
    def _install_handlers(cls) -> None:
        if cls._handlers_installed:
            return
        cls._handlers_installed = True
        atexit.register(cls._teardown_all)

        def handler(signum, frame):
            cls._teardown_all()
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt(f"signal {signum}") if signum == signal.SIGINT else SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):  # not the main thread
                pass

    @classmethod
    def _teardown_all(cls) -> None:
        for net in list(cls._live):
            net.teardown()


def ssh_into_namespace(args: Sequence[str]) -> None:
    """Hydra's remote shell for :meth:`Network.run_mpi`: ``[options] HOST COMMAND...`` runs COMMAND
    (joined, through ``sh -c`` as ssh would) in the namespace that owns address HOST."""
    hosts = dict(item.split("=", 1) for item in os.environ["BAGUA_NETNS_HOSTS"].split(","))
    at = next(i for i, a in enumerate(args) if a in hosts)
    os.execvp("ip", ["ip", "netns", "exec", hosts[args[at]], "sh", "-c", " ".join(args[at + 1 :])])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--ssh"]:
        ssh_into_namespace(argv[1:])
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--check", action="store_true", help="report what this machine supports and exit")
    parser.add_argument("--cleanup", action="store_true", help="remove leftover bagua-br / bagua-r<N> namespaces")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rate", default=None, help="per-rank link rate, e.g. 100mbit, 1gbit (default: unshaped)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way latency per link (needs netem)")
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed")
    args = parser.parse_args(argv)
    if args.check:
        for key, value in probe().items():
            print(f"{key:>7}: {value}")
        return 0
    require_root()
    if args.cleanup:
        cleanup_leftovers()
        return 0
    if not command:
        parser.error("give the command to run per rank after --")
    try:
        with Network(args.ranks, args.rate, args.delay_ms) as net:
            codes = net.run_all(command, args.port, args.timeout)
    except KeyboardInterrupt:
        print("[network] interrupted; the network was removed", file=sys.stderr)
        return 130
    print(f"[network] exit codes: {codes}", file=sys.stderr)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
