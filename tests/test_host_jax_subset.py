"""tests/host_jax_subset.py (scripts/test_host_jax.sh's plugin): each interpreted config of a
Mosaic kernel's grid once, the compiled cases and every other test untouched."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parent


def _collected(*args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "--co", *args],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_each_interpreted_config_runs_once_and_nothing_else_is_deselected():
    module = "tests/test_kernels_mosaic_fp8_gemm.py"
    everything = _collected(module)
    subset = _collected("-p", "host_jax_subset", module)
    grid = "test_matches_float64_loop["
    kept = [t for t in subset if grid in t and t.endswith("-interpret]")]
    configs = [t.split("-")[-2] for t in kept]
    all_configs = {t.split("-")[-2] for t in everything if grid in t and t.endswith("-interpret]")}
    assert sorted(configs) == sorted(all_configs)  # each once
    dropped = set(everything) - set(subset)
    assert dropped and all(t.endswith("-interpret]") for t in dropped)
    assert not set(subset) - set(everything)
