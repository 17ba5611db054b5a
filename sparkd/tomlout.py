"""Minimal TOML writer for ``sparkd config show`` (tables, arrays of tables, scalars, lists)."""

from __future__ import annotations

import json
from typing import Any


def scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {scalar(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def dumps(data: dict[str, Any], prefix: str = "") -> str:
    """TOML text for ``data``; ``None`` values are written as comments (TOML has no null)."""
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    arrays: list[tuple[str, list[dict[str, Any]]]] = []
    for k, v in data.items():
        if (
            isinstance(v, dict)
            and v
            and all(not isinstance(x, dict) for x in v.values())
            and prefix == ""
            and k in ("env",)
        ):
            lines.append(f"{k} = {scalar(v)}")
        elif isinstance(v, dict):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((k, v))
        elif v is None:
            lines.append(f"# {k} = (unset)")
        else:
            lines.append(f"{k} = {scalar(v)}")
    out = "\n".join(lines)
    for k, v in tables:
        name = f"{prefix}{k}"
        out += f"\n\n[{name}]\n" + dumps(v, prefix=name + ".")
    for k, items in arrays:
        for item in items:
            out += f"\n\n[[{prefix}{k}]]\n" + "\n".join(
                f"{ik} = {scalar(iv)}" if iv is not None else f"# {ik} = (unset)" for ik, iv in item.items()
            )
    return out.strip("\n") + ("\n" if prefix == "" else "")
