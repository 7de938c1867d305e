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
  (38 GiB over 24 layers).

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


def selective_checkpoint_policy(save: Iterable[str] = ("attention",)) -> Callable:
    """The policy function for `create_selective_checkpoint_contexts`: MUST_SAVE the chosen ops' outputs.

    `save`: names from `SAVE_CHOICES` (an iterable, or one comma-separated string such as ``"attention,experts"``).
    """
    chosen = frozenset(parse_checkpoint_saves(save))

    def policy(ctx, func, *args, **kwargs):
        if isinstance(func, torch._ops.OpOverload):
            if "attention" in chosen and _is_sink_attention_forward(func):
                return CheckpointPolicy.MUST_SAVE
            if "experts" in chosen and func._schema.name == _EXPERTS_OP_NAME:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_checkpoint_context_fn(save: Iterable[str] = ("attention",)) -> Callable:
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` keeping the chosen ops."""
    return functools.partial(create_selective_checkpoint_contexts, selective_checkpoint_policy(save))


def selective_checkpointing_kwargs(save: Iterable[str] = ("attention",), **checkpoint_kwargs) -> dict:
    """`gradient_checkpointing_kwargs` for `model.gradient_checkpointing_enable` (non-reentrant, with the context).

    Extra keyword arguments go to `torch.utils.checkpoint.checkpoint` as well; `use_reentrant=True` is refused
    (reentrant checkpointing has no selective mode).
    """
    if checkpoint_kwargs.get("use_reentrant"):
        raise ValueError("selective checkpointing needs use_reentrant=False")
    if "context_fn" in checkpoint_kwargs:
        raise ValueError("selective_checkpointing_kwargs builds context_fn itself; pass only one")
    return {**checkpoint_kwargs, "use_reentrant": False, "context_fn": selective_checkpoint_context_fn(save)}
