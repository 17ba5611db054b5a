"""``sparkd plan``'s table: a ``Plan`` as plain text to check by hand (pure).

Inputs with their value and source (``BudgetInputs.sources``) and how each was
reached (``BudgetInputs.explain``), the intermediates and results of the formula
(``sparkd.core.budget``), the squeeze, the warnings and the ``docker run`` line.
"""

from __future__ import annotations

from sparkd.core.budget import Plan
from sparkd.units import MiB

_SHORT = {"kv_cache_dtype": "dtype", "kv_mult": "KV_MULT", "mtp_enabled": "on/off", "max_num_seqs": "seqs"}


def render_plan_table(
    plan: Plan,
    *,
    image: str = "vllm/vllm-openai:latest",
    gpus: bool = True,
    init: bool = True,
    oom_score_adj: int | None = 500,
    command: str | None = None,
) -> str:
    """A plain-text table to check by hand: inputs, intermediates, results, command line.

    ``command``: the launch's own ``docker run`` line (``LaunchSpec.docker_run_command``); without
    it, the plan's flags alone."""
    i = plan.inputs

    def g(x: float) -> str:
        return f"{x:.2f} GiB"

    mtp = f"on, {g(i.mtp_gib)}" if i.mtp_enabled else f"off (credit {g(i.mtp_off_credit_gib)})"
    windows = "".join(f" + {b} B within {w} tokens" for w, b in i.kv_window_groups)
    # (label, value, the input names whose source the row shows)
    inputs: list[tuple[str, str, tuple[str, ...]]] = [
        ("MemTotal", g(plan.mem_total_gib), ("mem_total_bytes",)),
        # weights given directly (--weights-gib, budget.weights_gib): no checkpoint measured, said as such
        # (the row read "checkpoint weight files — flag", note 11)
        ("checkpoint weight files", g(plan.checkpoint_gib), ("weight_bytes",))
        if plan.checkpoint_gib is not None
        else ("weights (given; no checkpoint measured)", g(i.weights_gib or 0.0), ("weights_gib",)),
        ("PLE (mmap'ed, not on the GPU side)", g(plan.ple_gib), ("ple_bytes",)),
        ("overhead", g(i.overhead_gib), ("overhead_gib",)),
        ("MTP", mtp, ("mtp_enabled", "mtp_gib" if i.mtp_enabled else "mtp_off_credit_gib")),
        ("max_model_len", str(i.max_model_len), ("max_model_len",)),
        ("KV bytes per token (16-bit)", f"{i.kv_bytes_per_token} B{windows}", ("kv_bytes_per_token",)),
        ("KV cache dtype", f"{i.kv_cache_dtype} (KV_MULT {plan.kv_mult:g})", ("kv_cache_dtype", "kv_mult")),
        ("KV target", g(i.kv_target_gib), ("kv_target_gib",)),
        ("host reserve", g(i.host_reserve_gib), ("host_reserve_gib",)),
        (
            "max_num_seqs / max_num_batched_tokens",
            f"{i.max_num_seqs} / {i.max_num_batched_tokens}",
            ("max_num_seqs", "max_num_batched_tokens"),
        ),
        ("docker headroom", g(i.docker_headroom_gib), ("docker_headroom_gib",)),
    ]
    if i.state_bytes_per_seq:
        inputs.append(
            ("linear-attention state per sequence", f"{i.state_bytes_per_seq / MiB:.2f} MiB", ("state_bytes_per_seq",))
        )
    rows: list[tuple[str, str] | str] = [
        "intermediates",
        ("w = weights − PLE (− MTP-off credit)", g(plan.weights_gib)),
        (
            "fixed = w + overhead + MTP" + (" + max_num_seqs × state" if plan.state_gib else ""),
            g(plan.fixed_gib),
        ),
        ("kv_need = KV bytes of max_model_len × KV_MULT", g(plan.kv_need_gib)),
        ("wish = fixed + max(kv_need, KV target)", g(plan.wish_gib)),
        ("cap = MemTotal − host reserve", g(plan.cap_gib)),
        "results",
        (
            f"gmu ({plan.gmu_source}: floor(min(wish, cap) / MemTotal, 0.001); +0.001 if short of one request)",
            f"{plan.gmu:.3f}",
        ),
        ("budget = gmu × MemTotal", g(plan.budget_gib)),
        ("kv_exp = budget − fixed (vLLM profiling decides)", g(plan.kv_exp_gib)),
        ("max-length concurrency = kv_exp / kv_need", f"{plan.max_len_concurrency:.2f}"),
        (
            "docker --memory = --memory-swap (no swap)",
            f"{g(plan.docker_memory_gib)} ({plan.docker_memory_bytes // MiB}m)",
        ),
    ]
    width = max(len(r[0]) for r in [*inputs, *(r for r in rows if isinstance(r, tuple))]) + 2
    vwidth = max(len(r[1]) for r in inputs) + 2
    out = ['sparkd plan — vLLM memory budget (CONTEXT.md, "The memory budget")', "", "inputs (value, source)"]
    for label, value, names in inputs:
        known = [n for n in names if n in i.sources]
        if len({i.sources[n] for n in known}) > 1:  # say which part came from where
            srcs = ", ".join(f"{_SHORT.get(n, n)}: {i.sources[n]}" for n in known)
        else:
            srcs = i.sources[known[0]] if known else ""
        out.append(f"  {label:<{width}}{value:<{vwidth}}{srcs}".rstrip())
        out.extend(f"  {'':<{width}}  {i.explain[n]}" for n in names if n in i.explain)
    for r in rows:
        out.append(f"\n{r}" if isinstance(r, str) else f"  {r[0]:<{width}}{r[1]}")
    out.append("")
    if plan.squeezed:
        out.append(
            f"SQUEEZED: the host cap ({g(plan.cap_gib)}) is below the wish ({g(plan.wish_gib)}): "
            f"KV room {g(plan.kv_exp_gib)} instead of {g(max(plan.kv_need_gib, i.kv_target_gib))}."
        )
    else:
        out.append("not squeezed: the host cap leaves room for the KV target.")
    others = [w for w in plan.warnings if not w.startswith("host cap squeezed")]  # said above
    if others:
        out.append("\nwarnings")
        out.extend(f"  - {w}" for w in others)
    out.append("\ncommand")
    out.append(command or plan.docker_run_command(image, gpus=gpus, init=init, oom_score_adj=oom_score_adj))
    return "\n".join(out) + "\n"
