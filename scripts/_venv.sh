# Sourced by the scripts beside it: creates (once) and activates the project's virtualenv in
# MOE_JAX_VENV (default .venv, made with $PYTHON or python3), then installs the project with the
# extras given in MOE_JAX_EXTRAS; MOE_JAX_PIP_CONSTRAINTS names a pip constraints file, if any.
#
# torch: the extras that need it ([hf], [test], [torch]) pull PyPI's torch, on Linux the CUDA
# build with its nvidia-* wheels (several GB). On a machine without a GPU, MOE_JAX_TORCH=cpu
# installs torch's CPU build first, from PyTorch's CPU wheel index (or MOE_JAX_TORCH_INDEX_URL):
#   MOE_JAX_TORCH=cpu bash scripts/test.sh
# which is, by hand: pip install torch --index-url https://download.pytorch.org/whl/cpu
# MOE_JAX_NEEDS_TORCH=1 (test.sh) installs torch==2.13.0 where no torch is installed: the CPU
# build this project's CI machines keep on disk (elsewhere, PyPI's build of that version).
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
case "${MOE_JAX_TORCH:-}" in
  "") ;;
  cpu)
    if ! python -c "import torch" 2>/dev/null; then
      python -m pip install -q torch \
        --index-url "${MOE_JAX_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
    fi
    ;;
  *)
    echo "MOE_JAX_TORCH=$MOE_JAX_TORCH: use MOE_JAX_TORCH=cpu (torch's CPU build, installed" \
      "before the project) or leave it unset" >&2
    exit 2
    ;;
esac
if [ -n "${MOE_JAX_NEEDS_TORCH:-}" ] && ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
fi
python -m pip install -q ${MOE_JAX_PIP_CONSTRAINTS:+-c "$MOE_JAX_PIP_CONSTRAINTS"} \
  -e ".${MOE_JAX_EXTRAS:-}"
