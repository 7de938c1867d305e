"""Padding-free log-prob forwards: the rows of a padded batch packed into one row, and the results unpacked.

RL batches hold trajectories of very different lengths; a padded batch spends attention, experts and the LM head on
padding. :func:`packed_completion_logprobs` takes TRL's padded layout (a left-padded prompt followed by a
right-padded completion per row, ``attention_mask`` marking the real tokens), runs the model once on the real tokens
only, and returns per-token log-probs (and entropies) in the padded ``[B, logits_to_keep]`` layout that TRL's loss
reads (0 where TRL's padded forward gives 0: prompt tokens, pads).

Sequence boundaries follow transformers' packed-sequence convention, ``position_ids`` restarting at 0 for every
row:

- flash-attention implementations (the ``hf-gptoss-rl/sink-flash-attn3`` kernel included) run
  ``flash_attn_varlen_func``: one sequence per row, GPT-OSS's sliding window inside each. Their varlen arguments
  are passed with the forward (``cu_seq_lens_q/k`` and ``max_length_q/k``, transformers' ``FlashAttentionKwargs``,
  as TRL's ``DataCollatorWithFlattening`` does): without them transformers derives them from ``position_ids`` in
  every layer (``modeling_flash_attention_utils._is_packed_sequence`` and ``prepare_fa_kwargs_from_position_ids``),
  which reads values back from the GPU, i.e. a host sync per layer and per recomputed layer;
- GPT-OSS's model builds its masks without ``position_ids``, so for ``eager`` and ``flex_attention``
  :func:`packed_attention_masks` builds its per-layer-type masks (causal / sliding window) with transformers' own
  builders restricted to each row (``masking_utils.packed_sequence_mask_function``: block-diagonal), and the model
  takes that prepared mapping as is.

RoPE scores depend only on position differences, so the result equals the padded forward's (whose left-padded rows
start at a later absolute position) up to rounding. Rows must be one run of real tokens (:func:`rows_are_contiguous`).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = [
    "PACKED_MASK_ATTENTION",
    "attention_honours_packing",
    "flash_varlen_kwargs",
    "pack_rows",
    "packed_attention_masks",
    "packed_completion_logprobs",
    "rows_are_contiguous",
    "unpack_token_values",
]

#: implementations that need the block-diagonal masks of `packed_attention_masks` (the others derive varlen
#: boundaries from `position_ids` themselves)
PACKED_MASK_ATTENTION = frozenset({"eager", "sdpa", "flex_attention"})


def attention_honours_packing(attn_implementation: str | None) -> bool:
    """True for implementations that keep packed rows apart: `PACKED_MASK_ATTENTION` (with the prepared masks)
    and transformers' flash-attention path (flash_attention_2/3/4, hub kernels such as the sink kernel), which
    derives varlen ``cu_seqlens`` from ``position_ids``. Recognised by running transformers' own
    ``flash_attention_forward`` with flash_attention_2's mask function: another function registered under a custom
    name may ignore ``position_ids`` and attend across the packed trajectories, so it does not count."""
    if attn_implementation is None:
        return False
    if attn_implementation in PACKED_MASK_ATTENTION:
        return True
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    try:
        attention = ALL_ATTENTION_FUNCTIONS[attn_implementation]
        mask = ALL_MASK_ATTENTION_FUNCTIONS[attn_implementation]
    except KeyError:
        return False
    attention = getattr(attention, "func", attention)  # functools.partial around it
    return attention is flash_attention_forward and mask is ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]


def rows_are_contiguous(mask: torch.Tensor) -> bool:
    """True when every row of a `[B, S]` mask is one run of ones (left and right padding only), or empty."""
    mask = mask.bool()
    index = torch.arange(mask.shape[1], device=mask.device)
    count = mask.sum(1)
    first = torch.where(mask, index, mask.shape[1]).amin(1)
    last = torch.where(mask, index, -1).amax(1)
    return bool(((last - first + 1 == count) | (count == 0)).all())


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """`(packed_ids [1, N], position_ids [1, N], labels [1, N])` of the real tokens of a padded `[B, S]` batch.

    Labels are TRL's (only the last `logits_to_keep` columns, real tokens only), with every row's first token
    unlabelled so that no position scores the next row's first token.
    """
    mask = attention_mask.bool()
    if not rows_are_contiguous(mask):
        raise ValueError("pack_rows: an attention-mask row has a hole inside it (only left/right padding packs)")
    labels = input_ids.masked_fill(~mask, -100)
    labels[:, :-logits_to_keep] = -100
    positions = (mask.long().cumsum(1) - 1)[mask].unsqueeze(0)
    packed_labels = labels[mask].masked_fill(positions[0] == 0, -100).unsqueeze(0)
    return input_ids[mask].unsqueeze(0), positions, packed_labels


def unpack_token_values(packed: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """`[1, N-1]` values where entry j scores packed token j+1 -> `[B, logits_to_keep]` in the padded layout.

    Each token's value goes to its own `[B, S]` slot (0 elsewhere), then the last `logits_to_keep` columns are
    kept: the layout of `model(..., labels=, fused_lm_head=True).log_probs[:, -logits_to_keep:]`.
    """
    mask = attention_mask.bool()
    per_token = torch.nn.functional.pad(packed[0], (1, 0))  # packed token 0 is scored by nothing
    return per_token.new_zeros(mask.shape).masked_scatter(mask, per_token)[:, -logits_to_keep:]


def flash_varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """transformers' varlen ``FlashAttentionKwargs`` of one row whose ``position_ids`` restart at every sequence
    (transformers' own ``prepare_fa_kwargs_from_position_ids``), the max lengths as Python ints: computed once per
    forward and passed with it, so that no layer derives them again (a read-back from the device per layer)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "max_length_q": int(max_q), "max_length_k": int(max_k)}


