"""NumPy oracles for moe_jax tests: the dumbest loops, float64 unless a recipe says otherwise.

Each oracle restates vLLM's fused-MoE semantics (0.10.0) without calling moe_jax.
Where vLLM rounds (bf16 GEMM outputs, FP8 quantization), the oracle rounds at the same points with
`ml_dtypes`, so tests can hold the library to tight tolerances. Gradient tests differentiate
`fused_moe_jnp`, the one oracle written in jax.numpy (float64 under `jax.enable_x64`).
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
FP8_MAX = np.float32(448.0)
SCALE_EPS = np.float32(1e-10)


def seed(*parts) -> int:
    """A fixed integer seed for `np.random.default_rng` from a test's parameters (crc32 of their
    repr: the same in every process, unlike `hash()`)."""
    return zlib.crc32(repr(parts).encode())


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def round_to(a, dtype) -> np.ndarray:
    """float64 values of `a` after rounding to `dtype`."""
    return np.asarray(a).astype(dtype).astype(np.float64)


# --- routing ---------------------------------------------------------------------------------


def scores(logits, scoring_func: str) -> np.ndarray:
    """float64 softmax over the last axis, or sigmoid, of the given logits."""
    z = np.asarray(logits).astype(np.float64)
    if scoring_func == "softmax":
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if scoring_func == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    raise ValueError(scoring_func)


def fused_topk(logits, topk: int, *, renormalize: bool, scoring_func: str = "softmax"):
    """(weights float64[T, k], ids int64[T, k]): descending, ties to the lower id."""
    s = scores(np.asarray(logits).astype(np.float32), scoring_func)
    num_tokens = s.shape[0]
    weights = np.zeros((num_tokens, topk))
    ids = np.zeros((num_tokens, topk), np.int64)
    for t in range(num_tokens):
        order = sorted(range(s.shape[1]), key=lambda e, t=t: (-s[t, e], e))
        for j in range(topk):
            ids[t, j] = order[j]
            weights[t, j] = s[t, order[j]]
        if renormalize:
            weights[t] /= weights[t].sum()
    return weights, ids


def grouped_topk(
    logits,
    topk: int,
    *,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    bias=None,
    routed_scaling_factor: float = 1.0,
):
    """DeepSeek grouped routing -> (weights float64[T, k], ids int64[T, k]) in selection order.

    Scores are rounded to the logits' dtype (vLLM computes them in that dtype). With a bias the
    group score is the sum of the group's two best biased scores and the weights are the unbiased
    scores; without, the group score is the group max.
    """
    logits = np.asarray(logits)
    s = round_to(scores(logits.astype(np.float32), scoring_func), logits.dtype)
    num_tokens, num_experts = s.shape
    per_group = num_experts // num_expert_group
    choice = s if bias is None else s + np.asarray(bias).astype(np.float64)
    weights = np.zeros((num_tokens, topk))
    ids = np.zeros((num_tokens, topk), np.int64)
    for t in range(num_tokens):
        group_scores = []
        for g in range(num_expert_group):
            members = sorted(choice[t, g * per_group : (g + 1) * per_group], reverse=True)
            group_scores.append(members[0] + members[1] if bias is not None else members[0])
        groups = sorted(range(num_expert_group), key=lambda g: (-group_scores[g], g))
        kept = groups[:topk_group]
        candidates = [e for e in range(num_experts) if e // per_group in kept]
        candidates.sort(key=lambda e, t=t: (-choice[t, e], e))
        for j in range(topk):
            ids[t, j] = candidates[j]
            weights[t, j] = s[t, candidates[j]]
        if renormalize:
            weights[t] /= weights[t].sum()
        weights[t] *= routed_scaling_factor
    return weights, ids


# --- FP8 quantization ------------------------------------------------------------------------


def per_token_group_quant_fp8(x, group_size: int = 128):
    """vLLM's per-token-group recipe in float32: s = max(amax, 1e-10)/448, q = e4m3(clip(x/s))."""
    x = np.asarray(x).astype(np.float32)
    lead, hidden = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, hidden)
    num_groups = hidden // group_size
    q = np.zeros(flat.shape, FP8)
    s = np.zeros((flat.shape[0], num_groups), np.float32)
    for r in range(flat.shape[0]):
        for g in range(num_groups):
            part = flat[r, g * group_size : (g + 1) * group_size]
            scale = np.maximum(np.abs(part).max(), SCALE_EPS) / FP8_MAX
            q[r, g * group_size : (g + 1) * group_size] = np.clip(
                part / scale, -FP8_MAX, FP8_MAX
            ).astype(FP8)
            s[r, g] = scale
    return q.reshape(x.shape), s.reshape(*lead, num_groups)


