import contextlib
import os
import secrets
import sys
import zlib

import numpy as np
import pytest
from background_jobs import BackgroundJob
from extended import is_extended
from multiprocess import BENCHMARKS

from bagua_common.fault_tolerance import KVServer, job_secret
from bagua_common.fault_tolerance.settings import ENV_DIRECTORY, temporary_job_secret

sys.path.insert(0, str(BENCHMARKS))
from harness import links  # noqa: E402  (the network harness: the partition tests' links)

# Four simulated CPU devices for the shard_map tests; must be set before jax loads.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


# The members of the tests' fault-tolerant jobs prove the job's secret to each other's stores, as under bagua-launch
# --fault-tolerant; their processes inherit the variable, set from pytest_configure to pytest_unconfigure.
_job_secret = contextlib.ExitStack()

SEED = int(os.environ.get("BAGUA_TEST_SEED", secrets.randbits(32)))

# Bagua's own tests, run by test_bagua_upstream_torch.py in processes of their own (tests/bagua_upstream/README.md).
collect_ignore = ["bagua_upstream"]


SEED_FIXTURES = ("rng", "seed")
"""The fixtures through which a test's data depends on SEED; conftest marks the tests that use one ``seeded``."""


def pytest_report_header(config):
    return f"random data seed: BAGUA_TEST_SEED={SEED}"


def pytest_configure(config):
    _job_secret.enter_context(temporary_job_secret())
    config.addinivalue_line(
        "markers", "seeded: its data depends on BAGUA_TEST_SEED (marked by conftest); run these under many seeds"
    )
    config.addinivalue_line(
        "markers", "background_job(name): reads the job of background_jobs.JOBS named so, started at collection"
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_itemcollected(item):
    if is_extended(item.nodeid):
        item.add_marker(pytest.mark.extended)


@pytest.hookimpl(trylast=True)  # after -k and -m deselected what will not run
def pytest_collection_modifyitems(config, items):
    for item in items:
        # A test's own parameter of the same name (a fixed range of seeds) is not the run's seed.
        parameters = item.callspec.params if hasattr(item, "callspec") else {}
        if any(name in item.fixturenames and name not in parameters for name in SEED_FIXTURES):
            item.add_marker(pytest.mark.seeded)
    # The background jobs of the selected tests start now; their tests run last (background_jobs.py).
    jobs = config.stash.setdefault(_BACKGROUND_JOBS, {})
    waiting = [item for item in items if item.get_closest_marker("background_job")]
    if config.option.collectonly:
        return
    for item in waiting:
        name = item.get_closest_marker("background_job").args[0]
        if name not in jobs:
            jobs[name] = BackgroundJob.start(name)
    items[:] = [item for item in items if item not in waiting] + waiting


_BACKGROUND_JOBS = pytest.StashKey[dict]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # `pytest -q` prints no report header: a failing seeded test names the seed that replays it.
    report = yield
    if report.failed and item.get_closest_marker("seeded"):
        report.sections.append(("random data seed", f"replay with BAGUA_TEST_SEED={SEED}"))
    return report


def pytest_unconfigure(config):
    for job in config.stash.get(_BACKGROUND_JOBS, {}).values():
        job.stop()
    _job_secret.close()


@pytest.fixture
def launcher_directory(monkeypatch):
    """A node's launcher directory (``bagua-launch --fault-tolerant`` hosts one), named in this process's
    environment, which the ranks a test starts inherit."""
    server = KVServer("127.0.0.1", secret=job_secret())
    monkeypatch.setenv(ENV_DIRECTORY, f"127.0.0.1:{server.port}")
    yield server
    server.close()


@pytest.fixture
def network():
    """Three ranks' namespaces and links (the network harness, ``benchmarks/harness/links.py``), removed afterwards;
    a test of a network partition takes one rank's link down. Skipped without root and network namespaces."""
    can = links.probe()
    if not (can.get("netns") and can.get("veth") and can.get("bridge")):
        pytest.skip(f"a network partition needs root and network namespaces: {can}")
    with links.Network(3, verbose=False) as built:
        yield built


@pytest.fixture
def background_job(request) -> BackgroundJob:
    """The background job the test is marked with (``@pytest.mark.background_job(name)``)."""
    return request.config.stash[_BACKGROUND_JOBS][request.node.get_closest_marker("background_job").args[0]]


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random data each run, reproducible with the seed in the report header."""
    # crc32, not hash(): str hashes change with every interpreter (PYTHONHASHSEED).
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture(scope="session")
def seed() -> int:
    """The run's seed itself, for data drawn in other processes or shared by several tests."""
    return SEED


def random_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Gradient-like float32 data with a random overall scale."""
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
