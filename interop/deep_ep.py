"""DeepEP dispatch/combine inside `jax.jit`, through the DLPack bridge (`bridge.torch_callback`).

One process per GPU (`init_distributed`), a `deep_ep.Buffer` per process, and two modes:

- High-throughput (`DeepEPHighThroughput`, a `PrepareFinalize` for `ModularMoE` with contiguous
  experts and the rank's `expert_map`): intranode only (2, 4 or 8 ranks). Dispatch runs with
  `num_worst_tokens = R * T`, so the receive size is static and DeepEP makes no host sync; FP8
  rows + scales travel when the weights are FP8. Combine sums the ranks' weighted partial sums.
- Low-latency (`DeepEPLowLatency` + `deep_ep_ll_moe`): `[E_local, R * T_max, H]` masked layout
  straight into the masked grouped GEMM (DeepGEMM on the GPU); FP8 dispatch quantizes inside
  DeepEP; combine applies the weights. (The masked layout is not `PreparedTokens`' [T, H] rows,
  so this mode is a function, not a `PrepareFinalize`.)

Speaks DeepEP's V1 `Buffer` API (V2 keeps it as `deep_ep.Buffer`). DeepEP's handle crosses from the
dispatch call to the combine call as JAX arrays (copied out, rebuilt as torch views), so no torch
state outlives a callback. Hazards: DeepEP allocates its receive tensors in torch's pool and the
callbacks copy them into XLA's buffers (one device copy each); the callbacks are not CUDA-graph
safe (allocations); calls sharing a Buffer are ordered only by their data dependencies, which the
handle provides between a dispatch and its combine. Not yet run against a real DeepEP (no build on
the H200 host, see `DEEP_EP_INSTALL_HINT`); the layout side is tested on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax._pytree import pytree_dataclass
from moe_jax.experts import ExpertsCall, ExpertWeights
from moe_jax.interop import deep_ep_layouts as dl
from moe_jax.interop.bridge import import_torch, torch_callback
from moe_jax.prepare_finalize import PreparedTokens, PrepareFinalize, scale_by_router_weight

DEEP_EP_INSTALL_HINT = (
    "moe_jax.interop.deep_ep needs DeepEP (`import deep_ep`): build DeepEP V1 (tag v1.2.1, with "
    "NVSHMEM for the low-latency mode) from source against your torch. The PyPI sdist "
    "deepinfer-ep 2.5.0 (DeepEP V2) does not build on the H200 host: its NCCL 2.28.9 (torch "
    "2.11's nvidia-nccl-cu13) lacks ncclCommProperties/ncclCommQueryProperties (NCCL >= 2.30.4 "
    "needed). The JAX all-to-all path, moe_jax.expert_parallel, needs no DeepEP."
)


def import_deep_ep():
    """Returns the deep_ep module, or raises ImportError saying how to get it."""
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(DEEP_EP_INSTALL_HINT) from e
    return deep_ep


def topk_idx_torch_dtype(deep_ep, torch):
    """DeepEP's index dtype: int64 unless built with 32-bit ids (TOPK_IDX_BITS=32)."""
    return getattr(deep_ep, "topk_idx_t", torch.int64)


def init_distributed(
    *,
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    local_device_id: int | None = None,
    torch_init_method: str | None = None,
):
    """Starts jax.distributed and torch.distributed (NCCL) for one process per GPU.

    Args:
      coordinator_address: "host:port" of process 0 for JAX; torch uses port + 1 unless
        `torch_init_method` is given.
      num_processes, process_id: world size and this process's rank (= its EP rank).
      local_device_id: this process's GPU; None means process_id % GPUs per host.

    Returns:
      A gloo `torch.distributed` group over all processes, for `deep_ep.Buffer`.
    """
    torch = import_torch()
    local = process_id % torch.cuda.device_count() if local_device_id is None else local_device_id
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=[local],
    )
    if jax.local_device_count() != 1:
        raise ValueError(f"{jax.local_device_count()=}: DeepEP needs one GPU per process")
    torch.cuda.set_device(local)
    torch.zeros((), device="cuda")  # torch's CUDA context before the first jitted call
    host, port = coordinator_address.rsplit(":", 1)
    torch.distributed.init_process_group(
        "nccl",
        init_method=torch_init_method or f"tcp://{host}:{int(port) + 1}",
        rank=process_id,
        world_size=num_processes,
    )
    return torch.distributed.new_group(backend="gloo")


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


