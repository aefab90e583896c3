"""The pure-JAX side of the DeepEP adapters: limits, id rewrites, layout views, masked experts.

Everything here runs (and is tested) on the CPU; `moe_jax.interop.deep_ep` moves the tensors
through DeepEP. Contracts (DeepEP V1's `Buffer` API; vLLM's DeepEP prepare/finalize wrappers,
`deepep_ht_prepare_finalize.py` and `deepep_ll_prepare_finalize.py`):

High-throughput (HT, "normal") dispatch delivers each token with >= 1 expert on this rank once, with
`recv_topk_idx` holding *local* ids or -1 (another rank's expert; weight zeroed). vLLM rewrites the
ids to global ones before its experts: local -> local + rank * E_local, -1 -> an expert this rank
does not own (E - 1 on rank 0, else 0), which the rank's `expert_map` then drops. HT combine sums
the ranks' *weighted* partial outputs without weights.

Low-latency (LL) dispatch delivers `[E_local, R * T_max, H]` rows (one per selected expert, the
first `recv_count[e]` valid, the rest stale), FP8 scales allocated `[E_local, H / 128, R * T_max]`
and seen through a transposed view (DeepGEMM's masked SFA layout); LL combine applies the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, layouts
from moe_jax.experts import ExpertsCall, ExpertWeights, masked_mlp
from moe_jax.prepare_finalize import PreparedTokens

HT_INTRANODE_RANKS = (2, 4, 8)  # DeepEP `SWITCH_RANKS` (csrc/kernels/launch.cuh)
LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # V1 1.2.1 `SWITCH_HIDDEN`
LL_MAX_TOPK = 11  # V1 1.2.1 (the July 2025 tree allowed 9)
LL_MAX_TOKENS_PER_RANK = 511  # QP depth 1024 >= 2 * (tokens_per_rank + 1)
FP8_GROUP = 128


def check_ht(*, num_ranks: int, hidden: int, hidden_itemsize: int) -> None:
    """Raises ValueError when DeepEP's intranode HT kernels cannot run this problem."""
    if num_ranks not in HT_INTRANODE_RANKS:
        raise ValueError(
            f"{num_ranks=}: DeepEP high-throughput intranode kernels exist for "
            f"{HT_INTRANODE_RANKS} ranks only (one process per GPU); use the JAX all-to-all "
            "path (moe_jax.expert_parallel) for other rank counts"
        )
    if hidden * hidden_itemsize % 16:
        raise ValueError(f"{hidden=} x {hidden_itemsize} bytes must be a multiple of 16 bytes")


def check_ll(
    *,
    num_ranks: int,
    hidden: int,
    num_topk: int,
    num_max_tokens_per_rank: int,
    num_experts: int,
    use_fp8: bool,
) -> None:
    """Raises ValueError when DeepEP's low-latency kernels cannot run this problem."""
    if hidden not in LL_HIDDEN_SIZES:
        raise ValueError(
            f"{hidden=}: DeepEP low-latency kernels are compiled for hidden sizes "
            f"{LL_HIDDEN_SIZES} only; use the high-throughput mode or pad H"
        )
    if use_fp8 and hidden % 512:
        raise ValueError(f"{hidden=}: FP8 low-latency dispatch needs hidden % 512 == 0")
    if not 1 <= num_topk <= LL_MAX_TOPK:
        raise ValueError(f"{num_topk=}: DeepEP low-latency supports 1..{LL_MAX_TOPK} experts")
    if not 1 <= num_max_tokens_per_rank <= LL_MAX_TOKENS_PER_RANK:
        raise ValueError(
            f"{num_max_tokens_per_rank=} must be in 1..{LL_MAX_TOKENS_PER_RANK} "
            "(DeepEP's queue depth); split the batch into chunks"
        )
    if num_ranks * num_max_tokens_per_rank % 4:
        raise ValueError(f"{num_ranks=} x {num_max_tokens_per_rank=} must be a multiple of 4")
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts=} must be a multiple of {num_ranks=}")


def dispatch_topk_ids(topk_ids: jax.Array, *, num_experts: int) -> jax.Array:
    """int32[T, k] ids for DeepEP: ids outside [0, E) become -1 (DeepEP's "no expert")."""
    ids = topk_ids.astype(jnp.int32)
    return jnp.where((ids >= 0) & (ids < num_experts), ids, -1)


