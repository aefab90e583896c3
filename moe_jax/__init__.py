"""moe_jax: vLLM's modular fused-MoE kernel in JAX.

What a user calls: routing (`fused_topk`, `grouped_topk`), the functional layer (`fused_moe`), its
composable parts (`ModularMoE`, `NoEPPrepareFinalize`, `ContiguousExperts`, `MaskedExperts`,
`ExpertWeights`; `experts_names()` lists the experts by name), expert parallelism on JAX
collectives (`ep_fused_moe`, `ep_moe`, `AllToAllPrepareFinalize`, `EPConfig`,
`expert_map_for_rank`), FP8 quantization (`quant`), the float32 reference (`moe_reference`), and,
imported on first use because Flax is an optional extra, the Flax NNX layer (`MoE`,
`RouterConfig`) and its Hugging Face loaders (`moe_from_hf`, `moe_from_pretrained`,
`load_hf_moe`). Everything else stays in its module (`moe_jax.permute`, `moe_jax.registry`,
...); Pallas GPU kernels live in `moe_jax.kernels`, DLPack interop with torch-hosted
DeepGEMM/DeepEP in `moe_jax.interop`.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from moe_jax import quant
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.ep_api import ep_fused_moe, ep_moe
from moe_jax.expert_parallel import AllToAllPrepareFinalize, EPConfig, expert_map_for_rank
from moe_jax.experts import ExpertWeights
from moe_jax.experts_by_name import experts_names
from moe_jax.fused_moe import fused_moe
from moe_jax.masked_experts import MaskedExperts
from moe_jax.modular import ModularMoE
from moe_jax.prepare_finalize import NoEPPrepareFinalize
from moe_jax.reference import moe_reference
from moe_jax.routing import fused_topk, grouped_topk

if _TYPE_CHECKING:  # for type checkers and editors; at run time, `__getattr__` below
    from moe_jax.flax_layer import MoE, RouterConfig
    from moe_jax.hf_loading import load_hf_moe, moe_from_hf, moe_from_pretrained

__version__ = "0.1.0"

# Names whose modules need Flax (`pip install 'moe_jax[flax]'`): imported when first looked up.
_LAZY = {
    "MoE": "moe_jax.flax_layer",
    "RouterConfig": "moe_jax.flax_layer",
    "load_hf_moe": "moe_jax.hf_loading",
    "moe_from_hf": "moe_jax.hf_loading",
    "moe_from_pretrained": "moe_jax.hf_loading",
}

__all__ = [
    "AllToAllPrepareFinalize",
    "ContiguousExperts",
    "EPConfig",
    "ExpertWeights",
    "MaskedExperts",
    "MoE",
    "ModularMoE",
    "NoEPPrepareFinalize",
    "RouterConfig",
    "ep_fused_moe",
    "ep_moe",
    "expert_map_for_rank",
    "experts_names",
    "fused_moe",
    "fused_topk",
    "grouped_topk",
    "load_hf_moe",
    "moe_from_hf",
    "moe_from_pretrained",
    "moe_reference",
    "quant",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
