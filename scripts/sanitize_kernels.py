"""Drives each compiled Pallas kernel once at layer shape B, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/sanitize_kernels.py

pytest under compute-sanitizer does not finish in 10 minutes, so this script runs each kernel in
one small process instead: shape B (T=8192 E=128 k=8 H=2048 I=768), with invalid ids, an
expert_map with holes and a duplicate expert in a row, so the masked-off paths run too. Each
result is compared with the kernel's pure-JAX reference, so a clean sanitizer run is also a
correct one. Pass kernel names to run a subset.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import act_quant, grouped_gemm, permute, quant
from moe_jax.registry import NoImplementationError

T, E, K, H, INTER = 8192, 128, 8, 2048, 768


def _inputs():
    rng = np.random.default_rng(2026)
    ids = rng.integers(-2, E + 3, (T, K)).astype(np.int32)  # some invalid ids
    ids[::7, 1] = ids[::7, 0]  # duplicate expert in a row
    expert_map = np.arange(E + 8, dtype=np.int32)
    expert_map[rng.choice(E, E // 8, replace=False)] = -1  # holes
    expert_map[E:] = -1
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((T, 2 * INTER)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
    return jnp.asarray(ids), jnp.asarray(expert_map), x, h, weights


def _check(name, got, want):
    if name == "grouped_gemm_fp8":  # float32 accumulation order differs: compare to 1e-2
        g, w = (np.asarray(a.astype(jnp.float32), np.float64) for a in (got, want))
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        if not err < 1e-2:
            raise AssertionError(f"{name}: relative error {err:.3g} against the reference")
        print(f"{name}: ok (relative error {err:.2e})", flush=True)
        return
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(
            np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), err_msg=name
        )
    print(f"{name}: ok (equal to the reference)", flush=True)


def main(names: list[str], *, impl: str = "pallas") -> int:
    ids, expert_map, x, h, weights = _inputs()
    xq, xs = act_quant.group_quant(x, impl="xla")

    def run_permute(impl, rows, scales):
        return jax.jit(
            lambda r, s: permute.permute(
                r, ids, num_experts=E, x_scales=s, expert_map=expert_map, impl=impl
            )
        )(rows, scales)

    lay = run_permute("xla", x, None)
    y = jnp.asarray(np.random.default_rng(1).standard_normal(lay.rows.shape), jnp.bfloat16)
    # The decode GEMM at shape B's GEMM1 (N=2I, K=H) on the first 256 tokens, 16-row segments.
    decode = permute.permute(
        xq[:256],
        ids[:256],
        num_experts=E,
        x_scales=xs[:256],
        expert_map=expert_map,
        alignment=16,
        impl="xla",
    )
    w1 = jnp.asarray(np.random.default_rng(2).standard_normal((E, 2 * INTER, H)) / 32, jnp.float32)
    w1q, w1s = quant.per_block_quant_fp8(w1)

    def run_gemm(impl):
        backend = grouped_gemm.GEMMS.get(impl)
        return jax.jit(
            lambda r, s: backend.contiguous(
                r,
                w1q,
                decode.expert_ids,
                decode.expert_ends,
                x_scales=s,
                w_scales=w1s,
                alignment=16,
                out_dtype=jnp.bfloat16,
            )
        )(decode.rows, decode.row_scales)

    kernels = {
        "grouped_gemm_fp8": lambda impl: jnp.where(
            (decode.expert_ids >= 0)[:, None], run_gemm(impl), 0
        ),
        "group_quant": lambda impl: jax.jit(lambda v: act_quant.group_quant(v, impl=impl))(x),
        "act_and_quant": lambda impl: jax.jit(lambda v: act_quant.act_and_quant(v, impl=impl))(h),
        "permute_bf16": lambda impl: run_permute(impl, x, None),
        "permute_fp8": lambda impl: run_permute(impl, xq, xs),
        "unpermute": lambda impl: jax.jit(
            lambda v: permute.unpermute(v, lay.inverse, weights, impl=impl)
        )(y),
        "count": lambda impl: jax.jit(
            lambda i: permute.count_expert_num_tokens(i, E, expert_map, impl=impl)
        )(ids),
    }
    unknown = sorted(set(names) - set(kernels))
    if unknown:
        print(f"unknown kernels {unknown}; choose from {sorted(kernels)}", file=sys.stderr)
        return 2
    for name in names or kernels:
        try:
            got = jax.block_until_ready(kernels[name](impl))
        except NoImplementationError as error:
            print(f"{name}: not run ({error})", flush=True)
            return 1
        _check(name, got, kernels[name]("xla"))
    print(f"all kernels ran at T={T} E={E} k={K} H={H} I={INTER}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
