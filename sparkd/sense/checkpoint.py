"""A checkpoint directory as the budget sees it: the size of its weight files on disk
(``BudgetInputs.weight_bytes``), its ``config.json`` (for ``sparkd.core.kvcache``) and
whether it is complete (every shard of the index there and whole).

Kept apart from ``sparkd.core.budget`` so that module stays pure (no I/O).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkd.errors import InvalidInput

#: Weight-file groups in the order vLLM's default loader prefers them.
WEIGHT_SUFFIX_GROUPS: tuple[tuple[str, ...], ...] = ((".safetensors",), (".bin", ".pt"), (".gguf",))


def checkpoint_weight_bytes(path: str | os.PathLike[str]) -> int:
    """Total bytes of the weight files under ``path`` (a directory or one weight file).

    Counts ``*.safetensors`` if there are any, else ``*.bin``/``*.pt``, else
    ``*.gguf`` — a repository that ships both safetensors and .bin would
    otherwise be counted twice, while vLLM loads only the safetensors.
    Walks sub-directories without following directory symlinks (no loops, no
    escaping the tree); a symlinked *file* is counted at its target's size
    (the Hugging Face cache links snapshot files to blobs). Each inode counts
    once; broken links are skipped.

    Raises:
        InvalidInput: ``path`` is neither a directory nor a weight file.
    """
    p = Path(path)
    if p.is_file():
        if not any(p.name.endswith(s) for grp in WEIGHT_SUFFIX_GROUPS for s in grp):
            raise InvalidInput("checkpoint", str(p), "a directory or a weight file (.safetensors, .bin, .pt, .gguf)")
        return p.stat().st_size
    if not p.is_dir():
        raise InvalidInput("checkpoint", str(p), "an existing directory of weight files")
    files: list[Path] = []
    for root, _dirs, names in os.walk(p, followlinks=False):
        files.extend(Path(root, n) for n in names)
    for group in WEIGHT_SUFFIX_GROUPS:
        seen: set[tuple[int, int]] = set()
        total = 0
        for f in files:
            if not f.name.endswith(group):
                continue
            try:
                st = f.stat()  # follows a file symlink
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen or not f.is_file():
                continue
            seen.add(key)
            total += st.st_size
        if seen:
            return total
    return 0


def read_model_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's Hugging Face ``config.json`` as a dict (``path`` is the model directory).

    Raises:
        InvalidInput: no ``config.json`` there, or it is not a JSON object; the
            message asks for ``--kv-bytes-per-token`` instead.
    """
    f = Path(path) / "config.json"
    ask = "a checkpoint directory with a config.json, or the KV bytes per token given with --kv-bytes-per-token"
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise InvalidInput("config.json", str(f), ask + " (the file does not exist)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInput("config.json", str(f), f"{ask} ({e})") from None
    if not isinstance(data, dict):
        raise InvalidInput("config.json", str(f), ask + f" (it holds a {type(data).__name__}, not an object)")
    return data


@dataclass(frozen=True)
class CheckpointCheck:
    """Is every weight file the index names there, and whole?

    ``index``: the index file read (``None``: the directory has none, so only
    each safetensors file's own header is checked). ``missing``: shards the
    index names that do not exist. ``truncated``: ``(file, data bytes on disk,
    bytes its header promises)`` for safetensors files shorter than their
    header says. ``total_size_bytes``: the index's ``metadata.total_size`` (the
    tensor bytes) and ``data_bytes`` the tensor bytes found (file size − 8 −
    header length per safetensors shard); fewer found than the index says is a problem.
    """

    path: str
    index: str | None
    shards: int
    missing: tuple[str, ...] = ()
    truncated: tuple[tuple[str, int, int], ...] = ()
    total_size_bytes: int | None = None
    data_bytes: int | None = None
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        """One line: ``complete: …`` or the problems joined with ``; ``."""
        if self.ok:
            what = f"{self.shards} shards of {self.index}" if self.index else f"{self.shards} weight files, no index"
            return f"checkpoint {self.path} complete: {what}"
        return f"checkpoint {self.path} incomplete: " + "; ".join(self.problems)


#: Index files vLLM's loaders read (safetensors first).
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_checkpoint(path: str | os.PathLike[str]) -> CheckpointCheck:
    """Check that the checkpoint in directory ``path`` is complete (issue 19; vLLM fails on a
    missing shard only after loading the others).

    * every file named in the index's ``weight_map`` exists (the source project's rule);
    * each safetensors file is as long as its header says (8-byte little-endian header
      length, JSON header, then the tensor data up to the largest ``data_offsets`` end);
    * where the index gives ``metadata.total_size`` and its shards are safetensors, the
      tensor bytes found are not fewer. More is accepted: writers differ in how they count
      tied or quantised tensors, and a shortfall is what an unfinished download leaves.

    Raises:
        InvalidInput: ``path`` is not a directory, or the index is not valid JSON with a
            ``weight_map`` object.
    """
    p = Path(path)
    if not p.is_dir():
        raise InvalidInput("checkpoint", str(p), "an existing directory of weight files")
    index = next((p / n for n in INDEX_NAMES if (p / n).is_file()), None)
    problems: list[str] = []
    if index is None:
        shard_names = sorted(f.name for f in p.iterdir() if f.name.endswith(".safetensors"))
        missing: list[str] = []
        total = None
    else:
        try:
            doc = json.loads(index.read_text())
            weight_map = doc["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
            raise InvalidInput(index.name, str(index), f"a JSON object with a weight_map ({e!r})") from None
        shard_names = sorted({str(v) for v in weight_map.values()})
        missing = [n for n in shard_names if not (p / n).is_file()]
        if missing:
            problems.append(
                f"{len(missing)} of {len(shard_names)} shards named in {index.name} missing: {', '.join(missing)}"
            )
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        t = meta.get("total_size") if isinstance(meta, dict) else None
        total = int(t) if isinstance(t, int | float) and not isinstance(t, bool) else None
    truncated: list[tuple[str, int, int]] = []
    data = 0
    for n in shard_names:
        if n in missing or not n.endswith(".safetensors"):
            continue
        try:
            have, want = _safetensors_data_bytes(p / n)
        except (OSError, ValueError) as e:
            problems.append(f"{n}: not a readable safetensors file ({e})")
            continue
        data += have
        if have < want:
            truncated.append((n, have, want))
    if truncated:
        problems.append(
            "truncated: " + ", ".join(f"{n} has {have} of {want} data bytes" for n, have, want in truncated)
        )
    safetensors = bool(shard_names) and all(n.endswith(".safetensors") for n in shard_names)
    if total is not None and index is not None and safetensors and not missing and data < total:
        problems.append(f"tensor bytes found {data} < metadata.total_size {total} of {index.name}")
    return CheckpointCheck(
        path=str(p),
        index=index.name if index else None,
        shards=len(shard_names),
        missing=tuple(missing),
        truncated=tuple(truncated),
        total_size_bytes=total,
        data_bytes=data if safetensors else None,
        problems=tuple(problems),
    )


def _safetensors_data_bytes(f: Path) -> tuple[int, int]:
    """``(data bytes on disk, data bytes the header promises)`` of one safetensors file.

    Format (safetensors spec): u64 little-endian header length N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
    then the data; offsets are relative to the end of the header.
    """
    size = f.stat().st_size
    with f.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, 100 * 2**20):
            raise ValueError(f"header length {n} exceeds the file ({size} bytes) or 100 MiB")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    want = 0
    for k, v in header.items():
        if k == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
            raise ValueError(f"tensor {k!r} has no [begin, end] data_offsets")
        want = max(want, offsets[1])
    return size - 8 - n, want
