"""The closed choices of sparkd, each defined once as a ``Literal``.

Config, the rule compiler, the budget formula, the status contract
(``sparkd.loop.status``), the API, the CLI and the exporter all use these
aliases, so a new value is added here and nowhere else (``typing.get_args``
turns one into a tuple for click choices or Prometheus label sets). The
container's states are ``sparkd.core.lifecycle.ContainerState``.
"""

from __future__ import annotations

from typing import Literal, get_args

#: How a rule decides: a threshold on the current sample, or a prediction from the trend
#: (``sparkd.core.rules``).
RuleKind = Literal["threshold", "predictive"]
#: What a tripped rule does: stop the container, or only warn.
RuleAction = Literal["stop", "warn"]
#: vLLM ``--kv-cache-dtype`` values the budget knows a KV multiplier for
#: (``sparkd.core.budget.DEFAULT_KV_MULT``: 1.0 for 16-bit, 0.58 for fp8, CONTEXT.md "memory budget").
KvCacheDtype = Literal["auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"]
#: An event's severity.
Severity = Literal["info", "warning", "critical"]
#: The guard's sampling mode (``sparkd.core.sampling``): the normal interval, or the fast one.
SamplingMode = Literal["normal", "fast"]
#: Who owns the container: sparkd launches it (``managed``), the operator does and sparkd
#: guards it (``guard``), or there is none (``monitor-only``).
ContainerMode = Literal["managed", "guard", "monitor-only"]

KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
RULE_KINDS: tuple[str, ...] = get_args(RuleKind)
RULE_ACTIONS: tuple[str, ...] = get_args(RuleAction)
CONTAINER_MODES: tuple[str, ...] = get_args(ContainerMode)
