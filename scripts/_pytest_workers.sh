# Sourced by test.sh and test_host_jax.sh after _venv.sh: sets `pytest_workers` to pytest-xdist's
# arguments for the CPU suite, a worker per CPU core and at most one per 6 GiB of available
# memory (a worker reached 5 GB on a 2-core, 24 GB machine, 2026-12-07), none where pytest-xdist
# is missing. MOE_JAX_TEST_WORKERS=N sets the count; 1 runs the suite in one process.
pytest_workers=()
if python -c "import xdist" 2>/dev/null; then
  workers="${MOE_JAX_TEST_WORKERS:-}"
  if [ -z "$workers" ]; then
    cores="$(nproc 2>/dev/null || echo 1)"
    memory_gib="$(awk '/^MemAvailable:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null)"
    by_memory=$(( ${memory_gib:-6} / 6 ))
    workers=$(( cores < by_memory ? cores : by_memory ))
  fi
  if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: MOE_JAX_TEST_WORKERS=$workers: give a whole number of workers, 1 or more" >&2
    return 1
  fi
  if [ "$workers" -gt 1 ]; then
    pytest_workers=(-n "$workers")
  fi
fi
