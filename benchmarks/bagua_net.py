"""Bagua-Net under shaped links: one TCP stream against N streams split statically or scheduled dynamically.

Two network namespaces from ``harness/links.py`` (root only); the sender's link is shaped
with ``tc`` (htb classes and u32 filters: this kernel has no netem, so no added latency).
Traffic has NCCL's shape: 2 channels (one comm each), 8 steps of 512 KiB in flight per
channel, driven through the installed plugin by the C++ harness ``tests/net_harness/net_harness.cc``.

Scenarios (rates are per direction, sender to receiver):

* ``aggregate``: one 400 Mbit/s class for all traffic. Striping cannot help; the bar is
  that it costs nothing (within 5% of one stream).
* ``per-flow``: every TCP flow capped at 50 Mbit/s under 1 Gbit/s (the cloud pattern of
  a per-flow cap far below the NIC): an htb class per source port, the sender's ports
  pinned to a range so that each flow gets a class of its own.
* ``competing``: the 400 Mbit/s class shared with four bulk TCP flows started beside.
* ``slowed``: per-flow caps of 100 Mbit/s, and one data flow cut to 10 Mbit/s after the
  warm-up (the flow that carried the most bytes, so a data stream, not a control one).

Configurations: ``1 stream`` (NCCL's default shape on generic Ethernet), ``N static``
(each message split equally over N streams, as NCCL's socket transport does),
``N dynamic`` (128 KiB chunks to the stream with the least unsent data). Each
configuration runs ``--repeats`` times, interleaved; the table gives the mean and a 95%
interval (Student t) of throughput and of CPU seconds per GB (sender + receiver).

Command::

    python benchmarks/bagua_net.py [--streams 4] [--repeats 5] [--seconds 3]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import plots
from harness.console import Progress
from harness.links import Network
from harness.results import RESULTS, finish_meta, header_lines, run_meta, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bagua_common.comm.bagua_net import bagua_net_plugin_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PORT_BASE, PORT_COUNT = 40000, 64  # the sender's ephemeral ports, one htb class each
BULK_PORT = 5201
SCENARIOS = ("aggregate", "per-flow", "competing", "slowed")
T_95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def tc(ns: str, *args: str) -> None:
    subprocess.run(["tc", "-n", ns, *args], check=True, capture_output=True, timeout=30)


def shape(ns: str, scenario: str) -> None:
    """Build the scenario's htb tree on the sender's interface (replacing any earlier one)."""
    subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
    tc(ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "2")
    if scenario in ("aggregate", "competing"):
        tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:2", "htb", "rate", "400mbit")
        # A switch port's buffer (20 ms at this rate), not the kernel's default 1000-packet FIFO.
        tc(ns, "qdisc", "add", "dev", "eth0", "parent", "1:2", "bfifo", "limit", "1mb")
        return
    per_flow = "50mbit" if scenario == "per-flow" else "100mbit"
    tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "1gbit")
    tc(ns, "class", "add", "dev", "eth0", "parent", "1:1", "classid", "1:2", "htb", "rate", per_flow)
    for k in range(PORT_COUNT):
        classid = f"1:{0x100 + k:x}"
        tc(ns, "class", "add", "dev", "eth0", "parent", "1:1", "classid", classid, "htb", "rate", per_flow)
        tc(ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", "sport", str(PORT_BASE + k), "0xffff", "flowid", classid)  # fmt: skip


def slow_busiest_flow(ns: str, peer: str) -> int:
    """Cut the class of the sender's flow with the most bytes sent to 10 Mbit/s; return its port."""
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tin", "dst", peer], capture_output=True, text=True).stdout
    best, best_bytes = None, -1
    for match in re.finditer(r":(\d+)\s+\S+:\d+\s*\n(.*?)(?=\n\S|\Z)", out, re.S):
        sent = re.search(r"bytes_sent:(\d+)", match.group(2))
        port = int(match.group(1))
        if sent and PORT_BASE <= port < PORT_BASE + PORT_COUNT and int(sent.group(1)) > best_bytes:
            best, best_bytes = port, int(sent.group(1))
    if best is None:
        raise RuntimeError(f"no shaped flow found in:\n{out}")
    classid = f"1:{0x100 + best - PORT_BASE:x}"
    tc(ns, "class", "change", "dev", "eth0", "parent", "1:1", "classid", classid, "htb", "rate", "10mbit")
    return best


