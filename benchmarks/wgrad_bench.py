"""`python -m benchmarks.wgrad_bench`: the grouped weight gradient of a layer's two GEMMs, every
`WGRADS` implementation that runs here and a sweep of Mosaic GPU tile configurations, each checked
against the float32 XLA wgrad first.

The problems are the training step's: on `layer_bench`'s random routing, the permuted layout of
the layer's tokens (alignment 128, DeepGEMM's), GEMM1's wgrad dw1 [E, 2I, H] = dh^T rows and
GEMM2's dw2 [E, H, I] = dy^T a, with random bf16 cotangents and zero padding rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm_backward, permute
from moe_jax.cli.layer_bench import SHAPES, make_layer
from moe_jax.cli.timing import rel_error, time_jax
from moe_jax.registry import NoImplementationError

ALIGNMENT = 128


def wgrad_problems(shape_name: str) -> dict[str, tuple[jax.Array, jax.Array, object]]:
    """{"GEMM1": (dy [M, 2I], x [M, H], layout), "GEMM2": (dy [M, H], a [M, I], layout)}."""
    shape = SHAPES[shape_name]
    layer = make_layer(shape)
    lay = jax.jit(
        lambda x, ids: permute.permute(
            x, ids, num_experts=shape.num_experts, alignment=ALIGNMENT, impl="xla"
        )
    )(layer.x, layer.topk_ids)
    is_valid = (lay.expert_ids >= 0)[:, None]
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    num_rows = lay.rows.shape[0]

    def rows_of(key, width):
        values = jax.random.normal(key, (num_rows, width), jnp.bfloat16)
        return jnp.where(is_valid, values, jnp.zeros((), jnp.bfloat16))

    inter, hidden = shape.intermediate, shape.hidden
    return {
        "GEMM1": (rows_of(keys[0], 2 * inter), lay.rows, lay),
        "GEMM2": (rows_of(keys[1], hidden), rows_of(keys[2], inter), lay),
    }


def _mosaic_configs():
    from moe_jax.kernels.mosaic_wgrad import MosaicWgrad, MosaicWgradConfig

    for bm, bn, bk, steps, grid_n in itertools.product(
        (128,), (128, 256), (64,), (2, 4), (1, 4, 8)
    ):
        config = MosaicWgradConfig(
            block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=grid_n
        )
        yield f"mosaic bm{bm} bn{bn} bk{bk} s{steps} g{grid_n}", MosaicWgrad(config)


def _wgrad(impl, num_experts: int):
    """jit of the grouped wgrad through `impl` (a `WGRADS` name or object), bf16 result."""

    def fn(dy, x, expert_ids, expert_ends):
        return grouped_gemm_backward.grouped_wgrad_zero_padded(
            dy,
            x,
            expert_ids,
            expert_ends,
            num_experts=num_experts,
            alignment=ALIGNMENT,
            out_dtype=jnp.bfloat16,
            impl=impl,
        )

    return jax.jit(fn)


def _pallas_configs():
    import functools

    from moe_jax.kernels.wgrad import WgradConfig, grouped_wgrad
    from moe_jax.registry import FunctionImpl

    for bm, bn, bk, warps, stages in (
        (64, 128, 128, 4, 3),
        (64, 128, 256, 8, 3),
        (64, 256, 128, 8, 3),
        (128, 128, 128, 8, 3),
        (32, 128, 128, 8, 4),
        (64, 128, 128, 8, 4),
    ):
        config = WgradConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        fn = functools.partial(grouped_wgrad, config=config)
        yield f"pallas m{bm} n{bn} k{bk} w{warps} s{stages}", FunctionImpl("pallas", fn)


def run(shape_name: str, *, iters: int, sweep: bool, out=None) -> list[dict]:
    """Rows for `shape_name`; each is printed as a JSON line to `out` (None: sys.stdout)."""
    rows: list[dict] = []
    for gemm, (dy, x, lay) in wgrad_problems(shape_name).items():
        num_experts = lay.expert_ends.shape[0]

        args = (dy, x, lay.expert_ids, lay.expert_ends)
        f32 = (dy.astype(jnp.float32), x.astype(jnp.float32), lay.expert_ids, lay.expert_ends)
        with jax.default_matmul_precision("highest"):
            ref = jax.block_until_ready(_wgrad("xla", num_experts)(*f32))
        candidates = [(name, name) for name in ("torch", "mosaic", "pallas")]
        if sweep and jax.default_backend() == "gpu":
            candidates += list(_mosaic_configs()) + list(_pallas_configs())
        for label, impl in candidates:
            row = {"shape": shape_name, "gemm": gemm, "wgrad": label}
            try:
                fn = _wgrad(impl, num_experts)
                row["rel error"] = rel_error(fn(*args), ref)
                row["ms"] = time_jax(fn, args, iters=iters)[0]
            except NoImplementationError as error:
                row["skipped"] = "; ".join(f"{n}: {why}" for n, why in error.refusals.items())
            except Exception as error:  # a tile configuration that fails to lower
                row["skipped"] = f"{type(error).__name__}: {error}"[:300]
            rows.append(row)
            print(json.dumps(row), file=out, flush=True)
        direct = _torch_direct_ms(args, iters=iters)
        if direct is not None:
            row = {"shape": shape_name, "gemm": gemm, "wgrad": "torch direct (no bridge)"}
            rows.append({**row, "ms": direct, "rel error": float("nan")})
    return rows


def _torch_direct_ms(args, *, iters: int) -> float | None:
    """`torch._grouped_mm(dy.T, x, offs)` called from torch itself, result not copied anywhere:
    what the "torch" row costs without the bridge and the copy into XLA's buffer."""
    try:
        import torch
    except ImportError:
        return None
    if jax.default_backend() != "gpu" or not torch.cuda.is_available():
        return None
    from moe_jax.cli.timing import time_torch

    dy, x, _, ends = (torch.from_dlpack(a) for a in args)
    return time_torch(lambda: torch._grouped_mm(dy.t(), x, offs=ends), iters=iters)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["B"], choices=sorted(SHAPES))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also sweep Mosaic tile configs")
    parser.add_argument("--json", help="write the rows here as JSON")
    opts = parser.parse_args(argv)
    rows = [r for s in opts.shapes for r in run(s, iters=opts.iters, sweep=opts.sweep)]
    print("| shape | GEMM | wgrad | ms | rel. error |\n|---|---|---|---|---|")
    for r in rows:
        if "ms" in r:
            print(
                f"| {r['shape']} | {r['gemm']} | {r['wgrad']} | {r['ms']:.3f} | "
                f"{r['rel error']:.1e} |"
            )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
