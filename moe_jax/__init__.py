"""moe_jax: vLLM's modular fused-MoE kernel in JAX.

Routing (`fused_topk`, `grouped_topk`), the functional layer (`fused_moe`), its composable parts
(`ModularMoE`, `NoEPPrepareFinalize`, `ContiguousExperts`, `MaskedExperts`), and expert parallelism
on JAX collectives (`ep_fused_moe`, `ep_moe`, `AllToAllPrepareFinalize`). Pallas GPU
kernels live in `moe_jax.kernels`; DLPack interop with torch-hosted DeepGEMM/DeepEP in
`moe_jax.interop`.
"""

from moe_jax import layouts, quant
from moe_jax.activation import act_and_mul
from moe_jax.ep_api import ep_fused_moe, ep_moe
from moe_jax.expert_parallel import (
    AllToAllPrepareFinalize,
    EPConfig,
    EPStats,
    expert_map_for_rank,
)
from moe_jax.experts import (
    EXPERTS_NAMES,
    ContiguousExperts,
    Experts,
    ExpertsCall,
    ExpertWeights,
    MaskedExperts,
)
from moe_jax.fused_moe import fused_moe
from moe_jax.grouped_gemm import GemmProblem, GroupedGemm, available_gemms, register_gemm
from moe_jax.layouts import count_expert_num_tokens
from moe_jax.modular import ModularMoE
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
    "EXPERTS_NAMES",
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
    "available_gemms",
    "count_expert_num_tokens",
    "ep_fused_moe",
    "ep_moe",
    "expert_map_for_rank",
    "fused_moe",
    "fused_topk",
    "grouped_topk",
    "layouts",
    "moe_reference",
    "quant",
    "register_gemm",
]
