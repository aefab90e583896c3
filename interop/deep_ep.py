"""DeepEP dispatch/combine inside `jax.jit`, through the DLPack bridge (`bridge.torch_callback`).

This module holds what both modes share; `deep_ep_ht` and `deep_ep_ll` hold the modes.

One process per GPU (`moe_jax.distributed.init_distributed`), a `deep_ep.Buffer` per process
(`make_low_latency_buffer`, `make_high_throughput_buffer`), and two modes:

- High-throughput (`DeepEPHighThroughput`, a `PrepareFinalize` for `ModularMoE` with contiguous
  experts and the rank's `expert_map`): intranode only (2, 4 or 8 ranks). Dispatch runs with
  `num_worst_tokens = R * T`, so the receive size is static and DeepEP makes no host sync; FP8
  rows + scales travel when the weights are FP8. Combine sums the ranks' weighted partial sums.
- Low-latency (`DeepEPLowLatency`, a masked-format `PrepareFinalize`: `ModularMoE(ll,
  MaskedExperts())` with this rank's experts): `[E_local, R * T_max, H]` blocks straight into the
  masked grouped GEMM (DeepGEMM on the GPU); FP8 dispatch quantizes inside DeepEP; combine
  applies the weights. Runs on one GPU too (world size 1).

Speaks DeepEP V1's `Buffer` API (PyPI `tokenspeed-deepep` 1.2.1; V2 keeps it as `deep_ep.Buffer`).
DeepEP's handle crosses from the dispatch call to the combine call as a named pytree of JAX arrays
(`HTHandle`, `LLHandle`), so no torch state outlives a callback. Ids cross as the int32 words of
DeepEP's int64 `topk_idx` (`deep_ep_layouts.topk_idx_words`): no cast kernel per call.

Hazards: DeepEP allocates its dispatch outputs in torch's pool and the callback copies them into
XLA's buffers (`LL_RECV_COPIES`); LL combine writes straight into XLA's output (no copy). Each
callback costs host time (DLPack imports, DeepEP's Python wrapper): at decode sizes the LL round
trip is host-bound (BENCHMARKS.md). The LL callbacks can be captured into XLA's CUDA graphs
instead (`DeepEPLowLatency(command_buffer_compatible=True)`; `deep_ep_ll_graph` says how their
allocations and DeepEP's buffer alternation are kept safe); the HT callbacks allocate outside any
private pool and are never captured. Calls sharing a Buffer are ordered only by their data
dependencies, which the handle provides between a dispatch and its combine; DeepEP's LL mode
keeps two receive buffers, so at most two LL dispatches may be in flight before their combines.
"""

from __future__ import annotations

DEEP_EP_INSTALL_HINT = (
    "moe_jax.interop.deep_ep needs DeepEP V1 (`import deep_ep`): `pip install "
    "tokenspeed-deepep==1.2.1.post20251110` (CUDA 13, Python 3.12, links NVSHMEM; loads against "
    "torch 2.11). DeepEP V2 builds (tokenspeed-deepep 2.x, deepinfer-ep 2.5.0) need NCCL >= "
    "2.30 (torch 2.11 ships 2.28.9). The JAX all-to-all path, moe_jax.expert_parallel, needs no "
    "DeepEP."
)

# `PrepareFinalize.gradient_refusal` of both adapters: `ModularMoE` raises it under jax.grad.
GRADIENT_REFUSAL = (
    "DeepEP's dispatch and combine run as torch callbacks, which JAX cannot differentiate: "
    "differentiate the expert-parallel layer on JAX collectives instead (moe_jax.ep_moe or "
    "ep_fused_moe, AllToAllPrepareFinalize: with FP8 weights it dispatches float tokens under "
    "jax.grad), or keep the DeepEP layer out of the gradient (jax.lax.stop_gradient its inputs)"
)


def import_deep_ep():
    """Returns the deep_ep module, or raises ImportError saying how to get it."""
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(DEEP_EP_INSTALL_HINT) from e
    return deep_ep


def topk_idx_from_words(torch, deep_ep):
    """torch int32[T, k, 2] words -> DeepEP's `topk_idx_t` [T, k] (a view when that is int64)."""
    dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
    if dtype == torch.int64:
        return lambda words: words.view(torch.int64).squeeze(-1)
    return lambda words: words[..., 0].to(dtype)
