"""Runs every compiled Pallas kernel on a library path once, at layer shape B, for the sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 9 python -m benchmarks.sanitize_kernels
    compute-sanitizer --tool racecheck --error-exitcode 9 \
        python -m benchmarks.sanitize_kernels --shape tiny

pytest under compute-sanitizer does not finish in 10 minutes, so this script runs each kernel in
one small process instead: shape B (T=8192 E=128 k=8 H=2048 I=768), with invalid ids, an
expert_map with holes and a duplicate expert in a row, so the masked-off paths run too. Each
result is compared with the XLA implementation of the same op, so a clean sanitizer run is also a
correct one. Pass kernel names to run a subset (`--list` prints them).

The kernels, each through its front's registry (the names a user passes):

- permute (`PERMUTES` "pallas"): the row gather with and without FP8 scales, and with FP8
  scales leaving the padding rows unwritten (the FP8 layer's);
- unpermute (`UNPERMUTES`): the weighted gather-sum, and the weightless one (permute's VJP);
- count (`COUNTS`), routing_metadata (`ROUTING_METADATA`: the contiguous layout's inverse,
  counts, segment ends and each row's token and expert; the one kernel with atomics and a
  spin-wait), group_quant (`GROUP_QUANTS`), act_and_quant (`ACT_QUANTS`, silu);
- the Pallas grouped GEMM (`GEMMS` "pallas"): the FP8 block-scaled kernel and the unscaled bf16
  one on the contiguous layout, and the FP8 kernel on the masked layout, at decode size (the
  first 256 tokens: where "auto" takes it);
- moe_jax's Mosaic GPU FP8 grouped GEMM (`GEMMS` "mosaic_fp8": TMA, warp-specialised) on
  64-row segments at the same decode size, and with act(gate) * up and the FP8 quantization in
  its epilogue on 128-row segments;
- JAX's Mosaic GPU kernels that moe_jax runs: `GEMMS` "mosaic" (ragged_dot, bf16) and `WGRADS`
  "mosaic" (transposed_ragged_dot).

Not covered: the uint16 weight view of the grouped GEMM (FP8 weights of 2**31 to 2**32
elements, 2 GiB or more), and DeepEP low latency's Triton row copy (needs DeepEP).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import act_quant, grouped_gemm, grouped_gemm_backward, layouts, permute, quant
from moe_jax.kernels import mosaic_fp8_gemm
from moe_jax.registry import NoImplementationError


@dataclasses.dataclass(frozen=True)
class Shape:
    num_tokens: int  # T
    num_experts: int  # E
    topk: int  # k
    hidden: int  # H
    inter: int  # I
    decode_tokens: int  # tokens of the decode-size GEMM calls
    max_m: int  # rows per expert of the masked-layout GEMM


SHAPE_B = Shape(8192, 128, 8, 2048, 768, decode_tokens=256, max_m=32)
# The tests of this script: the smallest shape every kernel accepts (Mosaic: 2I a multiple of 512).
SHAPE_TINY = Shape(48, 8, 4, 256, 256, decode_tokens=16, max_m=4)


def _gemm(impl: str):
    """The GEMM backend `impl` names: the interpret twins, which only the tests register, as
    objects."""
    if impl == "pallas_interpret":
        from moe_jax.kernels.grouped_gemm import PallasGemm

        return PallasGemm(name=impl, interpret=True)
    return mosaic_fp8_gemm.MosaicFp8Gemm(interpret=True) if impl == "mosaic_fp8_interpret" else impl


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel run: `run(impl)` with the compiled implementation's name or its interpret
    twin (None: no interpret mode); `rtol` None compares bitwise with XLA, else by relative
    Frobenius error (float32 accumulation orders differ)."""

    run: Callable[[str], object]
    compiled: str
    interpret: str | None
    rtol: float | None = None


