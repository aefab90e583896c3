#!/usr/bin/env bash
# Set up .venv with the test extra (first run only), lint, and run the CPU test suite: pytest [args],
# on a pytest-xdist worker per core (scripts/_pytest_workers.sh; MOE_JAX_TEST_WORKERS=1: one process).
MOE_JAX_EXTRAS="[test]" MOE_JAX_NEEDS_TORCH=1 source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
source scripts/_pytest_workers.sh
ruff check moe_jax kernels interop tests benchmarks
python -m pytest ${pytest_workers[@]+"${pytest_workers[@]}"} "$@"
