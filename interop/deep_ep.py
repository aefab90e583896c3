"""DeepEP dispatch/combine inside `jax.jit`, through the DLPack bridge (`bridge.torch_callback`).

One process per GPU (`moe_jax.distributed.init_distributed`), a `deep_ep.Buffer` per process
(`make_low_latency_buffer`, `make_high_throughput_buffer`), and two modes:

- High-throughput (`DeepEPHighThroughput`, a `PrepareFinalize` for `ModularMoE` with contiguous
  experts and the rank's `expert_map`): intranode only (2, 4 or 8 ranks). Dispatch runs with
  `num_worst_tokens = R * T`, so the receive size is static and DeepEP makes no host sync; FP8
  rows + scales travel when the weights are FP8. Combine sums the ranks' weighted partial sums.
- Low-latency (`DeepEPLowLatency` + `deep_ep_ll_moe`): `[E_local, R * T_max, H]` masked layout
  straight into the masked grouped GEMM (DeepGEMM on the GPU); FP8 dispatch quantizes inside
  DeepEP; combine applies the weights. Runs on one GPU too (world size 1). The masked layout is
  not `PreparedTokens`' [T, H] rows, so this mode is a function, not a `PrepareFinalize`.

Speaks DeepEP V1's `Buffer` API (PyPI `tokenspeed-deepep` 1.2.1; V2 keeps it as `deep_ep.Buffer`).
DeepEP's handle crosses from the dispatch call to the combine call as a named pytree of JAX arrays
(`HTHandle`, `LLHandle`), so no torch state outlives a callback. Ids cross as the int32 words of
DeepEP's int64 `topk_idx` (`deep_ep_layouts.topk_idx_words`): no cast kernel per call.

Hazards: DeepEP allocates its dispatch outputs in torch's pool and the callback copies them into
XLA's buffers (`LL_RECV_COPIES`); LL combine writes straight into XLA's output (no copy). Each
callback costs host time (DLPack imports, DeepEP's Python wrapper): at 128 tokens per rank the LL
round trip is host-bound, 2.7-4.3x a direct DeepEP call (BENCHMARKS.md). The callbacks
allocate, so they are not CUDA-graph safe. Calls sharing a Buffer are ordered only by their
data dependencies, which the handle provides between a dispatch and its combine; DeepEP's LL
mode keeps two receive buffers, so at most two LL dispatches may be in flight before their
combines.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax._pytree import pytree_dataclass
from moe_jax.experts import ExpertsCall, ExpertWeights
from moe_jax.interop import deep_ep_layouts as dl
from moe_jax.interop.bridge import import_torch, torch_callback
from moe_jax.interop.deep_ep_layouts import DeepEPProblem, HTHandle, LLDispatched, LLHandle
from moe_jax.prepare_finalize import PreparedTokens, PrepareFinalize, scale_by_router_weight
from moe_jax.registry import AUTO

DEEP_EP_INSTALL_HINT = (
    "moe_jax.interop.deep_ep needs DeepEP V1 (`import deep_ep`): `pip install "
    "tokenspeed-deepep==1.2.1.post20251110` (CUDA 13, Python 3.12, links NVSHMEM; loads against "
    "torch 2.11). DeepEP V2 builds (tokenspeed-deepep 2.x, deepinfer-ep 2.5.0) need NCCL >= "
    "2.30 (torch 2.11 ships 2.28.9). The JAX all-to-all path, moe_jax.expert_parallel, needs no "
    "DeepEP."
)

# DeepEP V1's default `Buffer.num_sms`, also vLLM's cap: the HT kernels take 20 of the H200's 132
# SMs and leave the rest to the experts. Even: each channel is one sending and one receiving SM.
HT_NUM_SMS = 20
# DeepEP V1 1.2.1's recommended intranode configs (`Buffer.get_dispatch_config` and
# `get_combine_config`) without their SM count, which `HT_NUM_SMS` sets instead of the
# process-global `Buffer.num_sms`: (NVL send chunk, NVL receive buffer, RDMA send chunk, RDMA
# receive buffer), in tokens.
HT_DISPATCH_TUNING = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)}
HT_COMBINE_TUNING = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128)}
# How the LL dispatch's receive buffers reach XLA's: "valid_rows" copies only rows < recv_count
# (one Triton kernel, GPU only), "all_rows" copies whole buffers (five torch copies, any device).
# "auto" is "valid_rows" on a GPU backend (fewer bytes: ~7.6 MB instead of ~30 MB at T_max=128,
# E_local=32, H=7168), else "all_rows". At that size the round trip is bound by host time and the
# two were within run-to-run noise on one H200 (2026-12-01: 172 vs 203 us in one run, 274 vs
# 224 us in another).
LL_RECV_COPIES = (AUTO, "valid_rows", "all_rows")


def import_deep_ep():
    """Returns the deep_ep module, or raises ImportError saying how to get it."""
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(DEEP_EP_INSTALL_HINT) from e
    return deep_ep


def _ids_from_words(torch, deep_ep):
    """torch int32[T, k, 2] words -> DeepEP's `topk_idx_t` [T, k] (a view when that is int64)."""
    dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
    if dtype == torch.int64:
        return lambda words: words.view(torch.int64).squeeze(-1)
    return lambda words: words[..., 0].to(dtype)


