"""Pallas GPU kernels (Triton backend): permute, unpermute (weight-and-reduce), token counting.

Installed as `moe_jax.kernels`; each kernel runs in interpret mode on CPU with `interpret=True`.
"""

from moe_jax.kernels.count import CountConfig, count_expert_num_tokens
from moe_jax.kernels.permute import PermuteConfig, permute
from moe_jax.kernels.unpermute import UnpermuteConfig, unpermute

__all__ = [
    "CountConfig",
    "PermuteConfig",
    "UnpermuteConfig",
    "count_expert_num_tokens",
    "permute",
    "unpermute",
]
