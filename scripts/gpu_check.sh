#!/usr/bin/env bash
# On the GPU host, after `source .gpu/install.sh` (see ../shared/device/stage):
#   bash scripts/gpu_check.sh suite [pytest args]    the whole test suite, every marker (a
#       pytest-xdist worker per 12 GiB of GPU memory, at most 8, where xdist is installed, else
#       one process); args select a part. MOE_JAX_SUITE_LIMIT_S=N stops it after N s, and
#       scripts/test_log.py then says which tests were still running and which took longest
#   bash scripts/gpu_check.sh sanitize [memcheck|racecheck] [--shape b|tiny] [kernel ...]
#       compute-sanitizer on the Pallas kernels (both tools by default, shape B by default;
#       `python3 scripts/sanitize_kernels.py --list`)
#   bash scripts/gpu_check.sh train      training-step bench and per-stage backward times, shapes B and A
#   bash scripts/gpu_check.sh decode     the Mosaic FP8 GEMM's compiled tests, its config sweep at
#       T=1024-6144 and the decode layer from T=512 to 8192 with "auto" beside the three FP8
#       grouped GEMMs (the evidence behind the GEMM heuristics and "auto"'s crossovers)
#   bash scripts/gpu_check.sh prefill    issue 14's figures: `bench` at shapes B and A (the FP8
#       layer, "auto" and never fused, and its fused-GEMM1 variants, the gathered one too), then
#       `kernel_gaps` for both experts at B and A and for the gathered GEMM1 at B, and
#       `gather_bench` at B (both to the log),
#       then `call_timeline` at B (one waited call's host and device
#       timeline; 7 files to $OUT: the device tool brings back at most 8)
#   bash scripts/gpu_check.sh epilogue   issue 14's fused GEMM1 against the plain Mosaic GEMM1: ncu
#       on one FP8 forward at shape B with each: every kernel's time, shared-memory bank conflicts
#       and instructions; then the GEMM1's warp-stall samples per SASS instruction, summarized by
#       loop level and opcode (scripts/gpu_kernel_times.py --sass; 7 files to $OUT). The process
#       ncu profiles dies now and then (segmentation fault, before the profiled range: 10 of 13
#       runs on H100s on 2026-12-05, every run of the plain path, with and without XLA's
#       autotuner and command buffers; cause not found; on 2026-12-06 both runs passed at their
#       first try on an H100), so each ncu run is tried up to 3 times
#   bash scripts/gpu_check.sh gather     issue 14's gathered fused GEMM1 against the contiguous
#       one "auto" runs at B: ncu on each (the forward's first Mosaic kernel) with its memory
#       sections (DRAM bytes, L2 / L1 hit rates, cp.async and TMA traffic, summarized to the
#       log) and its warp-stall samples per SASS instruction (7 files to $OUT)
#   bash scripts/gpu_check.sh baseline [bench args]   today's code against an earlier commit's
#       (`bash scripts/baseline_tree.sh COMMIT` here first, then carry .baseline): `bench` (by
#       default --shapes B A --variants moe_jax_fp8 --iters 20) from each in turn,
#       MOE_JAX_BASELINE_ROUNDS times (2), then scripts/bench_ratio.py's table of current /
#       baseline: a ratio that carries to issues whose figures came from another card
#   bash scripts/gpu_check.sh env NAME=VALUE [NAME=VALUE ...] [-- bench args]   the same
#       alternation for a process environment setting: `bench` (same default arguments) as this
#       shell runs it ("without") and with the assignments ("with"), MOE_JAX_ENV_ROUNDS times
#       (2), then bench_ratio.py's with / without table. First, each side's PjRt client log
#       lines (a JAX process at TF_CPP_MIN_LOG_LEVEL=0: XLA's TFRT client, where a plugin has it,
#       logs "TfrtGpuClient created"; jax 0.11.2's CUDA 13 plugin does not contain it, and
#       XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 changes nothing there, BENCHMARKS.md
#       2026-12-06); then each side's scripts/waited_overhead.py table
#       (what a waited call costs over a streamed one for programs that are not moe_jax's;
#       matmul side MOE_JAX_ENV_WAITED_SIZE, 8192). For XLA_FLAGS, XLA_PYTHON_CLIENT_*,
#       TF_CUDA_*: the runtime's settings, none of which moe_jax sets itself
# MOE_JAX_REQUIRE_GPU=NAME (any mode): run only on a GPU whose name holds NAME (e.g. H200, the
#   card issue 14's targets are set on); on any other, or with no GPU, say which GPU it is and
#   exit 3 before anything runs. The device tool lends H100s to most calls that ask for an H200
#   (BENCHMARKS.md, 2026-12-07): a call that finds one then costs only the machine's start.
# Logs go to $OUT (the device tool's result folder) or /tmp/gpu_check.
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
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
# `bench`'s arguments where the baseline and env modes are given none
default_bench_args=(--shapes B A --variants moe_jax_fp8 --iters 20)
# find_ncu: sets ncu_bin to Nsight Compute's command line, or says it is missing
find_ncu() {
  ncu_bin=$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")
  [ -x "$ncu_bin" ] || { echo "ncu not found (PATH, CUDA_HOME)" >&2; return 1; }
}
# ncu_tries OUTFILE NCU-ARGS...: ncu on one forward (--clock-control none: METHOD.md leaves the
# clocks alone), stdout to OUTFILE, stderr to $ncu_log, up to 3 tries while the profiled
# process crashes (see the epilogue mode)
ncu_tries() {
  local outfile=$1 try rc
  shift
  for try in 1 2 3; do
    "$ncu_bin" --profile-from-start off --clock-control none "$@" > "$outfile" 2>> "$ncu_log"
    rc=$?
    echo "ncu try $try: exit status $rc" | tee -a "$ncu_log"
    [ "$rc" -eq 0 ] && return 0
  done
  return "$rc"
}
# ncu_report_dir: a fresh folder for this run's ncu reports (too large for $OUT's 8 files),
# removed when the script exits
ncu_report_dir() {
  report_dir=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_ncu.XXXXXX")
  trap 'rm -rf "$report_dir"' EXIT
}
# stall_summary REPORT SASS_CSV: the warp-stall samples per SASS instruction of the ncu report
# REPORT.ncu-rep (collected with --section SourceCounters) to SASS_CSV, summarized to $ncu_log
stall_summary() {
  "$ncu_bin" --import "$1.ncu-rep" --page source --csv --print-source sass > "$2" \
    2>> "$ncu_log" || return 1
  python3 scripts/gpu_kernel_times.py --sass "$2" 2>&1 | tee -a "$ncu_log"
}
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
        python3 scripts/sanitize_kernels.py "$@" 2>&1 | tee "$out/$tool.log" | tail -25
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
  decode)
    status=0
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_mosaic_fp8_gemm.py 2>&1 \
      | tee "$out/decode_tests.log" | tail -3 || status=1
    python3 -m moe_jax.cli.gemm_sweep --tokens 1024 2048 4096 6144 --candidates mosaic \
      --samples 3 --json "$out/mosaic_sweep.json" 2>&1 | tee "$out/mosaic_sweep.log" || status=1
    python3 -m moe_jax bench --decode --iters 10 --tokens 512 768 2048 4096 6144 8192 \
      --variants auto pallas mosaic_fp8 deep_gemm --json "$out/decode.json" 2>&1 \
      | tee "$out/decode.log" || status=1
    exit "$status"
    ;;
  prefill)
    status=0
    python3 -m moe_jax bench --shapes B A --variants moe_jax_fp8 moe_jax_fp8_unfused \
      moe_jax_fp8_fused_act moe_jax_fp8_fused_act_skipping moe_jax_fp8_gathered --iters 20 \
      --json "$out/prefill_bench.json" 2>&1 | tee "$out/prefill.log" || status=1
    for shape in B A; do
      for experts in deep_gemm deep_gemm+mosaic_fp8; do
        python3 -m moe_jax.cli.kernel_gaps --shape "$shape" --experts "$experts" --samples 3 \
          --json "$out/gaps_${shape}_${experts/+/_}.json" 2>&1 | tee -a "$out/prefill.log" \
          || status=1
      done
    done
    # the gathered GEMM1 at B, to the log only (the device tool brings back at most 8 files):
    # in the layer, then its front half against the permuted one in alternating rounds
    python3 -m moe_jax.cli.kernel_gaps --shape B --variant moe_jax_fp8_gathered --samples 3 \
      2>&1 | tee -a "$out/prefill.log" || status=1
    python3 -m moe_jax.cli.gather_bench --shapes B --rounds 6 2>&1 | tee -a "$out/prefill.log" \
      || status=1
    python3 -m moe_jax.cli.call_timeline --shape B --json "$out/timeline_B.json" 2>&1 \
      | tee -a "$out/prefill.log" || status=1
    exit "$status"
    ;;
  epilogue)
    find_ncu || exit 2
    ncu_report_dir
    ncu_log="$out/epilogue.log"
    metrics=gpu__time_duration.sum,smsp__inst_executed.sum
    for op in ld st; do
      metrics+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_$op.sum
      metrics+=,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_$op.sum
    done
    # the raw page also lists the device's attributes: keep the metrics asked for
    columns='(gpu__time_duration|inst_executed|mem_shared_op_(ld|st))\.sum$'
    status=0
    # the fused GEMM1 (act*up + quantization in its epilogue) and the plain one + act_quant
    for experts in deep_gemm+mosaic_fp8 mosaic_fp8; do
      tag=${experts/+/_}
      forward=(python3 scripts/gpu_kernel_times.py B --experts "$experts")
      echo "== $experts: every kernel of the forward" | tee -a "$out/epilogue.log"
      ncu_tries "$out/epilogue_${tag}_metrics.csv" --metrics "$metrics" --csv --page raw \
        --print-units base "${forward[@]}" || status=1
      python3 scripts/gpu_kernel_times.py --summarize "$out/epilogue_${tag}_metrics.csv" \
        --columns "$columns" 2>&1 | tee -a "$out/epilogue.log" || status=1
      # the forward's first Mosaic kernel is its GEMM1 on both paths
      echo "== $experts: GEMM1's stall samples" | tee -a "$out/epilogue.log"
      report="$report_dir/epilogue_$tag"
      ncu_tries "$out/epilogue_${tag}_ncu.log" --kernel-name regex:mosaic --launch-count 1 \
        --section SourceCounters --section WarpStateStats --import-source no -f -o "$report" \
        "${forward[@]}" || status=1
      stall_summary "$report" "$out/epilogue_${tag}_sass.csv" || status=1
    done
    exit "$status"
    ;;
  gather)
    find_ncu || exit 2
    ncu_report_dir
    ncu_log="$out/gather.log"
    # what the memory system does in the gathered fused GEMM1 and in the contiguous one that
    # "auto" runs at B on permuted rows (each the forward's first Mosaic kernel): DRAM bytes,
    # L2 and L1 hit rates, the cp.async (LDGSTS) and TMA traffic, then where each kernel's
    # warps stall
    columns='(gpu__time_duration|dram__bytes_(read|write)\.sum$|dram__throughput|hit_rate'
    columns+='|lsu_mem_global_op_(ld|ldgsts)\.sum$|l1tex__m_xbar2l1tex_read_bytes\.sum$)'
    status=0
    for path in "--experts deep_gemm+mosaic_fp8" "--variant moe_jax_fp8_gathered"; do
      tag=${path##* }
      tag=${tag//+/_}
      read -r -a forward_args <<< "$path"
      forward=(python3 scripts/gpu_kernel_times.py B "${forward_args[@]}")
      echo "== $tag: the GEMM1's memory workload" | tee -a "$ncu_log"
      report="$report_dir/gather_$tag"
      ncu_tries "$out/gather_${tag}_ncu.log" --kernel-name regex:mosaic --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
        --section SourceCounters --import-source no -f -o "$report" "${forward[@]}" \
        || status=1
      "$ncu_bin" --import "$report.ncu-rep" --csv --page raw --print-units base \
        > "$out/gather_${tag}_raw.csv" 2>> "$ncu_log" || status=1
      python3 scripts/gpu_kernel_times.py --summarize "$out/gather_${tag}_raw.csv" \
        --columns "$columns" 2>&1 | tee -a "$ncu_log" || status=1
      echo "== $tag: the GEMM1's stall samples" | tee -a "$ncu_log"
      stall_summary "$report" "$out/gather_${tag}_sass.csv" || status=1
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
    python3 scripts/bench_ratio.py --baseline "$out"/baseline_*.json \
      --current "$out"/current_*.json 2>&1 | tee -a "$out/baseline.log" || status=1
    exit "$status"
    ;;
  env)
    # one environment setting against none, in alternating `bench` runs on this machine
    usage="usage: bash scripts/gpu_check.sh env NAME=VALUE [NAME=VALUE ...] [-- bench args]"
    settings=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      case "$1" in
        [A-Za-z_]*=*) settings+=("$1") ;;
        *) echo "env: '$1' is not NAME=VALUE; $usage" >&2; exit 2 ;;
      esac
      shift
    done
    [ "${1:-}" = "--" ] && shift
    [ ${#settings[@]} -gt 0 ] || { echo "env: no NAME=VALUE given; $usage" >&2; exit 2; }
    bench_args=("$@")
    [ ${#bench_args[@]} -gt 0 ] || bench_args=("${default_bench_args[@]}")
    # runs a command as this shell would ("without") or with the settings ("with")
    on_side() { if [ "$1" = with ]; then shift; env "${settings[@]}" "$@"; else shift; "$@"; fi; }
    echo "with: ${settings[*]}; bench ${bench_args[*]}" | tee "$out/env.log"
    for side in without with; do
      echo "PjRt client log lines $side:" | tee -a "$out/env.log"
      on_side "$side" env TF_CPP_MIN_LOG_LEVEL=0 python3 -c \
        'import jax; print("devices:", jax.devices())' 2>&1 | grep -i -E "client|devices:" \
        | tee -a "$out/env.log"
    done
    status=0
    for side in without with; do
      echo "waited_overhead.py $side:" | tee -a "$out/env.log"
      on_side "$side" python3 scripts/waited_overhead.py --samples 15 \
        --size "${MOE_JAX_ENV_WAITED_SIZE:-8192}" 2>&1 | tee -a "$out/env.log" || status=1
    done
    for round in $(seq -w "${MOE_JAX_ENV_ROUNDS:-2}"); do
      for side in without with; do
        on_side "$side" python3 -m moe_jax bench "${bench_args[@]}" \
          --json "$out/${side}_$round.json" 2>&1 | tee -a "$out/env.log" || status=1
      done
    done
    python3 scripts/bench_ratio.py --names without with \
      --baseline "$out"/without_*.json --current "$out"/with_*.json 2>&1 \
      | tee -a "$out/env.log" || status=1
    exit "$status"
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh suite|sanitize|train|decode|prefill|epilogue|baseline|env (see the top of this file)" >&2
    exit 2
    ;;
esac
