"""Selective activation checkpointing for GPT-OSS: keep the outputs of the expensive ops, recompute the rest.

Plain (non-reentrant) gradient checkpointing keeps only each decoder layer's input and re-runs the whole layer in
the backward, so every step pays one extra forward. For GPT-OSS most of that forward is two ops whose outputs are
cheap to keep compared with recomputing them:

- ``"attention"``: the sink kernel's forward op (``<sink_flash_attn3 namespace>::fwd``), whose outputs are the
  attention output ``[T, Hq, D]`` and the log-sum-exp ``[Hq, T]`` fp32 -- both already needed by its backward.
  Extra memory per layer ~ ``T * Hq * (2 D + 4)`` bytes (bf16): 0.26 GiB at 32k tokens for gpt-oss-20b, 6.2 GiB
  over 24 layers.
- ``"experts"``: the ``memory_efficient`` experts op (``hf_gptoss_rl::memory_efficient_experts``), whose outputs
  are the ``[T, H]`` result and the biased up-projection ``[T * top_k, 2I]`` its backward reads (unless
  ``experts_recompute_gate_up``). ~ ``T * (2 H + 4 top_k I)`` bytes per layer: 1.6 GiB at 32k for gpt-oss-20b
  (38 GiB over 24 layers). This grows with the tokens of a micro-batch, so ``experts_max_tokens`` bounds it:
  calls on more tokens recompute the experts as plain checkpointing does (``experts_max_tokens_for_memory`` picks
  the bound from the GPU's memory).

Everything else in the layer (norms, rotary, projections, router) is recomputed as before. This is
``torch.utils.checkpoint``'s own mechanism (``create_selective_checkpoint_contexts``), passed through transformers'
``gradient_checkpointing_kwargs``; the saved outputs are the very tensors the ops' backward uses, so gradients are
bitwise those of plain checkpointing. Ops of other attention / experts implementations are not matched (a no-op).

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=selective_checkpointing_kwargs(("attention",)))

``AgenticGRPOTrainer`` applies it from ``AgenticGRPOConfig.checkpoint_saves``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = [
    "SAVE_CHOICES",
    "experts_max_tokens_for_memory",
    "experts_max_tokens_for_model",
    "kept_experts_bytes_per_token",
    "parse_checkpoint_saves",
    "selective_checkpoint_context_fn",
    "selective_checkpoint_policy",
    "selective_checkpointing_kwargs",
]

#: What `save` may name, with the op each one keeps.
SAVE_CHOICES = {
    "attention": "the sink-flash-attn3 kernel's forward op (output + log-sum-exp)",
    "experts": "the memory_efficient experts op (output + biased up-projection)",
}

_EXPERTS_OP_NAME = "hf_gptoss_rl::memory_efficient_experts"


def _is_sink_attention_forward(func) -> bool:
    # The kernel registers its ops under a namespace unique to each loaded copy (e.g. `_sink_flash_attn3_0624b7c74e`
    # when `kernels` loads it from a build tree), always containing "sink_flash_attn3".
    namespace, _, name = func._schema.name.partition("::")
    return name == "fwd" and "sink_flash_attn3" in namespace


def parse_checkpoint_saves(save: Iterable[str] | str) -> list[str]:
    """`save` as a list of names from `SAVE_CHOICES` (an iterable, or one comma-separated string); bad names raise."""
    if isinstance(save, str):
        save = [part.strip() for part in save.split(",") if part.strip()]
    chosen = list(dict.fromkeys(save))
    unknown = sorted(set(chosen) - set(SAVE_CHOICES))
    if unknown:
        raise ValueError(f"unknown checkpoint save target(s) {unknown}; choose from {sorted(SAVE_CHOICES)}")
    return chosen


def kept_experts_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Bytes that ``"experts"`` keeps per token and per layer: the output ``[H]`` and the biased up-projection
    ``[top_k, 2I]`` (``dtype_bytes`` each element: the experts weights' dtype). 51,840 for gpt-oss-20b in bf16."""
    hidden, inter, top_k = config.hidden_size, config.intermediate_size, config.num_experts_per_tok
    return dtype_bytes * (hidden + top_k * 2 * inter)


