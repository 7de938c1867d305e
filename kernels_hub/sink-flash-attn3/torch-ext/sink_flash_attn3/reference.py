"""Plain PyTorch sink attention: the CPU path, with the same contract as ``triton_kernels.py``.

Math (per head h with sink logit s_h, query row i, visible keys j):
    S_ij  = scale * q_i . k_j
    LSE_i = log(sum_j exp(S_ij) + exp(s_h))          (natural log, sink-inclusive)
    P_ij  = exp(S_ij - LSE_i),   O_i = sum_j P_ij v_j  (the sink carries no value)
Backward (the FlashAttention backward with the sink-inclusive LSE):
    D_i = rowsum(dO_i * O_i),  dS_ij = P_ij (dP_ij - D_i),  dP = dO V^T
    dq = scale * dS K,  dk = scale * dS^T Q,  dv = P^T dO,  dsink_h = -sum_i exp(s_h - LSE_i) D_i

Memory stays bounded: the loops run over sequences and over query chunks, so at most
``heads x chunk x key_length`` fp32 scores exist at once; K/V are never repeated for GQA (the query heads of a
group are viewed as ``[kv_heads, group, ...]``). All accumulation is fp32; float64 inputs (which the public API
refuses) are computed in float64 throughout, LSE included, which makes these functions an fp64 reference.

Masking: query i of a sequence sits at key position ``i + len_k - len_q`` (bottom-right aligned causal mask, as
FlashAttention); key j is visible iff ``i_al - window_left <= j <= i_al + window_right`` (-1 = unbounded) and,
when causal, ``j <= i_al``. A row with no visible key has output 0 and LSE = sink (or -inf without a sink).
"""

from __future__ import annotations

import torch

# Upper bound on the fp32 score block of one query chunk (elements): 16M floats = 64 MiB.
_MAX_SCORE_ELEMENTS = 1 << 24


def _visible_mask(
    len_q: int, len_k: int, start_q: int, stop_q: int, causal: bool, window_left: int, window_right: int, device
) -> torch.Tensor | None:
    """Boolean ``[chunk, len_k]`` mask of visible keys for query rows ``start_q:stop_q``; None if all visible."""
    if not causal and window_left < 0 and window_right < 0:
        return None
    aligned = torch.arange(start_q, stop_q, device=device).unsqueeze(1) + (len_k - len_q)
    key = torch.arange(len_k, device=device).unsqueeze(0)
    visible = torch.ones(stop_q - start_q, len_k, dtype=torch.bool, device=device)
    if causal:
        visible &= key <= aligned
    if window_left >= 0:
        visible &= key >= aligned - window_left
    if window_right >= 0:
        visible &= key <= aligned + window_right
    return visible


