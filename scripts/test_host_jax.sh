#!/usr/bin/env bash
# The CPU test suite under the GPU host's Python and JAX (3.12, jax 0.11.2; MOE_JAX_HOST_JAX picks
# another JAX release), in .venv-host-jax without torch (its tests skip; pip would fetch a CUDA
# build of several GB): catches what only newer JAX breaks on a machine without a GPU, before
# a GPU session finds it. Arguments go to pytest (its workers as scripts/test.sh's). Python 3.12
# is $PYTHON312, else python3.12 on PATH, else pyenv's; with none, it fails, or with
# MOE_JAX_SKIP_WITHOUT_PY312=1 says so and stops.
#
# It leaves out the modules that test the repository's documents and tooling, not the library
# under a JAX release (MOE_JAX_HOST_JAX_ALL=1 runs them too): every failure that only newer JAX
# gave (git log: Pallas Triton lowering for sm_90 without a GPU, e398131; the CLI's import of
# the lowering helper, 10568df; a custom_vjp's non-hashable statics, dcebc23) was in the
# kernels, the layer or the CLI, which still run here (as the gathered GEMM1's lowering test,
# which needs jax >= 0.11 and so runs only here, d4b881c).
# The notebooks and README run the same public calls the suite tests (scripts/test.sh runs them
# under the pinned JAX); the others test shell scripts and pytest plumbing. And a Mosaic kernel's
# interpreted config grid runs each config once (tests/host_jax_subset.py says why).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 \
    "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" \
      2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if ! python312="$(find_python312)"; then
  message="no Python 3.12 found (set PYTHON312 to one): the suite under the host's JAX did not run"
  if [ -n "${MOE_JAX_SKIP_WITHOUT_PY312:-}" ]; then
    echo "SKIPPED: $message"
    exit 0
  fi
  echo "error: $message" >&2
  exit 1
fi

jax_version="${MOE_JAX_HOST_JAX:-0.11.2}"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
printf 'jax==%s\njaxlib==%s\n' "$jax_version" "$jax_version" > "$constraints"

PYTHON="$python312" MOE_JAX_VENV=.venv-host-jax MOE_JAX_EXTRAS="[test-no-torch]" \
  MOE_JAX_PIP_CONSTRAINTS="$constraints" source scripts/_venv.sh
python -c "import jax, sys; print(f'Python {sys.version.split()[0]}, jax {jax.__version__}')"
source scripts/_pytest_workers.sh
not_jax_release=()
if [ -z "${MOE_JAX_HOST_JAX_ALL:-}" ]; then
  for module in test_notebooks test_readme test_newcomer test_bench_ratio test_gpu_check \
    test_test_log test_pytest_workers; do
    not_jax_release+=("--ignore=tests/$module.py")
  done
  not_jax_release+=(-p host_jax_subset)
  export PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"  # where the plugin is
fi
python -m pytest ${pytest_workers[@]+"${pytest_workers[@]}"} \
  ${not_jax_release[@]+"${not_jax_release[@]}"} "$@"