def experts_max_tokens_for_memory(config, memory_bytes: int, dtype_bytes: int = 2, fraction: float = 0.5) -> int:
    """The most tokens per micro-batch for which every layer's kept experts outputs take at most ``fraction`` of
    ``memory_bytes`` (the GPU memory left after the weights).

    On a 140 GiB GPU holding gpt-oss-20b's bf16 weights (39 GiB), half of the remaining 101 GiB keeps the experts
    outputs of micro-batches up to ~43k tokens (1.24 MB per token over 24 layers): 32k-token micro-batches keep
    them (92 GiB peak in ``docs/benchmarks/full_step.md``), 64k-token ones recompute them (72 GiB peak instead of
    ~145 GiB).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    per_token = kept_experts_bytes_per_token(config, dtype_bytes) * config.num_hidden_layers
    return max(int(fraction * max(memory_bytes, 0)) // per_token, 0)


def _bytes_on(device: torch.device, modules) -> int:
    """Bytes of the parameters and buffers of ``modules`` held on ``device`` (a sharded DTensor: its local shard)."""
    seen, total = set(), 0
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            local = t.to_local() if hasattr(t, "to_local") else t
            if id(local) in seen or local.device != device:
                continue
            seen.add(id(local))
            total += local.numel() * local.element_size()
    return total


def experts_max_tokens_for_model(
    model: torch.nn.Module, device: torch.device, fraction: float = 0.5, resident: Iterable[torch.nn.Module] = ()
) -> int | None:
    """`experts_max_tokens_for_memory` for ``model`` training on ``device``: the GPU's total memory less what
    ``model`` and the ``resident`` modules (a reference model, an in-process rollout engine's copy) hold on it, in
    the experts weights' dtype. None (no bound) off CUDA."""
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    held = _bytes_on(device, (model, *resident))
    experts_dtype_bytes = next(
        (p.element_size() for name, p in model.named_parameters() if name.endswith("gate_up_proj")), 2
    )
    total = torch.cuda.get_device_properties(device).total_memory
    return experts_max_tokens_for_memory(model.config, total - held, experts_dtype_bytes, fraction)


def _check_max_tokens(experts_max_tokens: int | None) -> None:
    if experts_max_tokens is not None and (
        isinstance(experts_max_tokens, bool) or not isinstance(experts_max_tokens, int) or experts_max_tokens < 0
    ):
        raise ValueError(f"experts_max_tokens must be None (no bound) or an int >= 0, got {experts_max_tokens!r}")


def selective_checkpoint_policy(
    save: Iterable[str] = ("attention",), experts_max_tokens: int | None = None
) -> Callable:
    """The policy function for `create_selective_checkpoint_contexts`: MUST_SAVE the chosen ops' outputs.

    `save`: names from `SAVE_CHOICES` (an iterable, or one comma-separated string such as ``"attention,experts"``).
    `experts_max_tokens`: ``"experts"`` keeps the outputs of experts calls on at most this many tokens (the rows of
    their ``[T, H]`` input: a micro-batch's tokens); larger calls are recomputed. None: no bound. The choice depends
    on shapes only, so the forward and its recomputation agree.
    """
    chosen = frozenset(parse_checkpoint_saves(save))
    _check_max_tokens(experts_max_tokens)

    def policy(ctx, func, *args, **kwargs):
        if isinstance(func, torch._ops.OpOverload):
            if "attention" in chosen and _is_sink_attention_forward(func):
                return CheckpointPolicy.MUST_SAVE
            if (
                "experts" in chosen
                and func._schema.name == _EXPERTS_OP_NAME
                and (experts_max_tokens is None or args[0].shape[0] <= experts_max_tokens)
            ):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_checkpoint_context_fn(
    save: Iterable[str] = ("attention",), experts_max_tokens: int | None = None
) -> Callable:
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` keeping the chosen ops."""
    return functools.partial(
        create_selective_checkpoint_contexts, selective_checkpoint_policy(save, experts_max_tokens)
    )


def selective_checkpointing_kwargs(
    save: Iterable[str] = ("attention",), experts_max_tokens: int | None = None, **checkpoint_kwargs
) -> dict:
    """`gradient_checkpointing_kwargs` for `model.gradient_checkpointing_enable` (non-reentrant, with the context).

    `experts_max_tokens` as in `selective_checkpoint_policy`. Extra keyword arguments go to
    `torch.utils.checkpoint.checkpoint` as well; `use_reentrant=True` is refused (reentrant checkpointing has no
    selective mode).
    """
    if checkpoint_kwargs.get("use_reentrant"):
        raise ValueError("selective checkpointing needs use_reentrant=False")
    if "context_fn" in checkpoint_kwargs:
        raise ValueError("selective_checkpointing_kwargs builds context_fn itself; pass only one")
    context_fn = selective_checkpoint_context_fn(save, experts_max_tokens)
    return {**checkpoint_kwargs, "use_reentrant": False, "context_fn": context_fn}
