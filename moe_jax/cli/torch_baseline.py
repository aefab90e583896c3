"""Benchmark baseline: the FP8 MoE layer as torch code + DeepGEMM (no JAX on the timed path).

This is the "torch glue + DeepGEMM" row of `python -m moe_jax bench`: permutation, quantization,
activation and the weighted sum written as plain torch ops around DeepGEMM's contiguous grouped
GEMMs, with vLLM's layout (128-row segments, -1 on padding) and quantization formula. It is what
a torch user gets without fused glue kernels. Only the benchmarks import it.
"""

from __future__ import annotations

from moe_jax.cli.timing import time_torch

# DeepGEMM's contiguous grouped FP8 GEMM: the current name, then the one older releases used.
DEEP_GEMM_FP8_CONTIGUOUS = (
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
)


def _quantize(x, group: int = 128):
    """vLLM per-token-group FP8 quantization in torch: (q e4m3 [M, K], scales f32 [M, K/128])."""
    import torch

    grouped = x.float().view(x.shape[0], -1, group)
    scales = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (grouped / scales).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(x.shape), scales.squeeze(-1)


def deep_gemm_fp8_contiguous():
    """deep_gemm's contiguous grouped FP8 GEMM, called directly from torch (the baseline)."""
    import deep_gemm

    for name in DEEP_GEMM_FP8_CONTIGUOUS:
        if hasattr(deep_gemm, name):
            return getattr(deep_gemm, name)
    raise AttributeError(f"deep_gemm has none of {DEEP_GEMM_FP8_CONTIGUOUS}")


def make_forward(x, w1q, w1s, w2q, w2s, topk_weights, topk_ids):
    """A torch forward over torch CUDA tensors; returns bf16 [T, H]."""
    import torch

    gemm = deep_gemm_fp8_contiguous()
    num_tokens, topk = topk_ids.shape
    num_experts, two_i, hidden = w1q.shape
    inter = two_i // 2
    pairs = num_tokens * topk
    num_rows = -(-(pairs + min(pairs, num_experts) * 127) // 128) * 128
    arange = torch.arange(pairs, device=x.device)

    def forward():
        flat = topk_ids.reshape(-1).long()
        counts = torch.bincount(flat, minlength=num_experts)
        padded = (counts + 127) // 128 * 128
        starts = padded.cumsum(0) - padded
        order = torch.argsort(flat, stable=True)
        experts = flat[order]
        rank = arange - (counts.cumsum(0) - counts)[experts]
        dest = starts[experts] + rank
        m_indices = torch.full((num_rows,), -1, dtype=torch.int32, device=x.device)
        m_indices[dest] = experts.int()
        xq, xs = _quantize(x)
        source = order // topk
        rows = torch.zeros((num_rows, hidden), dtype=torch.uint8, device=x.device)
        rows[dest] = xq.view(torch.uint8)[source]
        row_scales = torch.zeros((num_rows, hidden // 128), dtype=torch.float32, device=x.device)
        row_scales[dest] = xs[source]
        h = torch.empty((num_rows, two_i), dtype=torch.bfloat16, device=x.device)
        gemm((rows.view(torch.float8_e4m3fn), row_scales), (w1q, w1s), h, m_indices)
        act = torch.nn.functional.silu(h[:, :inter].float()).bfloat16() * h[:, inter:]
        aq, a_scales = _quantize(act)
        y = torch.empty((num_rows, hidden), dtype=torch.bfloat16, device=x.device)
        gemm((aq, a_scales), (w2q, w2s), y, m_indices)
        per_pair = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
        per_pair[order] = y[dest].float()
        weighted = per_pair.view(num_tokens, topk, hidden) * topk_weights.float()[..., None]
        return weighted.sum(1).to(torch.bfloat16)

    return forward


def run(layer, *, iters: int):
    """(out, streamed ms, latency ms) for a `moe_jax.cli.layer_bench.Layer`, or why it cannot run.

    Timed by `moe_jax.cli.timing.time_torch`, the same loop as every JAX variant.
    """
    try:
        import deep_gemm  # noqa: F401
        import torch
    except ImportError as error:
        return f"needs torch and deep_gemm ({error})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    import jax.numpy as jnp
    import numpy as np

    tensors = [
        torch.from_dlpack(a)
        for a in (
            layer.x,
            layer.w1q,
            layer.w1s,
            layer.w2q,
            layer.w2s,
            layer.topk_weights,
            layer.topk_ids,
        )
    ]
    forward = make_forward(*tensors)
    streamed, latency = time_torch(forward, iters=iters)
    out = forward().float().cpu().numpy()
    return jnp.asarray(np.asarray(out)), streamed, latency
