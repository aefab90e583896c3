"""Frozen dataclasses that are JAX pytrees (every field a child)."""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls):
    """Makes `cls` a frozen dataclass registered as a pytree whose fields are all children."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])
