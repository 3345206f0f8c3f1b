"""benchmarks/harness: the load gate's count of foreign threads (a /proc written out here, and this process's own
busy child), its verdicts and retries, the phase protocol with a retried phase, the medians with [min, max], the
command recorded relative to the repository, a whole study without a network, checked against NumPy, a chaos
report written without matplotlib, a rank's cut of its own link, and the names of the ranks' addresses in their
namespaces."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import load, phases, repeats, results, study  # noqa: E402
from harness.results import RESULTS  # noqa: E402


def _task(proc: Path, pid: int, tid: int, name: str, state: str, ppid: int) -> None:
    folder = proc / str(pid) / "task" / str(tid)
    folder.mkdir(parents=True)
    (folder / "stat").write_text(f"{tid} ({name}) {state} {ppid} {pid} {pid} 0 -1 4194560 0 0 0\n")


def fake_proc(tmp_path: Path, foreign_running: int) -> Path:
    """A /proc: the study (pid 100) with a rank (101, two threads running) and the rank's launcher child (102,
    running); a kernel thread (3, running); another user's process (200) with ``foreign_running`` of its threads
    running; a sleeping stranger (300)."""
    proc = tmp_path / "proc"
    _task(proc, 100, 100, "python", "S", 1)
    _task(proc, 101, 101, "python", "R", 100)
    _task(proc, 101, 105, "python", "R", 100)
    _task(proc, 102, 102, "ip netns (x)", "R", 101)
    _task(proc, 3, 3, "ksoftirqd/0", "R", 2)
    _task(proc, 300, 300, "sleepy", "S", 1)
    for i in range(max(foreign_running, 1)):
        _task(proc, 200, 200 + i, "cc1plus", "R" if i < foreign_running else "S", 1)
    (proc / "loadavg").write_text("0.00 0.00 0.00 1/10 1\n")
    return proc


def test_census_counts_the_tree_as_own_and_the_rest_as_foreign(tmp_path):
    proc = fake_proc(tmp_path, foreign_running=3)
    seen = load.census(100, proc)
    assert (seen.own, seen.foreign) == (3, 3)
    assert seen.foreign_names == ["cc1plus"] * 3  # the kernel thread and the sleeper are not counted
    assert load.census(300, proc).own == 0


def test_census_sees_this_process_busy_child_as_own():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = load.census(os.getpid())
            if seen.own >= 2:  # this thread, reading, and the child
                break
            time.sleep(0.05)
        assert seen.own >= 2
    finally:
        child.kill()
        child.wait()


class _Sampler(load.ThreadSampler):
    """A sampler whose looks are taken by the test, over a /proc it rewrites."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(interval=0.5, root=100, proc=tmp_path / "proc")
        self.tmp_path = tmp_path

    def set_foreign(self, count: int) -> None:
        import shutil

        shutil.rmtree(self.proc, ignore_errors=True)
        fake_proc(self.tmp_path, count)


def test_gate_sets_aside_a_loaded_phase_and_runs_it_again(tmp_path):
    sampler = _Sampler(tmp_path)
    sampler.foreign_average = 0.0
    said: list[str] = []
    gate = load.LoadGate(limit=1.5, attempts=3, sampler=sampler, say=said.append)
    foreign_per_attempt = iter([4, 2, 0])

    def phase() -> str:
        sampler.set_foreign(next(foreign_per_attempt))
        for _ in range(3):
            sampler.sample()
        return "timed"

    sampler.set_foreign(0)
    result, kept, aside = gate.measure(phase, "x")
    assert result == "timed" and kept.published and kept.foreign_mean == 0
    assert [a.foreign_mean for a in aside] == [4, 2] and not any(a.published for a in aside)
    assert aside[0].foreign_top == [("cc1plus", 12)] and aside[0].foreign_max == 4
    assert len(said) == 2
    # the looks of the loaded attempts raised the running average: it decays with the kernel's 1-minute constant
    decay = np.exp(-0.5 / 60)
    expected = 0.0
    for count in [4] * 3 + [2] * 3 + [0] * 3:
        expected = decay * expected + (1 - decay) * count
    assert sampler.foreign_average == pytest.approx(expected)


def test_gate_keeps_the_last_attempt_when_the_load_never_drops(tmp_path):
    sampler = _Sampler(tmp_path)
    sampler.foreign_average = 0.0
    sampler.set_foreign(2)
    gate = load.LoadGate(limit=1.5, attempts=2, sampler=sampler, say=lambda _: None)
    _, kept, aside = gate.measure(lambda: sampler.sample(), "x")
    assert not kept.published and len(aside) == 1 and kept.foreign_mean == 2


