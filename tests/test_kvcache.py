"""KV bytes per token from a checkpoint's config.json, one config per family (issue 19).

Each expected figure is computed by hand in the comment beside it (E = 2 bytes per
element of a 16-bit cache). The configs carry the keys of the public config.json of the
named model (abridged to what matters plus a few decoys).
"""

from __future__ import annotations

from typing import Any

import pytest

from sparkd.core.kvcache import FP8_WHOLE_KV_MULT, KvLayout, UnknownKvLayout, kv_layout

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
LLAMA_2_7B = {  # plain MHA: no num_key_value_heads
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
LLAMA_31_70B = {**LLAMA_31_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64}
QWEN25_7B = {  # sliding_window present but switched off
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
}
DEEPSEEK_V3 = {  # MLA; num_key_value_heads is there but the cache holds one latent per layer
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
}
QWEN3_NEXT_80B = {  # hybrid: Gated DeltaNet layers, every 4th layer full attention
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
}
GEMMA3_27B = {  # multimodal: the language model is in text_config; every 6th layer global
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
    "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 27, "num_attention_heads": 16},
}
GPT_OSS_20B = {  # layer_types: alternating sliding (128 tokens) and full attention
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}
MISTRAL_7B_V01 = {  # one window for every layer
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
}
GEMMA2_9B = {  # even layers slide
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 3584,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "sliding_window": 4096,
}


@pytest.mark.parametrize(
    ("config", "per_token", "windows", "family"),
    [
        # 2 × 32 layers × 8 KV heads × 128 (4096 / 32) × 2 B = 131,072 B
        (LLAMA_31_8B, 131_072, (), "GQA"),
        # 2 × 32 × 32 KV heads (= attention heads) × 128 × 2 B = 524,288 B
        (LLAMA_2_7B, 524_288, (), "MHA"),
        # 2 × 80 × 8 × 128 (8192 / 64) × 2 B = 327,680 B
        (LLAMA_31_70B, 327_680, (), "GQA"),
        # 2 × 28 × 4 × 128 (3584 / 28) × 2 B = 57,344 B; the window is off
        (QWEN25_7B, 57_344, (), "GQA"),
        # 61 layers × (512 + 64) × 2 B = 70,272 B
        (DEEPSEEK_V3, 70_272, (), "MLA"),
        # 12 full-attention layers (48 / 4): 2 × 12 × 2 × 256 × 2 B = 24,576 B
        (QWEN3_NEXT_80B, 24_576, (), "hybrid"),
        # 10 global layers (6, 12, …, 60): 2 × 10 × 16 × 128 × 2 = 81,920 B;
        # 52 sliding: 2 × 52 × 16 × 128 × 2 = 425,984 B within 1,024 tokens
        (GEMMA3_27B, 81_920, ((1024, 425_984),), "sliding"),
        # 12 full: 2 × 12 × 8 × 64 × 2 = 24,576 B; 12 sliding: the same within 128 tokens
        (GPT_OSS_20B, 24_576, ((128, 24_576),), "sliding"),
        # no full layer; 32 sliding: 2 × 32 × 8 × 128 × 2 = 131,072 B within 4,096 tokens
        (MISTRAL_7B_V01, 0, ((4096, 131_072),), "sliding"),
        # 21 full (odd), 21 sliding (even): 2 × 21 × 8 × 256 × 2 = 172,032 B each
        (GEMMA2_9B, 172_032, ((4096, 172_032),), "sliding"),
    ],
)
def test_it_derives_bytes_per_token_per_family(
    config: dict[str, Any], per_token: int, windows: tuple[tuple[int, int], ...], family: str
) -> None:
    layout = kv_layout(config)
    # the per-token figure of the layers that keep every token, by hand above
    assert layout.bytes_per_token == per_token
    # sliding-window layers: (window, bytes per token) as computed above
    assert layout.window_groups == windows
    # the family is named in the plan
    assert family in layout.family
    # the whole KV of these families is fp8 under --kv-cache-dtype fp8
    assert layout.fp8_mult == FP8_WHOLE_KV_MULT == 0.5


def test_it_bounds_sliding_window_layers_by_the_window() -> None:
    layout = kv_layout(GEMMA3_27B)
    # 131,072 tokens: 131,072 × 81,920 + 1,024 × 425,984 = 10,737,418,240 + 436,207,616
    assert layout.kv_bytes_for(131_072) == 11_173_625_856
    # below the window every layer holds every token: 500 × (81,920 + 425,984)
    assert layout.kv_bytes_for(500) == 253_952_000


def test_it_puts_the_linear_attention_state_per_sequence_not_per_token() -> None:
    layout = kv_layout(QWEN3_NEXT_80B)
    # per Gated DeltaNet layer: conv (4 − 1) × (2 × 16 × 128 + 32 × 128) = 24,576 elements,
    # recurrent 32 × 128 × 128 = 524,288 elements; (24,576 + 524,288) × 2 B = 1,097,728 B;
    # 36 linear layers (48 − 12) → 39,518,208 B per sequence
    assert layout.state_bytes_per_seq == 39_518_208
    assert "36 linear-attention layers" in layout.state_formula
    # the state does not grow with the request
    assert layout.kv_bytes_for(1000) == 1000 * 24_576


def test_it_reads_layer_types_of_a_linear_hybrid_like_the_interval() -> None:
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12
    explicit = kv_layout(
        {k: v for k, v in QWEN3_NEXT_80B.items() if k != "full_attention_interval"} | {"layer_types": types}
    )
    assert (explicit.bytes_per_token, explicit.state_bytes_per_seq) == (24_576, 39_518_208)


def test_it_prefers_text_config_over_the_top_level() -> None:
    # a decoy top-level layer count (a vision tower's) must not be read
    cfg = {**GEMMA3_27B, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16}
    assert kv_layout(cfg).bytes_per_token == 81_920


def test_the_formula_names_its_inputs() -> None:
    layout: KvLayout = kv_layout(LLAMA_31_8B)
    assert "num_hidden_layers 32" in layout.formula and "num_key_value_heads 8" in layout.formula
    assert "head_dim 128 (hidden_size 4096 / num_attention_heads 32)" in layout.formula


@pytest.mark.parametrize(
    ("config", "says"),
    [
        # GPT-2 spells its sizes n_layer / n_head / n_embd
        (
            {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_head": 12, "n_embd": 768},
            "num_hidden_layers is missing",
        ),
        # Jamba: Mamba layers with an SSM state sparkd does not size
        (
            {**LLAMA_31_8B, "model_type": "jamba", "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16},
            "SSM/Mamba state (attn_layer_period, attn_layer_offset, mamba_d_state)",
        ),
        # Falcon-40B counts KV heads as num_kv_heads: reading it as MHA would be wrong
        ({**LLAMA_2_7B, "model_type": "falcon", "num_kv_heads": 8}, "KV heads given as num_kv_heads"),
        # a layer kind that is neither attention nor linear attention
        ({**LLAMA_31_8B, "layer_types": ["full_attention", "mamba"] * 16}, "layer_types entry 'mamba'"),
        # a hybrid whose linear-attention sizes are missing
        ({**QWEN3_NEXT_80B, "linear_value_head_dim": None}, "linear_value_head_dim is missing"),
        ({**LLAMA_31_8B, "num_key_value_heads": 0}, "num_key_value_heads is 0"),
        ({**LLAMA_31_8B, "hidden_size": 4097}, "not a multiple of num_attention_heads"),
    ],
)
def test_it_refuses_what_it_does_not_recognise_and_asks_for_the_flag(config: dict[str, Any], says: str) -> None:
    with pytest.raises(UnknownKvLayout) as e:
        kv_layout(config)
    # why, what was found, and the way out
    assert says in e.value.message
    assert repr(config.get("model_type")) in e.value.message
    assert "--kv-bytes-per-token" in e.value.message
    assert e.value.detail["model_type"] == config.get("model_type")
