"""DeepEP high-throughput (normal-mode) dispatch/combine as a `PrepareFinalize` (see
`moe_jax.interop.deep_ep` for the shared contract and hazards)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax._pytree import pytree_dataclass
from moe_jax.interop import deep_ep_layouts as dl
from moe_jax.interop.bridge import import_torch, torch_callback
from moe_jax.interop.deep_ep import GRADIENT_REFUSAL, import_deep_ep, topk_idx_from_words
from moe_jax.interop.deep_ep_layouts import DeepEPProblem, HTHandle
from moe_jax.prepare_finalize import PreparedTokens, PrepareFinalize, scale_by_router_weight

# DeepEP V1's default `Buffer.num_sms`, also vLLM's cap: the HT kernels take 20 of the H200's 132
# SMs and leave the rest to the experts. Even: each channel is one sending and one receiving SM.
HT_NUM_SMS = 20
# DeepEP V1 1.2.1's recommended intranode configs (`Buffer.get_dispatch_config` and
# `get_combine_config`) without their SM count, which `HT_NUM_SMS` sets instead of the
# process-global `Buffer.num_sms`: (NVL send chunk, NVL receive buffer, RDMA send chunk, RDMA
# receive buffer), in tokens.
HT_DISPATCH_TUNING = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)}
HT_COMBINE_TUNING = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128)}


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

    gradient_refusal = GRADIENT_REFUSAL
    buffer: Any
    problem: DeepEPProblem
    num_sms: int = HT_NUM_SMS

    def __post_init__(self):
        # The rows' dtype is known only in `prepare` (bf16, or FP8 under a quant config), which
        # checks again with its itemsize; here the bf16 rows (2 bytes) that every call can send.
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
        ids_from_words = topk_idx_from_words(torch, deep_ep)
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
