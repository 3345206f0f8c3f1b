"""Two ranks on one GPU allreduce through real NCCL with Bagua-Net as its network.

NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
detected"), so each rank names a host of its own through ``NCCL_HOSTID``: NCCL then
takes the ranks for two nodes and connects them through its network transport, which
``NCCL_NET_PLUGIN``/``NCCL_NET=Bagua`` make Bagua-Net's striped TCP over loopback.
Peer-to-peer and shared-memory transports are disabled as well, so no byte can take
another path.

The job checks NCCL's own debug output (the plugin loaded, the network in use, every
channel connected through it) and each allreduce's result against the exact sum, then
prints the bandwidth per size. With ``--baseline`` the same job runs over NCCL's own
socket transport as well (alternating, so both see the same machine), and the table
gives Bagua-Net's bandwidth as a ratio of it. Exit status 0 only when every check holds.

Command (a GPU and a CUDA + NCCL build)::

    python tests/bagua_net_nccl_job.py --sizes-mib 1 16 64 256 --iterations 20 --baseline
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

RANKS = 2
TIMEOUT_S = 300  # the suite's hang guard for a job's own processes


def rank_environment(rank: int, network: str) -> dict[str, str]:
    """This rank's variables: a host of its own, the network forced ("Bagua" or NCCL's
    own "Socket"), NCCL's debug output."""
    from bagua_common.comm.bagua_net import bagua_net_environment

    forced = bagua_net_environment() if network == "Bagua" else {"NCCL_NET_PLUGIN": "none", "NCCL_NET": network}
    return dict(
        os.environ,
        **forced,
        NCCL_HOSTID=f"bagua-net-check-{rank}",
        NCCL_P2P_DISABLE="1",
        NCCL_SHM_DISABLE="1",
        NCCL_SOCKET_IFNAME="lo",
        NCCL_DEBUG="INFO",
        NCCL_DEBUG_SUBSYS="INIT,NET",
    )


def run_rank(rank: int, unique_id_hex: str | None, sizes_mib: list[int], iterations: int) -> None:
    """One rank: create the communicator, check and time an allreduce per size, print JSON."""
    # torch first: importing it after a native module of this package crashed it on the
    # H200 machine (see benchmarks/results/gpu-check.md).
    import torch  # noqa: I001

    import _bagua_nccl as nccl

    unique_id = nccl.unique_id() if unique_id_hex is None else bytes.fromhex(unique_id_hex)
    if rank == 0:
        print(f"UNIQUE_ID {unique_id.hex()}", flush=True)
    handle = nccl.create(unique_id, rank, RANKS, "bagua-net-check", 120.0, 0)
    stream = torch.cuda.current_stream().cuda_stream
    results = []
    for size_mib in sizes_mib:
        n = size_mib * (1 << 20) // 4
        # Small integers in float32: every partial sum is exact, so the result is too.
        pattern = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(1021)
        x = pattern * (rank + 1)
        nccl.allreduce(handle, x, x, 0, stream)
        torch.cuda.synchronize()
        correct = bool(torch.equal(x, pattern * sum(r + 1 for r in range(RANKS))))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            nccl.allreduce(handle, x, x, 0, stream)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iterations
        nbytes = n * 4
        results.append(
            {
                "size_mib": size_mib,
                "correct": correct,
                "ms": seconds * 1e3,
                "algbw_gbps": nbytes / seconds / 1e9,
                "busbw_gbps": nbytes / seconds / 1e9 * 2 * (RANKS - 1) / RANKS,
            }
        )
    nccl.finalize()
    print("RESULTS " + json.dumps(results), flush=True)


def debug_checks(log: str, network: str = "Bagua") -> dict[str, bool]:
    """What NCCL's INFO output must show for the job to have gone through ``network``."""
    channels = re.findall(r"Channel \d+/\d+ : .*\bvia (\S+)", log)
    checks = {
        f"network in use is {network}": f"Using network {network}" in log,
        "channels connected": bool(channels),
        f"every channel via NET/{network}": bool(channels) and all(c.startswith(f"NET/{network}") for c in channels),
    }
    if network == "Bagua":
        checks["plugin loaded"] = re.search(r"Loaded net plugin Bagua", log) is not None
    return checks


