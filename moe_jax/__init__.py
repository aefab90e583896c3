"""moe_jax: vLLM's modular fused-MoE kernel in JAX."""
