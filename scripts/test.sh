#!/usr/bin/env bash
# Set up .venv with the test extra (first run only), lint, and run the CPU test suite: pytest [args].
MOE_JAX_EXTRAS="[test]" MOE_JAX_NEEDS_TORCH=1 source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ruff check moe_jax kernels interop tests
python -m pytest "$@"