def make_low_latency_buffer(group: Any, problem: DeepEPProblem):
    """A `deep_ep.Buffer` for `DeepEPLowLatency` (vLLM's settings): RDMA bytes from DeepEP's
    hint, one queue pair per local expert (DeepEP's requirement), NVLink between local peers.
    `explicitly_destroy=True`: call `.destroy()` before the process group goes."""
    deep_ep, p = import_deep_ep(), problem
    return deep_ep.Buffer(
        group,
        num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
            p.num_tokens, p.hidden, p.num_ranks, p.num_experts
        ),
        low_latency_mode=True,
        num_qps_per_rank=p.num_local_experts,
        allow_nvlink_for_low_latency_mode=True,
        explicitly_destroy=True,
    )


def make_high_throughput_buffer(group: Any, problem: DeepEPProblem, *, num_sms: int = HT_NUM_SMS):
    """A `deep_ep.Buffer` for `DeepEPHighThroughput`: NVLink bytes from DeepEP's hint for bf16 rows
    (the larger of the dispatch and combine needs), no RDMA (intranode)."""
    deep_ep, p = import_deep_ep(), problem
    hidden_bytes = p.hidden * 2  # bf16 combine rows are the widest that travel
    num_nvl_bytes = max(
        deep_ep.Config(num_sms, *tuning[p.num_ranks]).get_nvl_buffer_size_hint(
            hidden_bytes, p.num_ranks
        )
        for tuning in (HT_DISPATCH_TUNING, HT_COMBINE_TUNING)
    )
    return deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)


@pytree_dataclass
class HTPreparedTokens(PreparedTokens):
    """HT's received tokens (global ids, see `deep_ep_layouts.ht_prepared_tokens`) + handle."""

    handle: HTHandle


