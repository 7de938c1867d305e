"""Tiny GPT-OSS configurations for tests, examples and CPU runs (no weights are ever downloaded)."""

from __future__ import annotations

from transformers import GptOssConfig

# Released GPT-OSS special-token ids (o200k_harmony); the tokenizer helpers in `hf_gptoss_rl.harmony` own the
# full table, these two are what a model config needs.
GPTOSS_EOS_TOKEN_ID = 200002  # <|return|>
GPTOSS_PAD_TOKEN_ID = 199999  # <|endoftext|>
GPTOSS_VOCAB_SIZE = 201088
# The released models' YaRN RoPE (theta 150000, factor 32 over 4096 original positions).
GPTOSS_ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def alternating_layer_types(num_hidden_layers: int) -> list[str]:
    """GPT-OSS's layer pattern: sliding-window attention on even layers, full attention on odd ones."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_hidden_layers)]


def tiny_gptoss_config(
    *,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    num_local_experts: int = 4,
    num_experts_per_tok: int = 2,
    sliding_window: int = 8,
    vocab_size: int = GPTOSS_VOCAB_SIZE,
    max_position_embeddings: int = 4096,
    **overrides,
) -> GptOssConfig:
    """A GPT-OSS config small enough to train on a CPU, with every GPT-OSS feature kept.

    Layers alternate sliding/full attention like the released models (layer 0 is sliding), every head has a
    learnable sink, attention is GQA and the MoE keeps the clamped, interleaved gate. `intermediate_size`
    stays a multiple of 16 elements so `grouped_mm` accepts its strides on CPU. `vocab_size` defaults to the
    real o200k_harmony size so the offline GPT-OSS tokenizer can drive the model; pass a small value for
    kernel-level tests.
    """
    kwargs = dict(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        num_local_experts=num_local_experts,
        num_experts_per_tok=num_experts_per_tok,
        sliding_window=sliding_window,
        layer_types=alternating_layer_types(num_hidden_layers),
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=dict(GPTOSS_ROPE_PARAMETERS),
        eos_token_id=GPTOSS_EOS_TOKEN_ID if vocab_size > GPTOSS_EOS_TOKEN_ID else None,
        pad_token_id=GPTOSS_PAD_TOKEN_ID if vocab_size > GPTOSS_PAD_TOKEN_ID else None,
        tie_word_embeddings=False,
        attention_bias=True,
    )
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def gptoss_20b_config(num_hidden_layers: int = 24, **overrides) -> GptOssConfig:
    """The gpt-oss-20b architecture (for random-weight benchmarks on a GPU); fewer layers keep its layer pattern."""
    kwargs = dict(
        num_hidden_layers=num_hidden_layers,
        num_local_experts=32,
        num_experts_per_tok=4,
        hidden_size=2880,
        intermediate_size=2880,
        head_dim=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        sliding_window=128,
        layer_types=alternating_layer_types(num_hidden_layers),
        vocab_size=GPTOSS_VOCAB_SIZE,
        rope_parameters=dict(GPTOSS_ROPE_PARAMETERS),
        eos_token_id=GPTOSS_EOS_TOKEN_ID,
        pad_token_id=GPTOSS_PAD_TOKEN_ID,
        attention_bias=True,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)
