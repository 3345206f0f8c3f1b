"""Bagua-Net, NCCL's striped-TCP network plugin, driven the way NCCL's proxy thread drives it.

A C++ harness (tests/net_harness/net_harness.cc) dlopens the installed libnccl-net-bagua.so and
runs each scenario between two processes on loopback; it checks every payload against
an independently generated reference. The harness and the plugin are also rebuilt with
AddressSanitizer+UBSan and with ThreadSanitizer and run again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_common.comm.bagua_net import bagua_net_plugin_path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "bagua_net"
PLUGIN_SOURCES = [
    SOURCES / name for name in ("striped_transport.cc", "socket_io.cc", "environment.cc", "nccl_net_plugin.cc")
]
HARNESS = Path(__file__).resolve().parent / "net_harness" / "net_harness.cc"
SANITIZERS = {
    "asan-ubsan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "tsan": ["-fsanitize=thread"],
}

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the harness is built with g++")


def _compile(output: Path, sources: list[Path], flags: list[str]) -> subprocess.Popen:
    command = ["g++", "-std=c++17", "-g", f"-I{SOURCES}", *flags, *map(str, sources), "-o", str(output)]
    command += ["-ldl", "-pthread"]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen) -> None:
    _, errors = process.communicate(timeout=300)
    assert process.returncode == 0, errors


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """The harness and plugin per build: 'release' is the installed plugin, the others sanitized copies."""
    installed = bagua_net_plugin_path()
    assert installed is not None, "pip install . should have installed libnccl-net-bagua.so"
    folder = tmp_path_factory.mktemp("bagua_net")
    jobs = [_compile(folder / "net_harness", [HARNESS], ["-O2"])]
    result = {"release": (folder / "net_harness", Path(installed))}
    for name, flags in SANITIZERS.items():
        plugin = folder / f"libnccl-net-bagua-{name}.so"
        jobs.append(_compile(plugin, PLUGIN_SOURCES, ["-O1", "-fPIC", "-shared", *flags]))
        jobs.append(_compile(folder / f"net_harness-{name}", [HARNESS], ["-O1", *flags]))
        result[name] = (folder / f"net_harness-{name}", plugin)
    for job in jobs:
        _finish(job)
    return result


def run_harness(build: tuple[Path, Path], *args: str, timeout: float = 300, **env: str) -> str:
    harness, plugin = build
    environment = dict(os.environ, NCCL_SOCKET_IFNAME="lo", **env)
    # ASan's leak checker needs ptrace, which containers often forbid; the run is still fully checked otherwise.
    environment.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    environment.setdefault("TSAN_OPTIONS", "halt_on_error=1")
    scenario, rest = args[0], args[1:]
    done = subprocess.run(
        [str(harness), scenario, str(plugin), *rest], env=environment, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ok"), done.stdout + done.stderr
    for report in ("AddressSanitizer", "UndefinedBehaviorSanitizer", "runtime error", "ThreadSanitizer"):
        assert report not in done.stderr, done.stderr
    return done.stdout


def test_plugin_needs_no_cuda():
    path = bagua_net_plugin_path()
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed and not [lib for lib in needed if "cuda" in lib or "nccl" in lib], needed


def test_every_version_resolves_and_moves_data(builds):
    out = run_harness(builds["release"], "symbols")
    for version in range(8, 13):
        assert f"v{version} name=Bagua devices=1 dev0=lo" in out  # NCCL_SOCKET_IFNAME=lo


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("NCCL_SOCKET_IFNAME", "=no-such-interface", "no network interface matches NCCL_SOCKET_IFNAME"),
        ("BAGUA_NET_NSTREAMS", "0", "BAGUA_NET_NSTREAMS=0: expected an integer from 1 to 64"),
        ("BAGUA_NET_SCHEDULE", "fastest", "BAGUA_NET_SCHEDULE=fastest: expected dynamic or static"),
        ("BAGUA_NET_CHUNK", "100", "BAGUA_NET_CHUNK=100: expected an integer from 1024 to 1073741824"),
    ],
)
def test_bad_settings_fail_init_with_the_reason(builds, variable, value, message):
    harness, plugin = builds["release"]
    env = dict(os.environ, NCCL_SOCKET_IFNAME="lo") | {variable: value}
    done = subprocess.run([str(harness), "symbols", str(plugin)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "init failed" in done.stderr and message in done.stderr, done.stderr


def test_contract(builds):
    run_harness(builds["release"], "contract")


def test_message_larger_than_its_receive_is_an_error(builds):
    run_harness(builds["release"], "truncation")


@pytest.mark.parametrize("nstreams", [1, 2, 4, 8])
def test_fuzz_dynamic(builds, nstreams):
    out = run_harness(builds["release"], "fuzz", str(nstreams), "40", "26", BAGUA_NET_NSTREAMS=str(nstreams))
    assert "fuzz: 40 messages" in out


def test_fuzz_static_split_and_small_chunks(builds):
    run_harness(builds["release"], "fuzz", "11", "40", "24", BAGUA_NET_NSTREAMS="3", BAGUA_NET_SCHEDULE="static")
    run_harness(builds["release"], "fuzz", "12", "40", "20", BAGUA_NET_NSTREAMS="5", BAGUA_NET_CHUNK="4093")


@pytest.mark.parametrize("how", ["sender-killed", "receiver-killed"])
def test_killed_peer_fails_the_request(builds, how):
    # The deadline is 30 s; a killed peer must be noticed from its closed sockets, long before.
    out = run_harness(builds["release"], "peer-lost", how, "5", BAGUA_NET_TIMEOUT="30")
    assert "test failed" in out


def test_stopped_peer_fails_at_the_deadline(builds):
    out = run_harness(builds["release"], "peer-lost", "receiver-stopped", "6", BAGUA_NET_TIMEOUT="2")
    seconds = float(out.split("test failed ")[1].split(" s")[0])
    assert 1.5 <= seconds <= 6, out


def test_two_threads_on_separate_comms(builds):
    run_harness(builds["release"], "threads")


@pytest.mark.parametrize("sanitizer", list(SANITIZERS))
def test_sanitized(builds, sanitizer):
    build = builds[sanitizer]
    run_harness(build, "contract", timeout=300)
    run_harness(build, "truncation", timeout=300)
    run_harness(build, "threads", timeout=300)
    run_harness(build, "fuzz", "5", "12", "22", timeout=300, BAGUA_NET_NSTREAMS="3")
    run_harness(build, "peer-lost", "sender-killed", "5", timeout=300)


def test_build_info_reports_the_plugin():
    import bagua_jax

    path = bagua_jax.build_info()["bagua_net_plugin"]
    assert path is not None and os.path.isabs(path) and path.endswith("libnccl-net-bagua.so")
    assert path == bagua_net_plugin_path()


@pytest.mark.parametrize("mode", [[], ["--max-restarts", "0"]], ids=["local", "elastic"])
def test_launcher_flag_points_every_rank_at_the_plugin(tmp_path, mode):
    """``--enable-bagua-net`` reaches every rank, whether the launcher or torch's elastic agent starts them."""
    if mode:
        pytest.importorskip("torch")
    script = tmp_path / "show.py"
    script.write_text(
        "import json, os\nprint(json.dumps([os.environ.get('NCCL_NET_PLUGIN'), os.environ.get('NCCL_NET')]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("NCCL_NET", None)
    env.pop("NCCL_NET_PLUGIN", None)
    for flags, expected in (([], [None, None]), (["--enable-bagua-net"], [bagua_net_plugin_path(), "Bagua"])):
        done = subprocess.run(
            [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", *mode, *flags, str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        lines = sorted(line for line in done.stdout.splitlines() if line.startswith("[rank "))
        assert [line.split("] ", 1)[0] for line in lines] == ["[rank 0", "[rank 1"]
        assert all(json.loads(line.split("] ", 1)[1]) == expected for line in lines), done.stdout