def cache_keyword(function) -> str:
    """The name of the KV-cache argument of a transformers function (a mask function, a model's `forward`): `cache`
    in newer transformers (5.24 renames it with `@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")` on
    `masking_utils.create_causal_mask` and the models' `forward`s: a `FutureWarning` on every call that uses the old
    name), `past_key_values` in older ones."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


def packed_attention_masks(config, position_ids: torch.Tensor, dtype: torch.dtype) -> dict:
    """GPT-OSS's `{layer type: mask}` mapping for one packed row: causal (and sliding-window) within each sequence."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
    )

    sequence_ids = find_packed_sequence_indices(position_ids)
    if sequence_ids is None:  # one sequence
        sequence_ids = torch.zeros_like(position_ids)
    shape_only = torch.empty((1, position_ids.shape[1], 1), dtype=dtype, device=position_ids.device)
    kwargs = {
        "config": config,
        "inputs_embeds": shape_only,
        "attention_mask": None,
        cache_keyword(create_causal_mask): None,  # no KV cache: a training forward
        "and_mask_function": packed_sequence_mask_function(sequence_ids),
    }
    masks = {"full_attention": create_causal_mask(**kwargs)}
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


def packed_completion_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    compute_aux_loss: bool = False,
    autocast=None,
):
    """`(log_probs, entropy, aux_loss)` of the completions of a padded batch, from one packed forward.

    `model` is a GPT-OSS causal LM (plain or PEFT-wrapped) with a fused LM head (`add_chunked_logprob_head`, or
    TRL's `add_fused_lm_head` with a flash-path attention); log-probs and entropies are `[B, logits_to_keep]` as
    the padded forward gives them; `aux_loss` (with `compute_aux_loss`) averages the router loss over real tokens,
    as the padded forward's masked one does. `autocast`: a context manager factory (e.g. accelerate's).
    """
    base = model
    while isinstance(getattr(base, "module", None), nn.Module):  # DDP / accelerate wrappers: the config is inside
        base = base.module
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    config = base.config
    attn = getattr(config, "_attn_implementation", None)
    if not attention_honours_packing(attn):
        raise ValueError(f"attn_implementation={attn!r} does not keep packed sequences apart")
    ids, positions, labels = pack_rows(input_ids, attention_mask, logits_to_keep)
    model_inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
    if attn in PACKED_MASK_ATTENTION:
        model_inputs["attention_mask"] = packed_attention_masks(
            config, positions, base.get_input_embeddings().weight.dtype
        )
    else:
        model_inputs.update(flash_varlen_kwargs(positions))
    if compute_aux_loss:
        model_inputs["output_router_logits"] = True
    if autocast is None:
        out = model(**model_inputs, labels=labels, fused_lm_head=True)
    else:
        with autocast():
            out = model(**model_inputs, labels=labels, fused_lm_head=True)
    logps = unpack_token_values(out.log_probs, attention_mask, logits_to_keep)
    entropy = unpack_token_values(out.entropy, attention_mask, logits_to_keep) if out.entropy is not None else None
    return logps, entropy, (out.aux_loss if compute_aux_loss else None)