def dequant_per_token_group(q, s) -> np.ndarray:
    """float64 q * s per group."""
    q = np.asarray(q).astype(np.float64)
    s = np.asarray(s).astype(np.float64)
    group = q.shape[-1] // s.shape[-1]
    return q * np.repeat(s, group, axis=-1)


def per_block_quant_fp8(w, block_shape=(128, 128)):
    """One float32 scale per [bn, bk] tile of the last two axes (ragged edge tiles included)."""
    w = np.asarray(w).astype(np.float32)
    bn, bk = block_shape
    *lead, n, k = w.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    flat = w.reshape(-1, n, k)
    q = np.zeros(flat.shape, FP8)
    s = np.zeros((flat.shape[0], gn, gk), np.float32)
    for b in range(flat.shape[0]):
        for i in range(gn):
            for j in range(gk):
                tile = flat[b, i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
                scale = np.maximum(np.abs(tile).max(), SCALE_EPS) / FP8_MAX
                q[b, i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = np.clip(
                    tile / scale, -FP8_MAX, FP8_MAX
                ).astype(FP8)
                s[b, i, j] = scale
    return q.reshape(w.shape), s.reshape(*lead, gn, gk)


def dequant_per_block(q, s, block_shape=(128, 128)) -> np.ndarray:
    """float64 W[n, k] = q[n, k] * s[n // bn, k // bk]."""
    q = np.asarray(q).astype(np.float64)
    s = np.asarray(s).astype(np.float64)
    bn, bk = block_shape
    n, k = q.shape[-2:]
    full = np.repeat(np.repeat(s, bn, axis=-2), bk, axis=-1)[..., :n, :k]
    return q * full


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _gelu(v):
    return 0.5 * v * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(v / math.sqrt(2.0)))


ACTIVATIONS = {"silu": _silu, "gelu": _gelu}


def act_and_mul(h, activation: str = "silu", dtype=None) -> np.ndarray:
    """float64 act(h[:, :I]) * h[:, I:] with vLLM's roundings: act in float64 rounded to `dtype`
    (default: h's), the product rounded to `dtype` again."""
    h = np.asarray(h)
    dtype = h.dtype if dtype is None else dtype
    h = h.astype(np.float64)
    inter = h.shape[-1] // 2
    act = round_to(ACTIVATIONS[activation](h[..., :inter]), dtype)
    return round_to(act * h[..., inter:], dtype)


def grouped_gemm_contiguous(x, w, expert_ids) -> np.ndarray:
    """float64 y[row] = x[row] @ w[expert_ids[row]].T; rows with id -1 stay zero."""
    x = np.asarray(x).astype(np.float64)
    w = np.asarray(w).astype(np.float64)
    y = np.zeros((x.shape[0], w.shape[1]))
    for row, e in enumerate(np.asarray(expert_ids)):
        if e >= 0:
            y[row] = w[e] @ x[row]
    return y


def grouped_gemm_masked(x, w, num_rows_per_expert) -> np.ndarray:
    """float64 y[e, r] = x[e, r] @ w[e].T for r < num_rows_per_expert[e]; other rows zero."""
    x = np.asarray(x).astype(np.float64)
    w = np.asarray(w).astype(np.float64)
    y = np.zeros((*x.shape[:2], w.shape[1]))
    for e, count in enumerate(np.asarray(num_rows_per_expert)):
        for r in range(count):
            y[e, r] = w[e] @ x[e, r]
    return y


# --- layouts ---------------------------------------------------------------------------------


def local_ids(topk_ids, num_experts: int, expert_map=None) -> np.ndarray:
    """Local expert of each slot, -1 where it goes nowhere (ids outside the map's range too)."""
    ids = np.asarray(topk_ids).astype(np.int64)
    out = np.full(ids.shape, -1, np.int64)
    for idx, gid in np.ndenumerate(ids):
        if expert_map is not None:
            if not 0 <= gid < len(expert_map):
                continue
            gid = int(expert_map[gid])
        if 0 <= gid < num_experts:
            out[idx] = gid
    return out


def count_expert_num_tokens(topk_ids, num_experts: int, expert_map=None) -> np.ndarray:
    counts = np.zeros(num_experts, np.int64)
    for e in local_ids(topk_ids, num_experts, expert_map).reshape(-1):
        if e >= 0:
            counts[e] += 1
    return counts


def contiguous_num_rows(num_tokens: int, topk: int, num_experts: int, alignment: int) -> int:
    pairs = num_tokens * topk
    return round_up(pairs + min(pairs, num_experts) * (alignment - 1), alignment)


def permute(x, topk_ids, num_experts: int, *, alignment: int, expert_map=None, x_scales=None):
    """Contiguous layout by loops: experts in order, (token, slot) order inside, padded segments.

    Returns a dict with rows, row_scales, expert_ids, inverse, num_tokens_per_expert, expert_ends.
    """
    x = np.asarray(x)
    num_tokens, topk = np.asarray(topk_ids).shape
    local = local_ids(topk_ids, num_experts, expert_map)
    num_rows = contiguous_num_rows(num_tokens, topk, num_experts, alignment)
    rows = np.zeros((num_rows, *x.shape[1:]), x.dtype)
    row_scales = None
    if x_scales is not None:
        x_scales = np.asarray(x_scales)
        row_scales = np.zeros((num_rows, *x_scales.shape[1:]), x_scales.dtype)
    expert_ids = np.full(num_rows, -1, np.int64)
    inverse = np.full((num_tokens, topk), -1, np.int64)
    counts = np.zeros(num_experts, np.int64)
    ends = np.zeros(num_experts, np.int64)
    row = 0
    for e in range(num_experts):
        start = row
        for t in range(num_tokens):
            for j in range(topk):
                if local[t, j] == e:
                    rows[row] = x[t]
                    if row_scales is not None:
                        row_scales[row] = x_scales[t]
                    expert_ids[row] = e
                    inverse[t, j] = row
                    row += 1
        counts[e] = row - start
        row = start + round_up(counts[e], alignment)
        ends[e] = row
    return dict(
        rows=rows,
        row_scales=row_scales,
        expert_ids=expert_ids,
        inverse=inverse,
        num_tokens_per_expert=counts,
        expert_ends=ends,
    )


def contiguous_destinations(local_ids, num_experts: int, *, alignment: int):
    """(inverse int64[T, k], counts int64[E], ends int64[E]) of the contiguous layout, by loops
    over experts, then tokens, then slots; ids outside [0, E) go nowhere (-1)."""
    local_ids = np.asarray(local_ids)
    inverse = np.full(local_ids.shape, -1, np.int64)
    counts = np.zeros(num_experts, np.int64)
    ends = np.zeros(num_experts, np.int64)
    row = 0
    for e in range(num_experts):
        start = row
        for t in range(local_ids.shape[0]):
            for j in range(local_ids.shape[1]):
                if local_ids[t, j] == e:
                    inverse[t, j] = row
                    row += 1
        counts[e] = row - start
        row = start + round_up(counts[e], alignment)
        ends[e] = row
    return inverse, counts, ends


def routing_metadata(local_ids, num_experts: int, *, alignment: int, num_rows: int) -> dict:
    """`moe_jax.layouts.RoutingMetadata`'s fields by loops: the destinations above, and for each
    of the `num_rows` rows the token copied there and its expert (-1 on padding)."""
    local_ids = np.asarray(local_ids)
    inverse, counts, ends = contiguous_destinations(local_ids, num_experts, alignment=alignment)
    source = np.full(num_rows, -1, np.int64)
    expert_ids = np.full(num_rows, -1, np.int64)
    for (t, j), row in np.ndenumerate(inverse):
        if row >= 0:
            source[row] = t
            expert_ids[row] = local_ids[t, j]
    return dict(
        inverse=inverse,
        num_tokens_per_expert=counts,
        expert_ends=ends,
        source=source,
        expert_ids=expert_ids,
    )


def masked_layout(x, topk_ids, num_experts: int, *, max_m: int, expert_map=None, x_scales=None):
    """Masked layout by loops: each token takes one row of each expert it picks (slots repeating
    an expert share that row), rows [0, count) of an expert in token order; (token, expert) rows
    past `max_m` are dropped and counted. Returns a dict like `moe_jax.layouts.MaskedLayout`'s
    fields."""
    x = np.asarray(x)
    num_tokens, topk = np.asarray(topk_ids).shape
    local = local_ids(topk_ids, num_experts, expert_map)
    rows = np.zeros((num_experts, max_m, *x.shape[1:]), x.dtype)
    row_scales = None
    if x_scales is not None:
        x_scales = np.asarray(x_scales)
        row_scales = np.zeros((num_experts, max_m, *x_scales.shape[1:]), x_scales.dtype)
    filled = np.zeros(num_experts, np.int64)
    inverse = np.full((num_tokens, topk), -1, np.int64)
    dropped = 0
    for t in range(num_tokens):
        row_of_expert = {}  # this token's row at each expert it picked (-1: dropped)
        for j in range(topk):
            e = local[t, j]
            if e < 0:
                continue
            if e not in row_of_expert:
                if filled[e] == max_m:
                    row_of_expert[e] = -1
                    dropped += 1
                else:
                    rows[e, filled[e]] = x[t]
                    if row_scales is not None:
                        row_scales[e, filled[e]] = x_scales[t]
                    row_of_expert[e] = e * max_m + filled[e]
                    filled[e] += 1
            inverse[t, j] = row_of_expert[e]
    return dict(
        rows=rows,
        row_scales=row_scales,
        num_tokens_per_expert=filled,
        inverse=inverse,
        num_dropped=dropped,
    )


def unpermute(y, inverse, topk_weights) -> np.ndarray:
    """float64 out[t] = sum over slots j with inverse >= 0 of y[inverse[t, j]] * w[t, j]."""
    y = np.asarray(y).astype(np.float64)
    inverse = np.asarray(inverse)
    num_tokens, topk = inverse.shape
    out = np.zeros((num_tokens, y.shape[-1]))
    for t in range(num_tokens):
        for j in range(topk):
            if inverse[t, j] >= 0:
                w = 1.0 if topk_weights is None else float(np.asarray(topk_weights)[t, j])
                out[t] += y[inverse[t, j]] * w
    return out


# --- the MoE layer ---------------------------------------------------------------------------


def fused_moe(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    *,
    activation: str = "silu",
    expert_map=None,
    w1_scale=None,
    w2_scale=None,
    apply_router_weight_on_input: bool = False,
) -> np.ndarray:
    """float64[T, H]: a per-token, per-slot loop over the expert MLP with vLLM's rounding points.

    - float weights: GEMMs in float64, outputs rounded to the activation dtype; act in float64
      rounded to that dtype, times up, rounded again (vLLM's `silu_and_mul`).
    - float8_e4m3fn weights (block scales): x is quantized per token per 128 columns with vLLM's
      recipe, GEMM1 on dequantized operands rounded to bf16, act*up in bf16, requantized, GEMM2
      rounded to bf16 (the canonical contiguous pipeline).
    The weighted sum over slots is float64; the caller rounds to the output dtype if it wants.
    """
    x = np.asarray(x)
    act_dtype = x.dtype
    is_fp8 = np.asarray(w1).dtype == FP8
    if is_fp8:
        w1f = dequant_per_block(w1, w1_scale)
        w2f = dequant_per_block(w2, w2_scale)
        mid = BF16
    else:
        w1f = np.asarray(w1).astype(np.float64)
        w2f = np.asarray(w2).astype(np.float64)
        mid = np.promote_types(act_dtype, np.asarray(w1).dtype)
        mid = act_dtype if mid == np.float64 else mid
    weights = np.asarray(topk_weights).astype(np.float64)
    num_tokens, topk = np.asarray(topk_ids).shape
    num_experts, _, hidden = w1f.shape
    local = local_ids(topk_ids, num_experts, expert_map)
    out = np.zeros((num_tokens, hidden))
    for t in range(num_tokens):
        for j in range(topk):
            e = local[t, j]
            if e < 0:
                continue
            xt = x[t].astype(np.float64)
            w = weights[t, j]
            if apply_router_weight_on_input:
                xt, w = round_to(xt * w, act_dtype), 1.0
            if is_fp8:
                q, s = per_token_group_quant_fp8(xt[None].astype(np.float32))
                xt = dequant_per_token_group(q, s)[0]
            h = round_to(w1f[e] @ xt, mid)
            a = act_and_mul(h, activation, mid)
            if is_fp8:
                q, s = per_token_group_quant_fp8(a[None].astype(np.float32))
                a = dequant_per_token_group(q, s)[0]
            y = round_to(w2f[e] @ a, mid)
            out[t] += w * y
    return out


# Layer outputs against `fused_moe` rounded to the output dtype (outputs are O(1)): float32 to its
# rounding; bf16 and FP8 to about two bf16 ulps (one intermediate rounding that flips). FP8 lets
# FP8_FLIP_ROWS rows per call reach FP8_LOOSE_TOL: float32 against float64 GEMM1 sums can flip one
# bf16 intermediate, whose requantization moves one FP8 code of one (token, slot) by 6% and that
# token's row by up to ~5e-2 (within vLLM's own FP8 tolerance).
MOE_TOL = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
    "fp8": dict(rtol=1.6e-2, atol=1.6e-2),
}
FP8_FLIP_ROWS = 1
FP8_LOOSE_TOL = dict(rtol=6e-2, atol=6e-2)


