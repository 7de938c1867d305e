"""GPT-OSS models and attention variants for tests, examples, benchmarks and CPU runs (nothing is downloaded).

- `tiny_gptoss_config()` / `gptoss_20b_config()`: configurations with every GPT-OSS feature (sinks, alternating
  sliding/full layers, GQA, clamped-SwiGLU experts), tiny enough for a CPU or shaped like gpt-oss-20b.
- `build_random_gptoss()`: a model with random weights made directly on the target device in its dtype (a
  20B-shaped bf16 model is ready in seconds on a GPU), with sink logits drawn from a chosen spread.
- `register_sink_dropping_attention()`: `"eager_without_sinks"`, GPT-OSS eager attention with the sink column
  removed: what a training stack that silently drops the sinks computes, to reproduce the rollout/training mismatch.
- `setup_project_attention()` / `set_project_attention()`: the project's sink kernel as an attention implementation:
  the id users select, or its `flash_attn_func` registered directly through transformers' `AttentionInterface`
  (`"sink_kernel_direct"`, which keeps fp32 activations in fp32).
- `environment()`: versions, device and source commit, for the header of a benchmark report.
"""

from __future__ import annotations

import math
import os
import platform

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


SINK_DROPPING_ATTENTION = "eager_without_sinks"
DIRECT_KERNEL_ATTENTION = "sink_kernel_direct"
# No "flash" in the name: transformers replaces a requested attention name that contains "flash" and is not in the
# model's `_compatible_flash_implementations` (`PreTrainedModel._check_and_adjust_attn_implementation`).


# ----------------------------------------------------------------------------------------------------------- attention


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention_without_sinks(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS eager attention minus the sink column: `softmax(q k^T * scale + mask) v`, sinks ignored.

    Same math, dtype handling and mask as transformers' GPT-OSS `eager_attention_forward`, except that the softmax
    normaliser lacks `exp(sink_h)`; the sink parameter is deliberately never read.
    """
    n_rep = query.shape[1] // key.shape[1]
    key_states = _repeat_kv(key, n_rep)
    value_states = _repeat_kv(value, n_rep)
    scores = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key_states.shape[-2]]
    scores = scores - scores.amax(dim=-1, keepdim=True).detach()  # as eager does (stability, same result)
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value_states).transpose(1, 2).contiguous()
    return out, probs


def register_sink_dropping_attention() -> str:
    """Register `"eager_without_sinks"` (attention + its eager 4D mask) with transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(SINK_DROPPING_ATTENTION, eager_attention_without_sinks)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SINK_DROPPING_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return SINK_DROPPING_ATTENTION


def direct_sink_kernel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The project's kernel (`flash_attn_func`) called as transformers' flash path calls it, dtype unchanged.

    Inputs `[B, H, S, D]` (transformers' layout). Supports unpadded batches and right-padded ones (2D mask whose
    ones form a prefix of each row: each row runs on its valid prefix; padded positions output 0). Left padding
    and KV-cache decoding are refused (use the id `"hf-gptoss-rl/sink-flash-attn3"` for those).
    """
    from .attention import import_kernel_sources

    kernel = import_kernel_sources()
    if dropout:
        raise ValueError("sink_kernel_direct: dropout is not supported")
    if query.shape[2] != key.shape[2]:
        raise ValueError("sink_kernel_direct: only full-sequence forwards (no KV-cache decoding)")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> [B, S, H, D]
    window = (sliding_window - 1, sliding_window - 1) if sliding_window is not None else (-1, -1)
    sinks = s_aux.to(q.dtype) if s_aux is not None else None

    def run(qq, kk, vv):
        return kernel.flash_attn_func(qq, kk, vv, softmax_scale=scaling, causal=True, window_size=window, s_aux=sinks)

    if attention_mask is None:
        return run(q, k, v), None
    if attention_mask.dim() != 2:
        raise ValueError(f"sink_kernel_direct expects a 2D padding mask or None, got {tuple(attention_mask.shape)}")
    valid = attention_mask.bool()
    lengths = valid.sum(-1)
    prefix = torch.arange(valid.shape[1], device=valid.device)[None] < lengths[:, None]
    if not torch.equal(prefix, valid):
        raise ValueError("sink_kernel_direct supports right padding only (each row's ones must be a prefix)")
    out = torch.zeros_like(q)
    for b, n in enumerate(lengths.tolist()):
        if n > 0:
            out[b, :n] = run(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n])[0]
    return out, None


def setup_project_attention(prefer: str = "auto") -> tuple[str, str]:
    """The attn_implementation name that runs the project's kernel here, and how it was obtained.

    prefer: `"hub"` or `"auto"`: the id users select, `"hf-gptoss-rl/sink-flash-attn3"` (transformers' flash-attention
    wrapper around the kernel, which casts fp32 activations to bf16); `"direct"`: the kernel's `flash_attn_func`
    registered through `AttentionInterface` as `"sink_kernel_direct"` (keeps fp32; right padding only).
    """
    from . import attention as project_attention

    if prefer not in ("auto", "hub", "direct"):
        raise ValueError(f"prefer must be auto | hub | direct, got {prefer!r}")
    if prefer != "direct":
        from . import register

        register()
        return project_attention.ATTN_IMPLEMENTATION, "attn_implementation id (transformers' flash-attention wrapper)"
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    project_attention.import_kernel_sources()  # fail here, not inside the first forward
    AttentionInterface.register(DIRECT_KERNEL_ATTENTION, direct_sink_kernel_attention)
    # flash-style mask: None when nothing is padded, else the 2D padding mask
    ALL_MASK_ATTENTION_FUNCTIONS.register(DIRECT_KERNEL_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return DIRECT_KERNEL_ATTENTION, "kernel sources registered via AttentionInterface"


def set_project_attention(model, prefer: str = "auto") -> tuple[str, str]:
    """Switch `model` to the project's kernel; under `"auto"`, fall back to the direct registration if the hub path
    fails to load (e.g. a `kernels` version whose loader rejects the local build). Returns (name, how)."""
    name, how = setup_project_attention(prefer)
    try:
        model.set_attn_implementation(name)
    except Exception as e:
        if prefer != "auto" or name == DIRECT_KERNEL_ATTENTION:
            raise
        name, how = setup_project_attention("direct")
        how += f" (hub path failed: {type(e).__name__}: {str(e).splitlines()[0][:120]})"
        model.set_attn_implementation(name)
    return name, how


def flash_attention_4_available() -> bool:
    """Whether transformers can run `attn_implementation="flash_attention_4"` (flash-attn CuTe, Hopper+)."""
    if not torch.cuda.is_available():
        return False
    try:
        from transformers.utils import is_flash_attn_4_available
    except ImportError:
        return False
    try:
        return bool(is_flash_attn_4_available())
    except Exception:
        return False


# ----------------------------------------------------------------------------------------------------------- models


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


def git_commit() -> str | None:
    """The short commit of the source checkout this package runs from (None for an installed wheel or without git)."""
    import subprocess
    from pathlib import Path

    checkout = Path(__file__).resolve().parents[1]
    if not (checkout / ".git").exists():
        return None
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() or None


def environment() -> dict:
    """Versions, device and source commit, for the report header."""
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    for name in ("triton", "peft", "kernels"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    info["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    info["commit"] = git_commit()
    return info


def fmt(value, spec: str = ".3g") -> str:
    """A table cell: numbers formatted, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return format(value, spec)
