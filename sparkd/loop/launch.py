"""From settings to what a launch runs: the budget ``Plan`` and the Docker ``LaunchSpec``.

The budget formula lives in ``budget`` (pure). This module supplies its
measured inputs: MemTotal read now (never assumed 121.69 GiB), the weight
bytes of the checkpoint directory and the KV layout of its ``config.json``,
records where every input came from, and turns the plan into container settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sparkd.act.containerspec import LaunchSpec
from sparkd.config import BudgetSettings, ContainerSettings, Settings
from sparkd.core.budget import (
    NOTES_FP8_KV_MULT,
    NOTES_FP8_REASON,
    NOTES_KV_BYTES_PER_TOKEN,
    WHOLE_FP8_KV_MULT,
    BudgetInputs,
    Plan,
    kv_mult_table,
    make_plan,
)
from sparkd.core.kvcache import KvLayout, kv_layout
from sparkd.core.learned import LearnedPeak, config_key, learn, peak_from_record, recommended_reserve_bytes
from sparkd.core.rules import compile_rules, stop_lines
from sparkd.errors import InvalidInput
from sparkd.sense.checkpoint import checkpoint_weight_bytes, read_model_config
from sparkd.units import GiB, fmt_gib, parse_size

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


def setting_sources(
    b: BudgetSettings, flags: Iterable[str] = (), *, base: BudgetSettings | None = None
) -> dict[str, str]:
    """Where each budget setting of ``b`` came from: ``"flag"`` (named in ``flags``), ``"config file"``
    (set in ``base``, i.e. the config file or a ``SPARKD_BUDGET__*`` variable, or changed from it by a
    resize), else ``"default"``. ``base`` defaults to ``b`` (pass the configuration's budget when ``b``
    is a stored revision, which has every field set)."""
    flagged, ref = set(flags), base or b

    def source(name: str) -> str:
        if name in flagged:
            return "flag"
        if name in ref.model_fields_set or getattr(b, name) != getattr(ref, name):
            return "config file"
        return "default"

    return {name: source(name) for name in type(b).model_fields}


def budget_inputs(
    b: BudgetSettings,
    c: ContainerSettings,
    mem_total_bytes: int,
    *,
    sources: Mapping[str, str] | None = None,
    mem_total_source: str = "measured",
) -> BudgetInputs:
    """Build the formula's inputs, each with its source (``BudgetInputs.sources``).

    Weights: ``budget.weights_gib`` when set, else the checkpoint at
    ``container.model_dir`` (weight files) minus ``budget.ple_gib``.
    KV bytes per token: ``budget.kv_bytes_per_token`` when set, else derived
    from the checkpoint's ``config.json`` (``sparkd.core.kvcache``; its
    linear-attention state goes to ``state_bytes_per_seq``). The fp8 KV_MULT:
    ``budget.kv_fp8_mult`` when set; else the derived layout's (0.5); else the
    notes' 0.58 for the notes' 29,482 B/token; else 0.5, an assumption the plan
    warns about. ``sources``: per budget setting (``setting_sources``); missing
    names count as ``"default"``.

    Raises:
        InvalidInput: neither weights_gib nor a readable model_dir is configured;
            no KV bytes per token and no model_dir / config.json to derive them.
        UnknownKvLayout: config.json is not a layout sparkd can size (says what it found).
    """
    src = dict(sources or {})

    def s(name: str) -> str:
        return src.get(name, "default")

    weight_bytes = None
    if b.weights_gib is None:
        if not c.model_dir:
            raise InvalidInput(
                "budget.weights_gib",
                None,
                "a size in GiB (--weights-gib), or container.model_dir (--model-dir): the checkpoint to measure",
            )
        try:
            weight_bytes = checkpoint_weight_bytes(c.model_dir)
        except OSError as e:
            raise InvalidInput("container.model_dir", c.model_dir, f"a readable checkpoint directory ({e})") from None
    layout: KvLayout | None = None
    if b.kv_bytes_per_token is None:
        if not c.model_dir:
            raise InvalidInput(
                "budget.kv_bytes_per_token",
                None,
                "the 16-bit KV bytes per token (--kv-bytes-per-token), or container.model_dir (--model-dir) "
                "with the checkpoint's config.json to derive them from",
            )
        layout = kv_layout(read_model_config(c.model_dir))
    sources_out = {
        "mem_total_bytes": mem_total_source,
        "mtp_enabled": s("mtp"),
        **{
            n: s(n)
            for n in (
                "overhead_gib",
                "mtp_gib",
                "mtp_off_credit_gib",
                "kv_target_gib",
                "host_reserve_gib",
                "max_model_len",
                "kv_cache_dtype",
                "max_num_seqs",
                "max_num_batched_tokens",
                "docker_headroom_gib",
            )
        },
    }
    explain: dict[str, str] = {}
    if weight_bytes is not None:
        sources_out["weight_bytes"] = "measured"
        explain["weight_bytes"] = f"weight files in {c.model_dir}"
        sources_out["ple_bytes"] = s("ple_gib")
    else:
        sources_out["weights_gib"] = s("weights_gib")
    if b.gmu_override is not None:
        sources_out["gmu_override"] = s("gmu_override")
    if layout is None:
        sources_out["kv_bytes_per_token"] = s("kv_bytes_per_token")
    else:
        sources_out["kv_bytes_per_token"] = "checkpoint config.json"
        explain["kv_bytes_per_token"] = f"{layout.family}: {layout.formula}"
        if layout.state_bytes_per_seq:
            sources_out["state_bytes_per_seq"] = "checkpoint config.json"
            explain["state_bytes_per_seq"] = layout.state_formula
    if b.kv_fp8_mult is not None:
        fp8_mult, sources_out["kv_mult"] = b.kv_fp8_mult, s("kv_fp8_mult")
        explain["kv_mult"] = "fp8 KV_MULT set by hand (budget.kv_fp8_mult)"
    elif layout is not None:
        fp8_mult, sources_out["kv_mult"] = layout.fp8_mult, "checkpoint config.json"
        explain["kv_mult"] = f"fp8 KV_MULT {layout.fp8_mult:g}: {layout.fp8_reason}"
    elif b.kv_bytes_per_token == NOTES_KV_BYTES_PER_TOKEN:
        fp8_mult, sources_out["kv_mult"] = NOTES_FP8_KV_MULT, "default"
        explain["kv_mult"] = f"fp8 KV_MULT {NOTES_FP8_KV_MULT:g}: {NOTES_FP8_REASON}"
    else:
        fp8_mult, sources_out["kv_mult"] = WHOLE_FP8_KV_MULT, "default"
        explain["kv_mult"] = f"fp8 KV_MULT {WHOLE_FP8_KV_MULT:g}: assumed whole KV cache in fp8"
    return BudgetInputs(
        mem_total_bytes=mem_total_bytes,
        max_model_len=b.max_model_len,
        kv_bytes_per_token=layout.bytes_per_token if layout else int(b.kv_bytes_per_token or 0),
        kv_window_groups=layout.window_groups if layout else (),
        state_bytes_per_seq=layout.state_bytes_per_seq if layout else 0,
        model_max_len=layout.max_position_embeddings if layout else None,
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
        kv_mult_table=kv_mult_table(fp8_mult),
        max_num_seqs=b.max_num_seqs,
        max_num_batched_tokens=b.max_num_batched_tokens,
        gmu_override=b.gmu_override,
        docker_headroom_gib=b.docker_headroom_gib,
        model=c.served_model or (c.model_mount if c.model_dir else None),
        sources=sources_out,
        explain=explain,
    )


def plan_for(settings: Settings, mem_total_bytes: int, *, base: BudgetSettings | None = None) -> Plan | None:
    """The plan when the budget is enabled, else ``None``. ``base``: the configuration's budget
    when ``settings.budget`` is a revision (for the sources). Raises ``InvalidInput`` / ``Refused``."""
    if not settings.budget.enabled:
        return None
    b = settings.budget
    plan = make_plan(budget_inputs(b, settings.container, mem_total_bytes, sources=setting_sources(b, base=base)))
    return with_stop_line_warnings(plan, settings)


def with_stop_line_warnings(plan: Plan, settings: Settings) -> Plan:
    """``plan`` with a warning for each stop rule whose line on MemAvailable (or usable memory) a model using its
    whole budget reaches: MemAvailable cannot exceed MemTotal − budget while the model holds it, so such a rule
    stops the model before it is full (a walk-through resized to budget 21.49 of 23.54 GiB beside a rule at
    usable < 21.86 GiB, and was told only that host_reserve_gib 0 is below 28)."""
    total = plan.inputs.mem_total_bytes
    room = total - plan.budget_bytes
    extra = []
    for rule in compile_rules(settings.rules, total):
        if rule.action != "stop":
            continue
        for line in stop_lines(rule.to_json()):
            if line["field"] in ("mem_available", "mem_available_minus_cma") and line["value"] >= room:
                extra.append(
                    f"a model using its whole budget ({fmt_gib(plan.budget_bytes)}) leaves at most {fmt_gib(room)} "
                    f"of MemAvailable (MemTotal {fmt_gib(total)} − budget), not above stop rule {rule.name}'s line "
                    f"({line['label']} {fmt_gib(line['value'])}): the guard stops it before its KV cache is full; "
                    f"raise host_reserve_gib (now {plan.inputs.host_reserve_gib:g}) or lower kv_target_gib or "
                    "max_model_len"
                )
    return dataclasses.replace(plan, warnings=(*plan.warnings, *extra)) if extra else plan


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


#: container.args that shape the start-up peak (torch.compile, CUDA graph capture): part of the config key
GRAPH_ARG_PREFIXES = ("--compilation-config", "-O", "--enforce-eager", "--cuda-graph", "--max-seq-len-to-capture")


def launch_config_parts(settings: Settings, image: str | None = None) -> dict[str, Any]:
    """What shapes a launch's start-up peak (issue 16): image, model, max_num_seqs, max_model_len,
    KV cache dtype and the graph settings among ``container.args``; ``core.learned.config_key`` hashes it."""
    c, b = settings.container, settings.budget
    args = list(c.args)
    graph = [
        a
        for i, a in enumerate(args)
        if a.startswith(GRAPH_ARG_PREFIXES)
        or (i > 0 and args[i - 1].startswith(GRAPH_ARG_PREFIXES) and not a.startswith("-"))
    ]
    return {
        "image": image or c.image,
        "model": c.served_model or c.model_dir,
        "max_num_seqs": b.max_num_seqs,
        "max_model_len": b.max_model_len,
        "kv_cache_dtype": b.kv_cache_dtype,
        "graph": " ".join(graph),
    }


def launch_config_key(settings: Settings, image: str | None = None) -> str:
    """``core.learned.config_key`` of ``launch_config_parts``: launches with equal keys are compared."""
    return config_key(launch_config_parts(settings, image))


@dataclass(frozen=True)
class LearnedReserve:
    """The start-up overshoot learned for this configuration and the host reserve it recommends (bytes).

    ``learned``: None without a past launch of the same ``config_key`` that has the figures;
    ``recommended_reserve_bytes``: ``core.learned.recommended_reserve_bytes`` over the lowest
    MemAvailable at launch among the evidence (None without evidence); ``applied``: the plan was
    made with it (``budget.apply_learned_reserve`` and it is above the configured reserve).
    """

    key: str
    learned: LearnedPeak | None
    stop_line_bytes: int
    margin_bytes: int
    host_reserve_bytes: int
    recommended_reserve_bytes: int | None
    applied: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "config_key": self.key,
            "learned_overshoot_bytes": self.learned.overshoot_bytes if self.learned else None,
            "evidence": self.learned.to_json()["launches"] if self.learned else [],
            "stop_line_bytes": self.stop_line_bytes,
            "margin_bytes": self.margin_bytes,
            "host_reserve_bytes": self.host_reserve_bytes,
            "recommended_reserve_bytes": self.recommended_reserve_bytes,
            "applied": self.applied,
        }

    def lines(self) -> list[str]:
        """The plan table's section: the learned overshoot, its evidence and the recommended reserve."""
        if self.learned is None:
            return [f"learned start-up peak: no past launch of this configuration ({self.key}) with figures"]
        out = [
            f"learned start-up overshoot: {fmt_gib(self.learned.overshoot_bytes)} below the plan's floor "
            f"(worst of {len(self.learned.evidence)} launches of configuration {self.key})"
        ]
        for e in self.learned.evidence:
            out.append(
                f"  launch {e.launch_id}: planned floor {fmt_gib(e.plan_floor_bytes)}, dipped to "
                f"{fmt_gib(e.trough_bytes)} ({fmt_gib(e.overshoot_bytes)} below)"
            )
        rec = self.recommended_reserve_bytes
        out.append(
            f"recommended host reserve: {fmt_gib(rec)} (configured {fmt_gib(self.host_reserve_bytes)}; keeps the "
            f"start-up trough above the stop line {fmt_gib(self.stop_line_bytes)} + margin "
            f"{fmt_gib(self.margin_bytes)})" + ("; APPLIED (budget.apply_learned_reserve)" if self.applied else "")
        )
        return out


