"""A pytest plugin (tests/conftest.py loads it) that logs each test's start and end to the file
`MOE_JAX_TEST_LOG` names, when it is set: a run stopped by a time limit prints no summary, and
the log still says which tests were running and which took longest (`python3
scripts/test_log.py FILE` reads it; `bash scripts/gpu_check.sh suite` does both).

One tab-separated line per event: wall clock in seconds, xdist worker ("main" without xdist),
"start", "end" or "stop" (an exception such as KeyboardInterrupt left pytest's run of the test:
the run was interrupted while the test ran), seconds the test took ("-" at its start), node id.
"""

from __future__ import annotations

import os
import time

import pytest

LOG_PATH = os.environ.get("MOE_JAX_TEST_LOG")


def _worker(config: pytest.Config) -> str:
    """The xdist worker running this process's tests ("gw0", ...), or "main" without xdist.

    Read from pytest's own config, not from PYTEST_XDIST_WORKER: that variable is inherited by
    a pytest a test starts in a subprocess, which runs its tests in its own (main) process."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else "main"


def _log(event: str, worker: str, seconds: str, nodeid: str) -> None:
    # one short write per line in append mode: lines of several xdist workers do not interleave
    with open(LOG_PATH, "a", encoding="utf-8") as log:
        log.write(f"{time.time():.3f}\t{worker}\t{event}\t{seconds}\t{nodeid}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # runs where the test runs (an xdist worker, or the only process), once per test
    if not LOG_PATH:
        yield
        return
    worker = _worker(item.config)
    _log("start", worker, "-", item.nodeid)
    start = time.perf_counter()
    outcome = yield
    event = "end" if outcome.excinfo is None else "stop"
    _log(event, worker, f"{time.perf_counter() - start:.2f}", item.nodeid)
