#!/usr/bin/env bash
# On the GPU host, after `source .gpu/install.sh` (see ../shared/device/stage):
#   bash scripts/gpu_check.sh suite [pytest args]    the whole test suite, every marker (a
#       pytest-xdist worker per 12 GiB of GPU memory, at most 8, where xdist is installed, else
#       one process); args select a part. MOE_JAX_SUITE_LIMIT_S=N stops it after N s, and
#       scripts/test_log.py then says which tests were still running and which took longest
#   bash scripts/gpu_check.sh sanitize [memcheck|racecheck] [--shape b|tiny] [kernel ...]
#       compute-sanitizer on the Pallas kernels (both tools by default, shape B by default;
#       `python3 -m benchmarks.sanitize_kernels --list`)
#   bash scripts/gpu_check.sh train      training-step bench and per-stage backward times, shapes B and A
#   bash scripts/gpu_check.sh decode     the Mosaic FP8 GEMM's compiled tests, its config sweep at
#       T=1024-6144 and the decode layer from T=512 to 8192 with "auto" beside the three FP8
#       grouped GEMMs (the evidence behind the GEMM heuristics and "auto"'s crossovers)
#   bash scripts/gpu_check.sh prefill    the prefill layer and where its time goes: `bench` at
#       shapes B and A (the FP8 layer, "auto" and never fused, and its fused-GEMM1 variants, the
#       gathered one too), then benchmarks/: `kernel_gaps` for both experts at B and A and for the
#       gathered GEMM1 at B (to the log; 5 files to $OUT: the device tool brings back at most 8)
#   bash scripts/gpu_check.sh peers      moe_jax against what a user would pick instead: the
#       tokamax rows (the `peers` extra; the kit installs it) of `bench` (A, B), `bench --train`
#       and `bench --decode` with moe_jax on the same bf16 weights, then `bench --model` (a whole
#       Qwen3-MoE against jax.lax.ragged_dot experts and transformers in torch)
#   bash scripts/gpu_check.sh baseline [bench args]   today's code against an earlier commit's
#       (`bash scripts/baseline_tree.sh COMMIT` here first, then carry .baseline): `bench` (by
#       default --shapes B A --variants moe_jax_fp8 --iters 20) from each in turn,
#       MOE_JAX_BASELINE_ROUNDS times (2), then benchmarks/bench_ratio.py's table of current /
#       baseline: a ratio that carries to issues whose figures came from another card
#   bash scripts/gpu_check.sh ep         issue 64 on a host of 2-8 GPUs: scripts/ep_multigpu.py
#       (all parts: DeepEP HT and LL, JAX-native transports, gradients; PASS/MISS per target) on
#       every GPU, again on 2 where there are more and time is left, then `pytest -m multigpu`,
#       within MOE_JAX_EP_LIMIT_S seconds (540; a quarter, at least 120, kept for pytest); one
#       log, $OUT/ep.log, written as it goes. Fewer than 2 GPUs: says so, exit 3, nothing run
# MOE_JAX_REQUIRE_GPU=NAME (any mode): run only on a GPU whose name holds NAME (e.g. H200, the
#   card issue 14's targets are set on); on any other, or with no GPU, say which GPU it is and
#   exit 3 before anything runs. The device tool lends H100s to most calls that ask for an H200
#   (BENCHMARKS.md, 2026-12-07): a call that finds one then costs only the machine's start.
# Logs go to $OUT (the device tool's result folder) or /tmp/gpu_check. Commands run at the
# repository root (benchmarks/ runs as `python3 -m benchmarks.NAME` from there).
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONUNBUFFERED=1
# Several JAX processes (xdist workers, torch beside JAX) share the GPU: allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
mode="${1:-}"
shift || true
if [ -n "${MOE_JAX_REQUIRE_GPU:-}" ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$gpu" in
    *"$MOE_JAX_REQUIRE_GPU"*) ;;
    *)
      echo "MOE_JAX_REQUIRE_GPU=$MOE_JAX_REQUIRE_GPU but this GPU is '${gpu:-none found}':" \
        "nothing run" | tee "$out/require_gpu.log"
      exit 3
      ;;
  esac
