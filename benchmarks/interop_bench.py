"""DeepGEMM and torch grouped GEMMs from `jax.jit` (through the bridge) vs the same call from torch.

Run on a GPU host with DeepGEMM installed:

    python -m benchmarks.interop_bench [--iters 20] [--reps 15] [--command-buffer]

Every variant runs back to back `--iters` times per sample (so host work overlaps device work, as in
a model's forward pass); a sample is the mean per call, the table shows the median of `--reps`
samples. Every variant is timed by `moe_jax.cli.timing.time_calls` (wall clock; torch calls waited
for with `torch.cuda.synchronize`, jitted calls with `block_until_ready`). Variants:

- direct: `m_grouped_fp8_gemm_nt_contiguous` called from torch on the same buffers, with the scales
  already in DeepGEMM's MN-major layout (the best a torch program can do).
- jit: the same DeepGEMM call wrapped in `moe_jax.interop.torch_callback` alone, scales given in
  that layout (`mn_major_scales` outside the jit, `tma_aligned_view` inside the callback).
- jit+sf: `DeepGemm.contiguous` as the MoE pipeline calls it: row-major scales, transposed in XLA.
- grouped_mm: `torch._grouped_mm` bf16 direct vs the "torch" backend (which adds one [M, N] copy).

`--command-buffer` lets XLA capture the DeepGEMM call into a CUDA graph; it sets
`--xla_gpu_graph_min_graph_size=1` in XLA_FLAGS, so it must be given before JAX starts (it is
read here, before any device is touched).
"""

from __future__ import annotations

import argparse
import os
import sys

from moe_jax.cli.timing import time_calls
from moe_jax.cli.torch_baseline import deep_gemm_fp8_contiguous

SHAPES = (  # (groups, rows per group, N, K)
    (32, 1024, 4096, 7168),
    (64, 512, 1536, 2048),
    (8, 128, 4096, 7168),
)


def _torch_ms(torch, fn, *, iters: int, reps: int) -> float:
    timing = time_calls(fn, wait=lambda _: torch.cuda.synchronize(), samples=reps, burst=iters)
    return timing.streamed_ms


def _jax_ms(fn, args, *, iters: int, reps: int) -> float:
    import jax

    timing = time_calls(lambda: fn(*args), wait=jax.block_until_ready, samples=reps, burst=iters)
    return timing.streamed_ms


def _fp8_case(torch, backend, shape, *, iters, reps, command_buffer):
    import jax
    import jax.numpy as jnp

    from moe_jax import quant
    from moe_jax.interop import bridge, deep_gemm

    groups, rows, n, k = shape
    m = groups * rows
    kx, kw = jax.random.split(jax.random.key(0))
    xq, xs = quant.per_token_group_quant_fp8(jax.random.normal(kx, (m, k), jnp.bfloat16))
    wq, ws = quant.per_block_quant_fp8(jax.random.normal(kw, (groups, n, k), jnp.bfloat16))
    ids = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), rows)
    ends = jnp.cumsum(jnp.full((groups,), rows, jnp.int32))
    sfa_t = deep_gemm.mn_major_scales(xs)
    jax.block_until_ready((xq, xs, wq, ws, ids, sfa_t))

    gemm = deep_gemm_fp8_contiguous()
    t = {
        name: torch.from_dlpack(a)
        for name, a in dict(x=xq, sfa_t=sfa_t, w=wq, ws=ws, ids=ids).items()
    }
    sfa = deep_gemm.tma_aligned_view(t["sfa_t"], m)
    d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")

    def direct():
        gemm((t["x"], sfa), (t["w"], t["ws"]), d, t["ids"])

    direct()  # DeepGEMM JIT-compiles this shape here, outside timing and outside any capture
    torch.cuda.synchronize()

    def bridged(out, x, sfa_t, w, w_scales, expert_ids):  # the direct call, on XLA's buffers
        gemm((x, deep_gemm.tma_aligned_view(sfa_t, m)), (w, w_scales), out, expert_ids)

    call = bridge.torch_callback(
        bridged,
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        command_buffer_compatible=command_buffer,
    )
    jit_call = jax.jit(call)
    jit_full = jax.jit(
        lambda x, s, w, w_s, e, en: backend.contiguous(
            x, w, e, en, x_scales=s, w_scales=w_s, alignment=128, out_dtype=jnp.bfloat16
        )
    )
    y = jit_call(xq, sfa_t, wq, ws, ids)
    y_full = jit_full(xq, xs, wq, ws, ids, ends)
    torch.cuda.synchronize()
    is_equal = bool(
        torch.equal(torch.from_dlpack(y), d) and torch.equal(torch.from_dlpack(y_full), d)
    )
    ms_direct = _torch_ms(torch, direct, iters=iters, reps=reps)
    ms_jit = _jax_ms(jit_call, (xq, sfa_t, wq, ws, ids), iters=iters, reps=reps)
    ms_full = _jax_ms(jit_full, (xq, xs, wq, ws, ids, ends), iters=iters, reps=reps)
    tflops = 2 * m * n * k / (ms_direct * 1e-3) / 1e12
    return ms_direct, ms_jit, ms_full, tflops, is_equal


