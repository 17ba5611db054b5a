"""Small synthetic checkpoint directories: a ``config.json``, safetensors shards that are
sparse files (a real header, then a hole of the promised size: ``truncate``), and the
``model.safetensors.index.json`` that names them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sparkd.units import GiB


def write_shard(path: Path, data_bytes: int, tensor: str = "w") -> int:
    """A safetensors file with one BF16 tensor of ``data_bytes`` bytes (sparse). Returns the file size."""
    header = json.dumps({tensor: {"dtype": "BF16", "shape": [data_bytes // 2], "data_offsets": [0, data_bytes]}})
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)  # the spec pads the header to 8 bytes
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + data_bytes)
    return path.stat().st_size


def make_checkpoint(
    root: Path,
    config: dict[str, Any] | None,
    shard_data_bytes: list[int],
    *,
    index: bool = True,
    total_size: int | None = None,
) -> Path:
    """``root`` with ``config.json`` (unless None), shards ``model-0000i-of-0000n.safetensors`` holding
    the given tensor bytes, and an index naming them (``metadata.total_size`` = their sum unless given)."""
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    n = len(shard_data_bytes)
    weight_map = {}
    for i, size in enumerate(shard_data_bytes, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        write_shard(root / name, size, tensor=f"layers.{i}.w")
        weight_map[f"layers.{i}.w"] = name
    if index:
        total = sum(shard_data_bytes) if total_size is None else total_size
        doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(doc))
    return root


def gib(x: float) -> int:
    return int(x * GiB)


def disk_bytes(root: Path) -> int:
    """Blocks actually allocated under ``root`` (sparse shards stay tiny)."""
    return sum(os.stat(p).st_blocks * 512 for p in root.iterdir())
