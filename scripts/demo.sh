#!/usr/bin/env bash
# Set up .venv (first run only) and run the main job: python -m moe_jax demo [args].
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
python -m moe_jax demo "$@"
