"""Reading one decoder layer's tensors from a Hugging Face checkpoint directory, lazily.

A directory as `save_pretrained` writes it and the Hub serves it: config.json plus either one
model.safetensors or shards listed by model.safetensors.index.json (`weight_map`: tensor name ->
shard file). `open_hf_layer` reads only the safetensors headers up front; a tensor is read from
its shard (through `safetensors.safe_open`) when it is looked up, so a whole model is never in
memory. safetensors and torch (for bf16 and float8_e4m3fn tensors, which numpy cannot hold) are
imported inside the functions: `pip install 'moe_jax[hf]'`. Functions that take the directory
also take the path of its config.json.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"layers\.(\d+)\.")


def check_prefix(prefix: str, *, name: str = "prefix") -> None:
    """Raises unless `prefix` is "" or ends with '.': keys are prefix + "mlp.gate.weight" etc."""
    if not isinstance(prefix, str):
        raise TypeError(f"{name}={prefix!r} must be a str, such as 'model.layers.3.'")
    if prefix and not prefix.endswith("."):
        raise ValueError(
            f"{name}={prefix!r} must end with '.' (keys are {name} + 'mlp.gate.weight' and the "
            f"like): pass {prefix + '.'!r}"
        )


def checkpoint_directory(path: str | Path) -> Path:
    """The checkpoint directory `path` names: itself, or the folder of its config.json (or of
    model.safetensors, or of its index) when that file is given instead."""
    path = Path(path)
    if path.name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE) and path.is_file():
        return path.parent
    return path


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The dict of config.json in the checkpoint directory `path` (or at `path` itself).

    Raises:
      FileNotFoundError: no config.json in `path` (the message lists what is there).
    """
    path = checkpoint_directory(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} does not exist; pass the checkpoint directory that holds config.json "
            f"(found: {_listing(path)})"
        )
    return json.loads(file.read_text())


def _listing(path: str | Path) -> str:
    path = Path(path)
    if path.is_file():
        return f"{path} is a file; pass its directory"
    if not path.is_dir():
        return f"{path} is not a directory"
    names = sorted(p.name for p in path.iterdir())
    return ", ".join(names[:12]) + (" ..." if len(names) > 12 else "") or "nothing"


def _safe_open():
    try:
        import torch  # noqa: F401  (safe_open(framework="pt") holds bf16 and fp8; numpy cannot)
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(
            "reading a checkpoint directory needs safetensors and torch: pip install 'moe_jax[hf]'"
        ) from e
    return safe_open


def checkpoint_weight_map(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for every tensor of the checkpoint.

    Reads model.safetensors.index.json, or the header of a single model.safetensors.

    Raises:
      FileNotFoundError: neither file exists (e.g. a pytorch_model.bin checkpoint, which is not
        read: convert it to safetensors).
    """
    path = checkpoint_directory(path)
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {name: path / shard for name, shard in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        with _safe_open()(path / SINGLE_FILE, framework="pt") as f:
            return dict.fromkeys(f.keys(), path / SINGLE_FILE)
    raise FileNotFoundError(
        f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}; only safetensors checkpoints are "
        f"read (found: {_listing(path)})"
    )


class LazyTensors(Mapping[str, Any]):
    """A read-only mapping name -> torch tensor that reads each tensor when it is looked up.

    Shard files are opened on first use and stay open (memory-mapped, nothing read) until
    `close()` or the end of a `with` block. Each lookup reads the tensor anew: look each up once.
    """

    def __init__(self, weight_map: Mapping[str, Path]):
        self._weight_map = dict(weight_map)
        self._handles: dict[Path, Any] = {}

    def __getitem__(self, name: str) -> Any:
        shard = self._weight_map[name]
        if shard not in self._handles:
            if not shard.is_file():
                raise FileNotFoundError(
                    f"{shard}, listed in {INDEX_FILE} for {name}, does not exist; the download "
                    "is incomplete"
                )
            self._handles[shard] = _safe_open()(shard, framework="pt").__enter__()
        return self._handles[shard].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def close(self) -> None:
        """Closes every safetensors file opened so far (later reads open them again)."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> LazyTensors:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_hf_layer(path: str | Path, prefix: str) -> LazyTensors:
    """The tensors under `prefix` (e.g. "model.layers.3.") of a checkpoint, read lazily.

    Use it as a context manager so the shard files are closed:

        with open_hf_layer(path, "model.layers.3.") as tensors:
            params = hf_moe_params(tensors, "model.layers.3.")

    Raises:
      FileNotFoundError: no safetensors checkpoint in `path`.
      ValueError: no tensor name starts with `prefix` (the message lists the layers there).
    """
    check_prefix(prefix)
    weight_map = checkpoint_weight_map(path)
    layer = {name: shard for name, shard in weight_map.items() if name.startswith(prefix)}
    if not layer:
        indices = sorted({int(m.group(1)) for n in weight_map if (m := _LAYER.search(n))})
        have = f"layers {indices[0]}..{indices[-1]}" if indices else "no 'layers.N.' tensors"
        raise ValueError(
            f"no tensors under {prefix!r} in {path}: the checkpoint has {have}; pick a layer "
            "index in that range"
        )
    return LazyTensors(layer)
