"""The pure-JAX side of the DeepEP adapters: limits, handles, id rewrites, layout views.

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
The masked experts (`moe_jax.masked_experts`) run on those rows as `MaskedTokens`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import layouts
from moe_jax._pytree import pytree_dataclass
from moe_jax.prepare_finalize import PreparedTokens

HT_INTRANODE_RANKS = (2, 4, 8)  # DeepEP `SWITCH_RANKS` (csrc/kernels/launch.cuh)
LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # V1 1.2.1 `SWITCH_HIDDEN`
LL_MAX_TOPK = 11  # V1 1.2.1 (the July 2025 tree allowed 9)
LL_MAX_TOKENS_PER_RANK = 511  # QP depth 1024 >= 2 * (tokens_per_rank + 1)
FP8_GROUP = 128  # columns per FP8 scale (DeepEP's and DeepGEMM's 1 x 128 activation blocks)
# DeepEP moves rows in 16-byte vectors (int4): a row of H elements must be a multiple of 16 bytes.
ROW_ALIGN_BYTES = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepEPProblem:
    """Static sizes of one EP layer.

    Attributes:
      num_ranks, rank: EP world size and this process's rank.
      num_experts: E, global (E_local = E // R on every rank).
      num_tokens: T per rank per call (HT), or the per-rank maximum T_max (LL).
      hidden: H.
      num_topk: k.
    """

    num_ranks: int
    rank: int
    num_experts: int
    num_tokens: int
    hidden: int
    num_topk: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


@pytree_dataclass
class HTHandle:
    """What DeepEP's high-throughput combine needs from its dispatch (V1's intranode handle,
    which DeepEP passes as a positional 6-tuple), carried between the two calls as JAX arrays.

    C = `num_sms // 2` channels (DeepEP runs one channel per pair of SMs: a sender and a receiver).

    Attributes:
      rank_prefix_matrix: int32[R, R] prefix sums of tokens sent between ranks.
      channel_prefix_matrix: int32[R, C] per-channel prefix sums on the sender side.
      recv_channel_prefix_matrix: int32[R, C] the same on the receiver side (used by combine).
      recv_src_idx: int32[R * T] source token of each received row (num_worst_tokens rows).
      is_token_in_rank: int8[T, R] DeepEP's bool[T, R] (JAX buffers cross DLPack as int8).
      send_head: int32[T, R] where each token's copy sits in each destination's ring buffer.
    """

    rank_prefix_matrix: jax.Array
    channel_prefix_matrix: jax.Array
    recv_channel_prefix_matrix: jax.Array
    recv_src_idx: jax.Array
    is_token_in_rank: jax.Array
    send_head: jax.Array

    @classmethod
    def shapes(cls, problem: DeepEPProblem, *, num_channels: int) -> HTHandle:
        """The handle's `jax.ShapeDtypeStruct`s for one HT dispatch of `problem`."""
        r, t, i32 = problem.num_ranks, problem.num_tokens, jnp.int32
        return cls(
            rank_prefix_matrix=jax.ShapeDtypeStruct((r, r), i32),
            channel_prefix_matrix=jax.ShapeDtypeStruct((r, num_channels), i32),
            recv_channel_prefix_matrix=jax.ShapeDtypeStruct((r, num_channels), i32),
            recv_src_idx=jax.ShapeDtypeStruct((r * t,), i32),
            is_token_in_rank=jax.ShapeDtypeStruct((t, r), jnp.int8),
            send_head=jax.ShapeDtypeStruct((t, r), i32),
        )


@pytree_dataclass
class LLHandle:
    """What DeepEP's low-latency combine needs from its dispatch, as JAX arrays.

    DeepEP's own handle is `(src_info, layout_range, T_max, H, E)`; the three ints are static and
    come from `DeepEPProblem`.

    Attributes:
      src_info: int32[E_local, R * T_max] source (token, rank) of each received row; entries at
        or past the expert's count are stale.
      layout_range: int32[E_local, 2R], the little-endian words of DeepEP's int64[E_local, R]
        (offset and count of each source rank's rows, packed in one int64).
    """

    src_info: jax.Array
    layout_range: jax.Array


@pytree_dataclass
class LLDispatched:
    """DeepEP low-latency receive buffers as JAX arrays.

    Attributes:
      rows: [E_local, R * T_max, H] bf16 or float8_e4m3fn; rows >= recv_count[e] are stale.
      scales_storage: float32[E_local, H // 128, R * T_max] (DeepGEMM's masked SFA, transposed),
        or None for bf16 dispatch; `ll_scales_from_storage` gives the row view.
      recv_count: int32[E_local] valid rows per local expert.
      handle: `LLHandle` for the combine.
    """

    rows: jax.Array
    scales_storage: jax.Array | None
    recv_count: jax.Array
    handle: LLHandle


def check_ht(*, num_ranks: int, hidden: int, hidden_itemsize: int) -> None:
    """Raises ValueError when DeepEP's intranode HT kernels cannot run this problem.

    `hidden_itemsize` is the itemsize of the rows that travel: 2 for bf16, 1 for FP8 dispatch
    (whose scales also need H % 128 == 0)."""
    if num_ranks not in HT_INTRANODE_RANKS:
        raise ValueError(
            f"{num_ranks=}: DeepEP high-throughput intranode kernels exist for "
            f"{HT_INTRANODE_RANKS} ranks only (one process per GPU); use the JAX all-to-all "
            "path (moe_jax.expert_parallel) for other rank counts"
        )
    if hidden * hidden_itemsize % ROW_ALIGN_BYTES:
        raise ValueError(
            f"{hidden=} x {hidden_itemsize} bytes per element must be a multiple of "
            f"{ROW_ALIGN_BYTES} bytes (DeepEP moves rows in 16-byte vectors); pad H"
        )
    if hidden_itemsize == 1 and hidden % FP8_GROUP:
        raise ValueError(f"{hidden=}: FP8 dispatch sends one scale per {FP8_GROUP} columns")


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
    ids = layouts.ids_as_int32(topk_ids)
    return jnp.where((ids >= 0) & (ids < num_experts), ids, -1)


def topk_idx_words(topk_ids: jax.Array, *, num_experts: int) -> jax.Array:
    """int32[T, k, 2]: the little-endian words of DeepEP's int64 `topk_idx`, ids outside [0, E)
    as -1. JAX (without x64) has no int64; the torch side views these bytes as int64[T, k]
    without a copy, so no cast kernel runs per call.

    Example:
      >>> topk_idx_words(jnp.array([[3, -2]]), num_experts=4).tolist()
      [[[3, 0], [-1, -1]]]
    """
    ids = dispatch_topk_ids(topk_ids, num_experts=num_experts)
    return jnp.stack([ids, jnp.right_shift(ids, 31)], axis=-1)  # high word: sign extension


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