fi
# `bench`'s arguments where the baseline mode is given none
default_bench_args=(--shapes B A --variants moe_jax_fp8 --iters 20)
case "$mode" in
  suite)
    workers=()
    if python3 -c "import xdist" 2>/dev/null; then
      # a worker per 12 GiB of GPU memory, at most 8: with 8 on an 80 GB H100 two tests ran out
      # of memory beside the other workers (2026-12-05); the H200 (141 GB) takes 8
      gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null \
        | head -1 | awk '{print int($1 / 1024)}')
      n=$(( ${gib:-96} / 12 ))
      workers=(-n $(( n < 1 ? 1 : (n > 8 ? 8 : n) )))
    else
      echo "pytest-xdist is not installed: running the suite in one process" | tee "$out/pytest.log"
    fi
    # each test's start and end to a log (tests/suite_log.py), read back below: a run cut short
    # still says which tests were running; MOE_JAX_SUITE_LIMIT_S=N interrupts pytest after N s
    # (SIGINT, as Ctrl-C: pytest stops and prints its summary; a signal that lands inside a JAX
    # callback fails that test instead, so SIGKILL follows 30 s later), inside the device
    # tool's limit per command
    export MOE_JAX_TEST_LOG="$out/test_log.tsv"
    rm -f "$MOE_JAX_TEST_LOG"
    limit=()
    [ -n "${MOE_JAX_SUITE_LIMIT_S:-}" ] && limit=(timeout -s INT -k 30 "$MOE_JAX_SUITE_LIMIT_S")
    ${limit[@]+"${limit[@]}"} python3 -m pytest -q ${workers[@]+"${workers[@]}"} --durations=15 \
      "$@" 2>&1 | tee -a "$out/pytest.log"
    status=${PIPESTATUS[0]}
    python3 scripts/test_log.py "$MOE_JAX_TEST_LOG" 2>&1 | tee -a "$out/pytest.log"
    exit "$status"
    ;;
  sanitize)
    sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    [ -x "$sanitizer" ] || { echo "compute-sanitizer not found (PATH, CUDA_HOME)" >&2; exit 2; }
    tools=(memcheck racecheck)
    if [ "${1:-}" = memcheck ] || [ "${1:-}" = racecheck ]; then
      tools=("$1")
      shift
    fi
    # No XLA autotuning (it would launch every candidate GEMM under the sanitizer) and no command
    # buffers (each kernel a plain launch, named in the report); the kernels checked are the same.
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer="
    status=0
    for tool in "${tools[@]}"; do
      "$sanitizer" --tool "$tool" --error-exitcode 9 --print-limit 20 \
        python3 -m benchmarks.sanitize_kernels "$@" 2>&1 | tee "$out/$tool.log" | tail -25
      rc=${PIPESTATUS[0]}
      echo "$tool exit status: $rc" | tee -a "$out/$tool.log"
      [ "$rc" -eq 0 ] || status=$rc
    done
    exit "$status"
    ;;
  train)
    status=0
    for shape in B A; do
      python3 -m moe_jax bench --train --shapes "$shape" --iters 10 \
        --variants auto deep_gemm torch fp8_recipe torch_titan --json "$out/train_$shape.json" \
        2>&1 | tee "$out/train_$shape.log" || status=1
      for experts in auto fp8_recipe; do
        python3 -m benchmarks.train_stages --shape "$shape" --experts "$experts" --iters 10 \
          --json "$out/stages_${shape}_$experts.json" 2>&1 | tee -a "$out/train_$shape.log" \
          || status=1
      done
    done
    exit "$status"
    ;;
  decode)
    status=0
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_mosaic_fp8_gemm.py 2>&1 \
      | tee "$out/decode_tests.log" | tail -3 || status=1
    python3 -m benchmarks.gemm_sweep --tokens 1024 2048 4096 6144 --candidates mosaic \
      --samples 3 --json "$out/mosaic_sweep.json" 2>&1 | tee "$out/mosaic_sweep.log" || status=1
    python3 -m moe_jax bench --decode --iters 10 --tokens 512 768 2048 4096 6144 8192 \
      --variants auto pallas mosaic_fp8 deep_gemm --json "$out/decode.json" 2>&1 \
      | tee "$out/decode.log" || status=1
    exit "$status"
    ;;
  prefill)
    status=0
    python3 -m moe_jax bench --shapes B A --variants moe_jax_fp8 moe_jax_fp8_unfused \
      moe_jax_fp8_fused_act moe_jax_fp8_gathered --iters 20 \
      --json "$out/prefill_bench.json" 2>&1 | tee "$out/prefill.log" || status=1
    for shape in B A; do
      for experts in deep_gemm deep_gemm+mosaic_fp8; do
        python3 -m benchmarks.kernel_gaps --shape "$shape" --experts "$experts" --samples 3 \
          --json "$out/gaps_${shape}_${experts/+/_}.json" 2>&1 | tee -a "$out/prefill.log" \
          || status=1
      done
    done
    # the gathered GEMM1 in the layer at B, to the log only (the device tool brings back at
    # most 8 files)
    python3 -m benchmarks.kernel_gaps --shape B --variant moe_jax_fp8_gathered --samples 3 \
      2>&1 | tee -a "$out/prefill.log" || status=1
    exit "$status"
    ;;
  peers)
    status=0
    for args in "--shapes B A --variants tokamax tokamax_mosaic tokamax_triton moe_jax_bf16 moe_jax_fp8" \
      "--train --shapes B A --variants auto tokamax tokamax_mosaic tokamax_triton" \
      "--decode --tokens 1 32 128 512 2048 --variants auto_bf16 tokamax tokamax_mosaic tokamax_triton" \
      "--model"; do
      name=$(echo "$args" | awk '{print ($1 ~ /^--(train|decode|model)$/) ? substr($1, 3) : "forward"}')
      # shellcheck disable=SC2086
      python3 -m moe_jax bench $args --json "$out/peers_$name.json" 2>&1 | tee -a "$out/peers.log" \
        || status=1
    done
    exit "$status"
    ;;
  baseline)
    # today's code against an earlier commit's, in alternating `bench` runs on this machine
    base="${MOE_JAX_BASELINE_DIR:-.baseline}"
    [ -f "$base/COMMIT" ] || {
      echo "no $base/COMMIT: run bash scripts/baseline_tree.sh COMMIT where the repository is" \
        "and carry .baseline" >&2
      exit 2
    }
    bench_args=("$@")
    [ ${#bench_args[@]} -gt 0 ] || bench_args=("${default_bench_args[@]}")
    echo "baseline: $(cat "$base/COMMIT"); bench ${bench_args[*]}" | tee "$out/baseline.log"
    status=0
    for round in $(seq -w "${MOE_JAX_BASELINE_ROUNDS:-2}"); do
      # inside the baseline folder its moe_jax is the one imported (the working directory
      # comes first on sys.path), the installed one otherwise
      (cd "$base" && python3 -m moe_jax bench "${bench_args[@]}" --json "$out/baseline_$round.json") \
        2>&1 | tee -a "$out/baseline.log" || status=1
      python3 -m moe_jax bench "${bench_args[@]}" --json "$out/current_$round.json" 2>&1 \
        | tee -a "$out/baseline.log" || status=1
    done
    python3 -m benchmarks.bench_ratio --baseline "$out"/baseline_*.json \
      --current "$out"/current_*.json 2>&1 | tee -a "$out/baseline.log" || status=1
    exit "$status"
    ;;
  ep)
    log="$out/ep.log"
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if [ "$gpus" -lt 2 ]; then
      echo "ep: needs 2 or more GPUs on one host, found $gpus: nothing run" | tee "$log"
      exit 3
    fi
    limit=${MOE_JAX_EP_LIMIT_S:-540}
    test_s=$(( limit / 4 < 120 ? 120 : limit / 4 ))
    status=0
    ep_run() {  # ep_run PROCESSES SECONDS: every part, stopped (tracebacks to the log) in time
      echo "== $(date +%T) ep_multigpu.py on $1 GPUs, $2 s at most" | tee -a "$log"
      python3 -m moe_jax.distributed --num-processes "$1" --timeout-s "$2" \
        --coordinator-address "127.0.0.1:$(( 29500 + 10 * $1 ))" scripts/ep_multigpu.py \
        --parts ht,ll,jax,grad --hang-timeout-s $(( $2 > 60 ? $2 - 15 : 45 )) 2>&1 | tee -a "$log"
      rc=${PIPESTATUS[0]}
      echo "== ep_multigpu.py on $1 GPUs: exit status $rc" | tee -a "$log"
      [ "$rc" -eq 0 ] || status=1
    }
    main_s=$(( limit - test_s ))
    if [ "$gpus" -gt 2 ]; then
      ep_run "$gpus" $(( main_s * 3 / 5 ))
      left=$(( limit - test_s - SECONDS ))
      if [ "$left" -ge 90 ]; then ep_run 2 "$left"; else
        echo "== no time left for the 2-GPU run ($left s)" | tee -a "$log"; fi
    else
      ep_run 2 "$main_s"
    fi
    left=$(( limit - SECONDS ))
    echo "== $(date +%T) pytest -m multigpu, $(( left < 60 ? 60 : left )) s at most" | tee -a "$log"
    timeout -s INT -k 30 $(( left < 60 ? 60 : left )) python3 -m pytest -q -p no:cacheprovider \
      -m multigpu 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "== pytest -m multigpu: exit status $rc" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
    { echo "== targets (rank 0 of each run; PASS, MISS or NOT MEASURED):"
      grep -o '"line": "[^"]*"' "$log" | cut -d'"' -f4; } | tee -a "$log"
    exit "$status"
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh suite|sanitize|train|decode|prefill|peers|baseline|ep (see the top of this file)" >&2
    exit 2
    ;;
esac