class Samples:
    """The harness's "t=... bytes=... cpu=..." lines, read as they come."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.rows: list[tuple[float, int, float]] = []
        self.handles: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            if line.startswith("handle="):
                self.handles.append(line.split("=", 1)[1].strip())
            elif line.startswith("t="):
                fields = dict(item.split("=") for item in line.split())
                self.rows.append((float(fields["t"]), int(fields.get("bytes", 0)), float(fields["cpu"])))

    def at(self, t: float) -> tuple[float, int, float]:
        return min(self.rows, key=lambda row: abs(row[0] - t))


def run_once(net: Network, harness: Path, plugin: str, scenario: str, streams: int, schedule: str, seconds: float):
    """One measurement; returns (GB/s, CPU s per GB)."""
    shape(net.ns(0), scenario)
    env = dict(os.environ, NCCL_SOCKET_IFNAME="eth0", BAGUA_NET_NSTREAMS=str(streams), BAGUA_NET_SCHEDULE=schedule)
    warmup, settle = 1.0, 0.5
    total = warmup + settle + seconds + 1.0
    receiver = net.popen(1, [str(harness), "bench-receive", plugin, str(total + 2)], env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    received = Samples(receiver)
    deadline = time.monotonic() + 20
    while len(received.handles) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError("the receiver published no handles")
        time.sleep(0.01)
    sender = net.popen(0, [str(harness), "bench-send", plugin, *received.handles, str(total)], env,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    sent = Samples(sender)
    while not received.rows or received.rows[-1][1] == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("no data arrived")
        time.sleep(0.01)
    start = received.rows[-1][0]
    time.sleep(warmup)
    if scenario == "slowed":
        slow_busiest_flow(net.ns(0), net.addr(1))
    time.sleep(settle + seconds + 0.3)
    net.kill([sender, receiver])
    t0, t1 = start + warmup + settle, start + warmup + settle + seconds
    (a_t, a_bytes, a_cpu), (b_t, b_bytes, b_cpu) = received.at(t0), received.at(t1)
    (_, _, sa_cpu), (_, _, sb_cpu) = sent.at(t0), sent.at(t1)
    gigabytes = (b_bytes - a_bytes) / 1e9
    return gigabytes / (b_t - a_t), ((b_cpu - a_cpu) + (sb_cpu - sa_cpu)) / max(gigabytes, 1e-12)


def bulk_flows(net: Network) -> list[subprocess.Popen]:
    """Four bulk TCP flows from the sender's namespace to the receiver's, until killed."""
    sink = f"""
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("{net.addr(1)}", {BULK_PORT}))
s.listen(8)
def drain(c):
    while c.recv(1 << 20): pass
while True:
    threading.Thread(target=drain, args=(s.accept()[0],), daemon=True).start()
"""
    source = f"""
import socket, threading, time
def pump():
    c = socket.create_connection(("{net.addr(1)}", {BULK_PORT}), timeout=10); block = bytes(1 << 20)
    while True: c.sendall(block)
