#!/usr/bin/env bash
# On the GPU host, after `source .gpu/install.sh` (see ../shared/device/stage):
#   bash scripts/gpu_check.sh suite      the whole test suite, every marker (pytest-xdist, 8 workers)
#   bash scripts/gpu_check.sh sanitize   compute-sanitizer memcheck and racecheck on the Pallas kernels
#   bash scripts/gpu_check.sh train      training-step bench and per-stage backward times, shapes B and A
# Logs go to $OUT (the device tool's result folder) or /tmp/gpu_check.
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "${1:-}" in
  suite)
    python3 -m pytest -q -n 8 -p xdist --durations=15 2>&1 | tee "$out/pytest.log"
    ;;
  sanitize)
    status=0
    for tool in memcheck racecheck; do
      compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
        python3 scripts/sanitize_kernels.py 2>&1 | tee "$out/$tool.log" | tail -25
      rc=${PIPESTATUS[0]}
      echo "$tool exit status: $rc" | tee -a "$out/$tool.log"
      [ "$rc" -eq 0 ] || status=$rc
    done
    exit "$status"
    ;;
  train)
    status=0
    for shape in B A; do
      python3 -m moe_jax.cli.train_bench --shape "$shape" --iters 10 \
        --variants auto deep_gemm torch fp8_recipe torch_titan --json "$out/train_$shape.json" \
        2>&1 | tee "$out/train_$shape.log" || status=1
      for experts in auto fp8_recipe; do
        python3 -m moe_jax.cli.train_stages --shape "$shape" --experts "$experts" --iters 10 \
          --json "$out/stages_${shape}_$experts.json" 2>&1 | tee -a "$out/train_$shape.log" \
          || status=1
      done
    done
    exit "$status"
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh suite|sanitize|train" >&2
    exit 2
    ;;
esac