@dataclasses.dataclass(frozen=True, eq=False)
class DeepEPHighThroughput(PrepareFinalize):
    """DeepEP normal-mode dispatch/combine (module docstring). Run the experts with
    `expert_map=expert_map_for_rank(E, R, rank)`; received rows: R * T (num_worst_tokens).

    Attributes:
      buffer: this process's `make_high_throughput_buffer(group, problem)`.
      problem: `DeepEPProblem`.
      num_sms: SMs the HT kernels use (even; `HT_NUM_SMS` says why 20). Sets the handle's
        channel count, num_sms // 2.
    """

    buffer: Any
    problem: DeepEPProblem
    num_sms: int = HT_NUM_SMS

    def __post_init__(self):
        dl.check_ht(num_ranks=self.problem.num_ranks, hidden=self.problem.hidden, hidden_itemsize=2)
        if self.num_sms <= 0 or self.num_sms % 2:
            raise ValueError(f"num_sms={self.num_sms}: DeepEP needs a positive even SM count")

    def _config(self, deep_ep, tuning):
        return deep_ep.Config(self.num_sms, *tuning[self.problem.num_ranks])

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
        dl.check_ht(num_ranks=p.num_ranks, hidden=p.hidden, hidden_itemsize=x.dtype.itemsize)
        worst, groups = p.num_ranks * p.num_tokens, p.hidden // dl.FP8_GROUP
        has_scales = x_scales is not None
        handle_shapes = HTHandle.shapes(p, num_channels=self.num_sms // 2)
        results = [jax.ShapeDtypeStruct((worst, p.hidden), x.dtype)]
        if has_scales:
            results.append(jax.ShapeDtypeStruct((worst, groups), jnp.float32))
        results += [
            jax.ShapeDtypeStruct((worst, p.num_topk), jnp.int32),
            jax.ShapeDtypeStruct((worst, p.num_topk), jnp.float32),
            *jax.tree.leaves(handle_shapes),
        ]
        torch, deep_ep, buffer = import_torch(), import_deep_ep(), self.buffer
        ids_from_words = _ids_from_words(torch, deep_ep)
        config = self._config(deep_ep, HT_DISPATCH_TUNING)

        def dispatch(out, *args):
            x_t, scales_t, words_t, w_t = args if has_scales else (args[0], None, *args[1:])
            ids_t = ids_from_words(words_t)
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
                config=config,
            )
            received = list(recv) if has_scales else [recv]
            # V1's positional handle, in `HTHandle`'s field order; bool crosses as int8.
            prefix, channel, recv_channel, src_idx, in_rank, send_head = handle
            handle_parts = [prefix, channel, recv_channel, src_idx, in_rank.view(torch.int8)]
            for o, t in zip(
                out, [*received, recv_ids, recv_w, *handle_parts, send_head], strict=True
            ):
                if tuple(o.shape) != tuple(t.shape):
                    raise ValueError(
                        f"DeepEP returned {tuple(t.shape)} where {tuple(o.shape)} "
                        "was expected: this DeepEP's handle differs from V1's"
                    )
                o.copy_(t)

        words = dl.topk_idx_words(topk_ids, num_experts=p.num_experts)
        args = (x, x_scales, words, weights) if has_scales else (x, words, weights)
        outs = torch_callback(dispatch, results)(*args)
        recv_x, recv_scales = outs[0], (outs[1] if has_scales else None)
        recv_ids, recv_w, *handle_leaves = outs[1 + has_scales :]
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
            handle=jax.tree.unflatten(jax.tree.structure(handle_shapes), handle_leaves),
        )

    def finalize(self, expert_output, prepared, weight_and_reduce, *, out_dtype):
        p = self.problem
        partial = weight_and_reduce.apply(
            expert_output, prepared.topk_weights, out_dtype=jnp.bfloat16
        )
        torch, deep_ep, buffer = import_torch(), import_deep_ep(), self.buffer
        config = self._config(deep_ep, HT_COMBINE_TUNING)

        def combine(out, partial_t, prefix, channel, recv_channel, src_idx, in_rank, send_head):
            handle = (prefix, channel, recv_channel, src_idx, in_rank.view(torch.bool), send_head)
            combined, _, _ = buffer.combine(partial_t, handle, config=config)
            out.copy_(combined)

        result = jax.ShapeDtypeStruct((p.num_tokens, p.hidden), jnp.bfloat16)
        leaves = jax.tree.leaves(prepared.handle)
        return torch_callback(combine, result)(partial, *leaves).astype(out_dtype)