def assert_moe_close(out, ref, dtype: str, *, tol: dict | None = None) -> None:
    """A [T, H] layer output against float64 `ref` within `tol` (default MOE_TOL[dtype]); FP8
    with the flipped-row allowance above."""
    out, tol = np.asarray(out).astype(np.float64), tol or MOE_TOL[dtype]
    if dtype != "fp8":
        np.testing.assert_allclose(out, ref, **tol)
        return
    is_bad = np.abs(out - ref) > tol["atol"] + tol["rtol"] * np.abs(ref)
    bad_rows = np.flatnonzero(is_bad.any(axis=-1))
    assert len(bad_rows) <= FP8_FLIP_ROWS, f"rows {bad_rows} exceed {tol}"
    np.testing.assert_allclose(out, ref, **FP8_LOOSE_TOL)


@dataclasses.dataclass
class MoeInputs:
    """A layer's NumPy inputs (`moe_inputs`); the scales are None for float weights."""

    x: np.ndarray
    w1: np.ndarray
    w2: np.ndarray
    w1_scale: np.ndarray | None
    w2_scale: np.ndarray | None
    topk_weights: np.ndarray
    topk_ids: np.ndarray

    def args(self) -> list:
        """jnp (x, w1, w2, topk_weights, topk_ids): `fused_moe`'s positional arguments."""
        arrays = (self.x, self.w1, self.w2, self.topk_weights, self.topk_ids)
        return [jnp.asarray(a) for a in arrays]

    def scales(self) -> dict:
        """jnp w1_scale and w2_scale, the ones given."""
        named = dict(w1_scale=self.w1_scale, w2_scale=self.w2_scale)
        return {k: jnp.asarray(v) for k, v in named.items() if v is not None}

    def expected(self, **kwargs) -> np.ndarray:
        """`fused_moe` (this module's, with `kwargs`) rounded to x's dtype."""
        ref = fused_moe(
            self.x, self.w1, self.w2, self.topk_weights, self.topk_ids,
            w1_scale=self.w1_scale, w2_scale=self.w2_scale, **kwargs,
        )  # fmt: skip
        return round_to(ref, self.x.dtype)


