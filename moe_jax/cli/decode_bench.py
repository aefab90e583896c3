"""`python -m moe_jax bench --decode`: decode-size MoE layers against the HBM weight-read limit.

A decode step's MoE layer reads every active expert's weights once; everything else is small.
For each token count T this times the FP8 layer (DeepSeek-V3 expert shapes on one GPU: E=256,
H=7168, I=2048, k=8, 128x128 block scales, random softmax routing) with several experts
backends, after checking each against a float32 reference, and prints:

    T | active experts | limit us | auto us | x limit | deep_gemm us | pallas us | ... | auto GEMM

"limit" is the time to read the active experts' FP8 w1 and w2 and their scales once at
`HBM_BYTES_PER_S` (the H200's datasheet bandwidth). Times are the streamed medians of
`moe_jax.cli.timing.time_jax` (back-to-back calls: the per-layer cost inside a model). The float32
reference is `moe_jax.moe_reference`'s formula (dequantized weights, unquantized activations) on
the first `CHECK_TOKENS` tokens, so the error includes the activations' FP8 quantization.
Without a GPU the tiny shape runs (every stage on XLA) so the command can be tested anywhere.

Variants named "<experts>_bf16" and the tokamax peers ("tokamax", "tokamax_mosaic",
"tokamax_triton": `moe_jax.cli.tokamax_peer`, the peers extra) read the same weights dequantized
to bf16 (twice the bytes the limit counts); they run only when named in --variants.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import quant
from moe_jax.activation import act_and_mul
from moe_jax.cli import layer_report, tokamax_peer
from moe_jax.cli.timing import rel_error, time_jax
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertWeights
from moe_jax.experts_by_name import resolve_experts
from moe_jax.fused_moe import fused_moe
from moe_jax.routing import fused_topk

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
DEFAULT_TOKENS = (1, 8, 32, 128, 512, 2048)
VARIANTS = ("auto", "deep_gemm", "pallas", "deep_gemm_masked")
CHECK_TOKENS = 16  # tokens checked against the float32 reference
BF16_SUFFIX = "_bf16"  # "<experts>_bf16": fused_moe(experts=<experts>) on bf16 weights


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeShape:
    """Expert shapes of one MoE layer (all experts on one device)."""

    name: str
    num_experts: int
    hidden: int
    intermediate: int
    topk: int

    def expert_bytes(self) -> int:
        """Bytes of one expert's FP8 w1 [2I, H] and w2 [H, I] and their float32 block scales."""
        h, i = self.hidden, self.intermediate
        scales = (-(-2 * i // 128) * -(-h // 128) + -(-h // 128) * -(-i // 128)) * 4
        return 2 * i * h + h * i + scales


SHAPES = {
    "deepseek_v3": DecodeShape(
        name="deepseek_v3", num_experts=256, hidden=7168, intermediate=2048, topk=8
    ),
    "tiny": DecodeShape(name="tiny", num_experts=16, hidden=256, intermediate=128, topk=4),
    # the prefill bench's expert shapes (`moe_jax.cli.layer_bench.SHAPES` A and B), for
    # `gemm_sweep --shape` at their token counts (4096 and 8192)
    "layer_a": DecodeShape(name="layer_a", num_experts=32, hidden=7168, intermediate=2048, topk=8),
    "layer_b": DecodeShape(name="layer_b", num_experts=128, hidden=2048, intermediate=768, topk=8),
}


def make_weights(shape: DecodeShape, seed: int = 0) -> ExpertWeights:
    """FP8 expert weights drawn directly (normal values, block scales around 1/sqrt(K))."""
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)

    @jax.jit
    def draw():
        def fp8(key, dims):
            return jax.random.normal(key, dims, jnp.bfloat16).astype(quant.FP8_DTYPE)

        def scales(key, dims, k):
            return jax.random.uniform(key, dims, jnp.float32, 0.5, 1.5) * k**-0.5

        return ExpertWeights(
            w1=fp8(keys[0], (e, 2 * i, h)),
            w2=fp8(keys[1], (e, h, i)),
            w1_scale=scales(keys[2], (e, -(-2 * i // 128), -(-h // 128)), h),
            w2_scale=scales(keys[3], (e, -(-h // 128), -(-i // 128)), i),
        )

    return draw()


def make_tokens(shape: DecodeShape, num_tokens: int, seed: int = 1):
    """(x bf16[T, H], topk_weights float32[T, k], topk_ids int32[T, k]) with softmax routing."""
    keys = jax.random.split(jax.random.PRNGKey(seed + num_tokens), 2)
    x = jax.random.normal(keys[0], (num_tokens, shape.hidden), jnp.bfloat16)
    logits = jax.random.normal(keys[1], (num_tokens, shape.num_experts), jnp.float32)
    topk_weights, topk_ids = fused_topk(logits, shape.topk)
    return x, topk_weights, topk_ids


@jax.jit
def reference_rows(x, weights: ExpertWeights, topk_weights, topk_ids):
    """float32[T', H] `moe_reference` on the given tokens, one token at a time (only its k
    experts' weights are dequantized, so it fits for E=256)."""
    hi = jax.lax.Precision.HIGHEST

    def one(args):
        xt, wt, ids = args
        w1 = quant.dequant_per_block(weights.w1[ids], weights.w1_scale[ids])  # [k, 2I, H]
        w2 = quant.dequant_per_block(weights.w2[ids], weights.w2_scale[ids])  # [k, H, I]
        h = act_and_mul(jnp.einsum("h,kih->ki", xt.astype(jnp.float32), w1, precision=hi), "silu")
        y = jnp.einsum("ki,khi->kh", h, w2, precision=hi)
        return jnp.sum(y * wt[:, None], axis=0)

    return jax.lax.map(one, (x, topk_weights, topk_ids))


def layer_fn(experts: str):
    """The jitted FP8 `fused_moe(x, weights..., experts=experts)` of this bench: (x, ExpertWeights,
    topk_weights, topk_ids) -> bf16[T, H]."""

    def forward(x, w: ExpertWeights, topk_weights, topk_ids):
        return fused_moe(
            x,
            w.w1,
            w.w2,
            topk_weights,
            topk_ids,
            w1_scale=w.w1_scale,
            w2_scale=w.w2_scale,
            experts=experts,
        )

    return jax.jit(forward)


def bf16_weights(weights: ExpertWeights, variants: Sequence[str]) -> dict:
    """The FP8 weights dequantized to bf16, once, for the variants that read bf16: "experts"
    (`ExpertWeights`, moe_jax's layout) for "<experts>_bf16" names, "kn" ((w1 [E, H, 2I],
    w2 [E, I, H]), tokamax's layout) for the tokamax peers that run here."""
    dequant = jax.jit(lambda w, s: quant.dequant_per_block(w, s).astype(jnp.bfloat16))
    w = ((weights.w1, weights.w1_scale), (weights.w2, weights.w2_scale))
    out = {}
    if any(v.endswith(BF16_SUFFIX) for v in variants):
        out["experts"] = ExpertWeights(w1=dequant(*w[0]), w2=dequant(*w[1]))
    if any(v in tokamax_peer.PEERS and not tokamax_peer.unavailable_reason(v) for v in variants):
        kn = jax.jit(lambda w, s: jnp.swapaxes(dequant(w, s), 1, 2))  # one fused pass each
        out["kn"] = (kn(*w[0]), kn(*w[1]))
    return out


def _auto_gemm(weights: ExpertWeights, num_tokens: int, topk: int) -> str:
    """The GEMM backend `experts="auto"` picks for GEMM1 (and its alignment)."""
    try:
        pair = ContiguousExperts().plan_for(
            weights, num_tokens=num_tokens, topk=topk, x_dtype=quant.FP8_DTYPE
        )
    except NotImplementedError as error:
        return f"none ({error})"
    return f"{pair.gemm1.name}/{pair.gemm2.name} align {pair.alignment}"


def measure(
    shape: DecodeShape,
    weights: ExpertWeights,
    num_tokens: int,
    variants: Sequence[str],
    *,
    bf16: dict,
    iters: int,
    progress: TextIO,
) -> dict:
    """One table row: routing facts, the limit, and each variant's time, error or refusal;
    `bf16` holds `bf16_weights(weights, variants)`."""
    x, topk_weights, topk_ids = make_tokens(shape, num_tokens)
    num_active = int(np.unique(np.asarray(topk_ids)).size)
    limit_us = num_active * shape.expert_bytes() / HBM_BYTES_PER_S * 1e6
    checked = min(num_tokens, CHECK_TOKENS)
    ref = reference_rows(x[:checked], weights, topk_weights[:checked], topk_ids[:checked])
    row = dict(
        tokens=num_tokens,
        active_experts=num_active,
        limit_us=limit_us,
        auto_gemm=_auto_gemm(weights, num_tokens, shape.topk),
        variants={},
    )
    for name in variants:
        print(f"[T={num_tokens}] {name}", file=progress, flush=True)
        if name in tokamax_peer.PEERS:
            if (why := tokamax_peer.unavailable_reason(name)) is not None:
                row["variants"][name] = dict(skipped=why)
                continue
            fn = jax.jit(tokamax_peer.peer_layer(name))
            args = (x, *bf16["kn"], topk_weights, topk_ids)
        elif name.endswith(BF16_SUFFIX):
            fn = layer_fn(name.removesuffix(BF16_SUFFIX))
            args = (x, bf16["experts"], topk_weights, topk_ids)
        else:
            fn, args = layer_fn(name), (x, weights, topk_weights, topk_ids)
        try:
            out = fn(*args)
            error = rel_error(out[:checked], ref)
            ms, latency_ms = time_jax(fn, args, iters=iters)
        except NotImplementedError as refusal:  # every backend asked for refused: say why
            row["variants"][name] = dict(skipped=layer_report.skip_reason(refusal))
            continue
        except Exception as failure:  # noqa: BLE001 - e.g. out of memory: report, go on
            row["variants"][name] = dict(skipped=f"failed: {layer_report.skip_reason(failure)}")
            continue
        row["variants"][name] = dict(
            us=ms * 1e3, latency_us=latency_ms * 1e3, rel_error=error, x_limit=ms * 1e3 / limit_us
        )
    return row


def format_table(shape: DecodeShape, rows: list[dict], variants: Sequence[str]) -> str:
    """Markdown table of the rows; each refusal's reason once under it, and large errors."""
    head = ["T", "active experts", "limit us"]
    if "auto" in variants:
        head += ["auto us", "x limit"]
    head += [f"{v} us" for v in variants if v != "auto"] + ["auto rel err", "auto GEMM"]
    lines = [
        f"{shape.name}: E={shape.num_experts} H={shape.hidden} I={shape.intermediate} "
        f"k={shape.topk}, FP8 128x128 block scales; limit = active experts' weights / "
        f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    skips: dict[str, int] = {}
    notes = []
    for row in rows:
        cells = [str(row["tokens"]), str(row["active_experts"]), _us(row["limit_us"])]
        auto = row["variants"].get("auto", {})
        if "auto" in variants:
            cells += [_cell(auto, skips), f"{auto['x_limit']:.2f}" if "x_limit" in auto else "-"]
        for name in variants:
            if name != "auto":
                cells.append(_cell(row["variants"][name], skips))
        cells.append(f"{auto['rel_error']:.2e}" if "rel_error" in auto else "-")
        cells.append(row["auto_gemm"])
        lines.append("| " + " | ".join(cells) + " |")
        for name, result in row["variants"].items():
            if "skipped" not in result and result["rel_error"] > 0.1:
                notes.append(f"T={row['tokens']} {name}: rel error {result['rel_error']:.2e}")
    return "\n".join(lines + layer_report.note_lines(skips) + notes)


def _us(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.3g}"


def _cell(result: dict, skips: dict[str, int]) -> str:
    return _us(result["us"]) if "us" in result else layer_report.skip_note(result, skips)


def plot(shape: DecodeShape, rows: list[dict], variants: Sequence[str], path: str) -> None:
    """Log-log PNG of microseconds against T for each variant and the weight-read limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [row["tokens"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(tokens, [row["limit_us"] for row in rows], "k--", label="weight-read limit")
    for name in variants:
        points = [(r["tokens"], r["variants"][name].get("us")) for r in rows]
        points = [(t, us) for t, us in points if us is not None]
        if points:
            ax.plot(*zip(*points, strict=True), "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("us per layer (streamed)")
    ax.set_title(f"decode MoE layer, {shape.name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_decode_bench(
    *,
    tokens: Sequence[int] | None,
    iters: int,
    json_path: str | None = None,
    plot_path: str | None = None,
    shape: str | None = None,
    variants: Sequence[str] | None = None,
    progress: TextIO | None = None,
) -> int:
    """The `bench --decode` command: prints the table, writes JSON/PNG; returns the exit status.

    Args:
      tokens: token counts T; None: `DEFAULT_TOKENS` on a GPU, (1, 8, 32) elsewhere.
      iters: latency samples per variant (streamed samples: max(3, iters // 2)).
      json_path: write {"environment", "shape", "rows"} there.
      plot_path: write a PNG (log-log us against T) there.
      shape: a name from `SHAPES`; None: "deepseek_v3" on a GPU, "tiny" elsewhere.
      variants: `fused_moe` experts names, "<experts>_bf16" or tokamax peers; None: `VARIANTS`.
    """
    progress = sys.stderr if progress is None else progress
    on_gpu = jax.default_backend() == "gpu"
    shape_name = shape or ("deepseek_v3" if on_gpu else "tiny")
    if shape_name not in SHAPES:
        print(f"unknown shape {shape_name!r}; choose from {sorted(SHAPES)}", file=sys.stderr)
        return 2
    token_counts = list(tokens or (DEFAULT_TOKENS if on_gpu else (1, 8, 32)))
    if any(not isinstance(t, int) or t < 1 for t in token_counts):
        print(f"tokens={token_counts} but positive ints are needed", file=sys.stderr)
        return 2
    variants = list(variants or VARIANTS)
    for name in variants:  # an unknown name fails here, before any measurement
        if name in tokamax_peer.PEERS:
            continue
        try:
            resolve_experts(name.removesuffix(BF16_SUFFIX))
        except ValueError as e:
            print(f"--variants {name}: {e}", file=sys.stderr)
            return 2
    decode_shape = SHAPES[shape_name]
    weights = make_weights(decode_shape)
    bf16 = bf16_weights(weights, variants)
    rows = [
        measure(decode_shape, weights, t, variants, bf16=bf16, iters=iters, progress=progress)
        for t in token_counts
    ]
    env = layer_report.environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(format_table(decode_shape, rows, variants))
    return layer_report.write_outputs(
        dict(environment=env, shape=dataclasses.asdict(decode_shape), rows=rows),
        json_path=json_path,
        plot_path=plot_path,
        draw=lambda path: plot(decode_shape, rows, variants, path),
    )