@functools.cache
def _valid_rows_kernel():
    """The Triton kernel behind LL's "valid_rows" copy (built on first use; needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_valid_rows(
        # inputs (DeepEP's tensors)
        count_ptr,
        rows_ptr,
        scales_ptr,
        info_ptr,
        layout_ptr,
        # outputs (XLA's buffers)
        out_count_ptr,
        out_rows_ptr,
        out_scales_ptr,
        out_info_ptr,
        out_layout_ptr,
        num_rows,  # R * T_max
        row_words,  # int32 words per row
        num_groups,  # scales per row
        layout_words,  # 2R
        HAS_SCALES: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        # Program (e, b) copies rows [b * BLOCK_T, (b + 1) * BLOCK_T) of expert e that are below
        # its count (E=2, counts [3, 0], BLOCK_T=2: programs (0, 0) and (0, 1) copy rows 0-1 and
        # 2; the others copy nothing). Program (e, 0) also copies count[e] and layout_range[e].
        e = tl.program_id(0)
        start = tl.program_id(1) * BLOCK_T
        count = tl.load(count_ptr + e)
        if tl.program_id(1) == 0:
            tl.store(out_count_ptr + e, count)
            lw = tl.arange(0, BLOCK_L)
            lm = lw < layout_words
            lv = tl.load(layout_ptr + e * layout_words + lw, mask=lm)
            tl.store(out_layout_ptr + e * layout_words + lw, lv, mask=lm)
        if start < count:
            t = start + tl.arange(0, BLOCK_T)
            is_valid = t < count
            row = (e * num_rows + t).to(tl.int64)
            tl.store(out_info_ptr + row, tl.load(info_ptr + row, mask=is_valid), mask=is_valid)
            for w0 in range(0, row_words, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                mask = is_valid[:, None] & (w[None, :] < row_words)
                offs = row[:, None] * row_words + w[None, :]
                tl.store(out_rows_ptr + offs, tl.load(rows_ptr + offs, mask=mask), mask=mask)
            if HAS_SCALES:  # storage [E, G, R * T_max]: row t of group g at (e * G + g) * rows + t
                g = tl.arange(0, BLOCK_G)
                mask = (g[:, None] < num_groups) & is_valid[None, :]
                offs = (e * num_groups + g[:, None]).to(tl.int64) * num_rows + t[None, :]
                tl.store(out_scales_ptr + offs, tl.load(scales_ptr + offs, mask=mask), mask=mask)

    return triton, copy_valid_rows


def _copy_received(out, received, *, valid_rows_only: bool) -> None:
    """Copies LL dispatch results (count, rows, scales storage or None, src_info, layout_range as
    int32 words) into XLA's `out` buffers, in `LLDispatched`'s leaf order."""
    count, rows, scales, info, layout = received
    if not valid_rows_only:
        sources = [rows, scales, count, info, layout]
        for o, t in zip(out, [s for s in sources if s is not None], strict=True):
            o.copy_(t)
        return
    torch = import_torch()
    triton, kernel = _valid_rows_kernel()
    out_rows, out_scales = out[0], (out[1] if scales is not None else None)
    out_count, out_info, out_layout = out[1 + (scales is not None) :]
    num_experts, num_rows = rows.shape[:2]
    num_groups = 1 if scales is None else scales.shape[1]
    row_words = rows[0, 0].numel() * rows.element_size() // 4
    kernel[(num_experts, triton.cdiv(num_rows, 8))](
        count,
        rows.view(torch.int32),
        rows if scales is None else scales,
        info,
        layout,
        out_count,
        out_rows.view(torch.int32),
        out_rows if out_scales is None else out_scales,
        out_info,
        out_layout,
        num_rows,
        row_words,
        num_groups,
        layout.shape[1],
        HAS_SCALES=scales is not None,
        BLOCK_T=8,
        BLOCK_W=1024,
        BLOCK_G=triton.next_power_of_2(num_groups),
        BLOCK_L=triton.next_power_of_2(layout.shape[1]),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class DeepEPLowLatency:
    """DeepEP low-latency dispatch/combine (module docstring).

    Attributes:
      buffer: this process's `make_low_latency_buffer(group, problem)`.
      problem: `DeepEPProblem` with num_tokens = T_max, the most tokens a rank sends per call.
      use_fp8: dispatch FP8 rows + scales (DeepEP quantizes; amax floor 1e-4) instead of bf16.
      recv_copy: how the receive buffers reach XLA (`LL_RECV_COPIES`).
    """

    buffer: Any
    problem: DeepEPProblem
    use_fp8: bool = True
    recv_copy: str = AUTO

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
        if self.recv_copy not in LL_RECV_COPIES:
            raise ValueError(f"recv_copy={self.recv_copy!r}; choose from {LL_RECV_COPIES}")

    def dispatch(self, x: jax.Array, topk_ids: jax.Array) -> LLDispatched:
        """x bf16[T <= T_max, H], topk_ids int[T, k] global -> `LLDispatched`."""
        p, torch, deep_ep, buffer = self.problem, import_torch(), import_deep_ep(), self.buffer
        if x.shape[0] > p.num_tokens or x.shape[1] != p.hidden:
            raise ValueError(f"{x.shape=} but the problem has T_max={p.num_tokens}, H={p.hidden}")
        t_tot, e_loc, use_fp8 = p.num_ranks * p.num_tokens, p.num_local_experts, self.use_fp8
        results = [
            jax.ShapeDtypeStruct(
                (e_loc, t_tot, p.hidden), quant.FP8_DTYPE if use_fp8 else jnp.bfloat16
            )
        ]
        if use_fp8:
            results.append(
                jax.ShapeDtypeStruct((e_loc, p.hidden // dl.FP8_GROUP, t_tot), jnp.float32)
            )
        results += [
            jax.ShapeDtypeStruct((e_loc,), jnp.int32),
            jax.ShapeDtypeStruct((e_loc, t_tot), jnp.int32),
            jax.ShapeDtypeStruct((e_loc, 2 * p.num_ranks), jnp.int32),
        ]
        is_gpu = jax.default_backend() == "gpu"
        copy = self.recv_copy
        if copy == AUTO:
            copy = "valid_rows" if is_gpu else "all_rows"
        if copy == "valid_rows" and not is_gpu:
            raise ValueError("recv_copy='valid_rows' is a GPU (Triton) kernel; use 'all_rows'")
        ids_from_words = _ids_from_words(torch, deep_ep)

        def dispatch(out, x_t, words_t):
            recv, count, handle, _, _ = buffer.low_latency_dispatch(
                x_t,
                ids_from_words(words_t),
                p.num_tokens,
                p.num_experts,
                use_fp8=use_fp8,
                async_finish=False,
                return_recv_hook=False,
            )
            rows, scales = recv if use_fp8 else (recv, None)
            if scales is not None:  # [E, T_tot, G] with strides (G * T_tot, 1, T_tot)
                scales = scales.transpose(1, 2)
            src_info, layout_range = handle[0], handle[1].view(torch.int32)
            _copy_received(
                out,
                (count, rows, scales, src_info, layout_range),
                valid_rows_only=copy == "valid_rows",
            )

        words = dl.topk_idx_words(topk_ids, num_experts=p.num_experts)
        outs = torch_callback(dispatch, results)(x.astype(jnp.bfloat16), words)
        count, src_info, layout_range = outs[1 + use_fp8 :]
        return LLDispatched(
            rows=outs[0],
            scales_storage=outs[1] if use_fp8 else None,
            recv_count=count,
            handle=LLHandle(src_info=src_info, layout_range=layout_range),
        )

    def combine(
        self, y: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, dispatched: LLDispatched
    ) -> jax.Array:
        """y bf16[E_local, R * T_max, H] (unweighted expert outputs; rows past the counts are
        not read) -> bf16[T, H], the weighted sum over each token's experts. DeepEP writes the
        result straight into XLA's output buffer."""
        p, torch, deep_ep, buffer = self.problem, import_torch(), import_deep_ep(), self.buffer
        ids_from_words = _ids_from_words(torch, deep_ep)

        def combine(out, y_t, words_t, w_t, src_info, layout_range):
            handle = (
                src_info,
                layout_range.view(torch.int64),
                p.num_tokens,
                p.hidden,
                p.num_experts,
            )
            buffer.low_latency_combine(
                y_t,
                ids_from_words(words_t),
                w_t,
                handle,
                async_finish=False,
                return_recv_hook=False,
                out=out,
            )

        result = jax.ShapeDtypeStruct((topk_ids.shape[0], p.hidden), jnp.bfloat16)
        return torch_callback(combine, result)(
            y.astype(jnp.bfloat16),
            dl.topk_idx_words(topk_ids, num_experts=p.num_experts),
            topk_weights.astype(jnp.float32),
            dispatched.handle.src_info,
            dispatched.handle.layout_range,
        )