def _query_chunk(num_heads: int, len_k: int) -> int:
    return max(1, _MAX_SCORE_ELEMENTS // max(1, num_heads * len_k))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(q_chunk, k_seq, scale, mask):
    """Scores ``[Hkv, G, chunk, len_k]`` (fp32, fp64 for fp64 inputs) of a query chunk ``[chunk, Hkv, G, D]``
    against ``[len_k, Hkv, D]``."""
    acc = _accumulation_dtype(q_chunk.dtype)
    scores = torch.einsum("qhgd,khd->hgqk", q_chunk.to(acc), k_seq.to(acc)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _lengths(cu_seqlens: torch.Tensor) -> list[int]:
    return cu_seqlens.tolist()


def sink_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out [Tq, Hq, D]`` in q's dtype and the sink-inclusive ``lse [Hq, Tq]`` in fp32 (fp64 for fp64 q)."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    acc = _accumulation_dtype(q.dtype)
    out = torch.zeros(total_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, total_q, dtype=acc, device=q.device)
    # [Hkv, G, 1, 1] sink logits, or None
    sink = sinks.to(acc).view(num_kv_heads, group, 1, 1) if sinks is not None else None
    offsets_q, offsets_k = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)
    for seq in range(len(offsets_q) - 1):
        q0, q1, k0, k1 = offsets_q[seq], offsets_q[seq + 1], offsets_k[seq], offsets_k[seq + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0:
            continue
        k_seq, v_seq = k[k0:k1], v[k0:k1].to(acc)
        chunk = _query_chunk(num_heads, len_k)
        for c0 in range(0, len_q, chunk):
            c1 = min(c0 + chunk, len_q)
            mask = _visible_mask(len_q, len_k, c0, c1, causal, window_left, window_right, q.device)
            q_chunk = q[q0 + c0 : q0 + c1].view(c1 - c0, num_kv_heads, group, head_dim)
            scores = _scores(q_chunk, k_seq, softmax_scale, mask)  # [Hkv, G, c, len_k]
            if len_k > 0:
                row_max = scores.amax(dim=-1, keepdim=True)
            else:
                row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
            if sink is not None:
                row_max = torch.maximum(row_max, sink)
            # A row with no visible key and no sink has max -inf: shift by 0 instead so nothing becomes NaN.
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            probs = torch.exp(scores - row_max)
            denom = probs.sum(dim=-1, keepdim=True)
            if sink is not None:
                denom = denom + torch.exp(sink - row_max)
            chunk_lse = row_max + torch.log(denom)  # log(0) = -inf for an empty row without sink
            probs = probs / torch.where(denom > 0, denom, torch.ones_like(denom))
            chunk_out = torch.einsum("hgqk,khd->qhgd", probs, v_seq)
            out[q0 + c0 : q0 + c1] = chunk_out.reshape(c1 - c0, num_heads, head_dim).to(q.dtype)
            lse[:, q0 + c0 : q0 + c1] = chunk_lse.reshape(num_heads, c1 - c0)
    # Query tokens outside every sequence (cu_seqlens_q[-1] < Tq) keep out 0; give them an empty-row LSE.
    tail = offsets_q[-1]
    if tail < total_q:
        lse[:, tail:] = sinks.to(acc).unsqueeze(1) if sinks is not None else float("-inf")
    return out, lse


def sink_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool = False,
    dq_out: torch.Tensor | None = None,
    dk_out: torch.Tensor | None = None,
    dv_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns ``dq, dk, dv`` in the input dtypes and ``dsink [Hq]`` in the sink's dtype (None without sinks); ``dq_out``,
    ``dk_out``, ``dv_out``, when given, receive dq, dk, dv and are returned (any strides).

    Deterministic whatever ``deterministic`` says: sequential loops, no atomics.
    """
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    acc = _accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dsink = torch.zeros(num_kv_heads, group, dtype=acc, device=q.device) if sinks is not None else None
    sink = sinks.to(acc).view(num_kv_heads, group, 1) if sinks is not None else None
    offsets_q, offsets_k = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)
    for seq in range(len(offsets_q) - 1):
        q0, q1, k0, k1 = offsets_q[seq], offsets_q[seq + 1], offsets_k[seq], offsets_k[seq + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0:
            continue
        k_seq, v_seq = k[k0:k1].to(acc), v[k0:k1].to(acc)
        chunk = _query_chunk(num_heads, len_k)
        for c0 in range(0, len_q, chunk):
            c1 = min(c0 + chunk, len_q)
            rows = slice(q0 + c0, q0 + c1)
            mask = _visible_mask(len_q, len_k, c0, c1, causal, window_left, window_right, q.device)
            q_chunk = q[rows].to(acc).view(c1 - c0, num_kv_heads, group, head_dim)
            do_chunk = dout[rows].to(acc).view(c1 - c0, num_kv_heads, group, head_dim)
            o_chunk = out[rows].to(acc).view(c1 - c0, num_kv_heads, group, head_dim)
            chunk_lse = lse[:, rows].view(num_kv_heads, group, c1 - c0)  # [Hkv, G, c]
            # Rows with LSE = -inf (empty, no sink) have P = 0: shift them by 0 to avoid inf - inf.
            finite_lse = torch.where(torch.isinf(chunk_lse), torch.zeros_like(chunk_lse), chunk_lse)
            scores = _scores(q_chunk, k_seq, softmax_scale, mask)  # [Hkv, G, c, len_k]
            probs = torch.exp(scores - finite_lse.unsqueeze(-1))
            probs = torch.where(torch.isinf(chunk_lse).unsqueeze(-1), torch.zeros_like(probs), probs)
            delta = (do_chunk * o_chunk).sum(-1).permute(1, 2, 0)  # D_i: [Hkv, G, c]
            dprobs = torch.einsum("qhgd,khd->hgqk", do_chunk, v_seq)
            dscores = probs * (dprobs - delta.unsqueeze(-1))
            dq[rows] = (
                (torch.einsum("hgqk,khd->qhgd", dscores, k_seq) * softmax_scale)
                .reshape(c1 - c0, num_heads, head_dim)
                .to(q.dtype)
            )
            dk[k0:k1] += torch.einsum("hgqk,qhgd->khd", dscores, q_chunk) * softmax_scale
            dv[k0:k1] += torch.einsum("hgqk,qhgd->khd", probs, do_chunk)
            if sink is not None:
                dsink -= (torch.exp(sink - chunk_lse) * delta).sum(-1)
    grads = [
        grad if given is None else given.copy_(grad)
        for grad, given in ((dq, dq_out), (dk.to(k.dtype), dk_out), (dv.to(v.dtype), dv_out))
    ]
    return *grads, dsink.reshape(num_heads).to(sinks.dtype) if dsink is not None else None
