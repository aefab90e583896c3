"""`python -m moe_jax bench`: whole-layer forward times against baselines, checked, in one table.

Every variant runs the same routed layer (random tokens, softmax top-k routing) and is checked
against a float32 reference on the same weights before it is timed. Times are medians, after
warm-up, of bursts of back-to-back calls ("ms", the cost of a layer inside a model whose host runs
ahead) and of single waited-for calls ("latency ms"), with `block_until_ready` (JAX) or CUDA
events (torch). TFLOPS count the routed work
only: 6 * T * k * H * I.

Variants (each runs where it can; the table says why one did not):
  jax_ragged_dot_bf16   argsort + jax.lax.ragged_dot (what a JAX user writes today)
  jax_mosaic_bf16       argsort + JAX's Mosaic GPU ragged_dot kernel (GPU)
  torch_deep_gemm_fp8   torch glue (sort, index, quantize in torch ops) + DeepGEMM FP8 (GPU)
  moe_jax_bf16          fused_moe(experts="auto") on bf16 weights
  moe_jax_fp8           fused_moe(experts="auto") on FP8 block weights
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax.experts import ContiguousExperts
from moe_jax.fused_moe import fused_moe
from moe_jax.routing import fused_topk
from moe_jax.cli.timing import rel_error, time_jax


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchShape:
    name: str
    num_tokens: int
    num_experts: int
    topk: int
    hidden: int
    intermediate: int

    @property
    def flops(self) -> int:
        return 6 * self.num_tokens * self.topk * self.hidden * self.intermediate

    def __str__(self) -> str:
        return (
            f"{self.name}: T={self.num_tokens} E={self.num_experts} k={self.topk} "
            f"H={self.hidden} I={self.intermediate}"
        )


SHAPES = {
    "A": BenchShape(
        name="A", num_tokens=4096, num_experts=32, topk=8, hidden=7168, intermediate=2048
    ),
    "B": BenchShape(
        name="B", num_tokens=8192, num_experts=128, topk=8, hidden=2048, intermediate=768
    ),
    "small": BenchShape(
        name="small", num_tokens=256, num_experts=8, topk=2, hidden=256, intermediate=128
    ),
}
VARIANTS = (
    "jax_ragged_dot_bf16",
    "jax_mosaic_bf16",
    "torch_deep_gemm_fp8",
    "moe_jax_bf16",
    "moe_jax_fp8",
)
BASELINES = ("jax_ragged_dot_bf16", "jax_mosaic_bf16", "torch_deep_gemm_fp8")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer's inputs: bf16 and FP8 forms of the same expert weights, routed tokens."""

    x: jax.Array
    topk_weights: jax.Array
    topk_ids: jax.Array
    w1: jax.Array
    w2: jax.Array
    w1q: jax.Array
    w1s: jax.Array
    w2q: jax.Array
    w2s: jax.Array


def make_layer(shape: BenchShape, seed: int = 0) -> Layer:
    s = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(keys[0], (s.num_tokens, s.hidden), jnp.bfloat16)
    logits = jax.random.normal(keys[1], (s.num_tokens, s.num_experts), jnp.float32)
    topk_weights, topk_ids = fused_topk(logits, s.topk)
    w1 = jax.random.normal(keys[2], (s.num_experts, 2 * s.intermediate, s.hidden), jnp.bfloat16)
    w2 = jax.random.normal(keys[3], (s.num_experts, s.hidden, s.intermediate), jnp.bfloat16)
    w1 = (w1 * s.hidden**-0.5).astype(jnp.bfloat16)
    w2 = (w2 * s.intermediate**-0.5).astype(jnp.bfloat16)
    w1q, w1s = jax.jit(quant.per_block_quant_fp8)(w1)
    w2q, w2s = jax.jit(quant.per_block_quant_fp8)(w2)
    return Layer(x, topk_weights, topk_ids, w1, w2, w1q, w1s, w2q, w2s)


