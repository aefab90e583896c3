"""`python -m moe_jax bench --train`: one MoE training step (forward + backward), moe_jax against
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
  tokamax, tokamax_mosaic, tokamax_triton
                                argsort + tokamax.ragged_dot (its default, "mosaic", "triton")
                                and tokamax's backward (`moe_jax.cli.tokamax_peer`; peers extra)
  torch_titan                   torch: argsort, groups padded to 16 rows, two torch._grouped_mm,
                                autograd (torchtitan's MoE): the baseline. On CUDA when JAX runs on
                                a GPU, else on the CPU (torch >= 2.8 has a CPU torch._grouped_mm)

Times come from `moe_jax.cli.timing.time_calls` for both frameworks: "fwd ms" / "step ms" are
medians of back-to-back bursts, "step latency ms" the median of single waited-for steps.
"speedup vs torch_titan" is torch_titan's step ms / the row's step ms, per shape. Progress lines
go to stderr as variants run, then one table like `bench`'s, each skip reason once below it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import TextIO

import jax
import jax.numpy as jnp

from moe_jax.cli import layer_report, tokamax_peer
from moe_jax.cli.layer_bench import SHAPES, make_layer
from moe_jax.cli.timing import rel_error, time_calls, time_jax
from moe_jax.contiguous_experts import ContiguousExperts
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
    *tokamax_peer.PEERS,
    "torch_titan",
)
BASELINE = "torch_titan"
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


def make_step(forward):
    """jit(value_and_grad) of the probe loss w.r.t. (x, w1, w2, topk_weights), where
    `forward(x, w1, w2, topk_weights, topk_ids)` is the layer."""

    def loss(x, w1, w2, topk_weights, topk_ids, probe):
        return jnp.sum(forward(x, w1, w2, topk_weights, topk_ids).astype(jnp.float32) * probe)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def reference_grads(args):
    """float32 gradients through experts="xla" at the highest precision."""
    x, w1, w2, tw, ids, probe = args
    f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
    forward = functools.partial(fused_moe, experts=experts_for("xla"))
    with jax.default_matmul_precision("highest"):
        _, grads = make_step(forward)(*f32, tw, ids, probe)
    return jax.block_until_ready(grads)


def _errors(grads, ref) -> dict:
    return {f"err_d{n}": rel_error(g, r) for n, g, r in zip(GRAD_NAMES, grads, ref, strict=True)}


def run_jax_variant(name: str, args, ref, *, iters: int) -> dict:
    """A moe_jax variant's row, or a tokamax peer's (its weights as [E, K, N], transposed before
    the timed step; its weight gradients transposed back for the errors)."""
    x, w1, w2, tw, ids, probe = args
    is_peer = name in tokamax_peer.PEERS
    if is_peer:
        if (why := tokamax_peer.unavailable_reason(name)) is not None:
            return {"variant": name, "skipped": why}
        forward = tokamax_peer.peer_layer(name)
        w1, w2 = jax.jit(tokamax_peer.to_kn)(w1, w2)
    else:
        forward = functools.partial(fused_moe, experts=experts_for(name))
    step = make_step(forward)
    args = (x, w1, w2, tw, ids, probe)
    try:
        _, (dx, dw1, dw2, dtw) = step(*args)
    except Exception as error:  # a backend that cannot run here: report why, go on
        return {"variant": name, "skipped": layer_report.skip_reason(error)}
    if is_peer:  # back to moe_jax's layout, as the reference's
        dw1, dw2 = tokamax_peer.to_kn(dw1, dw2)
    row = {"variant": name, **_errors((dx, dw1, dw2, dtw), ref)}
    row["fwd ms"], row["fwd latency ms"] = time_jax(jax.jit(forward), args[:5], iters=iters)
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


def run_torch_titan(args, ref, *, iters: int) -> dict:
    """The torchtitan-style step on the arrays' device (CUDA tensors on a GPU, else the CPU)."""
    name = BASELINE
    try:
        import torch
    except ImportError as error:
        return {"variant": name, "skipped": f"needs torch ({error})"}
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not torch.cuda.is_available():
        return {"variant": name, "skipped": "JAX runs on a GPU but torch has no CUDA"}
    try:  # torch before 2.8 has no CPU torch._grouped_mm: report why, go on
        x, w1, w2, tw, ids, probe = (torch.from_dlpack(a) for a in args)
        x, w1, w2, tw = (t.clone().requires_grad_(True) for t in (x, w1, w2, tw))
        forward, step = torch_titan_step(x, w1, w2, tw, ids, probe)
        _, grads = step()
    except Exception as error:
        return {"variant": name, "skipped": layer_report.skip_reason(error)}
    as_jax = [jnp.asarray(g.detach().float().cpu().numpy()) for g in grads]
    row = {"variant": name, **_errors(as_jax, ref)}
    wait = (lambda _: torch.cuda.synchronize()) if on_gpu else (lambda _: None)  # CPU: eager

    def timed(fn) -> tuple[float, float]:
        timing = time_calls(fn, wait=wait, samples=max(3, iters // 2), latency_samples=iters)
        return timing.streamed_ms, timing.latency_ms

    with torch.no_grad():
        row["fwd ms"], row["fwd latency ms"] = timed(forward)
    row["step ms"], row["step latency ms"] = timed(step)
    return row


def run(shape_name: str, variants, *, iters: int, progress: TextIO | None = None) -> list[dict]:
    """Rows (dicts with "shape", "variant", times and gradient errors, or "skipped") for one shape;
    a line per step goes to `progress` (None: the current sys.stderr) as it starts."""
    progress = sys.stderr if progress is None else progress
    shape = SHAPES[shape_name]
    print(f"[{shape}] building inputs and float32 gradients", file=progress, flush=True)
    layer = make_layer(shape)
    probe = jax.random.normal(jax.random.PRNGKey(7), layer.x.shape, jnp.float32)
    args = (layer.x, layer.w1, layer.w2, layer.topk_weights, layer.topk_ids, probe)
    ref = reference_grads(args)
    rows = []
    for step, name in enumerate(variants, 1):
        print(f"[{step}/{len(variants)}] {shape.name} {name}", file=progress, flush=True)
        try:
            if name == BASELINE:
                row = run_torch_titan(args, ref, iters=iters)
            else:
                row = run_jax_variant(name, args, ref, iters=iters)
        except Exception as error:  # e.g. out of memory while timing: report, go on
            row = {"variant": name, "skipped": f"failed: {layer_report.skip_reason(error)}"}
        rows.append({"shape": shape_name, **row})
    baseline = next((r for r in rows if r["variant"] == BASELINE and "step ms" in r), None)
    for row in rows:
        if baseline is not None and "step ms" in row:
            row[f"speedup vs {BASELINE}"] = baseline["step ms"] / row["step ms"]
    return rows


# (row key, header, format) of the table's timed columns
COLUMNS = (
    ("fwd ms", "fwd ms", ".3f"),
    ("step ms", "step ms", ".3f"),
    ("step latency ms", "latency ms", ".3f"),
    (f"speedup vs {BASELINE}", f"x {BASELINE}", ".2f"),
    *((f"err_d{name}", f"err d{name}", ".2e") for name in GRAD_NAMES),
)


def format_table(rows: list[dict]) -> str:
    """One line per (shape, variant) row of `run`, as `bench`'s table: times, the speedup over
    the torch step, each gradient's error; a skipped row names its reason's note, each reason
    printed once below the table."""
    width = max([12, *(len(r["variant"]) for r in rows)])
    lines = layer_report.column_table(
        rows,
        COLUMNS,
        f"{'shape':<6} {'variant':<{width}}",
        lambda row: f"{row['shape']:<6} {row['variant']:<{width}}",
        10,
    )
    lines.append(
        "fwd / step ms: per call, back to back; latency: one step waited for. "
        f"x {BASELINE}: its step ms / step ms. err: each gradient against float32."
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Bar chart of step ms per variant (the baseline grey), one panel per shape, as PNG."""
    layer_report.plot(
        rows,
        path,
        shapes=SHAPES,
        baselines=(BASELINE,),
        value_key="step ms",
        xlabel="ms per training step, forward + backward, lower is better",
    )


def run_train_bench(
    *,
    shapes: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
    iters: int = 20,
    json_path: str | None = None,
    plot_path: str | None = None,
    progress: TextIO | None = None,
) -> int:
    """The `bench --train` command: runs, prints the table, writes JSON/PNG; returns the exit code.

    Args:
      shapes: names from `layer_bench.SHAPES`; None: B on a GPU, "small" elsewhere.
      variants: names from `VARIANTS`; None: all (each runs or says why not).
      iters: latency samples per variant (streamed samples: max(3, iters // 2)).
      json_path: write {"environment", "rows"} there.
      plot_path: write a PNG bar chart of the step times there.
      progress: where a line per step goes as it starts (None: the current sys.stderr).
    """
    shape_names = list(shapes or (["B"] if jax.default_backend() == "gpu" else ["small"]))
    variants = list(variants or VARIANTS)
    for given, known, what in (
        (shape_names, sorted(SHAPES), "shape"),
        (variants, VARIANTS, "variant"),
    ):
        unknown = [n for n in given if n not in known]
        if unknown:
            print(f"unknown {what} {unknown[0]!r}; choose from {list(known)}", file=sys.stderr)
            return 2
    if iters < 1:
        print(f"iters={iters} but at least 1 timed call is needed", file=sys.stderr)
        return 2
    rows = [
        row for name in shape_names for row in run(name, variants, iters=iters, progress=progress)
    ]
    env = layer_report.environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(format_table(rows))
    return layer_report.write_outputs(
        dict(environment=env, rows=rows),
        json_path=json_path,
        plot_path=plot_path,
        draw=lambda path: plot(rows, path),
    )
