"""KV cache size per token from a checkpoint's Hugging Face ``config.json`` (pure).

``kv_layout(config)`` turns the parsed ``config.json`` (a dict; reading it is
``sparkd.sense.checkpoint.read_model_config``) into a ``KvLayout``: the 16-bit
bytes one token adds to the KV cache, split by how long the layers keep it,
plus the fixed state one sequence holds in linear-attention layers.

Families and formulas (``E`` = 2 bytes per element: the 16-bit cache, i.e. the
model's BF16/FP16 dtype; vLLM's ``--dtype auto`` serves float32 checkpoints in
16 bit as well):

* **MHA/GQA** (Llama, Mistral, Qwen, …): per layer ``2 × num_key_value_heads ×
  head_dim × E`` (K and V). ``head_dim`` is the config's ``head_dim`` or
  ``hidden_size / num_attention_heads``; without ``num_key_value_heads`` the
  model is plain multi-head (``num_attention_heads`` KV heads, the Hugging
  Face default). Llama-3.1-8B: 2 × 32 × 8 × 128 × 2 = 131,072 B.
* **MLA** (DeepSeek-V2/V3, configs with ``kv_lora_rank``): per layer one latent
  of ``kv_lora_rank + qk_rope_head_dim`` elements (the compressed KV and the
  decoupled RoPE key; no separate V) — DeepSeek-V2 paper §2.1; vLLM's MLA
  cache spec (one KV head of that size). DeepSeek-V3: 61 × 576 × 2 = 70,272 B.
* **Sliding-window layers** (``layer_types`` entries ``sliding_attention``;
  ``sliding_window_pattern`` as in Gemma 3 / Cohere2, where every pattern-th
  layer is global; Gemma 2's alternation; a ``sliding_window`` with no per-layer
  marking applies to every layer, unless ``use_sliding_window`` is false as in
  Qwen2/Qwen3): the same per-layer bytes, but a request holds at most
  ``sliding_window`` tokens of them — ``KvLayout.kv_bytes_for(tokens)``.
* **Hybrid linear attention** (Qwen3-Next: ``layer_types`` entries
  ``linear_attention`` or ``full_attention_interval`` — layer i is full
  attention when (i+1) is a multiple of it): only full-attention layers add
  per-token KV. A Gated DeltaNet layer holds, per sequence, a convolution state
  of ``(linear_conv_kernel_dim − 1) × (2 × linear_num_key_heads ×
  linear_key_head_dim + linear_num_value_heads × linear_value_head_dim)``
  elements and a recurrent state of ``linear_num_value_heads ×
  linear_key_head_dim × linear_value_head_dim`` elements, at ``E`` bytes (vLLM's
  ``MambaStateShapeCalculator.gated_delta_net_state_shape``; the state dtype is
  ``mamba_ssm_cache_dtype``, the model's 16-bit dtype by default, and does not
  follow ``--kv-cache-dtype``). That state goes into the fixed part of the
  budget, once per sequence (× ``max_num_seqs``).
* A multimodal config's ``text_config`` is used when present (the language model
  holds the KV cache).

Anything else — Mamba/SSM layers (``hybrid_override_pattern``,
``layers_block_type``, ``attn_layer_period``, ``mamba_*``), unknown
``layer_types`` entries, missing sizes — raises ``UnknownKvLayout`` naming what
was found; the caller asks for ``--kv-bytes-per-token``. There is no default.

The fp8 multiplier (``KvLayout.fp8_mult``) is 0.5 for every layout derived
here: all per-token bytes are attention K/V (or MLA latents), which an fp8 KV
cache stores in 1 byte instead of 2; the linear-attention state is not per
token and is not scaled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparkd.errors import Refused

#: Bytes per element of a 16-bit (BF16/FP16) KV cache.
KV_ELEMENT_BYTES = 2
#: An fp8 KV cache stores every element in 1 byte instead of 2.
FP8_WHOLE_KV_MULT = 0.5
FP8_WHOLE_KV_REASON = "every per-token KV byte is attention K/V stored in fp8 (1 byte instead of 2)"

_FULL = frozenset({"full_attention", "attention", "global_attention", "global"})
_SLIDING = frozenset({"sliding_attention", "sliding_window", "local_attention", "local"})
_LINEAR = frozenset({"linear_attention"})
#: Keys that mean layers with an SSM state this module does not size.
_SSM_KEYS = ("hybrid_override_pattern", "layers_block_type", "attn_layer_period", "attn_layer_offset", "ssm_cfg")
#: Keys that carry the KV head count under another name (Falcon, ChatGLM, …): not read here.
_OTHER_KV_HEAD_KEYS = ("num_kv_heads", "n_head_kv", "multi_query", "multi_query_group_num", "num_key_value_groups")
_GDN_KEYS = (
    "linear_conv_kernel_dim",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_num_value_heads",
    "linear_value_head_dim",
)


class UnknownKvLayout(Refused):
    """``config.json`` does not describe a KV layout this module can size; ``detail`` has what was found."""


@dataclass(frozen=True)
class KvLayout:
    """The KV cache of one model, 16-bit sizes in bytes.

    ``bytes_per_token``: bytes each token adds in the layers that keep every
    token. ``window_groups``: ``(window_tokens, bytes_per_token)`` for sliding-
    window layers (a request holds at most ``window_tokens`` of them).
    ``state_bytes_per_seq``: the fixed linear-attention state of one sequence.
    ``family`` and ``formula`` say how the figures were reached (for the plan).
    ``max_position_embeddings``: the model's context length from the config, if given.
    """

    family: str
    bytes_per_token: int
    formula: str
    window_groups: tuple[tuple[int, int], ...] = ()
    state_bytes_per_seq: int = 0
    state_formula: str = ""
    fp8_mult: float = FP8_WHOLE_KV_MULT
    fp8_reason: str = FP8_WHOLE_KV_REASON
    max_position_embeddings: int | None = None

    def kv_bytes_for(self, tokens: int) -> int:
        """16-bit KV bytes of one request of ``tokens`` tokens (windows bound their layers)."""
        return tokens * self.bytes_per_token + sum(min(tokens, w) * b for w, b in self.window_groups)


def kv_layout(config: Mapping[str, Any]) -> KvLayout:
    """The ``KvLayout`` of a Hugging Face ``config.json`` (see the module docstring for the formulas).

    Raises:
        UnknownKvLayout: the config is not one of the families above, or a size
            it needs is missing or not a positive integer; the message names the
            model type, the architectures and the keys found.
    """
    text = config.get("text_config")
    cfg: Mapping[str, Any] = text if isinstance(text, Mapping) and text else config
    where = "text_config" if cfg is not config else "config.json"

    def unknown(why: str) -> UnknownKvLayout:
        return _unknown(config, cfg, where, why)

    ssm = [k for k in _SSM_KEYS if k in cfg] + sorted(k for k in cfg if k.startswith("mamba"))
    if ssm:
        raise unknown(f"layers with an SSM/Mamba state ({', '.join(ssm)}) are not sized by sparkd")
    layers = _pos_int(cfg, "num_hidden_layers", unknown)
    mpe = cfg.get("max_position_embeddings")
    max_pos = mpe if isinstance(mpe, int) and not isinstance(mpe, bool) and mpe >= 1 else None

    if cfg.get("kv_lora_rank") is not None:
        rank = _pos_int(cfg, "kv_lora_rank", unknown)
        rope = _pos_int(cfg, "qk_rope_head_dim", unknown)
        per_token = layers * (rank + rope) * KV_ELEMENT_BYTES
        return KvLayout(
            family="MLA (multi-head latent attention)",
            bytes_per_token=per_token,
            formula=f"num_hidden_layers {layers} × (kv_lora_rank {rank} + qk_rope_head_dim {rope}) × 2 B",
            max_position_embeddings=max_pos,
        )

    kinds = _layer_kinds(cfg, layers, unknown)
    heads = _pos_int(cfg, "num_attention_heads", unknown)
    if cfg.get("num_key_value_heads") is None:
        other = [k for k in _OTHER_KV_HEAD_KEYS if k in cfg]
        if other:
            raise unknown(f"KV heads given as {', '.join(other)}, not num_key_value_heads")
        kv_heads, kv_src = heads, f"num_attention_heads {heads} (no num_key_value_heads: MHA)"
    else:
        kv_heads = _pos_int(cfg, "num_key_value_heads", unknown)
        kv_src = f"num_key_value_heads {kv_heads}"
    if cfg.get("head_dim") is not None:
        head_dim = _pos_int(cfg, "head_dim", unknown)
        hd_src = f"head_dim {head_dim}"
    else:
        hidden = _pos_int(cfg, "hidden_size", unknown)
        if hidden % heads:
            raise unknown(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
        hd_src = f"head_dim {head_dim} (hidden_size {hidden} / num_attention_heads {heads})"
    per_layer = 2 * kv_heads * head_dim * KV_ELEMENT_BYTES
    n_full = kinds.count("full")
    n_sliding = kinds.count("sliding")
    n_linear = kinds.count("linear")
    n_src = f"num_hidden_layers {layers}" if n_full == layers else f"{n_full} full-attention layers"
    window_groups: tuple[tuple[int, int], ...] = ()
    parts = [f"2 × {n_src} × {kv_src} × {hd_src} × 2 B"]
    if n_sliding:
        window = _pos_int(cfg, "sliding_window", unknown)
        window_groups = ((window, n_sliding * per_layer),)
        parts.append(f"sliding-window layers: 2 × {n_sliding} × {kv_heads} × {head_dim} × 2 B, at most {window} tokens")
    state, state_formula = 0, ""
    if n_linear:
        conv_k, k_heads, k_dim, v_heads, v_dim = (_pos_int(cfg, k, unknown) for k in _GDN_KEYS)
        conv = (conv_k - 1) * (2 * k_heads * k_dim + v_heads * v_dim)
        recurrent = v_heads * k_dim * v_dim
        state = n_linear * (conv + recurrent) * KV_ELEMENT_BYTES
        state_formula = (
            f"{n_linear} linear-attention layers × ((conv kernel {conv_k} − 1) × (2 × {k_heads} × {k_dim} + "
            f"{v_heads} × {v_dim}) + {v_heads} × {k_dim} × {v_dim}) × 2 B per sequence"
        )
    family = "MHA" if kv_heads == heads else "GQA"
    if n_linear:
        family = f"hybrid: {family} + linear attention (Gated DeltaNet)"
    elif n_sliding:
        family = f"{family} with sliding-window layers"
    return KvLayout(
        family=family,
        bytes_per_token=n_full * per_layer,
        formula="; ".join(parts),
        window_groups=window_groups,
        state_bytes_per_seq=state,
        state_formula=state_formula,
        max_position_embeddings=max_pos,
    )


def _layer_kinds(cfg: Mapping[str, Any], layers: int, unknown: Any) -> list[str]:
    """``"full" | "sliding" | "linear"`` per layer, from the per-layer markings of the config."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, Sequence) or isinstance(types, str) or len(types) != layers:
            raise unknown(f"layer_types is not a list of num_hidden_layers ({layers}) entries")
        kinds = []
        for t in types:
            if t in _FULL:
                kinds.append("full")
            elif t in _SLIDING:
                kinds.append("sliding")
            elif t in _LINEAR:
                kinds.append("linear")
            else:
                raise unknown(f"layer_types entry {t!r} is not full, sliding-window or linear attention")
        return kinds
    if cfg.get("full_attention_interval") is not None:
        every = _pos_int(cfg, "full_attention_interval", unknown)
        return ["full" if (i + 1) % every == 0 else "linear" for i in range(layers)]
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return ["full"] * layers
    if cfg.get("sliding_window_pattern") is not None:  # Gemma 3, Cohere2: every pattern-th layer is global
        every = _pos_int(cfg, "sliding_window_pattern", unknown)
        return ["sliding" if (i + 1) % every else "full" for i in range(layers)]
    if cfg.get("model_type") == "gemma2":  # Gemma 2: even layers slide (transformers' Gemma2DecoderLayer)
        return ["sliding" if i % 2 == 0 else "full" for i in range(layers)]
    if cfg.get("max_window_layers") is not None:  # Qwen2 with use_sliding_window: layers from there on slide
        first = cfg["max_window_layers"]
        if not (isinstance(first, int) and not isinstance(first, bool) and first >= 0):
            raise unknown(f"max_window_layers {first!r} is not an integer ≥ 0")
        return ["sliding" if i >= first else "full" for i in range(layers)]
    return ["sliding"] * layers  # Mistral-7B-v0.1, Phi-3, Starcoder2: every layer


def _pos_int(cfg: Mapping[str, Any], key: str, unknown: Any) -> int:
    v = cfg.get(key)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise unknown(f"{key} is {'missing' if v is None else repr(v)} (needed: an integer ≥ 1)")
    return v


def _unknown(config: Mapping[str, Any], cfg: Mapping[str, Any], where: str, why: str) -> UnknownKvLayout:
    interesting = sorted(
        k
        for k in cfg
        if any(s in k for s in ("layer", "head", "hidden", "kv", "window", "attention", "mamba", "ssm", "lora"))
    )
    found = {
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "keys": interesting,
        "read_from": where,
    }
    msg = (
        f"cannot size the KV cache from the checkpoint's config.json: {why}. Found model_type "
        f"{found['model_type']!r}, architectures {found['architectures']!r}, keys ({where}) "
        f"{', '.join(interesting) or 'none'}. Give the 16-bit KV bytes per token with --kv-bytes-per-token "
        "(budget.kv_bytes_per_token); sparkd does not guess."
    )
    return UnknownKvLayout(msg, detail=found)
