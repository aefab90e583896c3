"""One Hugging Face MoE block's tensors -> numpy arrays named as `MoE` params.

Two namings, told apart by the keys under a layer prefix such as "model.layers.3.":

    per-expert (checkpoint files, transformers 4 in memory)
      block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1/w3/w2.weight      Mixtral
      mlp.gate.weight, mlp.experts.{e}.gate_proj/up_proj/down_proj.weight   Qwen, DeepSeek-V3
    fused (transformers 5 in memory: `model.state_dict()`)
      mlp.gate.weight [E, H], mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up rows),
      mlp.experts.down_proj [E, H, I]                                       every model type
    and with either
      mlp.gate.e_score_correction_bias [E]                                  DeepSeek-V3
      mlp.shared_experts.gate_proj/up_proj/down_proj.weight                 DeepSeek-V3
      mlp.shared_expert.gate_proj/up_proj/down_proj.weight,
      mlp.shared_expert_gate.weight [1, H]                                  Qwen2-MoE

Per-expert HF linears (weight [out, in], already the NT layout vLLM uses) are stacked into
w1 = concat(gate, up) [E, 2I, H] and w2 = down [E, H, I]; the router [E, H] becomes
`router_kernel` [H, E]. FP8 checkpoints (DeepSeek-V3) carry a float32 128x128 block scale
"<name>_scale_inv" beside each weight ("...weight_scale_inv", fused "...gate_up_proj_scale_inv").
Values may be numpy arrays, JAX arrays or torch tensors (torch is imported only to convert one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from moe_jax import quant
from moe_jax.hf_checkpoint import check_prefix

HF_NAMINGS = (
    "block_sparse_moe.experts.{e}.w1/w3/w2.weight (Mixtral checkpoints)",
    "mlp.experts.{e}.gate_proj/up_proj/down_proj.weight (Qwen2/3-MoE, DeepSeek-V3 checkpoints)",
    "mlp.experts.gate_up_proj + mlp.experts.down_proj (transformers 5 models in memory)",
)
_PER_EXPERT_PROJECTIONS = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
_SHARED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_SCALE_SUFFIX = "_scale_inv"
_MAX_LISTED = 12


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFNaming:
    """Where one MoE block's tensors are, relative to the layer prefix.

    Attributes:
      module: "block_sparse_moe." (Mixtral checkpoints) or "mlp.".
      projections: per-expert (gate, up, down) linear names, e.g. ("w1", "w3", "w2"); None when
        the experts are fused (transformers 5: experts.gate_up_proj, experts.down_proj).
      shared: "shared_experts" (DeepSeek-V3), "shared_expert" (Qwen2-MoE, gated by
        `shared_expert_gate`) or None.
      has_correction_bias: the router has `e_score_correction_bias` (DeepSeek-V3).
      is_fp8: weights come with "*_scale_inv" block scales.
    """

    module: str
    projections: tuple[str, str, str] | None
    shared: str | None
    has_correction_bias: bool
    is_fp8: bool

    @property
    def is_fused(self) -> bool:
        return self.projections is None

    @property
    def router_key(self) -> str:
        return self.module + "gate.weight"

    @property
    def param_names(self) -> set[str]:
        """The `MoE` params (block scales aside) that this block's tensors fill."""
        names = {"router_kernel", "w1", "w2"}
        names |= {"e_score_correction_bias"} if self.has_correction_bias else set()
        names |= {"shared_w1", "shared_w2"} if self.shared else set()
        return names | ({"shared_gate_kernel"} if self.shared == "shared_expert" else set())

    def expert_key(self, e: int, which: int) -> str:
        """Per-expert weight key of projection `which` (0 gate, 1 up, 2 down) of expert e."""
        return f"{self.module}experts.{e}.{self.projections[which]}.weight"