def _ids_for(torch, deep_ep, ids):
    """JAX hands int32 ids; DeepEP wants `topk_idx_t` (int64 unless built with 32 bits)."""
    dtype = topk_idx_torch_dtype(deep_ep, torch)
    return ids if ids.dtype == dtype else ids.to(dtype)


@pytree_dataclass
class HTPreparedTokens(PreparedTokens):
    """HT's received tokens (global ids, see `deep_ep_layouts.ht_prepared_tokens`) + handle."""

    handle: tuple


@dataclasses.dataclass(frozen=True, eq=False)
class DeepEPHighThroughput(PrepareFinalize):
    """DeepEP normal-mode dispatch/combine (module docstring). Run the experts with
    `expert_map=expert_map_for_rank(E, R, rank)`; received rows: R * T (num_worst_tokens)."""

    buffer: Any  # deep_ep.Buffer(group, num_nvl_bytes=1 << 30), one per process
    problem: DeepEPProblem
    num_sms: int = 20

    def __post_init__(self):
        dl.check_ht(num_ranks=self.problem.num_ranks, hidden=self.problem.hidden, hidden_itemsize=2)

    def _config(self, deep_ep, which: str):
        return getattr(deep_ep.Buffer, f"get_{which}_config")(self.problem.num_ranks)

    def _handle_shapes(self):
        p, channels = self.problem, self.num_sms // 2
        worst = p.num_ranks * p.num_tokens
        i32 = jnp.int32
        return (  # V1 intranode handle; is_token_in_rank travels as int8
            jax.ShapeDtypeStruct((p.num_ranks, p.num_ranks), i32),  # rank_prefix_matrix
            jax.ShapeDtypeStruct((p.num_ranks, channels), i32),  # channel_prefix_matrix
            jax.ShapeDtypeStruct((p.num_ranks, channels), i32),  # recv_channel_prefix_matrix
            jax.ShapeDtypeStruct((worst,), i32),  # recv_src_idx
            jax.ShapeDtypeStruct((p.num_tokens, p.num_ranks), jnp.int8),  # is_token_in_rank
            jax.ShapeDtypeStruct((p.num_tokens, p.num_ranks), i32),  # send_head
        )

    def prepare(
        self, hidden_states, topk_weights, topk_ids, *, quant_config, apply_router_weight_on_input
    ):
        p = self.problem
        if hidden_states.shape != (p.num_tokens, p.hidden) or topk_ids.shape[1] != p.num_topk:
            raise ValueError(
                f"{hidden_states.shape=}, {topk_ids.shape=} but the problem is "
                f"T={p.num_tokens}, H={p.hidden}, k={p.num_topk}"
            )
        weights = topk_weights.astype(jnp.float32)
        x = hidden_states.astype(jnp.bfloat16)
        if apply_router_weight_on_input:
            x, weights = scale_by_router_weight(x, weights), jnp.ones_like(weights)
        x_scales = None
        if quant_config is not None:
            x, x_scales = quant_config.quantize_activations(x)
        worst, groups = p.num_ranks * p.num_tokens, p.hidden // dl.FP8_GROUP
        results = [jax.ShapeDtypeStruct((worst, p.hidden), x.dtype)]
        if x_scales is not None:
            results.append(jax.ShapeDtypeStruct((worst, groups), jnp.float32))
        results += [
            jax.ShapeDtypeStruct((worst, p.num_topk), jnp.int32),
            jax.ShapeDtypeStruct((worst, p.num_topk), jnp.float32),
            *self._handle_shapes(),
        ]
        has_scales = x_scales is not None
        torch, deep_ep, buffer = import_torch(), import_deep_ep(), self.buffer

        def dispatch(out, *args):
            x_t, scales_t, ids_t, w_t = args if has_scales else (args[0], None, *args[1:])
            ids_t = _ids_for(torch, deep_ep, ids_t)
            per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
                ids_t, p.num_experts
            )
            recv, recv_ids, recv_w, _, handle, _ = buffer.dispatch(
                (x_t, scales_t) if has_scales else x_t,
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=ids_t,
                topk_weights=w_t,
                num_worst_tokens=worst,
                config=self._config(deep_ep, "dispatch"),
            )
            received = list(recv) if has_scales else [recv]
            handle = list(handle)
            handle[4] = handle[4].view(torch.int8)
            for o, t in zip(out, [*received, recv_ids, recv_w, *handle], strict=True):
                if tuple(o.shape) != tuple(t.shape):
                    raise ValueError(
                        f"DeepEP returned {tuple(t.shape)} where {tuple(o.shape)} "
                        "was expected: this DeepEP's handle differs from V1's"
                    )
                o.copy_(t)

        ids = dl.dispatch_topk_ids(topk_ids, num_experts=p.num_experts)
        args = (x, x_scales, ids, weights) if has_scales else (x, ids, weights)
        outs = torch_callback(dispatch, results)(*args)
        recv_x, recv_scales = outs[0], (outs[1] if has_scales else None)
        recv_ids, recv_w, *handle = outs[1 + has_scales :]
        base = dl.ht_prepared_tokens(
            recv_x,
            recv_scales,
            recv_ids,
            recv_w,
            rank=p.rank,
            num_local_experts=p.num_local_experts,
            num_experts=p.num_experts,
        )
        return HTPreparedTokens(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
            handle=tuple(handle),
        )

    def finalize(self, expert_output, prepared, weight_and_reduce, *, out_dtype):
        p = self.problem
        partial = weight_and_reduce.apply(
            expert_output, prepared.topk_weights, out_dtype=jnp.bfloat16
        )
        torch, deep_ep, buffer = import_torch(), import_deep_ep(), self.buffer

        def combine(out, partial_t, *handle):
            handle = list(handle)
            handle[4] = handle[4].view(torch.bool)
            combined, _, _ = buffer.combine(
                partial_t, tuple(handle), config=self._config(deep_ep, "combine")
            )
            out.copy_(combined)

        result = jax.ShapeDtypeStruct((p.num_tokens, p.hidden), jnp.bfloat16)
        return torch_callback(combine, result)(partial, *prepared.handle).astype(out_dtype)