def moe_inputs(shape, dtype: str, rng, *, id_low: int = 0, id_high: int | None = None):
    """`MoeInputs` of shape (T, H, I, E, k): float32 values of unit-scale outputs in `dtype`
    ("float32", "bfloat16", or "fp8": bf16 tokens, weights block-quantized), ids with duplicates
    from [id_low, id_high) (default E), normal router weights (negative ones included)."""
    t, h, i, e, k = shape
    x = rng.standard_normal((t, h)).astype(np.float32)
    w1 = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    w1_scale = w2_scale = None
    if dtype == "fp8":
        x = x.astype(BF16)
        w1, w1_scale = per_block_quant_fp8(w1)
        w2, w2_scale = per_block_quant_fp8(w2)
    elif dtype == "bfloat16":
        x, w1, w2 = (a.astype(BF16) for a in (x, w1, w2))
    ids = rng.integers(id_low, e if id_high is None else id_high, (t, k)).astype(np.int32)
    weights = rng.standard_normal((t, k)).astype(np.float32)
    return MoeInputs(x, w1, w2, w1_scale, w2_scale, weights, ids)


def fused_moe_jnp(x, w1, w2, topk_weights, local_ids, *, weight_on_input=False):
    """out[t] = sum_j w[t, j] * W2[e] @ (silu(W1g[e] x) * W1u[e] x), e = local_ids[t, j] >= 0, in
    jax.numpy with no rounding: differentiable, and float64 under `jax.enable_x64` with float64
    arguments (the gradient tests' reference). `weight_on_input` scales x by the top-1 weight."""
    intermediate = w2.shape[-1]
    is_valid = local_ids >= 0
    e = np.maximum(local_ids, 0)
    weights = topk_weights
    if weight_on_input:
        x = x * topk_weights[:, :1]
        weights = jnp.ones_like(topk_weights)
    h = jnp.einsum("tkih,th->tki", w1[e], x)
    gate, up = h[..., :intermediate], h[..., intermediate:]
    a = gate / (1.0 + jnp.exp(-gate)) * up
    y = jnp.einsum("tkhi,tki->tkh", w2[e], a)
    return jnp.sum(jnp.where(is_valid[..., None], weights[..., None] * y, 0.0), axis=1)


