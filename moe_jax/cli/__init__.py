"""The commands of `python -m moe_jax demo | info | bench` and the modules they need.

Everything here uses the library's public API only; the library never imports this package.
The profiling and exploration tools live outside the package, in a checkout's benchmarks/.
"""
