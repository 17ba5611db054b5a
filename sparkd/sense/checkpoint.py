"""The size of a checkpoint's weight files on disk (``BudgetInputs.weight_bytes``).

Kept apart from ``sparkd.core.budget`` so that module stays pure (no I/O).
"""

from __future__ import annotations

import os
from pathlib import Path

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
