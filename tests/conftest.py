import atexit
import os
import secrets
import shutil
import tempfile
import zlib

import numpy as np
import pytest

# Four simulated CPU devices for the shard_map tests; must be set before jax loads.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


def _fault_tolerance_secret() -> str:
    """The members of the tests' fault-tolerant jobs prove this secret to each other's stores (a file of mode 0600,
    as bagua-launch --fault-tolerant makes one); their processes inherit the variable."""
    directory = tempfile.mkdtemp(prefix="bagua-test-secret-")
    atexit.register(shutil.rmtree, directory, True)
    path = os.path.join(directory, "secret")
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(secrets.token_hex(32))
    return path


if not os.environ.get("BAGUA_FT_SECRET_FILE"):
    os.environ["BAGUA_FT_SECRET_FILE"] = _fault_tolerance_secret()

SEED = int(os.environ.get("BAGUA_TEST_SEED", secrets.randbits(32)))


SEED_FIXTURES = ("rng", "seed")
"""The fixtures through which a test's data depends on SEED; conftest marks the tests that use one ``seeded``."""


def pytest_report_header(config):
    return f"random data seed: BAGUA_TEST_SEED={SEED}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "seeded: its data depends on BAGUA_TEST_SEED (marked by conftest); run these under many seeds"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        # A test's own parameter of the same name (a fixed range of seeds) is not the run's seed.
        parameters = item.callspec.params if hasattr(item, "callspec") else {}
        if any(name in item.fixturenames and name not in parameters for name in SEED_FIXTURES):
            item.add_marker(pytest.mark.seeded)


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