class _OneRank:
    ranks, rate = 1, None

    def reshape(self, link):
        self.rate = link


def test_phases_are_given_in_turn_and_a_loaded_one_again(tmp_path):
    """Two one-rank jobs: training untimed, then two timed phases each; job 0's first timed phase meets load once."""
    sampler = _Sampler(tmp_path)
    sampler.foreign_average = 0.0
    sampler.set_foreign(0)
    gate = load.LoadGate(limit=1.5, attempts=3, sampler=sampler, say=lambda _: None)
    folders = [tmp_path / "a", tmp_path / "b"]
    jobs = []
    for folder in folders:
        folder.mkdir()
        jobs.append(phases.PhasedJob(folder, ["none", "none", "none"], [False, True, True]))
    runner = phases.PhaseRunner(_OneRank(), jobs, gate)
    assert not runner.completed(0)
    ran: list[tuple[int, int]] = []
    recorded: list[list[dict]] = [[], []]
    loaded = {(0, 1)}

    def rank(job: int) -> None:
        for seq, phase in phases.phases(folders[job], 0, timeout=30):
            ran.append((job, phase))
            sampler.set_foreign(3 if (job, phase) in loaded else 0)
            loaded.discard((job, phase))
            sampler.sample()
            recorded[job].append({"seq": seq, "figure": 10 * job + phase})
            sampler.set_foreign(0)

    ranks = [threading.Thread(target=rank, args=(j,)) for j in range(2)]
    for thread in ranks:
        thread.start()
    runner.start()
    for thread in ranks:
        thread.join(30)
    runner.join(30)
    assert ran == [(0, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 2), (0, 2)]
    assert runner.completed(0) and runner.completed(1)
    kept = phases.kept(recorded[0], runner.records, 0)
    assert [k["phase"] for k in kept] == [0, 1, 2] and [k["attempt"] for k in kept] == [0, 1, 0]
    assert kept[0]["load"] is None and kept[1]["load"]["published"] and len(kept[1]["set_aside"]) == 1
    assert [k["seq"] for k in kept] == [0, 2, 3]
    runner.records.pop()  # job 0's last phase not recorded: as if the group was aborted before it
    assert not runner.completed(0) and runner.completed(1)


def test_spread_and_paired_ratios(rng):
    values = rng.uniform(1, 9, 7)
    got = repeats.spread(values)
    assert (got.median, got.low, got.high) == (np.median(values), values.min(), values.max())
    assert got.scaled(1e3).format(".1f", " ms") == (
        f"{1e3 * np.median(values):.1f} ms [{1e3 * values.min():.1f}, {1e3 * values.max():.1f}]"
    )
    other = rng.uniform(1, 9, 7)
    assert repeats.paired_ratios(values, other).median == pytest.approx(np.median(values / other))
    assert repeats.rotated("abc", 4) == list("bca") and repeats.alternated("ab", 1) == ["b", "a"]
    with pytest.raises(ValueError):
        repeats.spread([])


def test_command_is_relative_to_the_repository(tmp_path):
    script = ROOT / "benchmarks" / "network_study.py"
    got = results.command([f"--out={ROOT}/x", str(ROOT / "benchmarks" / "results"), str(tmp_path)], str(script))
    assert got == f"python benchmarks/network_study.py --out={ROOT}/x benchmarks/results {tmp_path}"
    assert str(ROOT) not in results.command(["--out", str(ROOT / "benchmarks")], str(script))


def test_a_study_without_a_network_reports_medians_of_published_repeats(tmp_path, rng):
    times = {name: iter(rng.uniform(0.01, 0.1, 4).tolist()) for name in ("a", "b")}
    drawn: dict[str, list[float]] = {"a": [], "b": []}
    order: list[str] = []

    def measure(trial: study.Trial) -> dict:
        order.append(trial.variant.name)
        drawn[trial.variant.name].append(next(times[trial.variant.name]))
        return {"step_s": drawn[trial.variant.name][-1], "width": trial.variant["width"]}

    declared = study.Study(
        name="toy",
        title="A toy study",
        variants=[study.Variant("a", {"width": 1}), study.Variant("b", {"width": 2})],
        measure=measure,
        network=False,
        plot=False,
        packages=("numpy",),
        report=lambda data: [*study.table_lines(declared, data), f"rows: {len(data['rows'])}"],
    )
    argv = ["--repeats", "4", "--max-load", "1000", "--out", str(tmp_path)]
    assert study.main(declared, argv) == 0
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    with pytest.raises(SystemExit, match="no variant matches"):
        study.main(declared, [*argv, "--only", "c"])
    data = json.loads((tmp_path / "toy.json").read_text())
    assert data["meta"]["command"].endswith(f"--repeats 4 --max-load 1000 --out {tmp_path}")
    assert all(row["load"]["published"] and row["load"]["samples"] >= 1 for row in data["rows"])
    md = (tmp_path / "toy.md").read_text()
    for name in ("a", "b"):
        ms = 1e3 * np.array(drawn[name])
        assert f"| {name} | {np.median(ms):.4g} [{ms.min():.4g}, {ms.max():.4g}] |" in md
    assert "rows: 8" in md and "8 published, 0 set aside" in md


