"""The example ``sparkd.toml`` that ``sparkd install`` writes: every setting of
``sparkd.config.Settings`` commented out at its default, with its documentation line
(``FIELD_DOCS``), and the default stop rules. TOML values are written by
``sparkd.tomlout`` (the one TOML writer).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from sparkd.config import DEFAULT_RULES, FIELD_DOCS, Settings, setting_keys
from sparkd.tomlout import dumps
from sparkd.tomlout import scalar as toml_value

ConfigField = tuple[str, Any, str]  # (dotted key, default, description)


def render_example_config(fields: Sequence[ConfigField]) -> str:
    """A TOML example with every setting present and commented out at its default.

    ``fields``: ``(dotted_key, default, description)``; ``"api.port"`` goes to
    an (uncommented, empty) ``[api]`` table so that uncommenting a line puts
    it in the right place. ``None`` defaults render as ``# key = <unset>``.
    """
    tables: dict[str, list[ConfigField]] = {}
    for key, default, desc in fields:
        table, _, _ = key.rpartition(".")
        tables.setdefault(table, []).append((key, default, desc))
    out = [
        "# sparkd configuration. Every setting is shown at its default, commented out;",
        '# uncomment a line to change it. Sizes: "6GiB", "512MiB"; durations in seconds.',
        "# Environment variables SPARKD_<KEY> override this file.",
    ]
    for table in sorted(tables, key=lambda t: (t != "", t)):
        out.append("")
        if table:
            out.append(f"[{table}]")
        for key, default, desc in tables[table]:
            leaf = key.rpartition(".")[2]
            out.extend("# " + ln for ln in textwrap.wrap(desc, 76))
            value = "<unset>" if default is None else toml_value(default)
            out.append(f"# {leaf} = {value}")
    return "\n".join(out) + "\n"


def example_config_text() -> str:
    """The example ``sparkd.toml``: every setting commented out at its default, with its doc line."""
    defaults = Settings.model_construct().model_dump(mode="json")
    fields = []
    for key in setting_keys():
        if key == "rules":
            continue
        node: Any = defaults
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        fields.append((key, node, FIELD_DOCS.get(key, "")))
    text = render_example_config(fields)
    rules = "\n".join("# " + line for line in _rules_toml(DEFAULT_RULES).splitlines())
    return text + "\n\n# Stop rules (defaults shown). " + FIELD_DOCS["rules"] + "\n" + rules + "\n"


def _rules_toml(rules: list[dict[str, Any]]) -> str:
    return dumps({"rules": rules})