def launch(sizes_mib: list[int], iterations: int, network: str = "Bagua") -> dict:
    """Start both ranks over ``network`` (rank 0 first: it makes the unique id) and gather
    their reports."""
    script = os.path.abspath(__file__)
    common = ["--sizes-mib", *map(str, sizes_mib), "--iterations", str(iterations)]
    rank0 = subprocess.Popen(
        [sys.executable, script, "--rank", "0", *common],
        env=rank_environment(0, network),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    before_id = []  # NCCL's own lines come first
    for line in rank0.stdout:
        if line.startswith("UNIQUE_ID "):
            break
        before_id.append(line)
    else:
        rank0.wait()
        raise RuntimeError("rank 0 did not print its unique id:\n" + "".join(before_id))
    rank1 = subprocess.Popen(
        [sys.executable, script, "--rank", "1", "--unique-id", line.split()[1], *common],
        env=rank_environment(1, network),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    logs, codes = [], []
    for proc in (rank0, rank1):
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in (rank0, rank1):
                p.kill()
            raise RuntimeError(f"the job did not finish within {TIMEOUT_S} s") from None
        logs.append(("".join(before_id) if proc is rank0 else "") + out)
        codes.append(proc.returncode)
    reports = [re.search(r"^RESULTS (.*)$", log, re.MULTILINE) for log in logs]
    version = re.search(r"NCCL version (\S+)", logs[0])
    return {
        "exit_codes": codes,
        "nccl_version": version.group(1) if version else "not printed",
        "checks": [debug_checks(log, network) for log in logs],
        "results": [json.loads(r.group(1)) if r else None for r in reports],
        "logs": logs,
    }


def failures(job: dict) -> list[str]:
    """Every check the job failed, in words (empty when it passed)."""
    problems = [f"rank {r} exited with {c}" for r, c in enumerate(job["exit_codes"]) if c != 0]
    for rank, checks in enumerate(job["checks"]):
        problems += [f"rank {rank}: NCCL's output does not show: {name}" for name, ok in checks.items() if not ok]
    for rank, results in enumerate(job["results"]):
        if results is None:
            problems.append(f"rank {rank} reported no results")
            continue
        problems += [f"rank {rank}: {r['size_mib']} MiB allreduce is wrong" for r in results if not r["correct"]]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--baseline", action="store_true", help="also run over NCCL's socket transport")
    parser.add_argument("--repeats", type=int, default=2, help="jobs per network, alternating (with --baseline)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--unique-id", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args.rank, args.unique_id, args.sizes_mib, args.iterations)
        return 0
    networks = ["Bagua", "Socket"] if args.baseline else ["Bagua"]
    jobs = {n: [] for n in networks}
    for _ in range(args.repeats if args.baseline else 1):
        for network in networks:
            jobs[network].append(launch(args.sizes_mib, args.iterations, network))
    problems = [f"{n}: {p}" for n in networks for job in jobs[n] for p in failures(job)]
    first = jobs["Bagua"][0]
    print(f"NCCL {first['nccl_version']}, {RANKS} ranks on one GPU, each a host of its own, over loopback")

    def best_busbw(network: str, size_index: int) -> float:
        return max(job["results"][0][size_index]["busbw_gbps"] for job in jobs[network] if job["results"][0])

    header = "| size (MiB) | correct | Bagua-Net ms | Bagua-Net busbw (GB/s) |"
    print(header + (" NCCL socket busbw (GB/s) | Bagua-Net / socket |" if args.baseline else ""))
    print("|---" * (6 if args.baseline else 4) + "|")
    for i, r in enumerate(first["results"][0] or []):
        row = f"| {r['size_mib']} | {r['correct']} | {r['ms']:.2f} | {best_busbw('Bagua', i):.2f} |"
        if args.baseline:
            socket = best_busbw("Socket", i)
            row += f" {socket:.2f} | {best_busbw('Bagua', i) / socket:.2f} |"
        print(row)
    for rank, log in enumerate(first["logs"]):
        lines = [ln for ln in log.splitlines() if re.search(r"NET/|Using network|Channel 00|NCCL version|WARN", ln)]
        print(f"--- rank {rank}: NCCL's network lines (Bagua-Net job) ---", *lines[:25], sep="\n")
    print("\n".join(problems) if problems else "all checks passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