def _grouped_mm_case(torch, shape, *, iters, reps):
    import jax
    import jax.numpy as jnp

    from moe_jax import grouped_gemm

    groups, rows, n, k = shape
    m = groups * rows
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (groups, n, k), jnp.bfloat16)
    ids = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), rows)
    ends = jnp.cumsum(jnp.full((groups,), rows, jnp.int32))
    jax.block_until_ready((x, w, ends))
    tx, tw, tends = (torch.from_dlpack(a) for a in (x, w, ends))
    backend = grouped_gemm.GEMMS.get("torch")
    f = jax.jit(
        lambda x, w, e, en: backend.contiguous(x, w, e, en, alignment=1, out_dtype=jnp.bfloat16)
    )

    def direct():
        torch._grouped_mm(tx, tw.transpose(-2, -1), offs=tends)

    direct()
    y = f(x, w, ids, ends)
    torch.cuda.synchronize()
    is_equal = bool(torch.equal(torch.from_dlpack(y), torch._grouped_mm(tx, tw.mT, offs=tends)))
    ms_direct = _torch_ms(torch, direct, iters=iters, reps=reps)
    ms_jit = _jax_ms(f, (x, w, ids, ends), iters=iters, reps=reps)
    return ms_direct, ms_jit, is_equal


def _bridge_overhead_us(*, iters: int, reps: int) -> tuple[float, float]:
    """Per-call wall time of a jitted no-op vs a no-op bridge call on five small operands."""
    import jax
    import jax.numpy as jnp

    from moe_jax.interop import bridge

    args = tuple(jnp.ones((128, 128), jnp.float32) for _ in range(5))
    plain = jax.jit(lambda *a: a[0] + 1)
    noop = jax.jit(
        bridge.torch_callback(lambda out, *a: None, jax.ShapeDtypeStruct((128, 128), jnp.float32))
    )
    return (
        1e3 * _jax_ms(plain, args, iters=iters, reps=reps),
        1e3 * _jax_ms(noop, args, iters=iters, reps=reps),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--command-buffer", action="store_true")
    parser.add_argument("--skip-grouped-mm", action="store_true")
    args = parser.parse_args(argv)
    if args.command_buffer:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_graph_min_graph_size=1".strip()

    import jax
    import torch

    from moe_jax.interop import deep_gemm

    if jax.default_backend() != "gpu":
        print("needs a GPU (jax.default_backend() is not 'gpu')", file=sys.stderr)
        return 2
    torch.zeros((), device="cuda")  # torch's CUDA context on the main thread, before any jit
    try:
        import deep_gemm as dg_module
    except Exception as error:  # a broken build raises anything from ImportError to OSError
        print(f"import deep_gemm failed ({type(error).__name__}: {error})", file=sys.stderr)
        return 2
    backend = deep_gemm.DeepGemm(
        deep_gemm.DeepGemmConfig(command_buffer_compatible=args.command_buffer)
    )
    print(
        f"# {torch.cuda.get_device_name()} jax {jax.__version__} torch {torch.__version__} "
        f"deep_gemm {getattr(dg_module, '__version__', '?')} "
        f"command_buffer={args.command_buffer} iters={args.iters} reps={args.reps}"
    )
    plain_us, noop_us = _bridge_overhead_us(iters=args.iters * 5, reps=args.reps)
    print(f"# per call: jitted x+1 {plain_us:.1f} us, jitted no-op bridge call {noop_us:.1f} us")
    rows = []
    for shape in SHAPES:
        ms_d, ms_j, ms_f, tflops, ok = _fp8_case(
            torch,
            backend,
            shape,
            iters=args.iters,
            reps=args.reps,
            command_buffer=args.command_buffer,
        )
        rows.append(
            f"| deep_gemm fp8 {shape[0]}x{shape[1]} N={shape[2]} K={shape[3]} | {ms_d:.4f} | "
            f"{ms_j:.4f} | {ms_d / ms_j:.3f} | {ms_f:.4f} | {ms_d / ms_f:.3f} | "
            f"{tflops:.0f} | {ok} |"
        )
        print(rows[-1], flush=True)
    if not args.skip_grouped_mm:
        for shape in SHAPES:
            ms_d, ms_j, ok = _grouped_mm_case(torch, shape, iters=args.iters, reps=args.reps)
            rows.append(
                f"| torch._grouped_mm bf16 {shape[0]}x{shape[1]} N={shape[2]} K={shape[3]} | "
                f"{ms_d:.4f} | {ms_j:.4f} | {ms_d / ms_j:.3f} | - | - | - | {ok} |"
            )
            print(rows[-1], flush=True)
    print()
    print(
        "| case | direct ms | jit ms | jit/direct speed | jit+sf ms | jit+sf/direct | "
        "direct TFLOPS | bitwise equal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