def fused_moe_grads(x, w1, w2, topk_weights, probe, local_ids, *, weight_on_input=False):
    """float64 d<fused_moe_jnp(...), probe> / d(x, w1, w2, topk_weights), by `jax.grad` under
    `jax.enable_x64` (the gradient tests' reference)."""
    import jax

    with jax.enable_x64(True):

        def loss(x, w1, w2, topk_weights):
            out = fused_moe_jnp(x, w1, w2, topk_weights, local_ids, weight_on_input=weight_on_input)
            return jnp.sum(out * probe)

        args = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, w1, w2, topk_weights))
        return [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2, 3))(*args)]


def assert_grad_close(name: str, got, want, tol: float) -> None:
    """One gradient finite, of `want`'s shape, and within relative Frobenius error `tol` of the
    float64 `want` (a zero `want` asks for exact zeros)."""
    got, want = np.asarray(jnp.asarray(got, jnp.float32), np.float64), np.asarray(want)
    assert got.shape == want.shape and np.all(np.isfinite(got)), (name, got.shape, want.shape)
    error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert error <= tol, f"d{name}: relative error {error:.2e} > {tol}"


def assert_grads_close(grads, wants, tol: float) -> None:
    """Each of the (x, w1, w2, topk_weights) gradients as `assert_grad_close`."""
    for name, got, want in zip(("x", "w1", "w2", "topk_weights"), grads, wants, strict=True):
        assert_grad_close(name, got, want, tol)


