"""From settings to what a launch runs: the budget ``Plan`` and the Docker ``LaunchSpec``.

The budget formula lives in ``budget`` (pure). This module supplies its
measured inputs: MemTotal read now (never assumed 121.69 GiB) and the weight
bytes of the checkpoint directory, and turns the plan into container settings.
"""

from __future__ import annotations

from typing import Any

from sparkd.act.containerspec import LaunchSpec
from sparkd.config import BudgetSettings, ContainerSettings, Settings
from sparkd.core.budget import BudgetInputs, Plan, make_plan
from sparkd.errors import InvalidInput
from sparkd.sense.checkpoint import checkpoint_weight_bytes
from sparkd.units import GiB, parse_size

# Fields an operator may change with ``sparkd resize`` / ``POST /api/resize``.
RESIZE_FIELDS: tuple[str, ...] = (
    "kv_target_gib",
    "max_model_len",
    "max_num_seqs",
    "host_reserve_gib",
    "kv_cache_dtype",
    "gmu_override",
    "docker_headroom_gib",
)


def budget_inputs(b: BudgetSettings, c: ContainerSettings, mem_total_bytes: int) -> BudgetInputs:
    """Build the formula's inputs.

    Weights: ``budget.weights_gib`` when set, else the checkpoint at
    ``container.model_dir`` (weight files) minus ``budget.ple_gib``.

    Raises:
        InvalidInput: neither weights_gib nor a readable model_dir is configured.
    """
    weight_bytes = None
    if b.weights_gib is None:
        if not c.model_dir:
            raise InvalidInput("budget.weights_gib", None, "a size in GiB, or container.model_dir to measure")
        try:
            weight_bytes = checkpoint_weight_bytes(c.model_dir)
        except OSError as e:
            raise InvalidInput("container.model_dir", c.model_dir, f"a readable checkpoint directory ({e})") from None
    return BudgetInputs(
        mem_total_bytes=mem_total_bytes,
        max_model_len=b.max_model_len,
        kv_bytes_per_token=b.kv_bytes_per_token,
        weight_bytes=weight_bytes,
        ple_bytes=int(b.ple_gib * GiB) if weight_bytes is not None else 0,
        weights_gib=b.weights_gib,
        overhead_gib=b.overhead_gib,
        mtp_enabled=b.mtp,
        mtp_gib=b.mtp_gib,
        mtp_off_credit_gib=b.mtp_off_credit_gib,
        kv_target_gib=b.kv_target_gib,
        host_reserve_gib=b.host_reserve_gib,
        kv_cache_dtype=b.kv_cache_dtype,
        max_num_seqs=b.max_num_seqs,
        max_num_batched_tokens=b.max_num_batched_tokens,
        gmu_override=b.gmu_override,
        docker_headroom_gib=b.docker_headroom_gib,
        model=c.served_model or (c.model_mount if c.model_dir else None),
    )


def plan_for(settings: Settings, mem_total_bytes: int) -> Plan | None:
    """The plan when the budget is enabled, else ``None``. Raises ``InvalidInput`` / ``Refused``."""
    if not settings.budget.enabled:
        return None
    return make_plan(budget_inputs(settings.budget, settings.container, mem_total_bytes))


def launch_spec(settings: Settings, plan: Plan | None) -> LaunchSpec:
    """The container to run: vLLM args (plan + ``container.args``), ``--port``,
    ``--shutdown-timeout`` (the drain inside the 30 s stop window), limits, mounts,
    ``--init`` and ``--oom-score-adj`` (``container.init`` / ``container.oom_score_adj``).

    Raises:
        InvalidInput: no image configured.
    """
    c = settings.container
    if not c.image:
        raise InvalidInput("container.image", None, "an image name to launch")
    args: list[str] = plan.vllm_args() if plan else (["--model", c.served_model] if c.served_model else [])
    args += list(c.args)
    if "--port" not in args:
        args += ["--port", str(c.port)]
    if "--shutdown-timeout" not in args and c.shutdown_timeout_s:
        args += ["--shutdown-timeout", f"{c.shutdown_timeout_s:g}"]
    mem = plan.docker_memory_bytes if plan else (parse_size(c.memory) if c.memory else None)
    gpu: Any = {"auto": "auto", "on": True, "off": False}[c.gpu]
    return LaunchSpec(
        image=c.image,
        name=c.name,
        command=args,
        environment=dict(c.env),
        model_dir=(c.model_dir, c.model_mount) if c.model_dir else None,
        port=c.port,
        mem_limit_bytes=mem,
        memswap_limit_bytes=mem,
        gpu=gpu,
        init=c.init,
        oom_score_adj=c.oom_score_adj,
    )


def apply_resize(b: BudgetSettings, changes: dict[str, Any]) -> BudgetSettings:
    """A copy of ``b`` with ``changes`` validated by the settings model.

    Raises:
        InvalidInput: an unknown field (names the allowed ones) or a value out of range.
    """
    from pydantic import ValidationError

    unknown = sorted(set(changes) - set(RESIZE_FIELDS))
    if unknown:
        raise InvalidInput(unknown[0], changes[unknown[0]], "one of " + ", ".join(RESIZE_FIELDS))
    try:
        return BudgetSettings(**{**b.model_dump(), **changes, "enabled": True})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise InvalidInput(field, err.get("input"), err["msg"]) from None


def plan_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``{key: [old, new]}`` for the top-level plan figures that changed."""
    old = old or {}
    return {k: [old.get(k), v] for k, v in new.items() if not isinstance(v, dict | list) and old.get(k) != v}
