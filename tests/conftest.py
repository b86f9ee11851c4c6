"""Session-wide test setup.

JAX must see 8 host devices for the sharding tests; the flag only works if it is set before JAX
initialises a backend, so it is set here, before any test module imports jax.

Reproducible randomness: the ``rng`` fixture is a NumPy generator seeded from the test's id (the same
seed on every run), or from ``$CUDNN_ATTN_TEST_SEED`` to explore other draws.  Every failing test
prints a one-line reproduction - ``CUDNN_ATTN_TEST_SEED=<seed> python -m pytest <test id>`` - in its
report and again in the summary at the end of the run.  Tests that draw from their own fixed seeds
(``np.random.default_rng(7)``) reproduce from the test id alone.
"""

import os
import shlex
import zlib

import numpy as np
import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

SEED_ENV = "CUDNN_ATTN_TEST_SEED"
_reproductions: list[str] = []


def test_seed(nodeid: str) -> int:
    """The seed of a test: ``$CUDNN_ATTN_TEST_SEED`` when set, else a hash of the test id."""
    override = os.environ.get(SEED_ENV)
    return int(override) if override else zlib.crc32(nodeid.encode())


test_seed.__test__ = False          # a helper, not a test


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A NumPy generator seeded for this test (module doc); a failure prints the seed."""
    seed = test_seed(request.node.nodeid)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def reproduction(item: pytest.Item) -> str:
    seed = dict(item.user_properties).get("seed")
    prefix = f"{SEED_ENV}={seed} " if seed is not None else ""
    return f"{prefix}python -m pytest {shlex.quote(item.nodeid)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        line = reproduction(item)
        report.sections.append(("reproduce", line))
        _reproductions.append(line)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _reproductions:
        terminalreporter.section("reproduce the failures")
        for line in _reproductions:
            terminalreporter.write_line(line)