#: Sample attributes a MemAvailable stop line is written on (usable = MemAvailable − CmaFree, CONTEXT.md "CMA")
AVAILABLE_ATTRS = ("mem_available", "mem_available_minus_cma")


def stop_line_bytes(settings: Settings, mem_total_bytes: int | None) -> int:
    """The highest MemAvailable floor of the threshold rules that trip on MemAvailable alone (default rules:
    6 GiB; a predictive rule's gate is not a stop line, a gated rule needs more than MemAvailable)."""
    lines = [
        floor
        for r in compile_rules(settings.rules, mem_total_bytes)
        if r.kind == "threshold" and not r.gated and all(c.attr in AVAILABLE_ATTRS for c in r.when)
        for attr, floor in r.floors()
        if attr in AVAILABLE_ATTRS
    ]
    return int(max(lines, default=0))


def learned_reserve(
    settings: Settings,
    launches: Iterable[Mapping[str, Any]],
    *,
    mem_total_bytes: int,
    budget_bytes: int,
    image: str | None = None,
) -> LearnedReserve:
    """Learn from stored launch records (``Store.launches``) of the same configuration as ``settings``.

    ``budget_bytes``: the budget of the plan at hand; the recommended reserve is for it.
    """
    key = launch_config_key(settings, image)
    peaks = [
        p
        for rec in launches
        if (rec.get("actual") or {}).get("config_key") == key and (p := peak_from_record(rec)) is not None
    ]
    found = learn(peaks)
    b = settings.budget
    stop, margin = stop_line_bytes(settings, mem_total_bytes), int(b.preflight_margin_gib * GiB)
    reserve = int(b.host_reserve_gib * GiB)
    rec_bytes = None
    if found is not None:
        lowest_avail = min(e.mem_available_at_launch_bytes for e in found.evidence)
        rec_bytes = recommended_reserve_bytes(
            host_reserve_bytes=reserve,
            plan_floor_bytes=lowest_avail - budget_bytes,
            learned_overshoot_bytes=found.overshoot_bytes,
            stop_line_bytes=stop,
            margin_bytes=margin,
        )
    return LearnedReserve(key, found, stop, margin, reserve, rec_bytes)
