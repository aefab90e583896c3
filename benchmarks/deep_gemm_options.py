"""DeepGEMM's FP8 contiguous grouped GEMMs at the layer's shapes under its process-wide options.

The evidence for calling DeepGEMM with its defaults from `moe_jax.interop.deep_gemm`. For each
`bench` shape (`moe_jax.cli.layer_bench.SHAPES`) and each of the layer's two GEMMs (GEMM1: N = 2I,
K = H; GEMM2: N = H, K = I) it times `m_grouped_fp8_gemm_nt_contiguous` on a top-k routing's
contiguous layout under:

- segment alignment (`--alignments`, DeepGEMM's `set_mk_alignment_for_contiguous_layout`; on
  sm_90 it is also the tile's row count, so 64 means 64-row tiles and about half the padding);
- programmatic dependent launch (`--pdl`: each row also with `set_pdl(True)`);
- the N tile (`--block-n-multiples`: `set_block_size_multiple_of((1, n))`, DeepGEMM then models
  only tiles of a multiple of n columns; 1 is its own choice).

Correct first: every configuration's output (written over NaN) is compared with a float32
product on a sample of rows (relative error), and its valid rows, at one alignment, bit for bit
with DeepGEMM's own choice.
Operands are random (normal FP8 codes, scales in [0.5, 1.5)), never zeros. Timing: CUDA events
around one call, median of `--iters` after 3 warm-ups; A's GEMMs run into the H200's power
cap, so compare its rows within one run and in both orders.

    python -m benchmarks.deep_gemm_options [--shapes B A] [--alignments 128 64] [--pdl]
        [--block-n-multiples 1 192 160 128 96 64] [--iters 30]

Needs torch with CUDA and deep_gemm (on the H200 host: `source .gpu/install.sh`); the layout
builder (`contiguous_expert_ids`, moe_jax's own layout) runs anywhere torch does.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from moe_jax import layouts
from moe_jax.cli.layer_bench import SHAPES, BenchShape

SCALE_BLOCK = 128  # DeepGEMM's scale block: 1 x 128 for activations, 128 x 128 for weights
SAMPLED_ROWS = 16  # rows checked against float32 per configuration


def contiguous_expert_ids(topk_ids: torch.Tensor, num_experts: int, alignment: int) -> torch.Tensor:
    """int32[M] expert of each row of the contiguous layout, -1 on padding, on `topk_ids`' device.

    `moe_jax.layouts.routing_metadata`'s expert ids (computed on JAX's CPU device, so JAX takes
    no GPU memory beside torch) for M = `contiguous_num_rows(T, k, E, alignment)`, padded with
    -1 to a multiple of 128 rows (what moe_jax passes DeepGEMM).
    """
    num_tokens, topk = topk_ids.shape
    num_rows = layouts.contiguous_num_rows(num_tokens, topk, num_experts, alignment)
    with jax.default_device(jax.devices("cpu")[0]):
        local = layouts.map_expert_ids(jnp.asarray(topk_ids.cpu().numpy()), num_experts=num_experts)
        meta = layouts.routing_metadata(
            local, num_experts=num_experts, alignment=alignment, num_rows=num_rows
        )
        expert_ids = torch.from_numpy(np.array(meta.expert_ids))
    padded = -(-num_rows // SCALE_BLOCK) * SCALE_BLOCK
    expert_ids = torch.nn.functional.pad(expert_ids, (0, padded - num_rows), value=-1)
    return expert_ids.to(device=topk_ids.device, dtype=torch.int32)


@dataclasses.dataclass(frozen=True)
class Row:
    shape: str
    gemm: str
    alignment: int
    is_pdl: bool
    block_n_multiple: int
    us: float
    rel_err: float
    same_bits: bool | None  # against DeepGEMM's own choice at this alignment; None: is that one


def _fp8(shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.randn(shape, device="cuda") * 0.5).to(torch.float8_e4m3fn)


def _mn_major_scales(num_rows: int, k: int) -> torch.Tensor:
    """float32[M, K/128] view with strides (1, align(M, 4)): DeepGEMM's layout, no copy."""
    padded = -(-num_rows // 4) * 4
    storage = torch.rand(k // SCALE_BLOCK, padded, device="cuda") + 0.5
    return storage.as_strided((num_rows, k // SCALE_BLOCK), (1, padded))


def _time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def _rel_err(d, x, x_scales, w, w_scales, expert_ids) -> float:
    """|d - float32 product| / |product| over `SAMPLED_ROWS` valid rows spread over the layout."""
    valid = torch.nonzero(expert_ids >= 0).flatten()
    rows = valid[:: max(1, valid.numel() // SAMPLED_ROWS)][:SAMPLED_ROWS]
    experts = expert_ids[rows].long()
    n, k = w.shape[1], w.shape[2]
    xs = x[rows].float().view(-1, k // SCALE_BLOCK, SCALE_BLOCK) * x_scales[rows][..., None]
    ws = w[experts].float().view(-1, n // SCALE_BLOCK, SCALE_BLOCK, k // SCALE_BLOCK, SCALE_BLOCK)
    ws = ws * w_scales[experts][:, :, None, :, None]
    want = torch.einsum("rk,rnk->rn", xs.reshape(-1, k), ws.reshape(-1, n, k))
    return float((d[rows].float() - want).norm() / want.norm())


def run_shape(shape: BenchShape, args, deep_gemm) -> list[Row]:
    torch.manual_seed(args.seed)
    e, k_top = shape.num_experts, shape.topk
    topk_ids = torch.argsort(torch.rand(shape.num_tokens, e, device="cuda"), dim=1)[:, :k_top]
    gemms = {
        "GEMM1": (2 * shape.intermediate, shape.hidden),
        "GEMM2": (shape.hidden, shape.intermediate),
    }
    rows = []
    for alignment in args.alignments:
        deep_gemm.set_mk_alignment_for_contiguous_layout(alignment)
        expert_ids = contiguous_expert_ids(topk_ids, e, alignment)
        num_rows = expert_ids.numel()
        for gemm, (n, k) in gemms.items():
            x, x_scales = _fp8((num_rows, k)), _mn_major_scales(num_rows, k)
            w = _fp8((e, n, k))
            w_scales = torch.rand(e, n // SCALE_BLOCK, k // SCALE_BLOCK, device="cuda") + 0.5
            d = torch.empty(num_rows, n, dtype=torch.bfloat16, device="cuda")

            call = functools.partial(
                deep_gemm.m_grouped_fp8_gemm_nt_contiguous,
                (x, x_scales),
                (w, w_scales),
                d,
                expert_ids,
            )

            own = None
            for multiple in args.block_n_multiples:
                for is_pdl in (False, True) if args.pdl else (False,):
                    deep_gemm.set_block_size_multiple_of((1, multiple))
                    deep_gemm.set_pdl(is_pdl)
                    us = _time_us(call, args.iters)
                    d.fill_(
                        float("nan")
                    )  # poisoned: a call that skips valid rows fails both checks
                    call()
                    valid = d[expert_ids >= 0]
                    if own is None:
                        own, same = valid.clone(), None
                    else:
                        same = torch.equal(valid, own)
                    err = _rel_err(d, x, x_scales, w, w_scales, expert_ids)
                    row = Row(shape.name, gemm, alignment, is_pdl, multiple, us, err, same)
                    print(_format(row), flush=True)
                    rows.append(row)
            deep_gemm.set_block_size_multiple_of((1, 1))
            deep_gemm.set_pdl(False)
    deep_gemm.set_mk_alignment_for_contiguous_layout(SCALE_BLOCK)
    return rows


def _format(row: Row) -> str:
    same = "-" if row.same_bits is None else str(row.same_bits)
    return (
        f"{row.shape:5} {row.gemm:5} align {row.alignment:3}  pdl {row.is_pdl!s:5}  "
        f"block_n x{row.block_n_multiple:<3}  {row.us:8.1f} us  rel err {row.rel_err:.2e}  "
        f"same bits {same}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["B", "A"], choices=["A", "B", "small"])
    parser.add_argument("--alignments", nargs="+", type=int, default=[128, 64])
    parser.add_argument("--block-n-multiples", nargs="+", type=int, default=[1])
    parser.add_argument("--pdl", action="store_true", help="also time each row with PDL on")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if any(a not in (64, 128) for a in args.alignments):
        print(
            f"--alignments {args.alignments}: DeepGEMM's sm_90 tiles take 64 or 128",
            file=sys.stderr,
        )
        return 2
    if args.block_n_multiples[0] != 1:
        args.block_n_multiples = [1, *args.block_n_multiples]  # DeepGEMM's own choice first
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    try:
        import deep_gemm
    except ImportError as error:
        print(
            f"needs deep_gemm ({error}); on the H200 host: source .gpu/install.sh", file=sys.stderr
        )
        return 2
    rows = [row for name in args.shapes for row in run_shape(SHAPES[name], args, deep_gemm)]
    bad = [row for row in rows if not row.rel_err < 1e-2 or row.same_bits is False]
    print(f"\n{len(rows)} rows; fastest per shape and GEMM:")
    for key in dict.fromkeys((r.shape, r.gemm) for r in rows):
        group = [r for r in rows if (r.shape, r.gemm) == key]
        best, own = min(group, key=lambda r: r.us), group[0]
        print(f"  {_format(best)}   (DeepGEMM's own choice {own.us:.1f} us)")
    if bad:
        print(
            f"{len(bad)} rows failed their check (rel err >= 1e-2 or bits differ)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
