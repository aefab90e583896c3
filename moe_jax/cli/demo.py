"""`python -m moe_jax demo`: a small DeepSeek-style MoE layer, jitted, checked, timed."""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax.cli.timing import rel_error, time_calls
from moe_jax.fused_moe import fused_moe
from moe_jax.reference import moe_reference
from moe_jax.routing import grouped_topk


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoShape:
    """A small DeepSeek-V3-like layer: sigmoid scores, grouped routing with correction bias."""

    num_tokens: int = 256
    hidden: int = 512
    intermediate: int = 256
    num_experts: int = 32
    topk: int = 4
    num_expert_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5


def make_layer(shape: DemoShape, seed: int = 0) -> dict[str, jax.Array]:
    """Random tokens, router logits, bias and expert weights (float32) for `shape`."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    s = shape
    return dict(
        x=jax.random.normal(keys[0], (s.num_tokens, s.hidden), jnp.float32),
        logits=jax.random.normal(keys[1], (s.num_tokens, s.num_experts), jnp.float32),
        bias=0.1 * jax.random.normal(keys[2], (s.num_experts,), jnp.float32),
        w1=jax.random.normal(keys[3], (s.num_experts, 2 * s.intermediate, s.hidden))
        / s.hidden**0.5,
        w2=jax.random.normal(keys[4], (s.num_experts, s.hidden, s.intermediate))
        / s.intermediate**0.5,
    )


def run_demo(shape: DemoShape = DemoShape(), *, experts: str = "auto") -> list[dict]:
    """Runs the layer in FP8 and bf16 and returns one result row per variant."""
    p = make_layer(shape)
    s = shape

    def route(logits, bias):
        return grouped_topk(
            logits,
            s.topk,
            True,
            s.num_expert_group,
            s.topk_group,
            scoring_func="sigmoid",
            e_score_correction_bias=bias,
            routed_scaling_factor=s.routed_scaling_factor,
        )

    topk_weights, topk_ids = jax.jit(route)(p["logits"], p["bias"])
    w1q, w1s = quant.per_block_quant_fp8(p["w1"])
    w2q, w2s = quant.per_block_quant_fp8(p["w2"])
    w1b, w2b = p["w1"].astype(jnp.bfloat16), p["w2"].astype(jnp.bfloat16)
    x = p["x"].astype(jnp.bfloat16)
    layer = jax.jit(
        lambda x, w1, w2, tw, ti, s1, s2: fused_moe(
            x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2, experts=experts
        )
    )
    variants = {
        "fp8 block weights": (x, w1q, w2q, topk_weights, topk_ids, w1s, w2s),
        "bf16 weights": (x, w1b, w2b, topk_weights, topk_ids, None, None),
    }
    rows = []
    for name, args in variants.items():
        # Reference: float32 activations and arithmetic on the very same weights.
        ref = moe_reference(*args[:5], w1_scale=args[5], w2_scale=args[6])
        out = layer(*args)
        rows.append(
            dict(
                variant=name,
                backend=jax.default_backend(),
                experts=experts,
                ms=time_calls(
                    functools.partial(layer, *args), wait=jax.block_until_ready, samples=3, burst=3
                ).streamed_ms,
                rel_err=rel_error(out, ref),
            )
        )
    return rows


def format_table(shape: DemoShape, rows: list[dict]) -> str:
    s = shape
    lines = [
        f"moe_jax demo: T={s.num_tokens} H={s.hidden} I={s.intermediate} E={s.num_experts} "
        f"k={s.topk} (grouped top-k: {s.num_expert_group} groups, {s.topk_group} kept, sigmoid, "
        f"correction bias, scale {s.routed_scaling_factor})",
        "error = ||out - ref|| / ||ref|| against a float32 reference on the same weights",
        "",
        f"{'variant':<20} {'backend':<8} {'experts':<10} {'ms/call':>9} {'rel. error':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r['variant']:<20} {r['backend']:<8} {r['experts']:<10} "
            f"{r['ms']:>9.2f} {r['rel_err']:>11.2e}"
        )
    return "\n".join(lines)


def run_demo_command(*, tokens: int = 256, experts: str = "auto") -> int:
    """`python -m moe_jax demo`: prints the table; 1 if an error is above 0.1, else 0."""
    shape = DemoShape(num_tokens=tokens)
    # The first call of each variant compiles, in silence: say so before the wait.
    print(
        f"compiling the layer for T={tokens} with FP8 and bf16 weights on "
        f"{jax.default_backend()} (about 10 s on a CPU), then checking and timing it ...",
        file=sys.stderr,
        flush=True,
    )
    rows = run_demo(shape, experts=experts)
    print(format_table(shape, rows))
    worst = max(r["rel_err"] for r in rows)
    if not worst < 0.1:
        print(f"FAILED: relative error {worst:.3g} is above 0.1", file=sys.stderr)
        return 1
    return 0
