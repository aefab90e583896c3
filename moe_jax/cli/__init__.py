"""Command-line tools and benchmarks (`python -m moe_jax demo | bench | info`).

Everything here uses the library's public API only; the library never imports this package.
"""