def _inputs(shape: Shape):
    t, e, k, h, i = shape.num_tokens, shape.num_experts, shape.topk, shape.hidden, shape.inter
    rng = np.random.default_rng(2026)
    ids = rng.integers(-2, e + 3, (t, k)).astype(np.int32)  # some invalid ids
    ids[::7, 1] = ids[::7, 0]  # duplicate expert in a row
    expert_map = np.arange(e + 8, dtype=np.int32)
    expert_map[rng.choice(e, e // 8, replace=False)] = -1  # holes
    expert_map[e:] = -1
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((t, 2 * i)), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / 32, jnp.float32)
    return jnp.asarray(ids), jnp.asarray(expert_map), x, gate_up, weights, w1


def kernels(shape: Shape) -> dict[str, Kernel]:
    """The kernel runs at `shape`, by name."""
    e = shape.num_experts
    ids, expert_map, x, gate_up, weights, w1 = _inputs(shape)
    xq, xs = act_quant.group_quant(x, impl="xla")
    w1q, w1s = quant.per_block_quant_fp8(w1)
    w1_bf16 = w1.astype(jnp.bfloat16)

    def run_permute(
        impl,
        rows,
        scales,
        alignment=layouts.DEFAULT_ALIGNMENT,
        num_tokens=None,
        is_padding_zeroed=True,
    ):
        """The layout; without `is_padding_zeroed` (FP8 only) its padding rows and scales are
        zeroed after the kernel, so that the real rows compare bit for bit with XLA's."""
        n = shape.num_tokens if num_tokens is None else num_tokens

        def run(r, s):
            lay = permute.permute(
                r,
                ids[:n],
                num_experts=e,
                x_scales=s,
                expert_map=expert_map,
                alignment=alignment,
                is_padding_zeroed=is_padding_zeroed,
                impl=impl,
            )
            if is_padding_zeroed:
                return lay
            is_real = (lay.expert_ids >= 0)[:, None]
            return dataclasses.replace(
                lay,
                rows=jnp.where(is_real, lay.rows, jnp.zeros((), lay.rows.dtype)),
                row_scales=jnp.where(is_real, lay.row_scales, 0.0),
            )

        return jax.jit(run)(rows, scales)

    lay = run_permute("xla", x, None)
    y = jnp.asarray(np.random.default_rng(1).standard_normal(lay.rows.shape), jnp.bfloat16)

    def run_unpermute(impl, topk_weights):
        return jax.jit(lambda v: permute.unpermute(v, lay.inverse, topk_weights, impl=impl))(y)

    d = shape.decode_tokens
    # Decode-size layouts (16-row segments for the Pallas GEMM, 64 for the Mosaic FP8 GEMM, 128
    # for Mosaic's ragged_dot groups).
    decode_fp8 = run_permute("xla", xq[:d], xs[:d], alignment=16, num_tokens=d)
    decode_bf16 = run_permute("xla", x[:d], None, alignment=16, num_tokens=d)
    decode_fp8_64 = run_permute("xla", xq[:d], xs[:d], alignment=64, num_tokens=d)
    groups_bf16 = run_permute("xla", x[:d], None, num_tokens=d)
    masked = layouts.masked_layout_reference(
        xq[:d], ids[:d], num_experts=e, max_m=shape.max_m, x_scales=xs[:d], expert_map=expert_map
    )

    def contiguous_gemm(lay, w, w_scales, alignment):
        def run(impl):
            rows = lay.rows
            problem = grouped_gemm.GemmProblem(
                layout="contiguous",
                n=w.shape[1],
                k=w.shape[2],
                num_experts=e,
                num_pairs=d * shape.topk,
                x_dtype=jnp.dtype(rows.dtype).name,
                w_dtype=jnp.dtype(w.dtype).name,
                platform=jax.default_backend(),
                alignment=alignment,
            )
            backend = grouped_gemm.GEMMS.select(_gemm(impl), problem)
            out = jax.jit(
                lambda r, s: backend.contiguous(
                    r,
                    w,
                    lay.expert_ids,
                    lay.expert_ends,
                    x_scales=s,
                    w_scales=w_scales,
                    alignment=alignment,
                    out_dtype=jnp.bfloat16,
                )
            )(rows, lay.row_scales)
            return jnp.where((lay.expert_ids >= 0)[:, None], out, 0)  # padding: unspecified

        return run

    decode_fp8_128 = run_permute("xla", xq[:d], xs[:d], num_tokens=d)  # 128-row segments

    def gemm_act_quant(impl):
        """GEMM1 + act(gate) * up + FP8 quantization in one Mosaic kernel on 128-row segments
        (pairs of row blocks without a tile table, the heuristic's tiles); "xla" runs its
        pure-JAX reference."""
        lay = decode_fp8_128
        config = mosaic_fp8_gemm.act_quant_heuristic_config(
            num_rows=lay.rows.shape[0], num_experts=e, k=lay.rows.shape[1], alignment=128
        )
        fn = mosaic_fp8_gemm.mosaic_fp8_gemm_act_quant_contiguous
        if impl == "xla":
            fn = mosaic_fp8_gemm.mosaic_fp8_gemm_act_quant_reference
        options = mosaic_fp8_gemm.FusedGemm1Options(
            alignment=128, config=config, interpret=impl.endswith("interpret")
        )
        q, scales = jax.jit(
            lambda r, s: fn(r, w1q, lay.expert_ids, x_scales=s, w1_scales=w1s, options=options)
        )(lay.rows, lay.row_scales)
        valid = (lay.expert_ids >= 0)[:, None]  # padding rows: unspecified
        return jnp.where(valid, q.astype(jnp.float32) * jnp.repeat(scales, 128, axis=1), 0)

    def masked_gemm(impl):
        problem = grouped_gemm.GemmProblem(
            layout="masked",
            n=w1q.shape[1],
            k=w1q.shape[2],
            num_experts=e,
            num_pairs=d * shape.topk,
            x_dtype="float8_e4m3fn",
            w_dtype="float8_e4m3fn",
            platform=jax.default_backend(),
            max_m=shape.max_m,
        )
        backend = grouped_gemm.GEMMS.select(_gemm(impl), problem)
        counts = masked.num_tokens_per_expert
        out = jax.jit(
            lambda r, s: backend.masked(
                r, w1q, counts, x_scales=s, w_scales=w1s, out_dtype=jnp.bfloat16
            )
        )(masked.rows, masked.row_scales)
        is_valid = (
            jnp.arange(shape.max_m)[None, :] < counts[:, None]
        )  # past the counts: unspecified
        return jnp.where(is_valid[..., None], out, 0)

    def wgrad(impl):  # dw [E, I, H] of GEMM1's gate half: dy [rows, I], x [rows, H]
        rows = groups_bf16.rows
        dy = jnp.asarray(
            np.random.default_rng(3).standard_normal((rows.shape[0], shape.inter)), jnp.bfloat16
        )
        return jax.jit(
            lambda dy, x: grouped_gemm_backward.grouped_wgrad(
                dy,
                x,
                groups_bf16.expert_ids,
                groups_bf16.expert_ends,
                num_experts=e,
                alignment=layouts.DEFAULT_ALIGNMENT,
                out_dtype=jnp.float32,
                impl=impl,
            )
        )(dy, rows)

    return {
        "grouped_gemm_fp8": Kernel(
            contiguous_gemm(decode_fp8, w1q, w1s, 16), "pallas", "pallas_interpret", rtol=1e-2
        ),
        "grouped_gemm_bf16": Kernel(
            contiguous_gemm(decode_bf16, w1_bf16, None, 16), "pallas", "pallas_interpret", 1e-2
        ),
        "grouped_gemm_fp8_masked": Kernel(masked_gemm, "pallas", "pallas_interpret", rtol=1e-2),
        # The Mosaic GPU FP8 GEMM (TMA, warp-specialised) on 64-row segments.
        "mosaic_gemm_fp8": Kernel(
            contiguous_gemm(decode_fp8_64, w1q, w1s, 64),
            "mosaic_fp8",
            "mosaic_fp8_interpret",
            rtol=1e-2,
        ),
        # The same kernel with act(gate) * up and the FP8 quantization in its epilogue.
        "mosaic_gemm_act_quant": Kernel(
            gemm_act_quant, "mosaic_fp8", "mosaic_fp8_interpret", rtol=2e-2
        ),
        "mosaic_gemm_bf16": Kernel(
            contiguous_gemm(groups_bf16, w1_bf16, None, layouts.DEFAULT_ALIGNMENT),
            "mosaic",
            None,
            rtol=1e-2,
        ),
        "mosaic_wgrad_bf16": Kernel(wgrad, "mosaic", None, rtol=1e-2),
        "pallas_wgrad_bf16": Kernel(wgrad, "pallas", "pallas_interpret", rtol=1e-2),
        "group_quant": Kernel(
            lambda impl: jax.jit(lambda v: act_quant.group_quant(v, impl=impl))(x),
            "pallas",
            "pallas_interpret",
            # XLA:GPU's float32 division is not correctly rounded (README): its scales may sit
            # one ulp from vLLM's formula, which the kernel's div.rn follows, and move an FP8
            # code one step (0.12% of them at shape B on the H200, 2026-12-01).
            rtol=None if jax.default_backend() != "gpu" else 1e-2,
        ),
        "act_and_quant": Kernel(
            lambda impl: jax.jit(lambda v: act_quant.act_and_quant(v, impl=impl))(gate_up),
            "pallas",
            "pallas_interpret",
            # Compiled, Triton's exp may move an FP8 code one step (see test_kernels_act_quant).
            rtol=None if jax.default_backend() != "gpu" else 1e-2,
        ),
        "permute_bf16": Kernel(
            lambda impl: run_permute(impl, x, None), "pallas", "pallas_interpret"
        ),
        "permute_fp8": Kernel(lambda impl: run_permute(impl, xq, xs), "pallas", "pallas_interpret"),
        # the FP8 path's permute: padding rows left unwritten (real rows compared)
        "permute_fp8_unzeroed": Kernel(
            lambda impl: run_permute(impl, xq, xs, is_padding_zeroed=False),
            "pallas",
            "pallas_interpret",
        ),
        # The float32 slot sums may contract to FMAs (Triton, XLA): a bf16 output may round one
        # ulp apart (tests/test_kernels_unpermute holds them to a tolerance, not to bits).
        "unpermute": Kernel(
            lambda impl: run_unpermute(impl, weights), "pallas", "pallas_interpret", rtol=1e-3
        ),
        "unpermute_no_weights": Kernel(
            lambda impl: run_unpermute(impl, None), "pallas", "pallas_interpret", rtol=1e-3
        ),
        "count": Kernel(
            lambda impl: jax.jit(
                lambda i: permute.count_expert_num_tokens(i, e, expert_map, impl=impl)
            )(ids),
            "pallas",
            "pallas_interpret",
        ),
        # Raw ids (some negative, some >= E, duplicates in a row): the kernel sends them nowhere.
        "routing_metadata": Kernel(
            lambda impl: jax.jit(
                lambda i: permute.routing_metadata(
                    i,
                    num_experts=e,
                    alignment=layouts.DEFAULT_ALIGNMENT,
                    num_rows=layouts.contiguous_num_rows(
                        shape.num_tokens, shape.topk, e, layouts.DEFAULT_ALIGNMENT
                    ),
                    impl=impl,
                )
            )(ids),
            "pallas",
            "pallas_interpret",
        ),
    }


def _check(name: str, got, want, rtol: float | None) -> str:
    """Compares every array of the result with XLA's: bitwise, or to `rtol` relative error."""
    errors = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = (np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64) for a in (g, w))
        if rtol is None:
            np.testing.assert_array_equal(g, w, err_msg=name)
            continue
        errors.append(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
        if not errors[-1] < rtol:
            raise AssertionError(f"{name}: relative error {errors[-1]:.3g} >= {rtol} against XLA")
    return "equal to XLA" if rtol is None else f"relative error {max(errors):.2e} against XLA"


def main(names: list[str], *, interpret: bool = False, shape: Shape = SHAPE_B) -> int:
    """Runs the kernels named (all by default); 0 when each ran and matched XLA, 1 when one was
    refused, 2 for an unknown name. `interpret` runs the interpret-mode twins instead (the CPU
    test of this script), skipping kernels that have none."""
    runs = kernels(shape)
    unknown = sorted(set(names) - set(runs))
    if unknown:
        print(f"unknown kernels {unknown}; choose from {sorted(runs)}", file=sys.stderr)
        return 2
    for name in names or runs:
        kernel = runs[name]
        impl = kernel.interpret if interpret else kernel.compiled
        if impl is None:
            print(f"{name}: skipped (no interpret mode)", flush=True)
            continue
        try:
            got = jax.block_until_ready(kernel.run(impl))
        except NoImplementationError as error:
            print(f"{name}: not run ({error})", flush=True)
            return 1
        print(
            f"{name} ({impl}): ok, {_check(name, got, kernel.run('xla'), kernel.rtol)}", flush=True
        )
    s = shape
    print(
        f"all kernels ran at T={s.num_tokens} E={s.num_experts} k={s.topk} H={s.hidden} I={s.inter}"
    )
    return 0


SHAPES = {"b": SHAPE_B, "tiny": SHAPE_TINY}


def _parse(argv: list[str]) -> tuple[list[str], Shape]:
    """`[--shape b|tiny] [kernel ...]`: racecheck simulates every thread's shared-memory access,
    so it runs at the tiny shape (the same kernels, smaller grids) to finish in minutes."""
    shape = SHAPE_B
    if argv[:1] == ["--shape"]:
        if len(argv) < 2 or argv[1] not in SHAPES:
            raise SystemExit(f"--shape takes one of {sorted(SHAPES)}")
        shape, argv = SHAPES[argv[1]], argv[2:]
    return argv, shape


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if sys.argv[1:] == ["--list"]:
        print("\n".join(sorted(kernels(SHAPE_TINY))))
        sys.exit(0)
    names, shape = _parse(sys.argv[1:])
    sys.exit(main(names, shape=shape))
