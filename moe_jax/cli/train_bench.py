"""`python -m moe_jax.cli.train_bench`: one MoE training step (forward + backward), moe_jax against
torch's grouped-GEMM training step, each checked against a float32 reference before it is timed.

The step is `jax.value_and_grad` of `sum(fused_moe(x, w1, w2, topk_weights, ids) * probe)` with
respect to x, w1, w2 and topk_weights (the router's gradient path), on `layer_bench`'s random
layer (bf16 weights, softmax top-k routing). The reference is the same step on float32 copies
through `experts="xla"` at the highest matmul precision. Every variant reports the relative
Frobenius error of each gradient against it.

Variants:
  auto, torch, deep_gemm, xla   fused_moe(experts=...) ("xla": every stage in XLA, wgrad too)
  deep_gemm_nt_dgrad            deep_gemm with the dgrad as an NT GEMM against swapaxes(w)
  deep_gemm_mosaic_wgrad        deep_gemm with JAX's Mosaic GPU wgrad (transposed_ragged_dot)
  fp8_recipe                    ContiguousExperts(recipe=Fp8Training()) on the bf16 weights
  torch_titan                   torch: argsort, groups padded to 16 rows, two torch._grouped_mm,
                                autograd (torchtitan's MoE); GPU only

Times: "fwd ms" / "step ms" are medians of back-to-back bursts (`moe_jax.cli.timing.time_jax`;
torch: CUDA events over bursts), "step latency ms" the median of single waited-for steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp

from moe_jax.cli.layer_bench import SHAPES, make_layer
from moe_jax.cli.timing import rel_error, time_jax
from moe_jax.experts import ContiguousExperts
from moe_jax.fp8_training import Fp8Training
from moe_jax.fused_moe import fused_moe

VARIANTS = (
    "auto",
    "torch",
    "deep_gemm",
    "deep_gemm_nt_dgrad",
    "deep_gemm_mosaic_wgrad",
    "xla",
    "fp8_recipe",
    "torch_titan",
)
GRAD_NAMES = ("x", "w1", "w2", "topk_weights")


def experts_for(name: str):
    """The `experts=` argument of a moe_jax variant."""
    if name == "xla":
        return ContiguousExperts(gemm="xla", permute_impl="xla", act_quant_impl="xla", wgrad="xla")
    if name == "fp8_recipe":
        return ContiguousExperts(recipe=Fp8Training())
    if name == "deep_gemm_mosaic_wgrad":
        return ContiguousExperts(gemm="deep_gemm", wgrad="mosaic")
    if name == "deep_gemm_nt_dgrad":
        from moe_jax import grouped_gemm
        from moe_jax.interop.deep_gemm import DeepGemm

        class NtDgrad(DeepGemm):
            contiguous_dgrad = grouped_gemm.GroupedGemm.contiguous_dgrad

        return ContiguousExperts(gemm=NtDgrad())
    return name


def make_step(experts):
    """jit(value_and_grad) of the probe loss w.r.t. (x, w1, w2, topk_weights)."""

    def loss(x, w1, w2, topk_weights, topk_ids, probe):
        out = fused_moe(x, w1, w2, topk_weights, topk_ids, experts=experts)
        return jnp.sum(out.astype(jnp.float32) * probe)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def make_forward(experts):
    return jax.jit(lambda x, w1, w2, tw, ids: fused_moe(x, w1, w2, tw, ids, experts=experts))


def reference_grads(args):
    """float32 gradients through experts="xla" at the highest precision."""
    x, w1, w2, tw, ids, probe = args
    f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
    with jax.default_matmul_precision("highest"):
        _, grads = make_step(experts_for("xla"))(*f32, tw, ids, probe)
    return jax.block_until_ready(grads)


def _errors(grads, ref) -> dict:
    return {f"err_d{n}": rel_error(g, r) for n, g, r in zip(GRAD_NAMES, grads, ref, strict=True)}


def run_jax_variant(name: str, args, ref, *, iters: int) -> dict:
    experts = experts_for(name)
    step = make_step(experts)
    try:
        _, grads = step(*args)
    except Exception as error:  # a backend that cannot run here: report why, go on
        return {"variant": name, "skipped": f"{type(error).__name__}: {error}"[:300]}
    row = {"variant": name, **_errors(grads, ref)}
    x, w1, w2, tw, ids, _ = args
    row["fwd ms"], row["fwd latency ms"] = time_jax(
        make_forward(experts), (x, w1, w2, tw, ids), iters=iters
    )
    row["step ms"], row["step latency ms"] = time_jax(step, args, iters=iters)
    return row


def torch_titan_step(x, w1, w2, topk_weights, topk_ids, probe, *, align: int = 16):
    """torchtitan-style MoE step in torch: returns a closure running forward (+ backward).

    Tensors are torch CUDA tensors; x, w1, w2 bf16 and topk_weights float32 with requires_grad.
    """
    import torch
    import torch.nn.functional as F

    num_tokens, topk = topk_ids.shape
    num_experts, two_i, hidden = w1.shape
    inter = two_i // 2
    pairs = num_tokens * topk
    num_rows = pairs + num_experts * (align - 1)
    arange = torch.arange(pairs, device=x.device)

    def forward():
        flat = topk_ids.reshape(-1).long()
        counts = torch.bincount(flat, minlength=num_experts)
        padded = (counts + align - 1) // align * align
        offs = padded.cumsum(0).to(torch.int32)
        starts = offs - padded
        order = torch.argsort(flat, stable=True)
        experts = flat[order]
        rank = arange - (counts.cumsum(0) - counts)[experts]
        dest_sorted = starts[experts] + rank
        dest = torch.empty_like(dest_sorted)
        dest[order] = dest_sorted
        rows = x.new_zeros((num_rows, hidden)).index_copy(0, dest, x.repeat_interleave(topk, 0))
        h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
        per_pair = y[dest].view(num_tokens, topk, hidden).float()
        out = (per_pair * topk_weights[..., None]).sum(1).to(torch.bfloat16)
        return out

    def step():
        loss = (forward().float() * probe).sum()
        grads = torch.autograd.grad(loss, (x, w1, w2, topk_weights))
        return loss, grads

    return forward, step


def _cuda_median_ms(fn, *, iters: int, burst: int = 10) -> float:
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, iters // 2)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(burst):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / burst)
    return statistics.median(times)


def run_torch_titan(args, ref, *, iters: int) -> dict:
    name = "torch_titan"
    try:
        import torch
    except ImportError as error:
        return {"variant": name, "skipped": f"needs torch ({error})"}
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        return {"variant": name, "skipped": "needs a CUDA GPU (torch._grouped_mm on CUDA)"}
    x, w1, w2, tw, ids, probe = (torch.from_dlpack(a) for a in args)
    x, w1, w2, tw = (t.clone().requires_grad_(True) for t in (x, w1, w2, tw))
    forward, step = torch_titan_step(x, w1, w2, tw, ids, probe)
    _, grads = step()
    as_jax = [jnp.asarray(g.detach().float().cpu().numpy()) for g in grads]
    row = {"variant": name, **_errors(as_jax, ref)}
    with torch.no_grad():
        row["fwd ms"] = _cuda_median_ms(forward, iters=iters)
    row["step ms"] = _cuda_median_ms(step, iters=iters)
    return row


def run(shape_name: str, variants, *, iters: int, out=sys.stdout) -> list[dict]:
    shape = SHAPES[shape_name]
    layer = make_layer(shape)
    probe = jax.random.normal(jax.random.PRNGKey(7), layer.x.shape, jnp.float32)
    args = (layer.x, layer.w1, layer.w2, layer.topk_weights, layer.topk_ids, probe)
    ref = reference_grads(args)
    print(f"shape {shape}; jax {jax.__version__} on {jax.devices()[0].device_kind}", file=out)
    rows = []
    for name in variants:
        if name == "torch_titan":
            row = run_torch_titan(args, ref, iters=iters)
        else:
            row = run_jax_variant(name, args, ref, iters=iters)
        rows.append(row)
        print(json.dumps(row), file=out, flush=True)
    baseline = next((r for r in rows if r["variant"] == "torch_titan" and "step ms" in r), None)
    for row in rows:
        if baseline is not None and "step ms" in row:
            row["speedup vs torch_titan"] = baseline["step ms"] / row["step ms"]
    return rows


def _table(rows: list[dict]) -> str:
    cols = ("fwd ms", "step ms", "step latency ms", "speedup vs torch_titan", "err_dx", "err_dw1")
    cols += ("err_dw2", "err_dtopk_weights")
    lines = ["| variant | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['variant']} | skipped: {row['skipped']} |")
            continue
        cells = [f"{row[c]:.3g}" if c in row else "-" for c in cols]
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="B", choices=sorted(SHAPES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write the rows here as JSON")
    opts = parser.parse_args(argv)
    rows = run(opts.shape, opts.variants, iters=opts.iters)
    print(_table(rows))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"shape": opts.shape, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
