"""DeepEP low-latency dispatch/combine as a masked-format `PrepareFinalize` for `ModularMoE` with
`MaskedExperts` (see `moe_jax.interop.deep_ep` for the shared contract and hazards)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax._pytree import pytree_dataclass
from moe_jax.interop import deep_ep_layouts as dl
from moe_jax.interop.bridge import import_torch, torch_callback
from moe_jax.interop.deep_ep import GRADIENT_REFUSAL, import_deep_ep, topk_idx_from_words
from moe_jax.interop.deep_ep_layouts import DeepEPProblem, LLDispatched, LLHandle
from moe_jax.interop.deep_ep_ll_graph import LLCaptureState, combine_output
from moe_jax.prepare_finalize import (
    ActivationFormat,
    MaskedTokens,
    PrepareFinalize,
    scale_by_router_weight,
)
from moe_jax.registry import AUTO, FunctionImpl, OpProblem, Registry, current_platform

# How the LL dispatch's receive buffers reach XLA's: "valid_rows" copies only rows < recv_count
# (one Triton kernel, GPU only), "all_rows" copies whole buffers (five torch copies, any device);
# "auto" is "valid_rows" on a GPU backend, else "all_rows" (`RECV_COPIES`).
LL_RECV_COPIES = (AUTO, "valid_rows", "all_rows")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidRowsCopyConfig:
    """Tiling of the "valid_rows" receive copy (one Triton kernel).

    Attributes:
      block_t: received rows per program (power of two).
      block_w: int32 words per row chunk a program moves per step (power of two).
      num_warps: Triton warps per program.
    Defaults: BENCHMARKS.md, `deep_ep_ll_bench.py --copy-sweep`.
    """

    block_t: int = 4
    block_w: int = 1024
    num_warps: int = 8

    def __post_init__(self):
        for name in ("block_t", "block_w", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"ValidRowsCopyConfig.{name}={value} but a power of two is needed")


VALID_ROWS_COPY = ValidRowsCopyConfig()


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


def _copy_all_rows(out, received) -> None:
    """Copies LL dispatch results (count, rows, scales storage or None, src_info, layout_range as
    int32 words) whole into XLA's `out` buffers, in `LLDispatched`'s leaf order."""
    count, rows, scales, info, layout = received
    sources = [rows, scales, count, info, layout]
    for o, t in zip(out, [s for s in sources if s is not None], strict=True):
        o.copy_(t)


def _copy_valid_rows(out, received, config: ValidRowsCopyConfig = VALID_ROWS_COPY) -> None:
    """`_copy_all_rows` for the rows below each expert's count only, in one Triton kernel (rows
    past the counts are stale: `LLDispatched` leaves them unspecified)."""
    count, rows, scales, info, layout = received
    torch = import_torch()
    triton, kernel = _valid_rows_kernel()
    out_rows, out_scales = out[0], (out[1] if scales is not None else None)
    out_count, out_info, out_layout = out[1 + (scales is not None) :]
    num_experts, num_rows = rows.shape[:2]
    num_groups = 1 if scales is None else scales.shape[1]
    row_words = rows[0, 0].numel() * rows.element_size() // 4
    kernel[(num_experts, triton.cdiv(num_rows, config.block_t))](
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
        BLOCK_T=config.block_t,
        BLOCK_W=config.block_w,
        BLOCK_G=triton.next_power_of_2(num_groups),
        BLOCK_L=triton.next_power_of_2(layout.shape[1]),
        num_warps=config.num_warps,
    )


def _needs_gpu(problem: OpProblem) -> str | None:
    if problem.platform != "gpu":
        return f"a GPU (Triton) kernel, not for {problem.platform!r}; use 'all_rows'"
    return None


RECV_COPIES = Registry(
    "recv_copy",
    preference=lambda problem: (
        ("valid_rows", "all_rows") if problem.platform == "gpu" else ("all_rows",)
    ),
)
RECV_COPIES.register(FunctionImpl("valid_rows", _copy_valid_rows, refuse=_needs_gpu))
RECV_COPIES.register(FunctionImpl("all_rows", _copy_all_rows))


@pytree_dataclass
class LLPreparedTokens(MaskedTokens):
    """LL's received blocks (x: [E_local, R * T_max, H]) and the handle for the combine."""

    handle: LLHandle


