"""Whole models built on `moe_jax.flax_layer.MoE` (Flax NNX; `pip install 'moe_jax[hf]'`).

- `moe_jax.models.qwen3_moe`: transformers' Qwen3-MoE decoder: `from_pretrained`, forward,
  the router's load-balancing loss and an `nnx.jit` AdamW `train_step`.
"""
