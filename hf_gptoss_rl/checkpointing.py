"""Selective activation checkpointing for GPT-OSS: keep the outputs of the expensive ops, recompute the rest.

Plain (non-reentrant) gradient checkpointing keeps only each decoder layer's input and re-runs the whole layer in
the backward, so every step pays one extra forward. For GPT-OSS most of that forward is a few ops whose outputs are
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
- ``"projections"``: the layer's compute-bound matrix products, i.e. the attention projections q/k/v/o and the
  router (``aten.addmm`` / ``aten.mm`` with an inner dimension of at least `PROJECTION_MIN_INNER_DIM`; LoRA's
  ``lora_A`` products qualify; its rank-r ``lora_B`` products are recomputed, which costs one memory pass, as
  reading a kept copy would). ``kept_projection_bytes_per_token``: 0.49 GiB per layer at 32k tokens for
  gpt-oss-20b (11.8 GiB over 24 layers) instead of ~1.7 TFLOP of recomputation per layer; ``projections_max_tokens``
  bounds it like the experts'.

Everything else in the layer (norms, rotary, residual adds, the router's top-k) is recomputed as before. This is
``torch.utils.checkpoint``'s own mechanism (``create_selective_checkpoint_contexts``), passed through transformers'
``gradient_checkpointing_kwargs``; the saved outputs are the very tensors the ops' backward uses, so gradients are
bitwise those of plain checkpointing. Ops of other attention / experts implementations are not matched (a no-op);
``"projections"`` matches whatever runs the projections as ``addmm`` / ``mm``.

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=selective_checkpointing_kwargs(("attention",)))

``AgenticGRPOTrainer`` applies it from ``AgenticGRPOConfig.checkpoint_saves``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = [
    "PROJECTION_MIN_INNER_DIM",
    "SAVE_CHOICES",
    "experts_max_tokens_for_memory",
    "experts_max_tokens_for_model",
    "kept_experts_bytes_per_token",
    "kept_projection_bytes_per_token",
    "parse_checkpoint_saves",
    "projections_max_tokens_for_memory",
    "projections_max_tokens_for_model",
    "selective_checkpoint_context_fn",
    "selective_checkpoint_policy",
    "selective_checkpointing_kwargs",
]

#: What `save` may name, with the op each one keeps.
SAVE_CHOICES = {
    "attention": "the sink-flash-attn3 kernel's forward op (output + log-sum-exp)",
    "experts": "the memory_efficient experts op (output + biased up-projection)",
    "projections": "the attention projections' and the router's matrix products (inner dimension >= 256)",
}

#: Products (`aten.addmm` / `aten.mm`) with at least this inner dimension are kept by ``"projections"``. On current
#: GPUs a bf16 product is compute-bound from an inner dimension of a few hundred (H200: ~790 TFLOP/s over 4.8 TB/s
#: is ~165 FLOP per byte); below that, recomputing it costs about what reading a kept copy does.
PROJECTION_MIN_INNER_DIM = 256

_EXPERTS_OP_NAME = "hf_gptoss_rl::memory_efficient_experts"


def _is_sink_attention_forward(func) -> bool:
    # The kernel registers its ops under a namespace unique to each loaded copy (e.g. `_sink_flash_attn3_0624b7c74e`
    # when `kernels` loads it from a build tree), always containing "sink_flash_attn3".
    namespace, _, name = func._schema.name.partition("::")
    return name == "fwd" and "sink_flash_attn3" in namespace


def _is_compute_bound_product(func, args, max_rows: int | None) -> bool:
    name = func._schema.name
    if name == "aten::addmm":  # addmm(bias, input [M, K], weight.T [K, N])
        rows, inner = args[1].shape
    elif name == "aten::mm":
        rows, inner = args[0].shape
    else:
        return False
    return inner >= PROJECTION_MIN_INNER_DIM and (max_rows is None or rows <= max_rows)


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


def kept_projection_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Bytes that ``"projections"`` keeps per token and per layer: the q, k, v and o projections' outputs and the
    router logits (``dtype_bytes`` each: the attention weights' dtype; LoRA's ``lora_A`` outputs add ``dtype_bytes
    * r`` per adapted projection). 16,064 for gpt-oss-20b in bf16."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    outputs = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim + config.hidden_size
    return dtype_bytes * (outputs + config.num_local_experts)


def _max_tokens(per_token_per_layer: int, config, memory_bytes: int, fraction: float) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    per_token = per_token_per_layer * config.num_hidden_layers
    return max(int(fraction * max(memory_bytes, 0)) // per_token, 0)


def experts_max_tokens_for_memory(
    config, memory_bytes: int, dtype_bytes: int = 2, fraction: float = 0.5, with_projections: bool = False
) -> int:
    """The most tokens per micro-batch for which every layer's kept experts outputs (and, `with_projections`, its
    kept projections) take at most ``fraction`` of ``memory_bytes`` (the GPU memory left after the weights).

    On a 140 GiB GPU holding gpt-oss-20b's bf16 weights (39 GiB), half of the remaining 101 GiB keeps the experts
    outputs of micro-batches up to ~43k tokens (1.24 MB per token over 24 layers), ~33k with the projections kept
    too (1.63 MB per token): 32k-token micro-batches keep them, 64k-token ones recompute the experts.
    """
    per_token = kept_experts_bytes_per_token(config, dtype_bytes)
    if with_projections:
        per_token += kept_projection_bytes_per_token(config, dtype_bytes)
    return _max_tokens(per_token, config, memory_bytes, fraction)


def projections_max_tokens_for_memory(config, memory_bytes: int, dtype_bytes: int = 2, fraction: float = 0.5) -> int:
    """The most tokens per micro-batch for which every layer's kept projections take at most ``fraction`` of
    ``memory_bytes``: ~140k tokens for gpt-oss-20b on a 140 GiB GPU (0.39 MB per token over 24 layers), ~57k on an
    80 GiB one."""
    return _max_tokens(kept_projection_bytes_per_token(config, dtype_bytes), config, memory_bytes, fraction)


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


def _free_memory_and_dtype_bytes(model, device, resident, weight_suffix: str) -> tuple[int, int] | None:
    """(the GPU's total memory less what ``model`` and ``resident`` hold on it, the element size of ``model``'s
    parameters named ``*weight_suffix``); None off CUDA."""
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    held = _bytes_on(device, (model, *resident))
    dtype_bytes = next((p.element_size() for name, p in model.named_parameters() if name.endswith(weight_suffix)), 2)
    return torch.cuda.get_device_properties(device).total_memory - held, dtype_bytes


def experts_max_tokens_for_model(
    model: torch.nn.Module,
    device: torch.device,
    fraction: float = 0.5,
    resident: Iterable[torch.nn.Module] = (),
    with_projections: bool = False,
) -> int | None:
    """`experts_max_tokens_for_memory` for ``model`` training on ``device``: the GPU's total memory less what
    ``model`` and the ``resident`` modules (a reference model, an in-process rollout engine's copy) hold on it, in
    the experts weights' dtype. None (no bound) off CUDA."""
    free = _free_memory_and_dtype_bytes(model, device, resident, "gate_up_proj")
    if free is None:
        return None
    return experts_max_tokens_for_memory(model.config, free[0], free[1], fraction, with_projections)


def projections_max_tokens_for_model(
    model: torch.nn.Module, device: torch.device, fraction: float = 0.5, resident: Iterable[torch.nn.Module] = ()
) -> int | None:
    """`projections_max_tokens_for_memory` for ``model`` on ``device`` (as `experts_max_tokens_for_model`), in the
    attention weights' dtype. None (no bound) off CUDA."""
    free = _free_memory_and_dtype_bytes(model, device, resident, "q_proj.weight")
    if free is None:
        return None
    return projections_max_tokens_for_memory(model.config, free[0], free[1], fraction)


def _check_max_tokens(name: str, max_tokens: int | None) -> None:
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"{name} must be None (no bound) or an int >= 0, got {max_tokens!r}")