def reference(layer: Layer, *, fp8: bool) -> jax.Array:
    """float32 forward on the same weights (dequantized FP8 for fp8), via the XLA experts."""
    if fp8:
        w1 = quant.dequant_per_block(layer.w1q, layer.w1s)
        w2 = quant.dequant_per_block(layer.w2q, layer.w2s)
    else:
        w1, w2 = layer.w1.astype(jnp.float32), layer.w2.astype(jnp.float32)
    experts = ContiguousExperts(gemm="xla", permute_impl="xla", act_quant_impl="xla")
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda *a: fused_moe(*a, experts=experts))(
            layer.x.astype(jnp.float32), w1, w2, layer.topk_weights, layer.topk_ids
        )


def _sort_pipeline(gemm: Callable) -> Callable:
    """A user's JAX MoE: argsort by expert, two grouped GEMMs, unsort, weighted sum."""

    def forward(x, w1, w2, topk_weights, topk_ids):
        num_tokens, topk = topk_ids.shape
        num_experts = w1.shape[0]
        flat = topk_ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        rows = x[order // topk]
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        h = gemm(rows, w1, sizes)
        inter = h.shape[1] // 2
        a = jax.nn.silu(h[:, :inter].astype(jnp.float32)).astype(h.dtype) * h[:, inter:]
        y = gemm(a, w2, sizes)
        unsorted = jnp.zeros_like(y).at[order].set(y).reshape(num_tokens, topk, -1)
        out = jnp.sum(unsorted.astype(jnp.float32) * topk_weights[..., None], axis=1)
        return out.astype(x.dtype)

    return forward


def _lax_ragged(rows, w, sizes):
    return jax.lax.ragged_dot(
        rows, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=jnp.float32
    ).astype(rows.dtype)


def _mosaic_ragged(rows, w, sizes):
    from moe_jax.kernels.mosaic_gemm import MosaicGemm

    return MosaicGemm().ragged_dot(rows, w, sizes, rows.dtype)


def _jax_variant(name: str, layer: Layer) -> tuple[Callable, tuple] | str:
    """(jitted fn, args) for a JAX variant, or why it cannot run here."""
    on_gpu = jax.default_backend() == "gpu"
    bf16_args = (layer.x, layer.w1, layer.w2, layer.topk_weights, layer.topk_ids)
    if name == "jax_ragged_dot_bf16":
        return jax.jit(_sort_pipeline(_lax_ragged)), bf16_args
    if name == "jax_mosaic_bf16":
        if not on_gpu:
            return "needs an NVIDIA GPU"
        return jax.jit(_sort_pipeline(_mosaic_ragged)), bf16_args
    if name == "moe_jax_bf16":
        return jax.jit(lambda *a: fused_moe(*a, experts="auto")), bf16_args
    if name == "moe_jax_fp8":
        fp8_args = (
            layer.x,
            layer.w1q,
            layer.w2q,
            layer.topk_weights,
            layer.topk_ids,
            layer.w1s,
            layer.w2s,
        )
        return jax.jit(
            lambda x, w1, w2, tw, ti, s1, s2: fused_moe(
                x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2, experts="auto"
            )
        ), fp8_args
    raise ValueError(f"unknown variant {name!r}; choose from {list(VARIANTS)}")


def run_variant(name: str, layer: Layer, refs: dict, *, iters: int) -> dict:
    """One table row: time, error against the float32 reference, or the reason it was skipped."""
    is_fp8 = name.endswith("fp8")
    if name == "torch_deep_gemm_fp8":
        from moe_jax import torch_baseline

        result = torch_baseline.run(layer, iters=iters)
        if isinstance(result, str):
            return dict(skipped=result)
        out, ms, latency_ms = result
    else:
        built = _jax_variant(name, layer)
        if isinstance(built, str):
            return dict(skipped=built)
        fn, args = built
        out = fn(*args)
        ms, latency_ms = time_jax(fn, args, iters=iters)
    return dict(
        ms=ms, latency_ms=latency_ms, rel_err=rel_error(out, refs["fp8" if is_fp8 else "bf16"])
    )


def run(
    shape_names: list[str], variants: list[str], *, iters: int, progress=sys.stderr
) -> list[dict]:
    rows = []
    steps = len(shape_names) * len(variants)
    step = 0
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        print(f"[{shape}] building inputs and float32 references", file=progress, flush=True)
        layer = make_layer(shape)
        refs = {"bf16": reference(layer, fp8=False), "fp8": reference(layer, fp8=True)}
        for name in variants:
            step += 1
            print(f"[{step}/{steps}] {shape.name} {name}", file=progress, flush=True)
            try:
                row = run_variant(name, layer, refs, iters=iters)
            except Exception as error:  # a broken variant is reported, the others still run
                row = dict(skipped=f"failed: {type(error).__name__}: {error}"[:200])
            row.update(shape=shape.name, variant=name)
            if "ms" in row:
                row["tflops"] = shape.flops / row["ms"] / 1e9
            rows.append(row)
    _add_ratios(rows)
    return rows


def stage_breakdown(layer: Layer, *, iters: int) -> list[dict]:
    """Median ms of each stage of moe_jax's FP8 forward, each jitted alone on real inputs."""
    from moe_jax import permute
    from moe_jax.experts import ExpertsCall, ExpertWeights, _activate, resolve_experts
    from moe_jax.prepare_finalize import quantize_tokens

    num_tokens, topk = layer.topk_ids.shape
    weights = ExpertWeights(w1=layer.w1q, w2=layer.w2q, w1_scale=layer.w1s, w2_scale=layer.w2s)
    experts = resolve_experts(
        "auto", weights, num_tokens=num_tokens, topk=topk, x_dtype=quant.FP8_DTYPE
    )
    if not isinstance(experts, ContiguousExperts):
        return []
    gemm1, gemm2 = experts.select_gemms(
        weights, num_tokens=num_tokens, topk=topk, x_dtype=quant.FP8_DTYPE
    )
    config = quant.Fp8BlockQuant()
    call = ExpertsCall(quant_config=config, out_dtype=jnp.bfloat16)
    num_experts, align = weights.num_experts, experts.alignment

    def gemm(backend):
        return jax.jit(
            lambda rows, scales, ids, ends, w, ws: backend.contiguous(
                rows,
                w,
                ids,
                ends,
                x_scales=scales,
                w_scales=ws,
                alignment=align,
                out_dtype=jnp.bfloat16,
            )
        )

    stages = [
        ("quantize x", jax.jit(lambda x: quantize_tokens(x, config)), lambda: (layer.x,)),
        (
            "permute",
            jax.jit(
                lambda xq, xs, ids: permute.permute(
                    xq,
                    ids,
                    num_experts=num_experts,
                    x_scales=xs,
                    alignment=align,
                    impl=experts.permute_impl,
                )
            ),
            lambda: (*state["xq"], layer.topk_ids),
        ),
        (
            f"GEMM1 ({gemm1.name})",
            gemm(gemm1),
            lambda: (
                state["lay"].rows,
                state["lay"].row_scales,
                state["lay"].expert_ids,
                state["lay"].expert_ends,
                layer.w1q,
                layer.w1s,
            ),
        ),
        (
            "act*up + quantize",
            jax.jit(lambda h: _activate(h, call, experts.act_quant_impl)),
            lambda: (state["h"],),
        ),
        (
            f"GEMM2 ({gemm2.name})",
            gemm(gemm2),
            lambda: (
                *state["a"],
                state["lay"].expert_ids,
                state["lay"].expert_ends,
                layer.w2q,
                layer.w2s,
            ),
        ),
        (
            "unpermute + reduce",
            jax.jit(
                lambda y, inv, w: permute.unpermute(
                    y, inv, w, out_dtype=jnp.bfloat16, impl=experts.permute_impl
                )
            ),
            lambda: (state["y"], state["lay"].inverse, layer.topk_weights),
        ),
    ]
    keys = ["xq", "lay", "h", "a", "y", None]
    state: dict = {}
    rows = []
    for (name, fn, args), key in zip(stages, keys, strict=True):
        out = fn(*args())
        rows.append(dict(stage=name, ms=time_jax(fn, args(), iters=iters)[0]))
        if key:
            state[key] = out
    return rows


def format_breakdown(shape: BenchShape, rows: list[dict]) -> str:
    total = sum(r["ms"] for r in rows)
    lines = [f"stages of moe_jax_fp8, shape {shape} (each jitted alone)"]
    for r in rows:
        lines.append(f"  {r['stage']:<24} {r['ms']:>8.3f} ms  {100 * r['ms'] / total:5.1f}%")
    lines.append(f"  {'sum':<24} {total:>8.3f} ms")
    return "\n".join(lines)


def _add_ratios(rows: list[dict]) -> None:
    """speedup = best baseline time of the shape / this time."""
    for shape in {r["shape"] for r in rows}:
        base = [
            r["ms"] for r in rows if r["shape"] == shape and r["variant"] in BASELINES and "ms" in r
        ]
        for r in rows:
            if r["shape"] == shape and "ms" in r and base:
                r["vs_best_baseline"] = min(base) / r["ms"]


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'shape':<6} {'variant':<22} {'ms':>9} {'TFLOPS':>8} {'x best base':>11} {'rel. err':>9}"
        f" {'latency ms':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if "ms" not in r:
            lines.append(f"{r['shape']:<6} {r['variant']:<22} skipped: {r['skipped']}")
            continue
        ratio = f"{r['vs_best_baseline']:.2f}" if "vs_best_baseline" in r else "-"
        lines.append(
            f"{r['shape']:<6} {r['variant']:<22} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
            f"{ratio:>11} {r['rel_err']:>9.2e} {r['latency_ms']:>10.3f}"
        )
    lines.append(
        "ms: per forward, 10 calls back to back (host ahead, as in a model); latency: one "
        "call waited for. x best base: best baseline ms / ms."
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Bar chart of ms per variant, one panel per shape (log scale), written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        timed = [r for r in rows if r["shape"] == shape and "ms" in r]
        names = [r["variant"] for r in timed]
        colors = ["tab:gray" if n in BASELINES else "tab:blue" for n in names]
        bars = ax.barh(names, [r["ms"] for r in timed], color=colors)
        ax.bar_label(bars, labels=[f"{r['ms']:.2f} ms" for r in timed], padding=3, fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("ms per layer forward (log scale; lower is better)")
        ax.set_title(f"{SHAPES[shape]} on {jax.devices()[0].device_kind}", fontsize=9)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment() -> dict:
    info = dict(
        jax=jax.__version__,
        backend=jax.default_backend(),
        device=jax.devices()[0].device_kind,
        date=time.strftime("%Y-%m-%d"),
    )
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import deep_gemm

        info["deep_gemm"] = getattr(deep_gemm, "__version__", "unknown")
    except ImportError:
        pass
    return info


def main(args) -> int:
    on_gpu = jax.default_backend() == "gpu"
    shape_names = args.shapes or (["A", "B"] if on_gpu else ["small"])
    variants = args.variants or list(VARIANTS)
    for name in shape_names:
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}; choose from {sorted(SHAPES)}")
    for name in variants:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {list(VARIANTS)}")
    rows = run(shape_names, variants, iters=args.iters)
    breakdowns = {}
    if args.breakdown:
        for name in shape_names:
            print(f"[{name}] stage breakdown", file=sys.stderr, flush=True)
            breakdowns[name] = stage_breakdown(make_layer(SHAPES[name]), iters=args.iters)
    env = environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    for name, stages in breakdowns.items():
        print(format_breakdown(SHAPES[name], stages))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, rows=rows, breakdown=breakdowns), f, indent=1)
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0