def deep_ep_ll_moe(
    x: jax.Array,
    weights: ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    ll: DeepEPLowLatency,
    activation: str = "silu",
    gemm: str = AUTO,
) -> jax.Array:
    """One rank's MoE layer over DeepEP low-latency: dispatch -> masked experts -> combine.

    Args:
      x: bf16[T, H] this rank's tokens, T <= T_max (`ll.problem.num_tokens`).
      weights: this rank's experts, [E_local, ...] (global ids [rank * E_local, ...)).
      topk_weights: float[T, k] router weights.
      topk_ids: int[T, k] global expert ids; ids outside [0, E) go nowhere.
      ll: `DeepEPLowLatency`.
      activation: gated activation of the experts.
      gemm: grouped-GEMM backend of the masked layout (`moe_jax.grouped_gemm.GEMMS`); "auto" is
        DeepGEMM's masked GEMM on an H200.

    Returns:
      bf16[T, H]. With FP8 weights the dispatch sends FP8 (DeepEP's own cast, amax floor 1e-4:
      last-bit differences from moe_jax's quantizer) unless `ll.use_fp8` is False, in which case
      the received bf16 rows are quantized here.
    """
    got = ll.dispatch(x, topk_ids)
    scales = None if got.scales_storage is None else dl.ll_scales_from_storage(got.scales_storage)
    rows = got.rows
    quant_config = quant.Fp8BlockQuant() if weights.is_fp8 else None
    if quant_config is not None and scales is None:
        rows, scales = quant_config.quantize_activations(rows)
    elif quant_config is None and scales is not None:
        raise ValueError("FP8 dispatch with bf16 weights: build DeepEPLowLatency(use_fp8=False)")
    p = ll.problem
    y = dl.masked_experts_forward(
        rows,
        scales,
        got.recv_count,
        weights,
        gemm=gemm,
        call=ExpertsCall(activation=activation, quant_config=quant_config, out_dtype=jnp.bfloat16),
        num_pairs=p.num_ranks * p.num_tokens * p.num_topk,
        expected_m=dl.ll_expected_m(
            x.shape[0] * p.num_ranks, topk_ids.shape[1], p.num_experts, rows.shape[1]
        ),
    )
    return ll.combine(y, topk_ids, topk_weights, got)