# --- expert parallelism ----------------------------------------------------------------------


def ep_dispatch(ids, *, num_ranks: int, num_experts: int, capacity: int):
    """(keep bool[T, k], num_dropped int[R], num_routed_per_rank int[R, R]) of the capacity-bound
    all-to-all: each sender rank (T / R consecutive tokens) keeps, per destination rank (expert
    e on rank e // (E / R)), its first `capacity` pairs in (token, slot) order; ids outside
    [0, E) go nowhere and are neither routed nor dropped."""
    ids = np.asarray(ids)
    num_tokens, topk = ids.shape
    per_rank = num_tokens // num_ranks
    keep = np.zeros(ids.shape, bool)
    dropped = np.zeros(num_ranks, np.int64)
    routed = np.zeros((num_ranks, num_ranks), np.int64)
    for src in range(num_ranks):
        used = [0] * num_ranks
        for t in range(src * per_rank, (src + 1) * per_rank):
            for j in range(topk):
                e = int(ids[t, j])
                if not 0 <= e < num_experts:
                    continue
                dest = e // (num_experts // num_ranks)
                routed[src, dest] += 1
                if used[dest] < capacity:
                    used[dest] += 1
                    keep[t, j] = True
                else:
                    dropped[src] += 1
    return keep, dropped, routed
