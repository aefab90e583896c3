"""Pallas GPU kernels, one module each, imported by name (`moe_jax.kernels.permute`, ...) and
only when used: the fronts in `moe_jax` list them lazily, so importing `moe_jax` or running it on
a CPU imports none of them, nor JAX's Triton or Mosaic GPU backends.

Pallas Triton: `permute` (row gather), `unpermute` (weighted gather-sum), `count` (tokens per
expert), `routing_metadata` (the contiguous layout's routing), `act_quant` (FP8 group
quantization, alone and after act(gate) * up), `grouped_gemm` (decode grouped GEMM), `wgrad`
(grouped weight gradient). Mosaic GPU: `mosaic_gemm`, `mosaic_fp8_gemm` (with
`mosaic_fp8_gather`), `mosaic_wgrad`. Each kernel runs in interpret mode on a CPU with
`interpret=True`.
"""