@dataclasses.dataclass(frozen=True, eq=False)
class DeepEPLowLatency(PrepareFinalize):
    """DeepEP low-latency dispatch/combine (module docstring): `prepare` dispatches this rank's
    tokens (T <= T_max, global ids) into masked blocks for `MaskedExperts` run on this rank's
    experts ([E_local, ...], no expert_map); `finalize` combines them, weighted, into [T, H].

    Attributes:
      buffer: this process's `make_low_latency_buffer(group, problem)`.
      problem: `DeepEPProblem` with num_tokens = T_max, the most tokens a rank sends per call.
      use_fp8: dispatch FP8 rows + scales (DeepEP quantizes; amax floor 1e-4) instead of bf16.
      recv_copy: how the receive buffers reach XLA (`LL_RECV_COPIES`).
      command_buffer_compatible: let XLA capture the dispatch and combine callbacks into its CUDA
        graphs, so replays run no Python (`moe_jax.interop.deep_ep_ll_graph` says what that
        takes). Call `warm_up()` once, on every rank, before tracing; every jitted program must
        combine each of its dispatches (`ModularMoE` does).
      capture: `deep_ep_ll_graph.LLCaptureState`, made by the adapter: command-buffer mode's
        host state, with `num_host_calls` (DeepEP calls made from Python; a replay adds none).
    """

    activation_format = ActivationFormat.MASKED
    gradient_refusal = GRADIENT_REFUSAL
    buffer: Any
    problem: DeepEPProblem
    use_fp8: bool = True
    recv_copy: str = AUTO
    command_buffer_compatible: bool = False
    capture: LLCaptureState = dataclasses.field(init=False, repr=False, default=None)

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
        if self.recv_copy != AUTO:
            RECV_COPIES.get(self.recv_copy)  # an unknown name fails here, listing the valid ones
        # Host state of command-buffer mode (the frozen adapter's one mutable part).
        object.__setattr__(self, "capture", LLCaptureState(buffer=self.buffer, problem=p))

    def warm_up(self) -> None:
        """One eager dispatch -> combine of no tokens through XLA, for command-buffer mode.

        Fills the private memory pool on XLA's stream with DeepEP's receive tensors, compiles
        the receive copy, and records which LL buffer captured dispatches must use. Collective:
        every rank calls it, outside `jax.jit`. A no-op without `command_buffer_compatible`.
        """
        if not self.command_buffer_compatible:
            return
        p = self.problem
        x = jnp.zeros((p.num_tokens, p.hidden), jnp.bfloat16)
        ids = jnp.full((p.num_tokens, p.num_topk), -1, jnp.int32)
        weights = jnp.zeros((p.num_tokens, p.num_topk), jnp.float32)

        def round_trip(x, ids, weights):
            got = self.dispatch(x, ids, phase="warm_up")
            y = jnp.zeros((p.num_local_experts, p.num_ranks * p.num_tokens, p.hidden))
            return self.combine(y.astype(jnp.bfloat16), ids, weights, got, phase="warm_up")

        jax.block_until_ready(jax.jit(round_trip)(x, ids, weights))

    def prepare(
        self, hidden_states, topk_weights, topk_ids, *, quant_config, apply_router_weight_on_input
    ):
        """Dispatches bf16 rows -> `LLPreparedTokens`. FP8 rows come from DeepEP's own cast (amax
        floor 1e-4: last-bit differences from moe_jax's quantizer), or with use_fp8=False from
        quantizing the received buffer here."""
        if quant_config is None and self.use_fp8:
            raise ValueError(
                "use_fp8=True needs FP8 weights: build DeepEPLowLatency(use_fp8=False)"
            )
        weights = topk_weights.astype(jnp.float32)
        x = hidden_states.astype(jnp.bfloat16)
        if apply_router_weight_on_input:
            x, weights = scale_by_router_weight(x, weights), jnp.ones_like(weights)
        got = self.dispatch(x, topk_ids)
        rows, storage = got.rows, got.scales_storage
        scales = None if storage is None else dl.ll_scales_from_storage(storage)
        if quant_config is not None and scales is None:
            rows, scales = quant_config.quantize_activations(rows)
        return LLPreparedTokens(
            x=rows,
            x_scales=scales,
            topk_ids=topk_ids,
            topk_weights=weights,
            num_tokens_per_expert=got.recv_count,
            handle=got.handle,
        )

    def finalize(self, expert_output, prepared, weight_and_reduce, *, out_dtype):
        del weight_and_reduce  # DeepEP's combine applies the weights
        combined = self.combine(expert_output, prepared.topk_ids, prepared.topk_weights, prepared)
        return combined.astype(out_dtype)

    def dispatch(
        self, x: jax.Array, topk_ids: jax.Array, *, phase: str = "dispatch"
    ) -> LLDispatched:
        """x bf16[T <= T_max, H], topk_ids int[T, k] global -> `LLDispatched`. `warm_up` alone
        passes phase="warm_up" (eager, never captured)."""
        is_capturable = self.command_buffer_compatible and phase == "dispatch"
        if is_capturable and not self.capture.is_warm:
            raise ValueError(
                "DeepEPLowLatency(command_buffer_compatible=True) needs ll.warm_up() once, "
                "outside jax.jit and on every rank, before its first traced dispatch"
            )
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
        copy = RECV_COPIES.select(
            self.recv_copy, OpProblem(platform=current_platform(), dtype=jnp.dtype(x.dtype).name)
        )
        ids_from_words = topk_idx_from_words(torch, deep_ep)
        capture = self.capture

        def dispatch(out, x_t, words_t):
            if phase == "warm_up":
                capture.make_pool(torch, x_t.device)
                capture.dispatch_buffer_address = capture.next_buffer_address()
            elif is_capturable:
                capture.check("dispatch")
            with capture.allocating(torch):
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
                copy(out, (count, rows, scales, src_info, layout_range))

        words = dl.topk_idx_words(topk_ids, num_experts=p.num_experts)
        call = torch_callback(dispatch, results, command_buffer_compatible=is_capturable)
        outs = call(x.astype(jnp.bfloat16), words)
        count, src_info, layout_range = outs[1 + use_fp8 :]
        return LLDispatched(
            rows=outs[0],
            scales_storage=outs[1] if use_fp8 else None,
            recv_count=count,
            handle=LLHandle(src_info=src_info, layout_range=layout_range),
        )

    def combine(
        self,
        y: jax.Array,
        topk_ids: jax.Array,
        topk_weights: jax.Array,
        dispatched: LLDispatched,
        *,
        phase: str = "combine",
    ) -> jax.Array:
        """y bf16[E_local, R * T_max, H] (unweighted expert outputs; rows past the counts are
        not read) -> bf16[T, H], the weighted sum over each token's experts. `dispatched`: the
        dispatch's `LLDispatched` or `LLPreparedTokens` (only its handle is read). DeepEP writes the
        result straight into XLA's output buffer (into a temporary with `command_buffer_compatible`:
        `deep_ep_ll_graph.combine_output`). `warm_up` alone passes phase="warm_up" (eager)."""
        is_capturable = self.command_buffer_compatible and phase == "combine"
        p, torch, deep_ep, buffer = self.problem, import_torch(), import_deep_ep(), self.buffer
        ids_from_words = topk_idx_from_words(torch, deep_ep)
        capture = self.capture

        def combine(out, y_t, words_t, w_t, src_info, layout_range):
            if is_capturable:
                capture.check("combine")
            handle = (
                src_info,
                layout_range.view(torch.int64),
                p.num_tokens,
                p.hidden,
                p.num_experts,
            )
            with capture.allocating(torch):
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
        call = torch_callback(combine, result, command_buffer_compatible=is_capturable)
        combined = call(
            y.astype(jnp.bfloat16),
            dl.topk_idx_words(topk_ids, num_experts=p.num_experts),
            topk_weights.astype(jnp.float32),
            dispatched.handle.src_info,
            dispatched.handle.layout_range,
        )
        if not is_capturable:
            return combined
        ids = dl.dispatch_topk_ids(topk_ids, num_experts=p.num_experts)
        return combine_output(combined, ids)
