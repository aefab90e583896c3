# Sourced by the scripts beside it: creates (once) and activates the project's virtualenv in
# MOE_JAX_VENV (default .venv, made with $PYTHON or python3), then installs the project with the
# extras given in MOE_JAX_EXTRAS; MOE_JAX_PIP_CONSTRAINTS names a pip constraints file, if any.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${MOE_JAX_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip
if [ -n "${MOE_JAX_NEEDS_TORCH:-}" ] && ! python -c "import torch" 2>/dev/null; then
  # A CPU build of torch where one is on hand (this project's CI machines keep torch 2.13.0);
  # elsewhere whatever pip resolves.
  python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
fi
python -m pip install -q ${MOE_JAX_PIP_CONSTRAINTS:+-c "$MOE_JAX_PIP_CONSTRAINTS"} \
  -e ".${MOE_JAX_EXTRAS:-}"
