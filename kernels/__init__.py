"""Pallas GPU kernels (Triton backend): permute, unpermute (weight-and-reduce), token counting,
the contiguous layout's routing metadata,
FP8 group quantization (alone and fused after act(gate) * up), a grouped GEMM for few rows per
expert (decode), and the grouped weight gradient of the training step.

Installed as `moe_jax.kernels`; each kernel runs in interpret mode on CPU with `interpret=True`.
"""

from moe_jax.kernels.act_quant import ActQuantConfig, act_and_quant, group_quant
from moe_jax.kernels.count import CountConfig, count_expert_num_tokens
from moe_jax.kernels.grouped_gemm import GroupedGemmConfig, grouped_gemm_contiguous
from moe_jax.kernels.permute import PermuteConfig, permute
from moe_jax.kernels.routing_metadata import RoutingMetadataConfig, routing_metadata
from moe_jax.kernels.unpermute import UnpermuteConfig, unpermute
from moe_jax.kernels.wgrad import WgradConfig, grouped_wgrad

__all__ = [
    "ActQuantConfig",
    "CountConfig",
    "GroupedGemmConfig",
    "PermuteConfig",
    "RoutingMetadataConfig",
    "UnpermuteConfig",
    "WgradConfig",
    "act_and_quant",
    "count_expert_num_tokens",
    "group_quant",
    "grouped_gemm_contiguous",
    "grouped_wgrad",
    "permute",
    "routing_metadata",
    "unpermute",
]