def selective_checkpoint_policy(
    save: Iterable[str] = ("attention",),
    experts_max_tokens: int | None = None,
    projections_max_tokens: int | None = None,
) -> Callable:
    """The policy function for `create_selective_checkpoint_contexts`: MUST_SAVE the chosen ops' outputs.

    `save`: names from `SAVE_CHOICES` (an iterable, or one comma-separated string such as ``"attention,experts"``).
    `experts_max_tokens`: ``"experts"`` keeps the outputs of experts calls on at most this many tokens (the rows of
    their ``[T, H]`` input: a micro-batch's tokens); larger calls are recomputed. `projections_max_tokens`: the
    same for ``"projections"`` (the rows of the products). None: no bound. The choice depends on shapes only, so
    the forward and its recomputation agree.
    """
    chosen = frozenset(parse_checkpoint_saves(save))
    _check_max_tokens("experts_max_tokens", experts_max_tokens)
    _check_max_tokens("projections_max_tokens", projections_max_tokens)

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
            if "projections" in chosen and _is_compute_bound_product(func, args, projections_max_tokens):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_checkpoint_context_fn(
    save: Iterable[str] = ("attention",),
    experts_max_tokens: int | None = None,
    projections_max_tokens: int | None = None,
) -> Callable:
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` keeping the chosen ops."""
    return functools.partial(
        create_selective_checkpoint_contexts,
        selective_checkpoint_policy(save, experts_max_tokens, projections_max_tokens),
    )


def selective_checkpointing_kwargs(
    save: Iterable[str] = ("attention",),
    experts_max_tokens: int | None = None,
    projections_max_tokens: int | None = None,
    **checkpoint_kwargs,
) -> dict:
    """`gradient_checkpointing_kwargs` for `model.gradient_checkpointing_enable` (non-reentrant, with the context).

    `experts_max_tokens`, `projections_max_tokens` as in `selective_checkpoint_policy`. Extra keyword arguments go
    to `torch.utils.checkpoint.checkpoint` as well; `use_reentrant=True` is refused (reentrant checkpointing has no
    selective mode).
    """
    if checkpoint_kwargs.get("use_reentrant"):
        raise ValueError("selective checkpointing needs use_reentrant=False")
    if "context_fn" in checkpoint_kwargs:
        raise ValueError("selective_checkpointing_kwargs builds context_fn itself; pass only one")
    context_fn = selective_checkpoint_context_fn(save, experts_max_tokens, projections_max_tokens)
    return {**checkpoint_kwargs, "use_reentrant": False, "context_fn": context_fn}
