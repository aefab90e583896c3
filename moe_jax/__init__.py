"""moe_jax: vLLM's modular fused-MoE kernel in JAX.

Routing (`fused_topk`, `grouped_topk`), the functional layer (`fused_moe`), its composable parts
(`ModularMoE`, `NoEPPrepareFinalize`, `ContiguousExperts`, `MaskedExperts`), and expert parallelism
on JAX collectives (`ep_fused_moe`, `ep_moe`, `AllToAllPrepareFinalize`). Pallas GPU
kernels live in `moe_jax.kernels`; DLPack interop with torch-hosted DeepGEMM/DeepEP in
`moe_jax.interop`.
"""

from moe_jax import layouts, permute, quant, registry
from moe_jax.act_quant import act_and_quant, group_quant
from moe_jax.activation import act_and_mul
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.ep_api import ep_fused_moe, ep_moe
from moe_jax.expert_parallel import (
    AllToAllPrepareFinalize,
    EPConfig,
    EPStats,
    expert_map_for_rank,
)
from moe_jax.experts import Experts, ExpertsCall, ExpertWeights
from moe_jax.experts_by_name import experts_names
from moe_jax.fused_moe import fused_moe
from moe_jax.grouped_gemm import GEMMS, GemmProblem, GroupedGemm
from moe_jax.masked_experts import MaskedExperts
from moe_jax.modular import ModularMoE
from moe_jax.permute import count_expert_num_tokens
from moe_jax.prepare_finalize import (
    AlreadyReduced,
    NoEPPrepareFinalize,
    PreparedTokens,
    PrepareFinalize,
    WeightAndReduce,
)
from moe_jax.reference import moe_reference
from moe_jax.routing import fused_topk, grouped_topk

__version__ = "0.1.0"

__all__ = [
    "GEMMS",
    "AllToAllPrepareFinalize",
    "AlreadyReduced",
    "ContiguousExperts",
    "EPConfig",
    "EPStats",
    "Experts",
    "ExpertsCall",
    "ExpertWeights",
    "GemmProblem",
    "GroupedGemm",
    "MaskedExperts",
    "ModularMoE",
    "NoEPPrepareFinalize",
    "PrepareFinalize",
    "PreparedTokens",
    "WeightAndReduce",
    "act_and_mul",
    "act_and_quant",
    "count_expert_num_tokens",
    "ep_fused_moe",
    "ep_moe",
    "expert_map_for_rank",
    "experts_names",
    "fused_moe",
    "fused_topk",
    "group_quant",
    "grouped_topk",
    "layouts",
    "moe_reference",
    "permute",
    "quant",
    "registry",
]
