#!/usr/bin/env bash
# Set up .venv (first run only) and run the main job: python -m moe_jax demo [args].
# The environment has the [flax] extra (MOE_JAX_EXTRAS overrides it), so the README's Flax example
# runs in it too: source .venv/bin/activate.
MOE_JAX_EXTRAS="${MOE_JAX_EXTRAS-[flax]}" source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
python -m moe_jax demo "$@"
