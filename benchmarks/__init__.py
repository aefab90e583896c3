"""Profiling and exploration tools, run from a checkout's root: `python -m benchmarks.NAME --help`.

They import the installed `moe_jax` (the package never imports them); `python -m moe_jax bench`
is the product's benchmark. Their tests are in tests/test_benchmarks*.py and tests/test_<NAME>.py.

Whole layer:
  stage_breakdown     each stage of the FP8 forward jitted alone, host and device ms
  kernel_gaps         a forward's device time kernel by kernel, and the idle gaps between them
  train_stages        forward and backward time of each stage of a training step
  bench_ratio         current / baseline table of `bench --json` files (gpu_check.sh baseline)
Kernels:
  gemm_sweep          tile sweep of the decode grouped GEMMs (Pallas, Mosaic)
  sanitize_kernels    every compiled kernel once, for compute-sanitizer (gpu_check.sh sanitize)
Interop:
  deep_ep_ll_bench    DeepEP low latency through moe_jax on one GPU, run as a file: `python -m
                      moe_jax.distributed --num-processes 1 benchmarks/deep_ep_ll_bench.py`
"""
