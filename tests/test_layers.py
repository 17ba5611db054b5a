"""The layer table of docs/architecture.md, checked against every module's imports.

Each module of ``sparkd`` belongs to one layer (its subpackage, or ``base`` for the
top-level modules); a layer may import only the layers listed for it. Imports are
read with ``ast`` — module level, inside functions and under ``TYPE_CHECKING`` alike —
so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "sparkd"

BASE = {"errors", "units", "resources", "hostport", "logsetup", "tomlout", "__init__"}
ALLOWED: dict[str, set[str]] = {
    "base": {"base"},
    "config": {"base", "core"},
    "core": {"base", "core"},
    "sense": {"base", "core", "sense"},
    "store": {"base", "core", "store"},
    "act": {"base", "core", "sense", "config", "act"},
    "ops": {"base", "core", "sense", "store", "act", "config", "ops"},
    "loop": {"base", "core", "sense", "store", "act", "config", "ops", "loop"},
    "face": {"base", "core", "sense", "store", "act", "config", "ops", "loop", "face"},
    "main": {"face", "base"},
}


def layer_of(module: str) -> str:
    """``sparkd.core.rules`` → ``core``; ``sparkd.units`` → ``base``; ``sparkd`` → ``base``."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in BASE or parts[1].startswith("__version"):
        return "base"
    if parts[1] == "config":
        return "config"
    if parts[1] == "__main__":
        return "main"
    return parts[1]


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """Every ``sparkd`` module that the file imports, as (line, dotted name)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "sparkd"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "sparkd":
                continue
            if target == "sparkd":  # from sparkd import x: x may be a module or a name
                found += [(node.lineno, f"sparkd.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def violations(pkg: Path = PKG, root_name: str = "sparkd") -> list[str]:
    """Lines ``file:line: layer imports other`` for each import the table forbids."""
    out = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src = layer_of(module)
        for line, target in imports_of(path, module):
            dst = layer_of(target.replace(root_name, "sparkd", 1))
            if dst not in ALLOWED[src]:
                out.append(f"{path.relative_to(pkg.parent)}:{line}: {src} imports {dst} ({target})")
    return out


def test_it_finds_every_module_in_a_layer() -> None:
    layers = {layer_of(".".join(p.relative_to(PKG.parent).with_suffix("").parts)) for p in PKG.rglob("*.py")}
    assert layers <= set(ALLOWED), f"modules outside the table: {layers - set(ALLOWED)}"
    # every subpackage is a layer of the table (a new folder must be placed on purpose)
    subpackages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert subpackages <= set(ALLOWED), f"subpackage not in the layer table: {subpackages - set(ALLOWED)}"


def test_it_keeps_every_import_inside_the_table() -> None:
    assert violations() == []


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        ("core/bad.py", "from sparkd.config import Settings\n", "core imports config"),
        ("core/bad.py", "def f():\n    from sparkd.loop import daemon\n", "core imports loop"),
        ("loop/bad.py", "from sparkd.face.api import create_app\n", "loop imports face"),
        ("act/bad.py", "from ..store import store\n", "act imports store"),
        ("units.py", "from sparkd import config\n", "base imports config"),
    ],
)
def test_it_fails_on_a_wrong_import(tmp_path: Path, where: str, source: str, expected: str) -> None:
    # a temporary copy of the package with one deliberately wrong module
    import shutil

    copy = tmp_path / "sparkd"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / where).write_text(textwrap.dedent(source))
    found = violations(copy)
    assert any(expected in v and where in v for v in found), found
