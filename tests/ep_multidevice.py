"""Expert-parallel cases run on 8 CPU devices, in a process of their own.

XLA's host device count is fixed when JAX initialises, and the pytest process has already
initialised JAX with one device; so `tests/test_expert_parallel.py` runs this file as a script
(`python tests/ep_multidevice.py OUT.npz`) with `--xla_force_host_platform_device_count=8`. It
runs `ep_fused_moe` on every case in `CASES` and saves the outputs and statistics, and for
`GRAD_CASES` (FP8 weights held constant) the gradients of <out, `probe`> with respect to x and
topk_weights; the test computes the expectations (single-device `fused_moe`, float64 loops) in
its own process.
Importing this module has no side effects (pytest imports it for doctests).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

NUM_RANKS = 8


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens_per_rank: int = 4
    num_experts: int = 16
    topk: int = 3
    hidden: int = 128
    inter: int = 128
    routing: str = "uniform"  # "uniform", "skewed" (most pairs to rank 0, duplicates), "invalid"
    fp8: bool = False
    capacity_per_rank: int | None = None
    weight_on_input: bool = False
    experts: str = "contiguous"  # or "masked_chunked"


CASES = {
    c.name: c
    for c in [
        Case("uniform"),
        Case("skewed", routing="skewed"),
        Case("overflow", routing="skewed", capacity_per_rank=2),
        Case("fp8", routing="skewed", fp8=True),
        Case("fp8_overflow", routing="skewed", fp8=True, capacity_per_rank=3),
        Case("invalid_ids", routing="invalid", capacity_per_rank=1),
        Case("weight_on_input", topk=1, weight_on_input=True, routing="skewed"),
        Case("masked_chunked", routing="skewed", experts="masked_chunked"),
        # a token's [H / 128] scales, or a float token's [H], as many as its k slots: per-token
        # values that once were taken for per-(token, slot) ones
        Case("fp8_scale_groups_eq_k", fp8=True, hidden=256, topk=2),
        Case("hidden_eq_k", hidden=4, inter=8, topk=4),
        Case("fp8_invalid_masked", routing="invalid", fp8=True, experts="masked_chunked"),
    ]
}
# FP8 cases differentiated too: duplicates, drops past the capacity, ids outside [0, E) with
# masked experts over chunks.
GRAD_CASES = ("fp8", "fp8_overflow", "fp8_invalid_masked")


def probe(case: Case) -> np.ndarray:
    """The fixed output cotangent of a gradient case, float32[R * T, H]."""
    rng = np.random.default_rng(len(case.name))
    return rng.standard_normal((NUM_RANKS * case.tokens_per_rank, case.hidden)).astype(np.float32)


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Global (all ranks) float32 inputs of a case, from a fixed seed."""
    rng = np.random.default_rng(sorted(CASES).index(case.name))
    num_tokens = NUM_RANKS * case.tokens_per_rank
    e, k, h, i = case.num_experts, case.topk, case.hidden, case.inter
    ids = rng.integers(0, e, size=(num_tokens, k))
    if case.routing == "skewed":  # 3 of 4 pairs go to experts 0 and 1 (rank 0); duplicates
        hot = rng.random((num_tokens, k)) < 0.75
        ids = np.where(hot, rng.integers(0, 2, size=(num_tokens, k)), ids)
    elif case.routing == "invalid":  # -1 and >= E: routed nowhere, never counted as dropped
        ids = np.where(rng.random((num_tokens, k)) < 0.3, rng.choice([-1, e, e + 5]), ids)
    return dict(
        x=rng.standard_normal((num_tokens, h)).astype(np.float32),
        w1=(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32),
        w2=(rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32),
        topk_ids=ids.astype(np.int32),
        topk_weights=rng.standard_normal((num_tokens, k)).astype(np.float32),
    )


def layer_args(case: Case, inputs: dict[str, np.ndarray]):
    """(x, w1, w2, weights, ids, kwargs) as both the EP run and fused_moe take them."""
    import jax.numpy as jnp

    from moe_jax import quant

    x = jnp.asarray(inputs["x"])
    w1, w2 = jnp.asarray(inputs["w1"]), jnp.asarray(inputs["w2"])
    kwargs = dict(apply_router_weight_on_input=case.weight_on_input)
    if case.fp8:
        x = x.astype(jnp.bfloat16)
        w1, kwargs["w1_scale"] = quant.per_block_quant_fp8(w1)
        w2, kwargs["w2_scale"] = quant.per_block_quant_fp8(w2)
    weights = jnp.asarray(inputs["topk_weights"])
    if case.weight_on_input:
        weights = jnp.abs(weights)
    return x, w1, w2, weights, jnp.asarray(inputs["topk_ids"]), kwargs


