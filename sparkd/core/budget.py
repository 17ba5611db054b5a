"""vLLM's share of a DGX Spark's unified memory: the seed formula → a ``Plan``.

Source of the formula: CONTEXT.md, "The memory budget" (the launch script of
the deployment notes). All intermediate figures are GiB floats (2**30 bytes),
as in the notes; sizes read from the machine come in as bytes::

    w       = WEIGHT_BYTES / 2**30 - PLE_GIB            # GPU-resident weights
    w      -= min(MTP_OFF_CREDIT, max(w, 0))            # only when MTP is off
    fixed   = w + OVERHEAD_GIB + MTP_GIB                # MTP_GIB counts only when MTP is on
            + MAX_NUM_SEQS * STATE_BYTES_PER_SEQ / 2**30 # linear-attention state (issue 19; 0 for most)
    kv_need = KV_BYTES(MAX_MODEL_LEN) * KV_MULT / 2**30 # one max-length request
    KV_BYTES(L) = L * KV_BYTES_PER_TOKEN + sum(min(L, window) * bytes for each sliding-window group)
    wish    = fixed + max(kv_need, KV_TARGET_GIB)
    cap     = MEM_TOTAL_GIB - HOST_RESERVE_GIB
    budget  = min(wish, cap)
    gmu     = floor(budget / MEM_TOTAL_GIB * 1000) / 1000
    budget  = gmu * MEM_TOTAL_GIB
    kv_exp  = budget - fixed                            # an estimate; vLLM's profiling decides

With no state and no sliding window, ``KV_BYTES(L)`` is the notes'
``MAX_MODEL_LEN * KV_BYTES_PER_TOKEN``. Everything here is pure; the
checkpoint's size on disk (``weight_bytes``) comes from
``sparkd.sense.checkpoint.checkpoint_weight_bytes`` at the edge, the KV layout
from its ``config.json`` via ``sparkd.core.kvcache``. KV_MULT for fp8 is the
notes' 0.58 only for the notes' model; see ``NOTES_FP8_KV_MULT``.

Decisions beyond the notes (documented here, tested in tests/test_budget.py):

* ``gmu`` is floored with an epsilon of 1e-9 GMU steps, so a ratio that float
  arithmetic turns into 0.78599999… still gives 0.786. The overshoot this can
  cause is below one byte (1e-12 × MemTotal).
* When the floored ``gmu`` leaves less than one max-length request (``kv_exp < kv_need``)
  and the next step stays within ``cap``, ``gmu`` is that next step. Floored, a wish set
  by one request (``kv_need ≥ KV_TARGET_GIB``) fell short of it by up to one step (~125
  MiB), and every such model was refused ("KV room 1.98 GiB is below one max-length
  request 2.00 GiB", whatever host_reserve_gib). So a plan is refused exactly when the
  largest step within ``cap`` holds no max-length request; the budget exceeds ``wish`` by
  less than one step, never ``cap``. The notes' worked example is unchanged (its cap binds).
* ``gmu_override`` replaces the formula's gmu, but never the host reserve: an
  override whose budget exceeds ``cap`` is refused. To go higher, lower
  ``host_reserve_gib`` explicitly, so the choice shows in the plan.
* Docker's ``--memory`` is budget + headroom, rounded down to whole MiB, and
  ``--memory-swap`` is the same figure (no swap for the container).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, TypeGuard

from sparkd.core.choices import KV_CACHE_DTYPES
from sparkd.errors import InvalidInput, Refused
from sparkd.units import GiB, MiB

#: vLLM's ``--kv-cache-dtype`` choices sparkd plans for: the one definition (config, API, CLI).
FP8_KV_DTYPES: tuple[str, ...] = tuple(d for d in KV_CACHE_DTYPES if d.startswith("fp8"))

#: The launch notes' model (CONTEXT.md "The memory budget"): 29,482 B per token at
#: BF16, and KV_MULT 0.58 for fp8 because its side caches stay BF16 — only part of
#: its KV shrinks. Both figures belong to that model; any other model gets its
#: per-token figure from its config.json (``sparkd.core.kvcache``) and 0.5 for fp8.
NOTES_KV_BYTES_PER_TOKEN = 29482
NOTES_FP8_KV_MULT = 0.58
NOTES_FP8_REASON = (
    "the launch notes' model (29,482 B/token): its side caches stay BF16, so fp8 shrinks only part of "
    "the KV cache (notes: KV_MULT 0.58)"
)
#: An fp8 KV cache whose every byte is fp8: 1 byte per element instead of 2.
WHOLE_FP8_KV_MULT = 0.5


def kv_mult_table(fp8_mult: float) -> dict[str, float]:
    """KV_MULT per dtype: 1.0 for the 16-bit choices, ``fp8_mult`` for the fp8 ones."""
    return {d: (fp8_mult if d in FP8_KV_DTYPES else 1.0) for d in KV_CACHE_DTYPES}


#: KV_MULT per ``--kv-cache-dtype`` of the notes' model (CONTEXT.md: 1.0 for BF16, 0.58 for FP8).
DEFAULT_KV_MULT: Mapping[str, float] = MappingProxyType(kv_mult_table(NOTES_FP8_KV_MULT))
#: Where an input came from (``BudgetInputs.sources``), as shown by ``sparkd plan`` ("resize": a resize's revision
#: in effect over the configuration file, ``Store.revision_in_effect``).
SOURCES: tuple[str, ...] = ("flag", "config file", "resize", "checkpoint config.json", "measured", "default")
#: Names vLLM's --kv-cache-dtype does not accept in every release; a 16-bit KV
#: cache is "auto" (the model's dtype), which has the same size.
_VLLM_KV_DTYPE = {"bf16": "auto", "fp16": "auto"}
#: The reserve the operators later needed (CONTEXT.md: "26 GiB host reserve had to become 28").
RECOMMENDED_HOST_RESERVE_GIB = 28.0
_GMU_EPS = 1e-9  # in GMU steps (0.001); see the module docstring


def floor_gmu(budget_gib: float, mem_total_gib: float) -> float:
    """``floor(budget / MemTotal * 1000) / 1000`` without float artefacts.

    Returns a float with at most 3 decimals. Ratios within 1e-9 of a step below
    it count as that step (0.78599999999 → 0.786), so ``floor_gmu(g * T, T) == g``
    for every step g.
    """
    return math.floor(budget_gib / mem_total_gib * 1000 + _GMU_EPS) / 1000


@dataclass(frozen=True)
class BudgetInputs:
    """What the formula needs. Bytes for sizes read from the machine, GiB for knobs.

    Weights come either as ``weight_bytes`` (the checkpoint's weight files, see
    ``sparkd.sense.checkpoint.checkpoint_weight_bytes``) with ``ple_bytes`` (the mmap'ed embedding
    tables inside it), or directly as ``weights_gib`` (= w after PLE); give
    exactly one of the two. ``mtp_gib`` counts only when ``mtp_enabled``;
    ``mtp_off_credit_gib`` is subtracted from w only when it is not.
    ``kv_bytes_per_token`` is the 16-bit figure of the layers that keep every
    token; ``kv_window_groups`` are ``(window_tokens, bytes_per_token)`` of
    sliding-window layers (a request holds at most the window of them);
    ``kv_mult_table[kv_cache_dtype]`` scales both. ``state_bytes_per_seq`` is the
    fixed linear-attention state of one sequence: fixed += max_num_seqs × it
    (see ``sparkd.core.kvcache``). ``model_max_len`` is the checkpoint's
    ``max_position_embeddings`` when known (a warning, not a refusal, when
    ``max_model_len`` exceeds it: rope scaling can extend it). ``sources`` maps
    an input name (a field, or ``kv_mult``) to one of ``SOURCES``; ``explain``
    maps it to how the value was reached (a formula, a reason). Both are shown
    by the plan and drive its provenance warnings. ``model`` (a path inside the
    container) and ``extra_vllm_args`` (e.g. a speculative config for MTP) are
    passed through to ``vllm_args()``.

    Defaults are the notes' seed values. ``make_plan`` validates every field.
    """

    mem_total_bytes: int
    max_model_len: int
    kv_bytes_per_token: int
    weight_bytes: int | None = None
    ple_bytes: int = 0
    weights_gib: float | None = None
    overhead_gib: float = 5.60
    mtp_enabled: bool = True
    mtp_gib: float = 1.49
    mtp_off_credit_gib: float = 0.0
    kv_target_gib: float = 20.0
    host_reserve_gib: float = 26.0
    kv_cache_dtype: str = "auto"
    kv_mult_table: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_KV_MULT))
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 2048
    gmu_override: float | None = None
    docker_headroom_gib: float = 5.0
    model: str | None = None
    extra_vllm_args: tuple[str, ...] = ()
    kv_window_groups: tuple[tuple[int, int], ...] = ()
    state_bytes_per_seq: int = 0
    model_max_len: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    explain: Mapping[str, str] = field(default_factory=dict)

    def kv_bytes_for(self, tokens: int) -> int:
        """16-bit KV bytes of one request of ``tokens`` tokens (windows bound their layers)."""
        return tokens * self.kv_bytes_per_token + sum(min(tokens, w) * b for w, b in self.kv_window_groups)

    def validate(self) -> None:
        """Check every field; raise ``InvalidInput`` naming the first bad one and its range."""
        for name in (
            "mem_total_bytes",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            v = getattr(self, name)
            _need(_is_int(v) and v >= 1, self, name, "an integer ≥ 1")
        _need(
            _is_int(self.kv_bytes_per_token) and self.kv_bytes_per_token >= (0 if self.kv_window_groups else 1),
            self,
            "kv_bytes_per_token",
            "an integer ≥ 1 (≥ 0 when sliding-window layers hold the KV)",
        )
        _need(
            isinstance(self.kv_window_groups, tuple)
            and all(
                isinstance(g, tuple) and len(g) == 2 and all(_is_int(x) and x >= 1 for x in g)
                for g in self.kv_window_groups
            ),
            self,
            "kv_window_groups",
            "(window_tokens ≥ 1, bytes_per_token ≥ 1) pairs",
        )
        _need(
            _is_int(self.state_bytes_per_seq) and self.state_bytes_per_seq >= 0,
            self,
            "state_bytes_per_seq",
            "an integer number of bytes ≥ 0",
        )
        _need(
            self.model_max_len is None or (_is_int(self.model_max_len) and self.model_max_len >= 1),
            self,
            "model_max_len",
            "an integer ≥ 1, or unset",
        )
        for name, src in self.sources.items():
            if src not in SOURCES:
                raise InvalidInput(f"sources[{name}]", src, ", ".join(SOURCES))
        if (self.weight_bytes is None) == (self.weights_gib is None):
            which = "neither" if self.weight_bytes is None else "both"
            raise InvalidInput(
                "weights_gib",
                self.weights_gib,
                f"exactly one of weight_bytes or weights_gib (got {which})",
            )
        if self.weight_bytes is not None:
            _need(
                _is_int(self.weight_bytes) and self.weight_bytes >= 0,
                self,
                "weight_bytes",
                "an integer number of bytes ≥ 0",
            )
            _need(
                _is_int(self.ple_bytes) and 0 <= self.ple_bytes <= self.weight_bytes,
                self,
                "ple_bytes",
                f"an integer 0 ≤ ple_bytes ≤ weight_bytes ({self.weight_bytes})",
            )
        else:
            _need(
                _is_num(self.weights_gib) and self.weights_gib >= 0, self, "weights_gib", "a finite number of GiB ≥ 0"
            )
            _need(
                self.ple_bytes == 0, self, "ple_bytes", "0 when weights_gib is given (weights_gib is already after PLE)"
            )
        for name in ("overhead_gib", "mtp_gib", "mtp_off_credit_gib", "kv_target_gib", "docker_headroom_gib"):
            _need(_is_num(getattr(self, name)) and getattr(self, name) >= 0, self, name, "a finite number of GiB ≥ 0")
        total_gib = self.mem_total_bytes / GiB
        _need(
            _is_num(self.host_reserve_gib) and 0 <= self.host_reserve_gib < total_gib,
            self,
            "host_reserve_gib",
            f"0 ≤ host_reserve_gib < MemTotal ({total_gib:.2f} GiB)"
            + (
                f" ({self.sources['host_reserve_gib']}: set budget.host_reserve_gib or --host-reserve-gib)"
                if self.sources.get("host_reserve_gib") in ("default", "config file")
                else ""
            ),
        )
        _need(isinstance(self.mtp_enabled, bool), self, "mtp_enabled", "true or false")
        for dtype, mult in self.kv_mult_table.items():
            if not (_is_num(mult) and 0 < mult <= 4):
                raise InvalidInput(f"kv_mult_table[{dtype}]", mult, "a multiplier 0 < m ≤ 4")
        _need(
            isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype in self.kv_mult_table,
            self,
            "kv_cache_dtype",
            ", ".join(sorted(self.kv_mult_table)),
        )
        if self.gmu_override is not None:
            g = self.gmu_override
            _need(
                _is_num(g) and 0 < g <= 1 and abs(g * 1000 - round(g * 1000)) < 1e-6,
                self,
                "gmu_override",
                "0 < gmu ≤ 1 with at most 3 decimals (one step is 0.001)",
            )
        _need(
            self.model is None or (isinstance(self.model, str) and self.model.strip() != ""),
            self,
            "model",
            "a non-empty path or name, or unset",
        )
        _need(all(isinstance(a, str) for a in self.extra_vllm_args), self, "extra_vllm_args", "a list of strings")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_mult_table"] = dict(self.kv_mult_table)
        d["extra_vllm_args"] = list(self.extra_vllm_args)
        d["kv_window_groups"] = [list(g) for g in self.kv_window_groups]
        d["sources"] = dict(self.sources)
        d["explain"] = dict(self.explain)
        return d


@dataclass(frozen=True)
class Plan:
    """Every figure of the formula (GiB floats) and what the launch uses.

    ``squeezed`` is ``wish > cap``: the host cap left less KV room than the
    target. ``max_len_concurrency`` = kv_exp / kv_need (max-length requests
    that fit). ``docker_memory_bytes`` is both ``--memory`` and ``--memory-swap``.
    """

    inputs: BudgetInputs
    mem_total_gib: float
    checkpoint_gib: float | None  # None when weights_gib was given directly
    ple_gib: float
    mtp_off_credit_applied_gib: float
    weights_gib: float  # w: GPU-resident weights after PLE (and the MTP-off credit)
    overhead_gib: float
    mtp_gib: float  # as counted in fixed (0 when MTP is off)
    state_gib: float  # max_num_seqs × linear-attention state per sequence
    fixed_gib: float
    kv_mult: float
    kv_need_gib: float
    kv_target_gib: float
    wish_gib: float
    cap_gib: float
    squeezed: bool
    gmu: float
    gmu_source: str  # "formula" or "override"
    budget_gib: float
    kv_exp_gib: float
    max_len_concurrency: float
    docker_memory_bytes: int
    warnings: tuple[str, ...] = ()

    @property
    def budget_bytes(self) -> int:
        return math.floor(self.budget_gib * GiB)

    @property
    def docker_memory_gib(self) -> float:
        return self.docker_memory_bytes / GiB

    @property
    def docker_memory_swap_bytes(self) -> int:
        return self.docker_memory_bytes  # equal to --memory: no swap for the container

    def vllm_args(self) -> list[str]:
        """vLLM server arguments: ``[--model M] --gpu-memory-utilization 0.786 …`` + extras."""
        i = self.inputs
        args = ["--model", i.model] if i.model else []
        args += [
            "--gpu-memory-utilization",
            f"{self.gmu:.3f}",
            "--max-model-len",
            str(i.max_model_len),
            "--kv-cache-dtype",
            _VLLM_KV_DTYPE.get(i.kv_cache_dtype, i.kv_cache_dtype),
            "--max-num-seqs",
            str(i.max_num_seqs),
            "--max-num-batched-tokens",
            str(i.max_num_batched_tokens),
        ]
        return args + list(i.extra_vllm_args)

    def docker_args(self, *, gpus: bool = True, init: bool = True, oom_score_adj: int | None = 500) -> list[str]:
        """``docker run`` flags for the limits (``--memory`` in whole MiB, ``m`` suffix), ``--init`` and
        ``--oom-score-adj`` (the launch flags from the field: settings ``container.init`` /
        ``container.oom_score_adj``; ``None`` leaves Docker's 0)."""
        mem = f"{self.docker_memory_bytes // MiB}m"
        return [
            *(["--gpus", "all"] if gpus else []),
            *(["--init"] if init else []),
            *(["--oom-score-adj", str(oom_score_adj)] if oom_score_adj is not None else []),
            "--ipc",
            "host",
            "--network",
            "host",
            "--memory",
            mem,
            "--memory-swap",
            mem,
        ]

    def docker_run_command(
        self,
        image: str = "vllm/vllm-openai:latest",
        *,
        gpus: bool = True,
        init: bool = True,
        oom_score_adj: int | None = 500,
    ) -> str:
        """The ``docker run`` line a person would type, one flag pair per line."""
        flags = self.docker_args(gpus=gpus, init=init, oom_score_adj=oom_score_adj)
        lines = [
            ["docker", "run", "-d"],
            *_flag_groups(["--label", "sparkd.managed=true", *flags]),
            [image],
            *_flag_groups(self.vllm_args()),
        ]
        return " \\\n    ".join(shlex.join(part) for part in lines)

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-able dict (GiB floats, unrounded)."""
        return {
            "mem_total_gib": self.mem_total_gib,
            "checkpoint_gib": self.checkpoint_gib,
            "ple_gib": self.ple_gib,
            "mtp_off_credit_applied_gib": self.mtp_off_credit_applied_gib,
            "weights_gib": self.weights_gib,
            "overhead_gib": self.overhead_gib,
            "mtp_gib": self.mtp_gib,
            "state_gib": self.state_gib,
            "fixed_gib": self.fixed_gib,
            "kv_mult": self.kv_mult,
            "kv_need_gib": self.kv_need_gib,
            "kv_target_gib": self.kv_target_gib,
            "wish_gib": self.wish_gib,
            "cap_gib": self.cap_gib,
            "squeezed": self.squeezed,
            "gmu": self.gmu,
            "gmu_source": self.gmu_source,
            "budget_gib": self.budget_gib,
            "kv_exp_gib": self.kv_exp_gib,
            "max_len_concurrency": self.max_len_concurrency,
            "docker_memory_gib": self.docker_memory_gib,
            "docker_memory_swap_gib": self.docker_memory_swap_bytes / GiB,
            "docker_memory_bytes": self.docker_memory_bytes,
            "inputs": self.inputs.to_json(),
            "provenance": {
                name: {"source": src, **({"how": self.inputs.explain[name]} if name in self.inputs.explain else {})}
                for name, src in self.inputs.sources.items()
            },
            "vllm_args": self.vllm_args(),
            "warnings": list(self.warnings),
        }


def make_plan(inputs: BudgetInputs) -> Plan:
    """Apply the formula (module docstring; CONTEXT.md "The memory budget").

    Raises:
        InvalidInput: a field is out of range or inconsistent (named, with the range).
        Refused: the plan cannot work — the KV room is below one max-length
            request, the fixed part does not fit, gmu would be ≤ 0 or > 1, or
            ``gmu_override`` exceeds the host cap. The message says what to change.
    """
    inputs.validate()
    i = inputs
    total = i.mem_total_bytes / GiB
    if i.weights_gib is not None:
        checkpoint, ple, w = None, 0.0, float(i.weights_gib)
    else:
        assert i.weight_bytes is not None  # validate() guarantees it
        checkpoint, ple = i.weight_bytes / GiB, i.ple_bytes / GiB
        w = checkpoint - ple
    credit = 0.0 if i.mtp_enabled else min(i.mtp_off_credit_gib, max(w, 0.0))
    w -= credit
    mtp = i.mtp_gib if i.mtp_enabled else 0.0
    state = i.max_num_seqs * i.state_bytes_per_seq / GiB
    fixed = w + i.overhead_gib + mtp + state
    kv_mult = float(i.kv_mult_table[i.kv_cache_dtype])
    kv_need = i.kv_bytes_for(i.max_model_len) * kv_mult / GiB
    wish = fixed + max(kv_need, i.kv_target_gib)
    cap = total - i.host_reserve_gib
    squeezed = wish > cap

    if i.gmu_override is None:
        gmu, source = floor_gmu(min(wish, cap), total), "formula"
        up = round(gmu + 0.001, 3)
        if gmu > 0 and gmu * total - fixed < kv_need and up * total <= cap + 1e-9:
            gmu = up  # floored, the budget fell short of one max-length request: the next step (module docstring)
    else:
        gmu, source = round(i.gmu_override, 3), "override"
        if gmu * total > cap + 1e-9:
            raise Refused(
                f"gmu_override {gmu:.3f} gives {gmu * total:.2f} GiB, above the host cap "
                f"{cap:.2f} GiB (MemTotal {total:.2f} − host_reserve_gib {i.host_reserve_gib:g}). "
                f"Use gmu_override ≤ {floor_gmu(cap, total):.3f}, or lower host_reserve_gib "
                "explicitly if the host can spare it."
            )
    if not 0 < gmu <= 1:
        raise Refused(
            f"gpu-memory-utilization would be {gmu:.3f} (allowed 0 < gmu ≤ 1): budget "
            f"{min(wish, cap):.3f} GiB is below one step (0.001 × MemTotal = {total / 1000:.3f} "
            "GiB). Check mem_total_bytes and the weight size."
        )
    budget = gmu * total
    kv_exp = budget - fixed
    if kv_exp <= 0:
        state_text = f" + linear-attention state {state:.2f}" if state else ""
        raise Refused(
            f"the fixed part does not fit: weights {w:.2f} + overhead {i.overhead_gib:.2f} + MTP "
            f"{mtp:.2f}{state_text} = {fixed:.2f} GiB ≥ budget {budget:.2f} GiB (gmu {gmu:.3f}). Lower "
            f"host_reserve_gib (now {i.host_reserve_gib:g}) if the host can spare it, turn MTP "
            "off, or serve a smaller checkpoint."
        )
    if kv_exp < kv_need:
        max_len = _longest_fitting(i, kv_exp * GiB / kv_mult)
        fp8_hint = "" if kv_mult < 1 else ", or use an fp8 KV cache (kv_cache_dtype fp8)"
        windows = "".join(f" + min(max_model_len, {w}) × {b} B" for w, b in i.kv_window_groups)
        raise Refused(
            f"KV room {kv_exp:.2f} GiB (kv_exp = budget {budget:.2f} − fixed {fixed:.2f}) is "
            f"below one max-length request: (max_model_len {i.max_model_len} × "
            f"{i.kv_bytes_per_token} B/token{windows}) × {kv_mult:g} = {kv_need:.2f} GiB. Lower "
            f"max_model_len to ≤ {max_len}, or raise the host budget (host_reserve_gib now "
            f"{i.host_reserve_gib:g}){fp8_hint}."
        )
    concurrency = kv_exp / kv_need
    docker_bytes = math.floor((budget + i.docker_headroom_gib) * GiB / MiB) * MiB

    warnings: list[str] = []
    if squeezed:
        warnings.append(
            f"host cap squeezed the KV target: wish {wish:.2f} GiB > cap {cap:.2f} GiB; "
            f"expected KV room {kv_exp:.2f} GiB instead of {max(kv_need, i.kv_target_gib):.2f} GiB"
        )
    if i.host_reserve_gib < RECOMMENDED_HOST_RESERVE_GIB:
        warnings.append(
            f"host_reserve_gib {i.host_reserve_gib:g} is below {RECOMMENDED_HOST_RESERVE_GIB:g}: "
            "the operators later needed 28 GiB (start-up graph capture with 8 sequences "
            "peaked at ~103 GiB)"
        )
    if i.max_num_seqs > concurrency:
        warnings.append(
            f"max_num_seqs {i.max_num_seqs} > {concurrency:.2f} max-length requests that fit in "
            "the expected KV room: long requests beyond that wait or are preempted"
        )
    if source == "override":
        warnings.append(f"gmu_override {gmu:.3f} used instead of the formula's {floor_gmu(min(wish, cap), total):.3f}")
    warnings += provenance_warnings(i)

    return Plan(
        inputs=i,
        mem_total_gib=total,
        checkpoint_gib=checkpoint,
        ple_gib=ple,
        mtp_off_credit_applied_gib=credit,
        weights_gib=w,
        overhead_gib=i.overhead_gib,
        mtp_gib=mtp,
        state_gib=state,
        fixed_gib=fixed,
        kv_mult=kv_mult,
        kv_need_gib=kv_need,
        kv_target_gib=i.kv_target_gib,
        wish_gib=wish,
        cap_gib=cap,
        squeezed=squeezed,
        gmu=gmu,
        gmu_source=source,
        budget_gib=budget,
        kv_exp_gib=kv_exp,
        max_len_concurrency=concurrency,
        docker_memory_bytes=docker_bytes,
        warnings=tuple(warnings),
    )


def provenance_warnings(i: BudgetInputs) -> list[str]:
    """Warnings about where inputs came from (``i.sources``): a default standing in for a
    figure of this model, or a figure given for something that is off."""
    src, out = i.sources, []
    if src.get("overhead_gib") == "default":
        out.append(
            f"overhead_gib {i.overhead_gib:g} GiB is a default (the launch notes' model), not a figure for this "
            "model: take CUDA graphs + activations from a start-up log and set budget.overhead_gib"
        )
    if i.mtp_enabled and src.get("mtp_gib") == "default":
        out.append(
            f"mtp_gib {i.mtp_gib:g} GiB is a default (the launch notes' model, 3 speculative tokens), not a "
            "figure for this model: set budget.mtp_gib"
        )
    if not i.mtp_enabled and src.get("mtp_gib") in ("flag", "config file"):
        out.append(
            f"mtp_gib {i.mtp_gib:g} GiB was given ({src['mtp_gib']}) but MTP is off (no --mtp, budget.mtp "
            "false): it is not counted"
        )
    if i.model_max_len is not None and i.max_model_len > i.model_max_len:
        out.append(
            f"max_model_len {i.max_model_len} ({src.get('max_model_len', 'default')}) exceeds the checkpoint's "
            f"max_position_embeddings {i.model_max_len}: vLLM refuses that unless rope scaling extends the "
            "context; set --max-model-len"
        )
    elif src.get("max_model_len") == "default":
        out.append(
            f"max_model_len {i.max_model_len} is a default (the launch notes' model), not this model's context: "
            "set --max-model-len (budget.max_model_len)"
        )
    mult = i.kv_mult_table.get(i.kv_cache_dtype)
    if i.kv_cache_dtype in FP8_KV_DTYPES and src.get("kv_mult") == "default" and mult != NOTES_FP8_KV_MULT:
        out.append(
            f"fp8 KV multiplier {mult:g} is an assumption (the whole KV cache in fp8) for a per-token figure "
            "given by hand: if part of this model's cache stays 16-bit, set --kv-fp8-mult (budget.kv_fp8_mult)"
        )
    return out


def _longest_fitting(i: BudgetInputs, room_bytes: float) -> int:
    """The largest max_model_len whose 16-bit KV fits ``room_bytes`` (0 if none; binary search)."""
    lo, hi = 0, i.max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if i.kv_bytes_for(mid) <= room_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _flag_groups(tokens: list[str]) -> list[list[str]]:
    """``["--a", "1", "--b"]`` → ``[["--a", "1"], ["--b"]]`` (a flag with its values)."""
    groups: list[list[str]] = []
    for t in tokens:
        if t.startswith("-") or not groups:
            groups.append([t])
        else:
            groups[-1].append(t)
    return groups


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _need(ok: bool, inputs: BudgetInputs, name: str, allowed: str) -> None:
    if not ok:
        raise InvalidInput(name, getattr(inputs, name), allowed)