for _ in range(4): threading.Thread(target=pump).start()
"""
    procs = [net.popen(1, [sys.executable, "-c", sink], dict(os.environ))]
    time.sleep(0.5)
    procs.append(net.popen(0, [sys.executable, "-c", source], dict(os.environ)))
    return procs


def interval(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, T_95.get(len(values) - 1, 2.0) * statistics.stdev(values) / math.sqrt(len(values))


def build_harness(folder: Path) -> Path:
    harness = folder / "net_harness"
    source = ROOT / "tests" / "net_harness" / "net_harness.cc"
    subprocess.run(["g++", "-std=c++17", "-O2", f"-I{ROOT / 'bagua_net'}", str(source), "-o", str(harness),
                    "-ldl", "-pthread"], check=True)  # fmt: skip
    return harness


def plot(results: dict[str, Any], configs: list[str], path: Path) -> bool:
    drawn = plots.figure(size=(8, 4))
    if drawn is None:
        return False
    fig, ax = drawn[0], drawn[1][0][0]
    width = 0.8 / len(configs)
    for j, config in enumerate(configs):
        means = [results[s][config]["gbps"][0] * 8 for s in SCENARIOS]
        errors = [results[s][config]["gbps"][1] * 8 for s in SCENARIOS]
        ax.bar([i + j * width for i in range(len(SCENARIOS))], means, width, yerr=errors, label=config, capsize=3)
    ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(SCENARIOS))], SCENARIOS)
    ax.set_ylabel("Gbit/s (mean, 95% interval)")
    ax.set_title("Bagua-Net, NCCL-shaped traffic between two namespaces")
    ax.legend()
    plots.save(fig, path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=4, help="N, the striped configurations' stream count")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plugin", default=bagua_net_plugin_path(), help="default: the installed plugin")
    args = parser.parse_args(argv)
    plugin = args.plugin
    if plugin is None:
        parser.error("no installed libnccl-net-bagua.so (pip install .)")
    n = args.streams
    configs = {"1 stream": (1, "dynamic"), f"{n} static": (n, "static"), f"{n} dynamic": (n, "dynamic")}
    meta = run_meta(["bagua-jax"], argv=argv or sys.argv[1:], plugin=plugin, host=socket.gethostname())  # fmt: skip
    measured: dict[str, dict[str, list[tuple[float, float]]]] = {s: {c: [] for c in configs} for s in args.scenarios}
    progress = Progress(len(args.scenarios) * len(configs) * args.repeats)
    with tempfile.TemporaryDirectory() as folder, Network(2, rate=None, verbose=False) as net:
        harness = build_harness(Path(folder))
        port_range = f"net.ipv4.ip_local_port_range={PORT_BASE} {PORT_BASE + PORT_COUNT - 1}"
        subprocess.run(["ip", "netns", "exec", net.ns(0), "sysctl", "-qw", port_range], check=True)
        for scenario in args.scenarios:
            bulk = bulk_flows(net) if scenario == "competing" else []
            for repeat in range(args.repeats):
                for config, (streams, schedule) in configs.items():
                    gbps, cpu = run_once(net, harness, plugin, scenario, streams, schedule, args.seconds)
                    measured[scenario][config].append((gbps, cpu))
                    progress.line(f"{scenario:10s} {config:10s} #{repeat}: {gbps * 8:.3f} Gbit/s, {cpu:.2f} CPU s/GB")
            net.kill(bulk)
    finish_meta(meta)
    results = {
        s: {c: {"gbps": interval([g for g, _ in runs]), "cpu_s_per_gb": interval([u for _, u in runs]), "runs": runs}
            for c, runs in per.items()}
        for s, per in measured.items()
    }  # fmt: skip
    names = list(configs)
    lines = ["# Bagua-Net under shaped links", "", *header_lines(meta), ""]
    lines += [
        "Two network namespaces (`benchmarks/harness/links.py`), the sender's link shaped with htb/u32 "
        "(no netem on this kernel: no added latency, so no bandwidth-delay effects). NCCL-shaped traffic: "
        "2 channels x 8 steps of 512 KiB in flight. Mean and 95% interval over "
        f"{args.repeats} interleaved runs of {args.seconds:g} s.",
        "",
        "| scenario | configuration | Gbit/s | ratio to 1 stream | CPU s/GB |",
        "|---|---|---|---|---|",
    ]
    for s, per in results.items():
        base = per["1 stream"]["gbps"][0]
        for c in names:
            (g, gi), (u, ui) = per[c]["gbps"], per[c]["cpu_s_per_gb"]
            lines.append(f"| {s} | {c} | {g * 8:.3f} ± {gi * 8:.3f} | {g / base:.2f} | {u:.2f} ± {ui:.2f} |")
    lines.append("")
    if plot(results, names, args.out / "bagua-net.png") if set(results) == set(SCENARIOS) else False:
        lines += ["![throughput per scenario](bagua-net.png)", ""]
    payload = {"meta": meta, "results": results}
    md, js = write_results(args.out, "bagua-net", lines, payload)
    print("\n".join(lines))
    print(f"wrote {md} and {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
