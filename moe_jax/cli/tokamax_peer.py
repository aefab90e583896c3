"""The routed layer as a JAX user writes it with a ragged dot, and tokamax as that ragged dot.

tokamax (Google's Pallas kernel library, `pip install -e '.[peers]'`) ships `tokamax.ragged_dot`
with "mosaic" (Mosaic GPU, sm90) and "triton" implementations and an XLA fallback; its default
(None) takes the first that runs. Its weights are [E, K, N] per expert, so the peer takes moe_jax's
w1 bf16[E, 2I, H] and w2 bf16[E, H, I] transposed once, before the timed call (`to_kn`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# bench variant name -> tokamax.ragged_dot's `implementation`
PEERS = {"tokamax": None, "tokamax_mosaic": "mosaic", "tokamax_triton": "triton"}


def sorted_moe(x, w1, w2, topk_weights, topk_ids, *, ragged_dot: Callable) -> jax.Array:
    """argsort the (token, expert) pairs by expert, gather rows, GEMM1, SiLU(gate) * up, GEMM2,
    unsort, sum over top-k weighted by the router.

    Args:
      x: bf16[T, H] tokens.
      w1, w2: the experts' GEMM1 and GEMM2 weights, E leading, in the layout `ragged_dot` takes.
      topk_weights: float32[T, k] router weights; topk_ids: int32[T, k] experts in [0, E).
      ragged_dot: (rows [T*k, K], w, num_tokens_per_expert int32[E]) -> [T*k, N] in rows' dtype;
        GEMM1's N holds the gate columns, then the up columns.

    Returns:
      [T, H] in x's dtype.
    """
    num_tokens, topk = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w1.shape[0]).astype(jnp.int32)
    h = ragged_dot(x[order // topk], w1, sizes)
    gate, up = jnp.split(h, 2, axis=1)
    y = ragged_dot(jax.nn.silu(gate.astype(jnp.float32)).astype(h.dtype) * up, w2, sizes)
    per_pair = jnp.zeros_like(y).at[order].set(y).reshape(num_tokens, topk, -1)
    return jnp.sum(per_pair.astype(jnp.float32) * topk_weights[..., None], axis=1).astype(x.dtype)


def to_kn(w1: jax.Array, w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """moe_jax's w1 [E, 2I, H], w2 [E, H, I] as tokamax's [E, H, 2I], [E, I, H] (and back)."""
    return jnp.swapaxes(w1, 1, 2), jnp.swapaxes(w2, 1, 2)


def unavailable_reason(name: str) -> str | None:
    """Why the peer `name` (a key of `PEERS`) cannot run here, or None."""
    try:
        import tokamax  # noqa: F401
    except ImportError as error:
        return f"needs the peers extra: pip install -e '.[peers]' ({error})"
    if PEERS[name] is not None and jax.default_backend() != "gpu":
        return "needs an NVIDIA GPU"  # as the other GPU-only rows: one note for all
    return None


def peer_layer(name: str) -> Callable:
    """`sorted_moe` through `tokamax.ragged_dot(implementation=PEERS[name])`, in x's dtype:
    (x, w1 [E, H, 2I], w2 [E, I, H], topk_weights, topk_ids) -> [T, H]. Check
    `unavailable_reason` first."""
    import tokamax
    from absl import flags

    # tokamax reads its options as absl flags and, unless parsed, parses sys.argv for them (its
    # `_ConfigOption.value`), which fails on the bench's own options: keep its defaults.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

    def ragged_dot(rows, w, sizes):
        return tokamax.ragged_dot(
            rows, w, sizes, preferred_element_type=rows.dtype, implementation=PEERS[name]
        )

    return lambda *args: sorted_moe(*args, ragged_dot=ragged_dot)