def ht_global_topk_ids(
    recv_topk_idx: jax.Array, *, rank: int, num_local_experts: int, num_experts: int
) -> jax.Array:
    """vLLM's rewrite of HT's received ids: local -> global, -1 -> an expert not owned here.

    Example:
      >>> ht_global_topk_ids(jnp.array([[1, -1]]), rank=0, num_local_experts=2,
      ...                    num_experts=4).tolist()
      [[1, 3]]
      >>> ht_global_topk_ids(jnp.array([[1, -1]]), rank=1, num_local_experts=2,
      ...                    num_experts=4).tolist()
      [[3, 0]]
    """
    offset = rank * num_local_experts
    not_owned = num_experts - 1 if offset == 0 else 0
    ids = recv_topk_idx.astype(jnp.int32)
    return jnp.where(ids < 0, not_owned, ids + offset).astype(jnp.int32)


def ht_num_tokens_per_expert(recv_topk_idx: jax.Array, num_local_experts: int) -> jax.Array:
    """int32[E_local] received (token, slot) pairs per local expert (DeepEP's count list with
    expert_alignment=1), computed on the device: with num_worst_tokens DeepEP returns none."""
    return layouts.count_expert_num_tokens(recv_topk_idx, num_local_experts)


def ht_prepared_tokens(
    recv_x: jax.Array,
    recv_x_scales: jax.Array | None,
    recv_topk_idx: jax.Array,
    recv_topk_weights: jax.Array,
    *,
    rank: int,
    num_local_experts: int,
    num_experts: int,
) -> PreparedTokens:
    """HT's receive buffers -> `PreparedTokens` for contiguous experts run with this rank's
    expert_map (`moe_jax.expert_parallel.expert_map_for_rank`). Rows past the received count
    (num_worst_tokens padding) must carry -1 ids; their weights are zeroed here too."""
    weights = jnp.where(recv_topk_idx >= 0, recv_topk_weights.astype(jnp.float32), 0.0)
    ids = ht_global_topk_ids(
        recv_topk_idx, rank=rank, num_local_experts=num_local_experts, num_experts=num_experts
    )
    return PreparedTokens(x=recv_x, x_scales=recv_x_scales, topk_ids=ids, topk_weights=weights)


def ll_scales_from_storage(storage: jax.Array) -> jax.Array:
    """float32[E_local, G, T_tot] (how DeepEP LL allocates scales) -> [E_local, T_tot, G], the
    row view moe_jax's masked experts read. DeepGEMM's masked GEMM wants the storage itself."""
    return jnp.swapaxes(storage, 1, 2)


def ll_scales_to_storage(scales: jax.Array) -> jax.Array:
    """Inverse of `ll_scales_from_storage`: [E_local, T_tot, G] -> [E_local, G, T_tot]."""
    return jnp.swapaxes(scales, 1, 2)


def ll_clear_stale_rows(rows: jax.Array, recv_count: jax.Array) -> jax.Array:
    """Zeroes rows at or past recv_count[e] (stale in DeepEP's buffer) of [E, T_tot, ...] rows."""
    valid = jnp.arange(rows.shape[1], dtype=jnp.int32)[None, :] < recv_count[:, None]
    return jnp.where(
        valid.reshape(*valid.shape, *([1] * (rows.ndim - 2))), rows, jnp.zeros((), rows.dtype)
    )


def ll_expected_m(num_tokens: int, topk: int, num_experts: int, max_m: int) -> int:
    """DeepGEMM's masked-GEMM hint: mean rows per expert rounded up to 16, in [16, max_m]."""
    return max(16, min(max_m, layouts.round_up(-(-num_tokens * topk // num_experts), 16)))


def masked_experts_forward(
    rows: jax.Array,
    row_scales: jax.Array | None,
    recv_count: jax.Array,
    weights: ExpertWeights,
    *,
    call: ExpertsCall,
    gemm: str | grouped_gemm.GroupedGemm | None = "xla",
    expected_m: int | None = None,
) -> jax.Array:
    """The experts on LL's masked layout (vLLM's BatchedDeepGemmExperts): unweighted outputs.

    Args:
      rows: [E_local, T_tot, H] bf16, or float8_e4m3fn with `row_scales`.
      row_scales: float32[E_local, T_tot, H // 128] (see `ll_scales_from_storage`) or None.
      recv_count: int32[E_local] valid rows per expert.
      weights: this rank's `ExpertWeights` ([E_local, ...]).
      call: activation, quantization recipe (None: no FP8) and output dtype.
      gemm: grouped-GEMM backend name or object (DeepGEMM's masked GEMM on the GPU).
      expected_m: scheduling hint; None uses T_tot.

    Returns:
      [E_local, T_tot, H] in call.out_dtype; rows past recv_count are zero.
    """
    rows = ll_clear_stale_rows(rows, recv_count)
    if row_scales is not None:
        row_scales = ll_clear_stale_rows(row_scales, recv_count)
    y = masked_mlp(
        rows, row_scales, recv_count, weights, gemm=gemm, call=call, expected_m=expected_m
    )
    return ll_clear_stale_rows(y, recv_count).astype(call.out_dtype)