def test_a_chaos_report_links_its_chart_only_where_one_was_drawn(tmp_path, monkeypatch):
    # A published run's report, written again from its results: without matplotlib no chart is drawn, and the
    # report must not link to one (it did: every chaos report written without a chart showed a broken image).
    import fault_tolerance
    from harness import plots

    name = "fault-tolerance-torch-chaos-low_precision_decentralized"
    saved = RESULTS / "fault-tolerance-torch-join-low_precision_decentralized-new-1.json"
    (tmp_path / f"{name}.json").write_text(saved.read_text())
    monkeypatch.setattr(plots, "figure", lambda *args, **kwargs: None)
    fault_tolerance.report(
        fault_tolerance.build_parser().parse_args(
            ["report", "chaos-low_precision_decentralized", "--out", str(tmp_path)]
        )
    )
    report = (tmp_path / f"{name}.md").read_text()
    assert "| 120 | 0.473 | 3 | 2.7771 | 2.7363 | +0.0408 |" in report  # the report itself is written
    assert not (tmp_path / f"{name}.png").exists() and ".png" not in report


@pytest.mark.parametrize(
    ("attempts", "resumed"),
    [
        ([(9.0, 6), (10.2, 6), (10.5, 7)], 10.2),  # in the victim's step at the kill: that step again
        ([(9.0, 6), (10.05, 7), (10.3, 7)], 10.3),  # voting one ahead: a step started before the death is seen
        ([(9.0, 6), (10.1, 7), (10.6, 8)], 10.1),  # one behind, the step taken by itself: the next step
    ],
    ids=["retried", "one-ahead", "caught-up"],
)
def test_the_kill_study_times_a_survivors_resumption_from_its_retry(attempts, resumed):
    # A survivor's attempts (start time, step) around a kill at t = 10. The study took the last attempt at the
    # victim's step, which under asynchronous averaging (one ahead) was the survivors' step before the kill: -0.2 s.
    import fault_tolerance

    log = [{"event": "attempt", "time": started, "step": step} for started, step in attempts]
    assert fault_tolerance.resumed_at(log, 10.0) == resumed


@pytest.mark.parametrize(
    ("namespace", "cut"), [("", False), ("bagua-br", False), ("other-r1", False), ("bagua-r1", True)]
)
def test_a_rank_cuts_only_its_own_namespaces_link(monkeypatch, namespace, cut):
    # The partition tests' ranks take eth0 down as root: run anywhere but in a rank's namespace, that would be the
    # machine's own link. The commands are recorded here, never run.
    from harness import links

    commands = []

    def run(argv, check=True, timeout=30):
        commands.append(list(argv))
        return subprocess.CompletedProcess(
            argv, 0, stdout=namespace + "\n" if argv[:3] == ["ip", "netns", "identify"] else ""
        )

    monkeypatch.setattr(links, "_run", run)
    monkeypatch.setattr(links, "PREFIX", "bagua-")
    if cut:
        links.cut_own_link()
    else:
        with pytest.raises(links.HarnessError, match="not in a rank's namespace"):
            links.cut_own_link()
    assert (["ip", "link", "set", "eth0", "down"] in commands) == cut, commands


def test_every_ranks_address_has_a_name_inside_each_namespace_ipv4_mapped_too(network):
    # torch's TCPStore looks up the name of each client it accepts on its dual-stack socket (::ffff:10.88.0.2);
    # without a name in the namespace's hosts file the lookup went to DNS, and c10d warned about every client.
    addresses = [network.addr(rank) for rank in range(network.ranks)]
    lookups = "; ".join(
        f"print(socket.getnameinfo({address!r}, 0)[0])"
        for a in addresses
        for address in ((a, 0), (f"::ffff:{a}", 0, 0, 0))
    )
    for rank in range(network.ranks):
        named = subprocess.run(
            ["ip", "netns", "exec", network.ns(rank), sys.executable, "-c", f"import socket; {lookups}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert named.returncode == 0, named.stderr
        expected = [network.ns(r) for r in range(network.ranks) for _ in range(2)]
        expected[2 * rank] = socket.gethostname()  # its own address, the machine's name for it
        assert named.stdout.split() == expected