def to_numpy(value: Any) -> np.ndarray:
    """A numpy array from a numpy/JAX array or a torch tensor (bf16 and the FP8 dtypes via
    ml_dtypes; float8_e8m0fnu is the power-of-two scale format of UE8M0 checkpoints, which
    transformers 5 may hold in memory)."""
    if type(value).__module__.startswith("torch"):
        import torch

        t = value.detach().cpu()
        views = {
            torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
            torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
            torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
        }
        if hasattr(torch, "float8_e8m0fnu"):  # torch >= 2.7
            views[torch.float8_e8m0fnu] = (torch.uint8, ml_dtypes.float8_e8m0fnu)
        if t.dtype in views:
            raw, dtype = views[t.dtype]
            return t.contiguous().view(raw).numpy().view(dtype)
        return t.numpy()
    return np.asarray(value)


def _keys_under(state_dict: Mapping[str, Any], prefix: str) -> list[str]:
    return sorted(k for k in state_dict if k.startswith(prefix))


def detect_hf_naming(state_dict: Mapping[str, Any], prefix: str = "") -> HFNaming:
    """Which naming the MoE block under `prefix` follows (only keys are looked at).

    Raises:
      ValueError: no MoE block under the prefix (the message says whether the layer is a dense
        MLP, and lists the keys found), or experts in none of `HF_NAMINGS`.
    """
    check_prefix(prefix)
    module = next(
        (m for m in ("block_sparse_moe.", "mlp.") if prefix + m + "gate.weight" in state_dict),
        None,
    )
    if module is None:
        under = _keys_under(state_dict, prefix)
        if prefix + "mlp.gate_proj.weight" in state_dict:
            raise ValueError(
                f"the layer under {prefix!r} is a dense MLP (mlp.gate_proj/up_proj/down_proj), "
                "not an MoE block: pick an MoE layer (DeepSeek's first_k_dense_replace layers "
                "and Qwen's mlp_only_layers are dense)"
            )
        raise ValueError(
            f"no MoE router under prefix {prefix!r}: expected {prefix}block_sparse_moe.gate.weight "
            f"or {prefix}mlp.gate.weight. Keys under the prefix: {under[:_MAX_LISTED] or 'none'} "
            "(check the prefix, e.g. 'model.layers.3.')"
        )
    experts = prefix + module + "experts."
    if experts + "gate_up_proj" in state_dict:
        projections = None
        is_fp8 = experts + "gate_up_proj" + _SCALE_SUFFIX in state_dict
    else:
        projections = next(
            (
                p
                for p in _PER_EXPERT_PROJECTIONS
                if any(k.startswith(experts) and k.endswith(f".{p[0]}.weight") for k in state_dict)
            ),
            None,
        )
        if projections is None:
            raise ValueError(
                f"the router {prefix + module}gate.weight has no experts in a known naming; "
                f"expected one of: {'; '.join(HF_NAMINGS)}. Keys under the prefix: "
                f"{_keys_under(state_dict, prefix + module)[:_MAX_LISTED]}"
            )
        is_fp8 = any(k.startswith(experts) and k.endswith(_SCALE_SUFFIX) for k in state_dict)
    shared = next(
        (
            s
            for s in ("shared_experts", "shared_expert")
            if f"{prefix}mlp.{s}.gate_proj.weight" in state_dict
        ),
        None,
    )
    return HFNaming(
        module=module,
        projections=projections,
        shared=shared,
        has_correction_bias=prefix + module + "gate.e_score_correction_bias" in state_dict,
        is_fp8=is_fp8,
    )


