"""Per-kernel device times of one moe_jax FP8 layer forward, for `ncu` (a development tool).

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --csv --page raw python3 scripts/gpu_kernel_times.py A > kernels_A.csv
    python3 scripts/gpu_kernel_times.py --summarize kernels_A.csv

Only the last forward (after warm-up) is inside the profiled range.
"""

import csv
import sys


def profile(shape_name: str) -> None:
    import jax
    import torch

    from moe_jax.cli import layer_bench
    from moe_jax.fused_moe import fused_moe

    layer = layer_bench.make_layer(layer_bench.SHAPES[shape_name])
    fn = jax.jit(
        lambda x, w1, w2, tw, ti, s1, s2: fused_moe(x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2)
    )
    args = (layer.x, layer.w1q, layer.w2q, layer.topk_weights, layer.topk_ids, layer.w1s, layer.w2s)
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    jax.block_until_ready(fn(*args))
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def summarize(path: str) -> None:
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    total = 0.0
    print(f"{'kernel':<70} {'us':>9}")
    for row in rows:
        value = row.get("gpu__time_duration.sum", "")
        try:
            us = float(value.replace(",", "")) / 1e3  # ns, with thousands separators
        except ValueError:
            continue  # the units row
        total += us
        print(f"{row['Kernel Name'][:70]:<70} {us:>9.1f}")
    print(f"{'sum of kernel times':<70} {total:>9.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    else:
        profile(sys.argv[1])