@pytree_dataclass
class LLDispatched:
    """DeepEP low-latency receive buffers as JAX arrays.

    Attributes:
      rows: [E_local, R * T_max, H] bf16 or float8_e4m3fn; rows >= recv_count[e] are stale.
      scales_storage: float32[E_local, H // 128, R * T_max] (DeepGEMM's masked SFA, transposed),
        or None for bf16 dispatch; `deep_ep_layouts.ll_scales_from_storage` gives the row view.
      recv_count: int32[E_local] valid rows per local expert.
      src_info: int32[E_local, R * T_max] DeepEP handle part.
      layout_range: int64[E_local, R] DeepEP handle part, carried as int32[E_local, 2R].
    """

    rows: jax.Array
    scales_storage: jax.Array | None
    recv_count: jax.Array
    src_info: jax.Array
    layout_range: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class DeepEPLowLatency:
    """DeepEP low-latency dispatch/combine. `buffer`: deep_ep.Buffer(group, num_rdma_bytes=
    Buffer.get_low_latency_rdma_size_hint(T_max, H, R, E), low_latency_mode=True,
    num_qps_per_rank=E_local)."""

    buffer: Any
    problem: DeepEPProblem
    use_fp8: bool = True

    def __post_init__(self):
        p = self.problem
        dl.check_ll(
            num_ranks=p.num_ranks,
            hidden=p.hidden,
            num_topk=p.num_topk,
            num_max_tokens_per_rank=p.num_tokens,
            num_experts=p.num_experts,
            use_fp8=self.use_fp8,
        )

    def dispatch(self, x: jax.Array, topk_ids: jax.Array) -> LLDispatched:
        """x bf16[T <= T_max, H], topk_ids int[T, k] global -> `LLDispatched`."""
        p, torch, deep_ep, buffer = self.problem, import_torch(), import_deep_ep(), self.buffer
        t_tot, e_loc = p.num_ranks * p.num_tokens, p.num_local_experts
        rows = jax.ShapeDtypeStruct(
            (e_loc, t_tot, p.hidden), quant.FP8_DTYPE if self.use_fp8 else jnp.bfloat16
        )
        results = [rows]
        if self.use_fp8:
            results.append(
                jax.ShapeDtypeStruct((e_loc, p.hidden // dl.FP8_GROUP, t_tot), jnp.float32)
            )
        results += [
            jax.ShapeDtypeStruct((e_loc,), jnp.int32),
            jax.ShapeDtypeStruct((e_loc, t_tot), jnp.int32),
            jax.ShapeDtypeStruct((e_loc, 2 * p.num_ranks), jnp.int32),
        ]

        def dispatch(out, x_t, ids_t):
            recv, count, handle, _, _ = buffer.low_latency_dispatch(
                x_t,
                _ids_for(torch, deep_ep, ids_t),
                p.num_tokens,
                p.num_experts,
                use_fp8=self.use_fp8,
                async_finish=False,
                return_recv_hook=False,
            )
            received = [recv[0], recv[1].transpose(1, 2)] if self.use_fp8 else [recv]
            layout_range = handle[1].contiguous().view(torch.int32)
            for o, t in zip(out, [*received, count, handle[0], layout_range], strict=True):
                o.copy_(t)

        outs = torch_callback(dispatch, results)(
            x.astype(jnp.bfloat16), dl.dispatch_topk_ids(topk_ids, num_experts=p.num_experts)
        )
        scales = outs[1] if self.use_fp8 else None
        count, src_info, layout_range = outs[1 + self.use_fp8 :]
        return LLDispatched(
            rows=outs[0],
            scales_storage=scales,
            recv_count=count,
            src_info=src_info,
            layout_range=layout_range,
        )

    def combine(
        self, y: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, dispatched: LLDispatched
    ) -> jax.Array:
        """y bf16[E_local, R * T_max, H] (unweighted expert outputs) -> bf16[T, H], weighted."""
        p, torch, deep_ep, buffer = self.problem, import_torch(), import_deep_ep(), self.buffer

        def combine(out, y_t, ids_t, w_t, src_info, layout_range):
            handle = (
                src_info,
                layout_range.view(torch.int64),
                p.num_tokens,
                p.hidden,
                p.num_experts,
            )
            buffer.low_latency_combine(
                y_t,
                _ids_for(torch, deep_ep, ids_t),
                w_t,
                handle,
                async_finish=False,
                return_recv_hook=False,
                out=out,
            )

        result = jax.ShapeDtypeStruct((topk_ids.shape[0], p.hidden), jnp.bfloat16)
        return torch_callback(combine, result)(
            y.astype(jnp.bfloat16),
            dl.dispatch_topk_ids(topk_ids, num_experts=p.num_experts),
            topk_weights.astype(jnp.float32),
            dispatched.src_info,
            dispatched.layout_range,
        )


def deep_ep_ll_moe(
    x: jax.Array,
    weights: ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    ll: DeepEPLowLatency,
    activation: str = "silu",
    gemm: str | None = "deep_gemm",
) -> jax.Array:
    """One rank's MoE layer over DeepEP low-latency: dispatch -> masked experts -> combine.

    x bf16[T, H] (T <= T_max), weights this rank's [E_local, ...] experts, routing with global
    ids -> bf16[T, H]. With FP8 weights the dispatch sends FP8 (DeepEP's own cast, amax floor
    1e-4: last-bit differences from moe_jax's quantizer) unless `ll.use_fp8` is False, in which
    case the received bf16 rows are quantized here.
    """
    got = ll.dispatch(x, topk_ids)
    scales = None if got.scales_storage is None else dl.ll_scales_from_storage(got.scales_storage)
    rows = got.rows
    quant_config = quant.Fp8BlockQuant() if weights.is_fp8 else None
    if quant_config is not None and scales is None:
        rows, scales = quant_config.quantize_activations(rows)
    elif quant_config is None and scales is not None:
        raise ValueError("FP8 dispatch with bf16 weights: build DeepEPLowLatency(use_fp8=False)")
    y = dl.masked_experts_forward(
        rows,
        scales,
        got.recv_count,
        weights,
        gemm=gemm,
        call=ExpertsCall(activation=activation, quant_config=quant_config, out_dtype=jnp.bfloat16),
        expected_m=dl.ll_expected_m(
            x.shape[0] * ll.problem.num_ranks,
            topk_ids.shape[1],
            ll.problem.num_experts,
            rows.shape[1],
        ),
    )
    return ll.combine(y, topk_ids, topk_weights, got)