def _raise_missing(missing: list[str], prefix: str) -> None:
    if missing:
        listed = ", ".join(missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise KeyError(
            f"the MoE weights under {prefix!r} are incomplete: missing {len(missing)} keys: "
            f"{listed}{more}"
        )


def _stack(state_dict: Mapping[str, Any], keys: list[list[str]]) -> np.ndarray:
    """out[e] = concat(rows of keys[e]); fills one preallocated array, one tensor at a time.

    Reading tensor by tensor keeps the peak at one stacked copy plus one tensor, which matters
    for a lazily read checkpoint (a DeepSeek-V3 layer holds 256 experts).
    """
    if len(keys) == 1 and len(keys[0]) == 1:  # a fused or shared tensor: a view, no copy
        return to_numpy(state_dict[keys[0][0]])[None]
    parts = [to_numpy(state_dict[k]) for k in keys[0]]
    first = np.concatenate(parts) if len(parts) > 1 else parts[0]
    out = np.empty((len(keys), *first.shape), first.dtype)
    out[0] = first
    for e in range(1, len(keys)):
        row = 0
        for k in keys[e]:
            a = to_numpy(state_dict[k])
            if (
                a.ndim != first.ndim
                or a.shape[1:] != first.shape[1:]
                or row + a.shape[0] > first.shape[0]
            ):
                raise ValueError(
                    f"{k} has shape {a.shape}, which does not fit expert 0's {keys[0]} "
                    f"(stacked {first.shape}); all experts need the same shapes"
                )
            out[e, row : row + a.shape[0]] = a
            row += a.shape[0]
        if row != first.shape[0]:
            raise ValueError(
                f"{keys[e]} stack to {row} rows but expert 0's {keys[0]} to {first.shape[0]}; "
                "all experts need the same shapes"
            )
    return out


def dequantize_blocks(w: np.ndarray, scale: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[..., N, K] = float32(w) * scale per 128x128 tile (DeepSeek's `weight_scale_inv`, of
    shape `quant.block_scale_shape(w.shape)`, not checked here), cast to out's dtype.

    Goes one [N, K] matrix at a time, so the float32 temporaries are one expert's, not the
    layer's (a DeepSeek-V3 w1 is 7.5e9 values). Returns `out`.
    """
    bn, bk = quant.DEFAULT_BLOCK_SHAPE
    n, k = w.shape[-2:]
    for i in np.ndindex(w.shape[:-2]):
        tiles = np.repeat(np.repeat(scale[i], bn, axis=0), bk, axis=1)[:n, :k]
        out[i] = (w[i].astype(np.float32) * tiles).astype(out.dtype)
    return out


def _dequantize_halves(w: np.ndarray, scale: np.ndarray, *, name: str) -> np.ndarray:
    """float32 [..., 2I, K] of an FP8 gate-and-up weight whose halves carry their own 128x128
    block scales, [..., 2 ceil(I/128), ceil(K/128)]: how DeepSeek's per-projection tensors (and
    transformers 5's fused `gate_up_proj_scale_inv`) store them. Where I is not a multiple of
    128, no one block-scale array of the joined [2I, K] weight holds them."""
    half = w.shape[-2] // 2
    *lead, groups, k_groups = quant.block_scale_shape((*w.shape[:-2], half, w.shape[-1]))
    if scale.shape != (*lead, 2 * groups, k_groups):
        raise ValueError(
            f"{name}: {w.shape=} (gate and up halves of {half} rows) needs per-half 128x128 "
            f"block scales of shape {(*lead, 2 * groups, k_groups)} but {scale.shape=}; the "
            "checkpoint's weight_scale_inv does not match its weight"
        )
    out = np.empty(w.shape, np.float32)
    for h in range(2):
        dequantize_blocks(
            w[..., h * half : (h + 1) * half, :],
            scale[..., h * groups : (h + 1) * groups, :],
            out[..., h * half : (h + 1) * half, :],
        )
    return out


def _expert_keys(naming: HFNaming, prefix: str, num_experts: int) -> dict[str, list[list[str]]]:
    """`MoE` param name -> keys[e] = rows to concatenate for expert (or shared block) e."""
    if naming.is_fused:
        experts = prefix + naming.module + "experts."
        keys = {"w1": [[experts + "gate_up_proj"]], "w2": [[experts + "down_proj"]]}
    else:
        keys = {
            "w1": [
                [prefix + naming.expert_key(e, 0), prefix + naming.expert_key(e, 1)]
                for e in range(num_experts)
            ],
            "w2": [[prefix + naming.expert_key(e, 2)] for e in range(num_experts)],
        }
    if naming.shared:
        shared = [f"{prefix}mlp.{naming.shared}.{p}.weight" for p in _SHARED_PROJECTIONS]
        keys |= {"shared_w1": [shared[:2]], "shared_w2": [shared[2:]]}
    return keys


def hf_moe_params(state_dict: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """Stacks one HF MoE block's weights into `MoE` param arrays.

    Args:
      state_dict: HF names -> numpy arrays, JAX arrays or torch tensors, in either naming
        (`HF_NAMINGS`); it may be lazy (tensors are read one at a time, each once).
      prefix: the decoder layer prefix, e.g. "model.layers.3." (keys are prefix + name).

    Returns:
      numpy arrays named as `MoE` params: router_kernel [H, E], w1 [E, 2I, H], w2 [E, H, I];
      e_score_correction_bias float32[E] and shared_w1 [2nI, H], shared_w2 [H, nI] when the
      checkpoint has them; with FP8 checkpoints w1/w2 (and shared_*) are float8_e4m3fn and
      float32 `*_scale` arrays come too, except a w1 (or shared_w1) whose I is not a multiple
      of 128: its gate and up halves are block-scaled separately, which one [2I, H] FP8 array
      with 128x128 block scales cannot hold, so it comes dequantized to float32. Qwen2-MoE's
      shared-expert gate comes as `shared_gate_kernel` [H, 1] (the shared output is scaled by
      sigmoid(x @ it)), which `MoE` has no param for.

    Raises:
      ValueError: no MoE block under the prefix, or shapes that do not agree.
      KeyError: expert or shared-expert weights are missing (all missing keys are counted).
    """
    naming = detect_hf_naming(state_dict, prefix)
    gate = to_numpy(state_dict[prefix + naming.router_key])
    if gate.ndim != 2:
        raise ValueError(
            f"{prefix + naming.router_key} has shape {gate.shape} but [E, H] is needed"
        )
    num_experts, hidden = gate.shape
    keys = _expert_keys(naming, prefix, num_experts)
    wanted = [k for rows in keys.values() for row in rows for k in row]
    if naming.is_fp8:
        wanted += [k + _SCALE_SUFFIX for k in wanted]
    if naming.shared == "shared_expert":
        wanted.append(prefix + "mlp.shared_expert_gate.weight")
    _raise_missing([k for k in wanted if k not in state_dict], prefix)

    params = {"router_kernel": np.ascontiguousarray(gate.T)}
    for name, rows in keys.items():
        is_shared = name.startswith("shared")
        w = _stack(state_dict, rows)
        params[name] = w[0] if is_shared or naming.is_fused else w
        if naming.is_fp8:
            scale_rows = [[k + _SCALE_SUFFIX for k in row] for row in rows]
            s = _stack(state_dict, scale_rows).astype(np.float32)
            s = s[0] if is_shared or naming.is_fused else s
            if name.endswith("w1") and (params[name].shape[-2] // 2) % quant.DEFAULT_BLOCK_SHAPE[0]:
                params[name] = _dequantize_halves(params[name], s, name=name)
            else:
                params[name + "_scale"] = s
    w1, w2 = params["w1"], params["w2"]
    if w1.ndim != 3 or w1.shape[::2] != (num_experts, hidden) or w1.shape[1] % 2:
        raise ValueError(
            f"w1 stacks to {w1.shape} but [E={num_experts}, 2I, H={hidden}] is needed "
            "(transformers 5 gate_up_proj is [E, 2I, H]; a transposed [E, H, 2I] is not read)"
        )
    if w2.shape != (num_experts, hidden, w1.shape[1] // 2):
        raise ValueError(f"w2 stacks to {w2.shape} but {w1.shape=} needs [E, H, I]")
    if naming.has_correction_bias:
        bias_key = prefix + naming.module + "gate.e_score_correction_bias"
        params["e_score_correction_bias"] = to_numpy(state_dict[bias_key]).astype(np.float32)
    if naming.shared == "shared_expert":
        gate_w = to_numpy(state_dict[prefix + "mlp.shared_expert_gate.weight"])
        params["shared_gate_kernel"] = np.ascontiguousarray(gate_w.reshape(1, hidden).T)
    return params
