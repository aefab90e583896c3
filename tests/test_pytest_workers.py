"""`scripts/_pytest_workers.sh`: the pytest-xdist arguments the CPU suite's scripts pass."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "_pytest_workers.sh"


def _source(**env: str) -> subprocess.CompletedProcess:
    """bash sourcing the script, then printing `pytest_workers` a word a line, under this
    interpreter (`python` on PATH), without the settings that would change its count (`nproc`
    honours OpenMP's)."""
    unset = ("MOE_JAX_TEST_WORKERS", "OMP_NUM_THREADS", "OMP_THREAD_LIMIT")
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    environ["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{environ['PATH']}"
    environ.update(env)
    printed = 'printf "%s\\n" ${pytest_workers[@]+"${pytest_workers[@]}"}'
    script = f'source "{SCRIPT}" || exit; {printed}'
    return subprocess.run(["bash", "-c", script], env=environ, capture_output=True, text=True)


def _workers(**env: str) -> list[str]:
    """The `pytest_workers` array the script sets."""
    result = _source(**env)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_named_count_and_one_process():
    pytest.importorskip("xdist")
    assert _workers(MOE_JAX_TEST_WORKERS="3") == ["-n", "3"]
    assert _workers(MOE_JAX_TEST_WORKERS="1") == []


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_refuses_a_count_that_is_not_a_positive_whole_number(value):
    pytest.importorskip("xdist")
    result = _source(MOE_JAX_TEST_WORKERS=value)
    assert result.returncode != 0 and result.stdout == ""
    assert f"MOE_JAX_TEST_WORKERS={value}: give a whole number of workers" in result.stderr


def _expected_workers() -> int:
    cores = len(os.sched_getaffinity(0))
    with open("/proc/meminfo") as meminfo:
        available_kib = next(int(line.split()[1]) for line in meminfo if "MemAvailable" in line)
    return max(1, min(cores, available_kib // 1048576 // 6))


@pytest.mark.skipif(not pathlib.Path("/proc/meminfo").exists(), reason="reads /proc/meminfo")
def test_default_is_a_worker_per_core_within_the_memory():
    pytest.importorskip("xdist")
    before = _expected_workers()
    got = _workers()
    after = _expected_workers()  # the memory available moves while the suite runs
    count = int(got[1]) if got else 1
    assert got == ([] if count == 1 else ["-n", str(count)])
    assert min(before, after) <= count <= max(before, after)