def ep_layer(case: Case, mesh, transport: str = "padded"):
    """(f, x, topk_weights): f(x, topk_weights) -> (out, stats) runs a case's `ep_fused_moe`."""
    from moe_jax import MaskedExperts
    from moe_jax.ep_api import ep_fused_moe

    x, w1, w2, weights, ids, kwargs = layer_args(case, make_inputs(case))
    experts, chunk = "auto", None
    if case.experts == "masked_chunked":
        experts, chunk = MaskedExperts(gemm="xla"), 40

    def f(x, weights, w1=w1):
        return ep_fused_moe(
            mesh, x, w1, w2, weights, ids, axis_name="ep", capacity_per_rank=case.capacity_per_rank,
            transport=transport, experts=experts, chunk_size=chunk, **kwargs,
        )  # fmt: skip

    return f, x, weights


def all_to_all_dtypes(f, *args, op: str = "all_to_all") -> str:
    """The element types on the lines of `op` in the lowered `jax.jit(f)(*args)`, sorted."""
    import re

    text = __import__("jax").jit(f).lower(*args).as_text()
    lines = [line for line in text.splitlines() if op in line]
    return " ".join(sorted({t for line in lines for t in re.findall(r"x([a-zA-Z]\w*)>", line)}))


def main(path: str) -> None:
    import jax
    import jax.numpy as jnp

    from moe_jax.ep_api import ep_fused_moe

    if jax.device_count() != NUM_RANKS:
        raise SystemExit(
            f"needs {NUM_RANKS} devices, got {jax.device_count()}: set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={NUM_RANKS} before JAX starts"
        )
    mesh = jax.make_mesh((NUM_RANKS,), ("ep",))
    saved = {}
    for name, case in CASES.items():
        f, x, weights = ep_layer(case, mesh)
        out, stats = f(x, weights)
        saved[f"{name}/out"] = np.asarray(out.astype(jnp.float32))
        saved[f"{name}/num_dropped"] = np.asarray(stats.num_dropped)
        saved[f"{name}/num_routed_per_rank"] = np.asarray(stats.num_routed_per_rank)
        if name in GRAD_CASES:  # the forward under differentiation (float rows), its gradients
            out, vjp, _ = jax.vjp(f, x, weights, has_aux=True)
            saved[f"{name}/vjp_out"] = np.asarray(out.astype(jnp.float32))
            dx, dweights = vjp(jnp.asarray(probe(case), out.dtype))
            saved[f"{name}/dx"] = np.asarray(dx.astype(jnp.float32))
            saved[f"{name}/dweights"] = np.asarray(dweights)
    # FP8 rows cross the all-to-all, float rows under differentiation; no gradient to FP8 w1.
    f, x, weights = ep_layer(CASES["fp8"], mesh)
    w1 = layer_args(CASES["fp8"], make_inputs(CASES["fp8"]))[1]
    saved["fp8/all_to_all"] = np.asarray(all_to_all_dtypes(lambda *a: f(*a)[0], x, weights))
    backward = jax.grad(lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32)), argnums=(0, 1))
    saved["fp8/grad_all_to_all"] = np.asarray(all_to_all_dtypes(backward, x, weights))
    ragged, x, weights = ep_layer(CASES["fp8"], mesh, transport="ragged")  # its VJP lowers
    backward = jax.grad(lambda *a: jnp.sum(ragged(*a)[0].astype(jnp.float32)), argnums=(0, 1))
    saved["fp8/grad_ragged"] = np.asarray(all_to_all_dtypes(backward, x, weights, op="ragged"))
    try:
        jax.grad(lambda w1: jnp.sum(f(x, weights, w1)[0].astype(jnp.float32)))(w1)
        saved["fp8/w1_error"] = np.asarray("")
    except TypeError as e:
        saved["fp8/w1_error"] = np.asarray(str(e))
    # "auto" resolves to the padded transport off the GPU and gives the same result.
    case = CASES["skewed"]
    x, w1, w2, weights, ids, kwargs = layer_args(case, make_inputs(case))
    out, _ = ep_fused_moe(mesh, x, w1, w2, weights, ids, axis_name="ep", transport="auto")
    saved["auto/out"] = np.asarray(out)
    # The ragged transport lowers to XLA's ragged all-to-all (XLA:CPU cannot compile it).
    lowered = jax.jit(lambda *a: ep_fused_moe(mesh, *a, axis_name="ep", transport="ragged")).lower(
        x, w1, w2, weights, ids
    )
    saved["ragged/hlo_has_ragged"] = np.asarray("ragged_all_to_all" in lowered.as_text())
    # E not a multiple of R: a ValueError that says so.
    try:
        ep_fused_moe(mesh, x, w1[:12], w2[:12], weights, ids % 12, axis_name="ep")
        saved["uneven/error"] = np.asarray("")
    except ValueError as e:
        saved["uneven/error"] = np.asarray(str(e))
    np.savez(path, **saved)


if __name__ == "__main__":
    main(sys.argv[1])
