"""DLPack custom calls into torch-hosted libraries, usable inside `jax.jit` (moe_jax.interop).

`bridge.torch_callback` runs a torch function on XLA's buffers and stream; the GEMM backends
"torch" and "deep_gemm" register themselves with `moe_jax.grouped_gemm` when imported (the registry
imports them on first use). `deep_ep`, `deep_ep_ht` and `deep_ep_ll` hold the DeepEP
expert-parallel adapters (one process per GPU, started with
`moe_jax.distributed.init_distributed`); `deep_ep_ll_graph` keeps the low-latency adapter's calls
safe to capture into XLA's CUDA graphs. torch, deep_gemm and deep_ep are
imported only when a call needs them.
"""

from moe_jax.interop import deep_ep_layouts
from moe_jax.interop.bridge import TORCH_INSTALL_HINT, import_torch, torch_callback
from moe_jax.interop.deep_ep import DEEP_EP_INSTALL_HINT
from moe_jax.interop.deep_ep_ht import DeepEPHighThroughput, make_high_throughput_buffer
from moe_jax.interop.deep_ep_layouts import DeepEPProblem, HTHandle, LLDispatched, LLHandle
from moe_jax.interop.deep_ep_ll import DeepEPLowLatency, LLPreparedTokens, make_low_latency_buffer

__all__ = [
    "DEEP_EP_INSTALL_HINT",
    "DeepEPHighThroughput",
    "DeepEPLowLatency",
    "DeepEPProblem",
    "HTHandle",
    "LLDispatched",
    "LLHandle",
    "LLPreparedTokens",
    "TORCH_INSTALL_HINT",
    "deep_ep_layouts",
    "import_torch",
    "make_high_throughput_buffer",
    "make_low_latency_buffer",
    "torch_callback",
]
