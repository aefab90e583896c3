#!/usr/bin/env bash
# The CPU test suite under the GPU host's Python and JAX (3.12, jax 0.11.2; MOE_JAX_HOST_JAX picks
# another JAX release), in .venv-host-jax without torch (its tests skip; pip would fetch a CUDA
# build of several GB): catches what only newer JAX breaks on a machine without a GPU, before
# a GPU session finds it. Arguments go to pytest (its workers as scripts/test.sh's). Python 3.12
# is $PYTHON312, else python3.12 on PATH, else pyenv's; with none, it fails, or with
# MOE_JAX_SKIP_WITHOUT_PY312=1 says so and stops.
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
python -m pytest ${pytest_workers[@]+"${pytest_workers[@]}"} "$@"
