"""Attention variants of GPT-OSS registered through transformers' `AttentionInterface`, for experiments and CPU runs.

- `register_sink_dropping_attention()`: `"eager_without_sinks"`, GPT-OSS eager attention with the sink column
  removed: what a training stack that silently drops the sinks computes, to reproduce the rollout/training mismatch.
- `setup_project_attention()` / `set_project_attention()`: the project's sink kernel as an attention implementation:
  the id users select, or its `flash_attn_func` registered directly (`"sink_kernel_direct"`, which keeps fp32
  activations in fp32; right padding only).
- `register_span_kernel_attention()`: `"sink_kernel_span"`, the kernel's `flash_attn_varlen_func` on every row's
  valid tokens packed into one call per layer (any padding whose valid tokens form one span per row, as TRL's
  `[left pad | prompt | completion | right pad]` training batches; fp32 stays fp32).

Nothing here is registered by `import hf_gptoss_rl`: each function registers its own name when called.
"""

from __future__ import annotations

import weakref

import torch

SINK_DROPPING_ATTENTION = "eager_without_sinks"
DIRECT_KERNEL_ATTENTION = "sink_kernel_direct"
SPAN_KERNEL_ATTENTION = "sink_kernel_span"
# No "flash" in the names: transformers replaces a requested attention name that contains "flash" and is not in the
# model's `_compatible_flash_implementations` (`PreTrainedModel._check_and_adjust_attn_implementation`), and routes
# such names through its flash-attention preparation (fp32 inputs cast to half precision, its own mask handling).


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


# (weakref to the mask's storage owner, view geometry, version) -> packing; see `_varlen_packing`
_PACKINGS: list[tuple] = []


def _varlen_packing(attention_mask):
    """`(indices, cu_seqlens, max_seqlen)` of a 2-D padding mask `[B, S]`: the flat `B*S` positions of the valid
    tokens (row by row, in order), int32 cumulative row lengths `[B + 1]` and the longest row.

    One host sync per mask (totals for the packed size); the result is cached for the mask, which transformers
    hands to every layer of a forward (the full- and sliding-attention masks are views of one tensor, hence the key
    on the storage owner and the view geometry). Rows whose valid tokens do not form one contiguous span are
    refused: packing them would close the gap and shift causal/sliding distances, which eager would not.
    """
    owner = attention_mask._base if attention_mask._base is not None else attention_mask
    key = (attention_mask.storage_offset(), tuple(attention_mask.shape), attention_mask.stride(),
           attention_mask._version, attention_mask.device)  # fmt: skip
    for ref, cached_key, packing in _PACKINGS:
        if ref() is owner and cached_key == key:
            return packing
    valid = attention_mask.bool()
    lengths = valid.sum(-1, dtype=torch.int32)
    starts = valid.clone()
    starts[:, 1:] &= ~valid[:, :-1]  # a span starts where a valid token follows a pad (or the row's start)
    total, longest, broken = torch.stack(
        [lengths.sum(), lengths.max(), (starts.sum(-1) > 1).sum()]
    ).tolist()  # the one host sync
    if broken:
        raise ValueError(
            f"{SPAN_KERNEL_ATTENTION}: {broken} row(s) of the padding mask have valid tokens that are not one "
            "contiguous span"
        )
    indices = torch.nonzero_static(valid.reshape(-1), size=total).reshape(-1)  # no sync: the size is known
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    packing = (indices, cu_seqlens, longest)
    _PACKINGS[:] = [entry for entry in _PACKINGS[-3:] if entry[0]() is not None] + [(weakref.ref(owner), key, packing)]
    return packing


def varlen_sink_kernel_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    s_aux=None,
    **kwargs,
):
    """The project's kernel on every row's valid tokens in ONE `flash_attn_varlen_func` call (fp32 stays fp32).

    TRL's training batches are `[left pad | prompt | completion | right pad]`: a row's valid tokens form one
    contiguous span. They are gathered into a packed `[T, H, D]` batch delimited by `cu_seqlens` (each span its own
    sequence: causal and sliding-window distances are index differences within the span, so left padding shifts
    nothing, and RoPE was applied before attention), which is exactly what eager computes with the padding mask.
    The output is scattered back to `[B, S, H, D]` with zeros at pad positions. `attention_mask` is what the
    flash-style mask function gives: the 2-D padding mask, or None when nothing is padded.
    """
    from .attention import import_kernel_sources

    if attention_mask is None:
        return direct_sink_kernel_attention(
            module, query, key, value, None, scaling, dropout, sliding_window=sliding_window, s_aux=s_aux
        )
    if dropout:
        raise ValueError(f"{SPAN_KERNEL_ATTENTION}: dropout is not supported")
    batch, heads, seqlen, head_dim = query.shape
    if attention_mask.dim() != 2 or key.shape[2] != seqlen or attention_mask.shape != (batch, seqlen):
        raise ValueError(
            f"{SPAN_KERNEL_ATTENTION}: needs a full-sequence forward with a 2D padding mask [B, S], got mask "
            f"{tuple(attention_mask.shape)} for query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    indices, cu_seqlens, longest = _varlen_packing(attention_mask)

    def pack(t):  # [B, H', S, D] -> [T, H', D]
        return t.transpose(1, 2).reshape(batch * seqlen, t.shape[1], head_dim).index_select(0, indices)

    window = (sliding_window - 1, sliding_window - 1) if sliding_window is not None else (-1, -1)
    out = import_kernel_sources().flash_attn_varlen_func(
        pack(query),
        pack(key),
        pack(value),
        cu_seqlens,
        cu_seqlens,
        longest,
        longest,
        softmax_scale=scaling,
        causal=True,
        window_size=window,
        s_aux=s_aux.to(query.dtype) if s_aux is not None else None,
    )
    padded = out.new_zeros(batch * seqlen, heads, head_dim).index_copy(0, indices, out)
    return padded.view(batch, seqlen, heads, head_dim), None


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


def register_span_kernel_attention() -> str:
    """Register `"sink_kernel_span"` (`varlen_sink_kernel_attention` with the flash-style 2-D padding mask) with
    transformers after importing the kernel sources (a broken kernel fails here, not in the first forward); returns
    the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from .attention import import_kernel_sources

    import_kernel_sources()
    AttentionInterface.register(SPAN_KERNEL_ATTENTION, varlen_sink_kernel_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SPAN_KERNEL_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return SPAN_KERNEL_ATTENTION


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
