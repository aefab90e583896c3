"""DLPack custom calls into torch-hosted libraries, usable inside `jax.jit` (moe_jax.interop).

`bridge.torch_callback` runs a torch function on XLA's buffers and stream; the GEMM backends
"torch" and "deep_gemm" register themselves with `moe_jax.grouped_gemm` when imported (the registry
imports them on first use). torch and deep_gemm are imported only when a call needs them.
"""

from moe_jax.interop.bridge import TORCH_INSTALL_HINT, import_torch, torch_callback

__all__ = ["TORCH_INSTALL_HINT", "import_torch", "torch_callback"]
