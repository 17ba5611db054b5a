"""How long the complete-checkpoint check and the KV derivation take on a large checkpoint.

Builds a sparse synthetic checkpoint in a temporary directory — ``--shards`` safetensors
files (163 as DeepSeek-V3 ships), each with ``--tensors`` tensors in its header (real
headers, holes for the data) — and times ``check_checkpoint`` (reads every header),
``checkpoint_weight_bytes`` and ``read_model_config`` + ``kv_layout``. ``sparkd plan`` and
every launch preflight pay this once. No goal in the issue; the figures are for the record.

Usage: ``.venv/bin/python bench/checkpoint.py [--shards 163] [--tensors 600] [--repeat 5]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from sparkd.core.kvcache import kv_layout
from sparkd.sense.checkpoint import check_checkpoint, checkpoint_weight_bytes, read_model_config

CONFIG = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}


def build(root: Path, shards: int, tensors: int, tensor_bytes: int) -> None:
    (root / "config.json").write_text(json.dumps(CONFIG))
    weight_map: dict[str, str] = {}
    for s in range(1, shards + 1):
        name = f"model-{s:05d}-of-{shards:05d}.safetensors"
        header = {}
        for t in range(tensors):
            key = f"model.layers.{s}.mlp.experts.{t}.weight"
            header[key] = {
                "dtype": "BF16",
                "shape": [tensor_bytes // 2],
                "data_offsets": [t * tensor_bytes, (t + 1) * tensor_bytes],
            }
            weight_map[key] = name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with (root / name).open("wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + tensors * tensor_bytes)
    total = shards * tensors * tensor_bytes
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )


def timed(fn, repeat: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    runs, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=163)
    ap.add_argument("--tensors", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, a.shards, a.tensors, tensor_bytes=4 * 2**20)
        header_kib = sum(int.from_bytes(f.open("rb").read(8), "little") for f in root.glob("*.safetensors")) / 1024
        t_check, check = timed(lambda: check_checkpoint(root), a.repeat)
        t_size, size = timed(lambda: checkpoint_weight_bytes(root), a.repeat)
        t_kv, layout = timed(lambda: kv_layout(read_model_config(root)), a.repeat)
        print(f"checkpoint: {a.shards} shards × {a.tensors} tensors, {size / 2**30:.1f} GiB (sparse)")
        print(f"safetensors headers: {header_kib:.0f} KiB of JSON in all")
        print(f"check_checkpoint        {t_check * 1000:8.1f} ms  ({check.describe()[:60]}…)")  # type: ignore[attr-defined]
        print(f"checkpoint_weight_bytes {t_size * 1000:8.1f} ms")
        print(f"config.json → KvLayout  {t_kv * 1000:8.1f} ms  ({layout.bytes_per_token} B/token)")  # type: ignore[attr-defined]
        print("(median of", a.repeat, "runs, warm page cache)")


if __name__ == "__main__":
    main()
