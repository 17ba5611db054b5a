"""The memory budget and the launches: ``plan``, ``launches``, ``vllm-log``."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import click
from pydantic import ValidationError

from sparkd.config import Settings
from sparkd.core.choices import KV_CACHE_DTYPES
from sparkd.face.cli.base import (
    _budget_in_effect,
    _f,
    _settings,
    _store,
    _ts,
    main,
    revision_note,
)
from sparkd.units import GiB, fmt_gib


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--limit", default=20, show_default=True)
@click.pass_context
def launches(ctx: click.Context, as_json: bool, limit: int) -> None:
    """Launch records: the plan beside what vLLM reported and the start-up trough."""
    settings = _settings(ctx)
    rows = _store(settings).launches(limit=limit)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        click.echo("no launches recorded")
    for r in rows:
        plan, act = r.get("plan") or {}, r.get("actual") or {}
        ready = f"ready after {r['ready_at'] - r['started_at']:.1f} s" if r.get("ready_at") else "never ready"
        click.echo(
            f"{_ts(r['started_at'])} {r['id']} {r['status']:<10} {ready}; trough "
            f"{fmt_gib(r.get('trough_bytes'))}; rev {r.get('revision')}{' FORCED' if r.get('forced') else ''}"
        )
        click.echo(
            f"    estimate: GMU {plan.get('gmu', '-')}, KV {_f(plan.get('kv_exp_gib'))} GiB, "
            f"max-len concurrency {_f(plan.get('max_len_concurrency'))}"
        )
        click.echo(
            f"    actual:   weights {_f(act.get('model_load_gib'))} GiB in {_f(act.get('model_load_s'))} s, "
            f"KV {_f(act.get('kv_cache_available_gib'))} GiB = {act.get('kv_cache_tokens', '-')} tokens, concurrency "
            f"{_f(act.get('max_concurrency'))}x, graphs {_f(act.get('graph_capture_gib'))} GiB"
        )
        if act.get("failure_summary"):
            click.echo(f"    failed:   {act['failure_summary']}")
        for text in (act.get("warnings") or {}).values():
            click.echo(f"    warning:  {text}")


_PLAN_OPTS = [
    ("--weights-gib", "weights_gib", float, "GPU-resident weights after PLE (GiB); default: measure model_dir"),
    ("--ple-gib", "ple_gib", float, "mmap'ed embedding tables (PLE) in the checkpoint"),
    ("--overhead-gib", "overhead_gib", float, "CUDA graphs, activations, workspaces"),
    ("--mtp-gib", "mtp_gib", float, "MTP memory (with --mtp)"),
    ("--mtp-off-credit-gib", "mtp_off_credit_gib", float, "weights not loaded with MTP off"),
    ("--kv-target-gib", "kv_target_gib", float, "KV cache wanted"),
    ("--host-reserve-gib", "host_reserve_gib", float, "left to the host"),
    ("--max-model-len", "max_model_len", int, "vLLM --max-model-len"),
    ("--kv-bytes-per-token", "kv_bytes_per_token", int, "16-bit KV bytes per token; default: from config.json"),
    ("--kv-cache-dtype", "kv_cache_dtype", click.Choice(KV_CACHE_DTYPES), "vLLM --kv-cache-dtype"),
    ("--kv-fp8-mult", "kv_fp8_mult", float, "KV_MULT of an fp8 KV cache; default 0.5 (0.58 for the notes' model)"),
    ("--max-num-seqs", "max_num_seqs", int, "vLLM --max-num-seqs"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "vLLM --max-num-batched-tokens"),
    ("--gmu-override", "gmu_override", float, "explicit --gpu-memory-utilization"),
    ("--docker-headroom-gib", "docker_headroom_gib", float, "Docker --memory = budget + this"),
]


def _plan_options(f: Any) -> Any:
    for flag, dest, typ, help_ in reversed(_PLAN_OPTS):
        f = click.option(flag, dest, type=typ, default=None, help=help_)(f)
    return f


@main.command()
@_plan_options
@click.option("--mem-total-gib", type=float, default=None, help="MemTotal (GiB); default: read /proc/meminfo now.")
@click.option("--model-dir", type=click.Path(), default=None, help="Checkpoint directory to measure.")
@click.option("--mtp/--no-mtp", default=None, help="Multi-token prediction on/off (counts --mtp-gib).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def plan(
    ctx: click.Context,
    mem_total_gib: float | None,
    model_dir: str | None,
    mtp: bool | None,
    as_json: bool,
    **inputs: Any,
) -> None:
    """The memory budget without launching (the seed's --no-launch): inputs with their sources,
    intermediate values, results. An incomplete checkpoint (a shard of the index missing or
    short) is refused (exit 1)."""
    from sparkd.core.budget import make_plan
    from sparkd.core.plan_table import render_plan_table
    from sparkd.errors import Refused
    from sparkd.loop.launch import budget_inputs, setting_sources, with_stop_line_warnings
    from sparkd.sense.checkpoint import check_checkpoint

    settings = _settings(ctx)
    changes = {k: v for k, v in inputs.items() if v is not None}
    if mtp is not None:
        changes["mtp"] = mtp

    from sparkd.config import BudgetSettings, format_validation_error

    in_effect, rev = _budget_in_effect(settings)  # a resize in effect is what the daemon launches with
    if rev is not None:
        click.echo(f"sparkd: {revision_note(settings, rev)}", err=as_json)
    try:
        b = BudgetSettings(**{**in_effect.model_dump(), **changes, "enabled": True})
    except ValidationError as e:
        click.echo("sparkd: " + format_validation_error(e, "plan inputs"), err=True)
        sys.exit(2)
    c = settings.container.model_copy(update={"model_dir": model_dir} if model_dir else {})
    if mem_total_gib is not None:
        mem_total = int(mem_total_gib * 2**30)
    else:
        from sparkd.sense.procfs import read_meminfo

        mem_total = read_meminfo(settings.proc_root).fields["MemTotal"]
    check = check_checkpoint(c.model_dir) if c.model_dir else None
    if check is not None and not check.ok:
        raise Refused(
            check.describe() + ": vLLM would fail on it after loading the rest; complete the download",
            detail={"missing": list(check.missing), "problems": list(check.problems)},
        )
    sources = setting_sources(in_effect, flags=changes, base=settings.budget)
    if rev is not None:
        filed = settings.budget.model_dump()
        sources = {k: "resize" if v != "flag" and rev["data"].get(k) != filed.get(k) else v for k, v in sources.items()}
    mem_src = "flag" if mem_total_gib is not None else "measured"
    p = make_plan(budget_inputs(b, c, mem_total, sources=sources, mem_total_source=mem_src))
    learned = _learned_reserve(settings.model_copy(update={"budget": b, "container": c}), mem_total, p)
    if (
        learned is not None
        and b.apply_learned_reserve
        and (learned.recommended_reserve_bytes or 0) > int(b.host_reserve_gib * GiB)
    ):  # the learned reserve, applied: the plan is made again with it (its evidence is printed below)
        b = b.model_copy(update={"host_reserve_gib": learned.recommended_reserve_bytes / GiB})
        sources = {**sources, "host_reserve_gib": "measured"}  # from the launch records
        p = make_plan(budget_inputs(b, c, mem_total, sources=sources, mem_total_source=mem_src))
        learned = dataclasses.replace(learned, applied=True)
    p = with_stop_line_warnings(p, settings)
    if as_json:
        out = p.to_json()
        out["checkpoint"] = None if check is None else {"ok": check.ok, "describe": check.describe()}
        out["learned"] = learned.to_json() if learned is not None else None
        click.echo(json.dumps(out, indent=2))
    else:
        from sparkd.loop.launch import launch_spec

        spec = launch_spec(
            settings.model_copy(
                update={"container": c.model_copy(update={"image": c.image or "vllm/vllm-openai:latest"})}
            ),
            p,
        )
        click.echo(render_plan_table(p, command=spec.docker_run_command()))
        if c.gpu == "auto":  # the launch asks the engine; this offline line cannot (note 11)
            click.echo(
                "(--gpus all: container.gpu = auto, as on a Spark; a launch asks for the GPU only where the Docker "
                "engine has the NVIDIA runtime)"
            )
        if check is not None:
            click.echo(check.describe())
        if learned is not None:
            click.echo("\n".join(learned.lines()))


def _learned_reserve(settings: Settings, mem_total: int, p: Any) -> Any:
    """``loop.launch.learned_reserve`` over the daemon's stored launch records; None without a database."""
    from sparkd.loop.launch import learned_reserve

    if not settings.db_file.exists():
        return None
    store = _store(settings)
    try:
        launches = store.launches(limit=500)
    finally:
        store.close()
    return learned_reserve(
        settings,
        launches,
        mem_total_bytes=mem_total,
        budget_bytes=int(p.budget_gib * GiB),
        image=settings.container.image,
    )


@main.command("vllm-log")
@click.argument("file", type=click.File("rb"))
@click.option("--json", "as_json", is_flag=True, help="The launch record as JSON.")
def vllm_log(file: Any, as_json: bool) -> None:
    """Why did this launch fail? Parse a saved vLLM log (or `docker logs` output; FILE - reads stdin)
    into the launch record: state, phase reached, figures, root cause and warnings.
    Exit status: 0 ready or still starting, 1 failed (or an empty log)."""
    from sparkd.sense.vllm_log import LaunchLogParser

    parser = LaunchLogParser()
    for raw in file:
        parser.feed(raw)
    rec = parser.record
    if as_json:
        click.echo(json.dumps(rec.to_json(), indent=2))
        sys.exit(1 if rec.failed else 0)
    if rec.lines_seen == 0:
        click.echo("sparkd: the log is empty", err=True)
        sys.exit(1)
    state = rec.state + (" (the log ends before 'Application startup complete')" if rec.state == "starting" else "")
    out = [f"state:   {state}", f"phase:   {rec.phase} (last start-up step the log shows)"]
    if rec.failed:
        out.append(f"cause:   {rec.failure_summary()}")
        if rec.failure_message:
            out.append(f"root cause line: {rec.failure_message}")
        if rec.failure_generic:
            out.append(f"generic line (not the reason): {rec.failure_generic}")
    skip = {"state", "phase", "failed", "failure_message", "failure_generic", "failure_summary", "warnings"}
    figures = {k: v for k, v in rec.to_json().items() if k not in skip and v not in (None, False)}
    if figures:
        out.append("figures:")
        width = max(len(k) for k in figures) + 2
        out += [f"  {k:<{width}}{json.dumps(v) if isinstance(v, dict) else v}" for k, v in figures.items()]
    for text in rec.warnings().values():
        out.append(f"WARNING: {text}")
    if rec.phase == "starting" and not rec.failed:
        out.append(
            f"NOTE: none of the {rec.lines_seen} lines is a vLLM start-up line sparkd knows "
            "(is this vLLM's output? `docker logs` writes it to stderr: add 2>&1)"
        )
    click.echo("\n".join(out))
    if rec.failed:
        sys.exit(1)  # a failed launch: scripts can branch on it (the report above says why)
