"""GPT-OSS configurations and random-weight models, built without downloading anything.

- `tiny_gptoss_config()` / `gptoss_20b_config()`: configurations with every GPT-OSS feature (sinks, alternating
  sliding/full layers, GQA, clamped-SwiGLU experts), tiny enough for a CPU or shaped like gpt-oss-20b;
  `gptoss_config("tiny" | "20b")` picks one by name, as the benchmarks' `--model` does.
- `build_random_gptoss()`: a model with random weights made directly on the target device in its dtype (a
  20B-shaped bf16 model is ready in seconds on a GPU), with sink logits drawn from a chosen spread.

Tests, examples, benchmarks and the CPU recipes (`trl_ext.recipes`) build their models from these.
"""

from __future__ import annotations

import math

import torch
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


def gptoss_config(model: str, num_hidden_layers: int | None = None) -> GptOssConfig:
    """The configuration named `model`: "tiny" (`tiny_gptoss_config`, 2 layers by default) or "20b"
    (`gptoss_20b_config`, 24 layers by default)."""
    if model == "tiny":
        return tiny_gptoss_config(num_hidden_layers=num_hidden_layers or 2)
    if model == "20b":
        return gptoss_20b_config(num_hidden_layers or 24)
    raise ValueError(f"unknown model {model!r} (tiny | 20b)")


def build_random_gptoss(
    config,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    sink_mean: float = 1.0,
    sink_std: float = 1.5,
    logit_std: float = 3.0,
):
    """A `GptOssForCausalLM` with random weights, created directly on `device` in `dtype`.

    Init (all normal, on device, seeded): embeddings N(0, 1); q/k/v and expert up-projections std `fan_in^-0.5`
    (unit-variance pre-activations, some gates reach GPT-OSS's clamp); o_proj and expert down-projections the same
    divided by `sqrt(2 * layers)` (a residual stream that stays O(1) over depth); router std `1.5 * H^-0.5` with
    bias N(0, 0.5) (uneven expert load, as trained routers have); other biases N(0, 0.02); norms 1; sinks
    N(sink_mean, sink_std) per head; LM head std `logit_std * H^-0.5`, so the logits have std ~`logit_std` and
    next-token distributions are peaked (the top token often holds 5-30% of the mass) instead of near-uniform over
    201k ids, which would make every |Δp| vanish.
    """
    from transformers import GptOssForCausalLM

    device = torch.device(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = GptOssForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = config.hidden_size
    residual_scale = 1.0 / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(sink_mean, sink_std, generator=generator)
            elif "norm" in name:
                param.fill_(1.0)
            elif name.endswith("router.bias"):
                param.normal_(0.0, 0.5, generator=generator)
            elif name.endswith("router.weight"):
                param.normal_(0.0, 1.5 * hidden**-0.5, generator=generator)
            elif "bias" in name:
                param.normal_(0.0, 0.02, generator=generator)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=generator)
            elif name.endswith("lm_head.weight"):
                param.normal_(0.0, logit_std * hidden**-0.5, generator=generator)
            elif name.endswith("experts.gate_up_proj"):  # [E, H, 2I]
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
            elif name.endswith("experts.down_proj"):  # [E, I, H]
                param.normal_(0.0, param.shape[1] ** -0.5 * residual_scale, generator=generator)
            elif name.endswith("o_proj.weight"):  # [out, in]
                param.normal_(0.0, param.shape[1] ** -0.5 * residual_scale, generator=generator)
            else:  # q/k/v projections and anything new: fan-in scaling
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
    model.config.use_cache = False
    return model
