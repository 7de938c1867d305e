"""Memory-efficient GPT-OSS experts, registered as ``experts_implementation="memory_efficient"``.

:func:`hf_gptoss_rl.register` (called by ``import hf_gptoss_rl``) registers :func:`memory_efficient_experts_forward`
in transformers' ``ALL_EXPERTS_FUNCTIONS``; importing this module alone registers nothing. Select it with
``from_pretrained(..., experts_implementation="memory_efficient")`` or
``model.set_experts_implementation("memory_efficient")``.

It computes exactly GPT-OSS's experts (``GptOssExperts``): per-expert biases, the interleaved gate/up
projection, ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``
and the router's top-k softmax weights, with ``alpha``/``limit`` read from the module (recent transformers set
them from ``config.swiglu_alpha/swiglu_limit``, older releases hard-code 1.702 / 7.0).

How it saves memory (S = tokens × top_k token-expert pairs):

- The pairs are sorted by expert once, on the device, and processed in chunks of at most ``chunk_rows`` pairs.
  A chunk gathers its token rows, runs the up projection, the gate and the down projection (its rows of the
  ``[S, H]`` result, in the input's dtype, kept as the matmul returned them); one pass then sums
  ``w * (y + b_down)`` per token over its top-k slots, reading every chunk's rows where they are, in fp32 and in
  slot order (deterministic, no atomics). No ``[S, 2I]`` tensor exists in the no-grad
  pass, and expert weights are never copied.
- Training goes through the custom op ``hf_gptoss_rl::memory_efficient_experts`` (forward and backward ops
  joined by ``register_autograd``), which saves only the biased up-projection output (``[S, 2I]`` in sorted-pair
  order, or nothing with ``recompute_gate_up=True``) and recomputes the gate activations in the backward. Being
  one op, its outputs can be kept by selective activation checkpointing (``hf_gptoss_rl.checkpointing``), which
  then skips the whole experts forward in the recompute. Weight and bias gradients are skipped when the experts
  are frozen (PEFT LoRA on attention), the routing-weight gradient when the router is frozen.
- EP sentinel indices (``>= num_experts``) are sorted to the tail and contribute nothing: no output and a zero
  routing-weight gradient, as transformers' ``grouped_mm`` handles them.

Two ways to cut the chunks, chosen from what the host knows (backend, needed gradients):

- Sync-free, whenever the matmuls run in ``torch._grouped_mm`` (CUDA bf16), except a backward that needs
  expert weight gradients. Chunks are fixed in pair space (``[i*C, (i+1)*C)``), each runs against the full
  weight tensors, and the per-expert offsets of every chunk are computed on the device (experts absent from a
  chunk are empty groups). Nothing is read back, so the host keeps queuing kernels instead of draining the GPU
  twice per layer. Sentinel pairs then sit inside chunks: ``_grouped_mm`` leaves their rows unwritten and the
  gate / combine steps mask them on the device. Negative indices are caught by a device-side assert.
- Host-planned otherwise (the per-expert ``torch.mm`` loop needs host row ranges; a chunk spanning all
  experts would make ``[E, K, N]`` weight-gradient temporaries). One host sync reads the expert boundaries;
  chunks cover real pairs only, span at most ``MAX_EXPERTS_PER_CHUNK`` experts and use weight slices. Negative
  indices raise ``ValueError``.

Both sort the pairs the same way and save ``[S, 2I]`` in the same order, so either backward follows either
forward (a sync-free forward, then a host-planned backward when the experts train).

Backends: on CUDA the gate, bias and combine steps run in fused Triton kernels (``hf_gptoss_rl._experts_triton``)
and, with bf16 weights, the matmuls in ``torch._grouped_mm``; elsewhere (CPU, fp32 matmuls) a per-expert
``torch.mm`` loop over the same chunks and the same math in PyTorch, exact in fp32. Overrides
(``hf_gptoss_rl.set_backends`` / ``use_backends``, started from the environment at import, see
``hf_gptoss_rl._backend``): ``experts="torch"|"triton"`` (``HF_GPTOSS_RL_EXPERTS_BACKEND``; ``triton`` on CPU needs
TRITON_INTERPRET=1 set before triton is imported) and ``experts_grouped_mm=True``
(``HF_GPTOSS_RL_EXPERTS_GROUPED_MM=1``: use ``torch._grouped_mm``, hence the sync-free plan, on CPU too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _backend

try:  # Triton is optional: the PyTorch path covers CPU and any device Triton cannot drive.
    from . import _experts_triton
except Exception:  # pragma: no cover - triton missing or unusable on this machine
    _experts_triton = None

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "EXPERTS_OP",
    "memory_efficient_experts_forward",
]

#: Token-expert pairs processed per chunk. At gpt-oss-20b size (H = I = 2880, bf16) a chunk's
#: intermediates take about 30 KiB per row, so 32768 rows ≈ 1 GiB whatever the sequence length. Fewer,
#: larger chunks launch fewer kernels: a 32k-token GRPO step on an H200 took 2.31 s at 8192 rows, 2.25 s at
#: 16384 and 2.21 s at 32768 (second of two steps each, 2026-12-02), 0.5 GiB more at peak.
DEFAULT_CHUNK_ROWS = 32768
#: Experts one chunk of the host plan may span (bounds the per-chunk weight-gradient temporaries: 8 × 32 MiB at
#: 20b size).
MAX_EXPERTS_PER_CHUNK = 8

_DEFAULT_ALPHA = 1.702
_DEFAULT_LIMIT = 7.0


# --------------------------------------------------------------------------------------------------------
# Routing plan: sort once on the device, then cut the sorted pairs into chunks (on the host or on the device).
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    start: int  # first sorted pair of the chunk
    stop: int  # one past the last sorted pair
    expert_lo: int  # experts [expert_lo, expert_hi) own the chunk's rows (all experts on the sync-free plan)
    expert_hi: int
    ends: list[int] | None  # cumulative row ends of those experts, local to the chunk (host plan only)
    offs: torch.Tensor  # the same on the device, int32 (what torch._grouped_mm wants)


@dataclass
class _RoutingPlan:
    num_tokens: int
    top_k: int
    num_experts: int
    perm: torch.Tensor  # [S] flat (token * top_k + slot) index of each sorted pair
    position: torch.Tensor  # [S] sorted position of each flat pair (the inverse of `perm`)
    token: torch.Tensor  # [S] token of each sorted pair
    expert: torch.Tensor  # [S] expert of each sorted pair (sentinels keep their value and are masked)
    sync_free: bool  # chunks cut in pair space, sentinel rows inside chunks (see `_device_chunks`)
    chunks: list[_Chunk]


def _use_sync_free_plan(x: torch.Tensor, expert_weight_grads: bool = False) -> bool:
    """Plan the routing without a host sync? Only with `torch._grouped_mm` (the per-expert `torch.mm` loop needs
    host row ranges) and without expert weight gradients (a sync-free chunk spans all E experts, so grouped_mm's
    weight-gradient output would be an [E, K, N] temporary per chunk instead of `MAX_EXPERTS_PER_CHUNK`)."""
    return not expert_weight_grads and _grouped_mm_supported(x)


def _plan_routing(top_k_index: torch.Tensor, num_experts: int, chunk_rows: int, sync_free: bool) -> _RoutingPlan:
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be [num_tokens, top_k], got shape {tuple(top_k_index.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    sorted_expert, perm = torch.sort(flat, stable=True)
    # bounds[e] = first sorted pair with expert >= e; pairs >= bounds[E] are EP sentinels.
    bounds = torch.searchsorted(sorted_expert, torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype))
    if sync_free:
        chunks = _device_chunks(bounds, flat.shape[0], num_experts, chunk_rows)
    else:
        chunks = _host_chunks(bounds.tolist(), num_experts, chunk_rows, flat.device)  # the host sync
    return _RoutingPlan(
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        perm=perm,
        position=torch.empty_like(perm).index_copy_(0, perm, torch.arange(perm.shape[0], device=perm.device)),
        token=torch.div(perm, top_k, rounding_mode="floor"),
        expert=sorted_expert,
        sync_free=sync_free,
        chunks=chunks,
    )


def _device_chunks(bounds: torch.Tensor, num_pairs: int, num_experts: int, chunk_rows: int) -> list[_Chunk]:
    """Chunks fixed in pair space, [i*C, min((i+1)*C, S)), each against all E experts, with `offs` computed on
    the device: nothing is read back. Experts without rows in a chunk are empty groups; rows past `offs[-1]`
    (EP sentinels) are left unwritten by `torch._grouped_mm` and masked by the gate / combine steps."""
    # Negative indices sort to the head and join expert 0's group; the masks then drop them like sentinels, but
    # they are an error: checked on the device (on CUDA it fails at the next sync point, on CPU at once).
    torch._assert_async(bounds[0] == 0, "top_k_index holds negative expert indices; expected 0 <= index")
    starts = range(0, num_pairs, chunk_rows)
    start = torch.arange(0, num_pairs, chunk_rows, device=bounds.device, dtype=bounds.dtype).unsqueeze(1)
    # offs[i, e] = row end of expert e local to chunk i, clamped to [0, chunk length]
    offs = torch.minimum((bounds[1:] - start).clamp(min=0), (num_pairs - start).clamp(max=chunk_rows))
    offs = offs.to(torch.int32)
    return [_Chunk(s, min(s + chunk_rows, num_pairs), 0, num_experts, None, offs[i]) for i, s in enumerate(starts)]


def _host_chunks(bounds: list[int], num_experts: int, chunk_rows: int, device: torch.device) -> list[_Chunk]:
    """Chunks over the real pairs only, cut at most `chunk_rows` pairs and `MAX_EXPERTS_PER_CHUNK` experts, each
    against the weight slices of its experts."""
    if bounds[0] != 0:
        raise ValueError(f"top_k_index holds {bounds[0]} negative expert indices; expected 0 <= index")
    num_valid = bounds[num_experts]
    chunks: list[_Chunk] = []
    all_ends: list[int] = []
    start = 0
    while start < num_valid:
        # experts whose row range [bounds[e], bounds[e+1]) intersects [start, stop); empty ones in between stay.
        lo = next(e for e in range(num_experts) if bounds[e + 1] > start)
        # A chunk also spans at most MAX_EXPERTS_PER_CHUNK experts: its weight-gradient matmul writes an
        # [experts, H, 2I] temporary, which must stay small when few tokens spread over many experts.
        stop = min(start + chunk_rows, num_valid, bounds[min(lo + MAX_EXPERTS_PER_CHUNK, num_experts)])
        hi = next(e for e in range(lo, num_experts) if bounds[e + 1] >= stop) + 1
        ends = [min(bounds[e + 1], stop) - start for e in range(lo, hi)]
        chunks.append(_Chunk(start, stop, lo, hi, ends, None))  # type: ignore[arg-type]
        all_ends.extend(ends)
        start = stop
    if chunks:
        offs = torch.tensor(all_ends, dtype=torch.int32).to(device, non_blocking=True)
        position = 0
        for chunk in chunks:
            chunk.offs = offs[position : position + len(chunk.ends)]
            position += len(chunk.ends)
    return chunks


# --------------------------------------------------------------------------------------------------------
# Grouped matmuls over one chunk.
# --------------------------------------------------------------------------------------------------------


_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _grouped_mm_supported(t: torch.Tensor) -> bool:
    """`torch._grouped_mm` on CUDA bf16 (SM90 for torch < 2.9, SM80+ after), as transformers gates it."""
    if _backend.current.experts_grouped_mm:  # tests: force it on CPU (torch >= 2.9)
        return hasattr(torch, "_grouped_mm")
    if not (t.is_cuda and t.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    major, minor = torch.cuda.get_device_capability(t.device)
    return (major, minor) >= (8, 0) if _TORCH_VERSION >= (2, 9) else major == 9


def _segments(chunk: _Chunk):
    start = 0
    for i, end in enumerate(chunk.ends):
        yield i, start, end
        start = end


def _gmm(a: torch.Tensor, b: torch.Tensor, chunk: _Chunk, use_grouped_mm: bool) -> torch.Tensor:
    """Rows of `a` [R, K] times their expert's `b[i]` [K, N] (b: [E_c, K, N]) -> [R, N]."""
    if use_grouped_mm:
        return torch._grouped_mm(a, b, offs=chunk.offs)
    out = torch.empty(a.shape[0], b.shape[-1], device=a.device, dtype=a.dtype)
    for i, start, end in _segments(chunk):
        if end > start:
            torch.mm(a[start:end], b[i], out=out[start:end])
    return out


def _gmm_weight_grad(a_t: torch.Tensor, d: torch.Tensor, chunk: _Chunk, use_grouped_mm: bool) -> torch.Tensor:
    """Per-expert `a_t[:, rows] @ d[rows]` (a_t: [K, R], d: [R, N]) -> [E_c, K, N]; empty experts get zeros."""
    if use_grouped_mm:
        out = torch._grouped_mm(a_t, d, offs=chunk.offs)
        empty = [i for i, start, end in _segments(chunk) if end == start]
        if empty:  # do not rely on the kernel writing zeros for an empty K range
            out[empty] = 0
        return out
    out = torch.zeros(len(chunk.ends), a_t.shape[0], d.shape[1], device=d.device, dtype=d.dtype)
    for i, start, end in _segments(chunk):
        if end > start:
            torch.mm(a_t[:, start:end], d[start:end], out=out[i])
    return out


def _segment_sum(d: torch.Tensor, chunk: _Chunk, expert: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """Per-expert sum of the rows of `d` [R, N] (each scaled by `w`) -> [E_c, N], as one small matmul (rows of
    experts outside the chunk's, such as sentinels, match no expert: their `d` must be finite)."""
    local = expert - chunk.expert_lo
    experts = torch.arange(chunk.expert_hi - chunk.expert_lo, device=d.device, dtype=local.dtype)
    one_hot = local.unsqueeze(0) == experts.unsqueeze(1)
    one_hot = one_hot.to(d.dtype) if w is None else one_hot * w.to(d.dtype).unsqueeze(0)
    return one_hot.to(d.dtype) @ d


# --------------------------------------------------------------------------------------------------------
# Gate and combine: Triton on CUDA, the same math in PyTorch elsewhere.
# --------------------------------------------------------------------------------------------------------


def _use_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA; on CPU only when asked (backend ``experts="triton"`` with TRITON_INTERPRET=1)."""
    return _backend.use_triton("experts", t, _experts_triton is not None)


def _valid_rows(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    return (expert >= 0) & (expert < num_experts)


# Rows of EP sentinels (expert outside [0, E)) are masked on the device by all three steps: on the sync-free plan
# they sit inside chunks, and `torch._grouped_mm` leaves their rows unwritten (garbage, possibly NaN).


def _gate_forward(pre, bias, expert, alpha, limit, write_h=True, store_pre=True, pre_out=None):
    """Return the gated activation of `pre` + bias; `store_pre`: write the biased `pre` (rounded) to `pre_out`
    (default: `pre` itself, in place). Sentinel rows get zeros in both."""
    if _use_triton(pre):
        return _experts_triton.gate_forward(pre, bias, expert, alpha, limit, write_h, store_pre, pre_out)
    valid = _valid_rows(expert, bias.shape[0]).unsqueeze(1)
    row_bias = bias.index_select(0, expert.clamp(0, bias.shape[0] - 1))
    if pre_out is not None and pre_out is not pre:
        pre = torch.add(pre, row_bias, out=pre_out)
    else:
        pre.add_(row_bias)
    pre.masked_fill_(~valid, 0)
    if not write_h:
        return None
    gate, up = pre[:, 0::2].float(), pre[:, 1::2].float()
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return torch.where(valid, (up + 1) * gate * torch.sigmoid(alpha * gate), 0.0).to(pre.dtype)


def _gate_backward(pre, g, w, alpha, limit, write_hw, write_dw, expert, num_experts):
    """Return (dpre, w * h, rowsum(g * h)); sentinel rows (their `g` is garbage) get exact zeros."""
    if _use_triton(pre):
        return _experts_triton.gate_backward(pre, g, w, alpha, limit, write_hw, write_dw, expert, num_experts)
    valid = _valid_rows(expert, num_experts).unsqueeze(1)
    gate = torch.where(valid, pre[:, 0::2].float(), 0.0)
    up = torch.where(valid, pre[:, 1::2].float(), 0.0)
    g = torch.where(valid, g.float(), 0.0)
    gate_c = gate.clamp(max=limit)
    up_c = up.clamp(min=-limit, max=limit)
    sig = torch.sigmoid(alpha * gate_c)
    glu = gate_c * sig
    h = torch.where(valid, (up_c + 1) * glu, 0.0)
    dh = g * w.unsqueeze(1)
    d_gate = torch.where(gate <= limit, dh * (up_c + 1) * (sig + alpha * gate_c * sig * (1 - sig)), 0.0)
    d_up = torch.where((up >= -limit) & (up <= limit), dh * glu, 0.0)
    dpre = torch.stack((d_gate, d_up), dim=-1).reshape(pre.shape).to(pre.dtype)
    hw = (h * w.unsqueeze(1)).to(pre.dtype) if write_hw else None
    dw = (g * h).sum(1) if write_dw else None
    return dpre, hw, dw


def _gather_rows_sum(parts, n_cols, like, plan, w=None, bias=None):
    """fp32 `[T, n_cols]`: out[t] = sum over slots k of w[s] * (src[s] + bias[expert[s]]), s the sorted row of pair
    (t, k), summed in slot order; sentinel rows (expert outside [0, E)) are skipped. `src` `[S, n_cols]` comes as
    `parts`, (start, rows) per chunk as its matmul returned them; `w` `[S]` is in sorted-pair order. `like`: a
    tensor of the device and dtype of the rows (for a plan without chunks)."""
    if _use_triton(like):
        return _experts_triton.gather_rows_sum(
            parts, n_cols, plan.position, plan.expert, plan.num_experts, plan.top_k, w, bias
        )
    src = like.new_zeros(plan.perm.shape[0], n_cols)  # sentinel rows: no part, masked below
    for start, rows in parts:
        src[start : start + rows.shape[0]] = rows
    expert = plan.expert.index_select(0, plan.position)  # flat pair order from here
    value = src.index_select(0, plan.position).float()
    if bias is not None:
        value = value + bias.index_select(0, expert.clamp(0, bias.shape[0] - 1)).float()
    if w is not None:
        value = value * w.index_select(0, plan.position).unsqueeze(1)
    value = torch.where(_valid_rows(expert, plan.num_experts).unsqueeze(1), value, 0.0)
    total = value.new_zeros(plan.num_tokens, src.shape[1])
    for slot in value.view(plan.num_tokens, plan.top_k, -1).unbind(1):  # slot order, as the kernel sums
        total += slot
    return total


# --------------------------------------------------------------------------------------------------------
# Forward over chunks, and the training ops (forward + backward custom ops).
# --------------------------------------------------------------------------------------------------------


def _experts_forward(x, w_sorted, plan, gate_up, gate_up_bias, down, down_bias, alpha, limit, save_pre):
    """Return (fp32 [T, H] output, the biased pre-activations [S, 2I] in sorted-pair order when `save_pre`)."""
    use_grouped_mm = plan.sync_free or _grouped_mm_supported(x)
    # every chunk's down-projection rows, summed per token once at the end (`_gather_rows_sum`)
    y_parts = []
    # One buffer for every chunk's biased pre-activation: the gate kernel writes there directly (no copy). It
    # has a row per pair, sentinels included (zeros on the sync-free plan, never written nor read on the host
    # plan), so both plans share one layout and a backward may use either plan.
    saved = x.new_empty(plan.perm.shape[0], gate_up.shape[-1]) if save_pre else None
    for chunk in plan.chunks:
        token = plan.token[chunk.start : chunk.stop]
        expert = plan.expert[chunk.start : chunk.stop]
        x_chunk = x.index_select(0, token)
        pre = _gmm(x_chunk, gate_up[chunk.expert_lo : chunk.expert_hi], chunk, use_grouped_mm)
        del x_chunk
        pre_out = saved[chunk.start : chunk.stop] if save_pre else None
        h = _gate_forward(pre, gate_up_bias, expert, alpha, limit, store_pre=save_pre, pre_out=pre_out)
        del pre
        y_parts.append((chunk.start, _gmm(h, down[chunk.expert_lo : chunk.expert_hi], chunk, use_grouped_mm)))
        del h
    return _gather_rows_sum(y_parts, down.shape[-1], x, plan, w_sorted, down_bias), saved


# The training path is a pair of custom ops (forward, backward) joined by `register_autograd`, rather than an
# autograd.Function: an op is one unit to the dispatcher, so selective activation checkpointing
# (`hf_gptoss_rl.checkpointing`) can keep its outputs and skip the whole experts forward in the recompute.
EXPERTS_OP = "hf_gptoss_rl::memory_efficient_experts"


@torch.library.custom_op(EXPERTS_OP, mutates_args=())
def _experts_op(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float,
    limit: float,
    chunk_rows: int,
    save_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts output `[T, H]` (input dtype) and the biased pre-activations `[T * top_k, 2I]` in sorted-pair order
    for the backward (`[0, 2I]` without `save_pre`: the backward recomputes the up projection chunk by chunk)."""
    plan = _plan_routing(top_k_index, gate_up_proj.shape[0], chunk_rows, _use_sync_free_plan(hidden_states))
    out, saved = _experts_forward(
        hidden_states, _sorted_weights(top_k_weights, plan), plan, gate_up_proj, gate_up_proj_bias, down_proj,
        down_proj_bias, alpha, limit, save_pre,
    )  # fmt: skip
    if saved is None:
        saved = hidden_states.new_empty(0, gate_up_proj.shape[-1])
    return out.to(hidden_states.dtype), saved


@_experts_op.register_fake
def _(hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
      alpha, limit, chunk_rows, save_pre):  # fmt: skip
    rows = top_k_index.numel() if save_pre else 0  # one row per pair, EP sentinels included
    return torch.empty_like(hidden_states), hidden_states.new_empty(rows, gate_up_proj.shape[-1])


@torch.library.custom_op("hf_gptoss_rl::memory_efficient_experts_backward", mutates_args=())
def _experts_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    saved_pre: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
    chunk_rows: int,
    needs_grad: list[bool],
) -> list[torch.Tensor]:
    """Gradients of (x, top_k_weights, gate_up, gate_up_bias, down, down_bias); an empty tensor where not needed.

    The routing is sorted again from `top_k_index` (a stable sort: the same pair order as the forward's, so
    `saved_pre` lines up whichever plan each pass used). Expert weight gradients need the host plan.
    """
    need_x, need_w, need_gu, need_gub, need_d, need_db = needs_grad
    num_experts = gate_up.shape[0]
    plan = _plan_routing(top_k_index, num_experts, chunk_rows, _use_sync_free_plan(x, need_gu or need_d))
    w_sorted = _sorted_weights(top_k_weights, plan)
    saved = saved_pre if saved_pre.shape[0] > 0 else None  # empty: recompute the up projection
    use_grouped_mm = plan.sync_free or _grouped_mm_supported(x)
    grad_out = grad_out.to(x.dtype).contiguous()

    # every chunk's input-gradient rows, summed per token once at the end (`_gather_rows_sum`)
    dx_parts = []
    grad_w_sorted = torch.zeros(plan.perm.shape[0], device=x.device, dtype=torch.float32) if need_w else None
    # Expert weight gradients are written chunk by chunk: copied where an expert is first seen, added only
    # for the one expert a chunk boundary splits; experts no chunk touches are zeroed.
    grad_gu = torch.empty_like(gate_up) if need_gu else None
    grad_gub = torch.zeros_like(gate_up_bias) if need_gub else None
    grad_d = torch.empty_like(down) if need_d else None
    grad_db = torch.zeros_like(down_bias) if need_db else None
    written_hi = 0  # experts [0, written_hi) hold a gradient already

    for chunk in plan.chunks:
        lo, hi = chunk.expert_lo, chunk.expert_hi
        split_expert = lo < written_hi
        for grad in (grad_gu, grad_d):
            if grad is not None and lo > written_hi:  # empty experts between two chunks
                grad[written_hi:lo].zero_()
        token = plan.token[chunk.start : chunk.stop]
        expert = plan.expert[chunk.start : chunk.stop]
        w = w_sorted[chunk.start : chunk.stop]
        x_chunk = x.index_select(0, token) if (need_gu or saved is None) else None
        if saved is None:
            pre = _gmm(x_chunk, gate_up[lo:hi], chunk, use_grouped_mm)
            _gate_forward(pre, gate_up_bias, expert, alpha, limit, write_h=False)
        else:
            pre = saved[chunk.start : chunk.stop]
        dy = grad_out.index_select(0, token)
        g = _gmm(dy, down[lo:hi].transpose(1, 2), chunk, use_grouped_mm)  # dOut @ W_downᵀ, unweighted
        dpre, hw, dw = _gate_backward(pre, g, w, alpha, limit, need_d, need_w, expert, num_experts)
        del g, pre
        if need_w:
            # d w = dOut · (h @ W_down + b_down) = rowsum(g * h) + dOut · b_down (0 for sentinel rows)
            local = (expert - lo).clamp(0, hi - lo - 1).unsqueeze(1)
            bias_term = (dy @ down_bias[lo:hi].t()).gather(1, local).squeeze(1).float()
            dw += torch.where(_valid_rows(expert, num_experts), bias_term, 0.0)
            grad_w_sorted[chunk.start : chunk.stop] = dw
        if need_d:
            _write_weight_grad(grad_d, _gmm_weight_grad(hw.t(), dy, chunk, use_grouped_mm), lo, split_expert)
        del hw
        if need_db:
            grad_db[lo:hi] += _segment_sum(dy, chunk, expert, w)
        del dy
        if need_gu:
            part = _gmm_weight_grad(x_chunk.t(), dpre, chunk, use_grouped_mm)
            _write_weight_grad(grad_gu, part, lo, split_expert)
            del part
        del x_chunk
        if need_gub:
            grad_gub[lo:hi] += _segment_sum(dpre, chunk, expert, None)
        if need_x:
            dx_parts.append((chunk.start, _gmm(dpre, gate_up[lo:hi].transpose(1, 2), chunk, use_grouped_mm)))
        del dpre
        written_hi = hi

    for grad in (grad_gu, grad_d):
        if grad is not None:
            grad[written_hi:].zero_()  # empty experts after the last chunk (or all, with no chunk)
    grad_weights = None
    if need_w:  # back to (token, slot) order; sentinel pairs hold a zero gradient
        grad_weights = torch.empty_like(grad_w_sorted).index_copy_(0, plan.perm, grad_w_sorted)
        grad_weights = grad_weights.view(plan.num_tokens, plan.top_k)
    grad_x = _gather_rows_sum(dx_parts, x.shape[1], x, plan).to(x.dtype) if need_x else None
    grads = (grad_x, grad_weights, grad_gu, grad_gub, grad_d, grad_db)
    return [x.new_empty(0) if g is None else g for g in grads]


@_experts_backward_op.register_fake
def _(grad_out, x, top_k_index, top_k_weights, saved_pre, gate_up, gate_up_bias, down, down_bias, alpha, limit,
      chunk_rows, needs_grad):  # fmt: skip
    like = (x, top_k_weights.float(), gate_up, gate_up_bias, down, down_bias)
    return [torch.empty_like(t) if need else x.new_empty(0) for t, need in zip(like, needs_grad)]


def _experts_setup_context(ctx, inputs, output):
    x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, alpha, limit, chunk_rows, _ = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, output[1])
    ctx.params = (alpha, limit, chunk_rows)
    ctx.mark_non_differentiable(output[1])
    # the saved pre-activations get no gradient: without this autograd would hand the backward a zero-filled
    # [T * top_k, 2I] tensor for them (a 1.5 GB fill per layer at 32k tokens for gpt-oss-20b)
    ctx.set_materialize_grads(False)


def _experts_backward(ctx, grad_out, _grad_saved):
    if grad_out is None:  # the output took no part in the loss
        return (None,) * 11
    x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, saved_pre = ctx.saved_tensors
    need_x, _, need_w, *need_params = ctx.needs_input_grad[:7]
    needs = [need_x, need_w, *need_params]
    grads = _experts_backward_op(
        grad_out.contiguous(), x, top_k_index, top_k_weights, saved_pre, gate_up, gate_up_bias, down, down_bias,
        *ctx.params, needs,
    )  # fmt: skip
    grad_x, grad_w, grad_gu, grad_gub, grad_d, grad_db = (g if need else None for g, need in zip(grads, needs))
    if grad_w is not None:
        grad_w = grad_w.to(top_k_weights.dtype)
    return grad_x, None, grad_w, grad_gu, grad_gub, grad_d, grad_db, None, None, None, None


torch.library.register_autograd(EXPERTS_OP, _experts_backward, setup_context=_experts_setup_context)


def _write_weight_grad(grad: torch.Tensor, part: torch.Tensor, lo: int, split_expert: bool) -> None:
    """grad[lo:lo+len(part)] = part, except the expert a chunk boundary split (the first), which is added."""
    if split_expert:
        grad[lo] += part[0]
        grad[lo + 1 : lo + part.shape[0]].copy_(part[1:])
    else:
        grad[lo : lo + part.shape[0]].copy_(part)


def _sorted_weights(top_k_weights: torch.Tensor, plan: _RoutingPlan) -> torch.Tensor:
    return top_k_weights.reshape(-1).float().index_select(0, plan.perm)


# --------------------------------------------------------------------------------------------------------
# The registered experts forward.
# --------------------------------------------------------------------------------------------------------


def _check_gptoss_experts(module: torch.nn.Module) -> None:
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    missing = [n for n in names if not hasattr(module, n)]
    layout_ok = getattr(module, "is_transposed", True) and not getattr(module, "is_concatenated", False)
    if missing or not layout_ok:
        raise NotImplementedError(
            f'experts_implementation="memory_efficient" implements GPT-OSS experts only (biased, interleaved '
            f"gate/up, [E, H, 2I] weights); {type(module).__name__} "
            + (f"lacks {missing}" if missing else "has a different weight layout")
        )


def memory_efficient_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Experts forward for `GptOssExperts`, registered as ``"memory_efficient"`` in ``ALL_EXPERTS_FUNCTIONS``.

    Args:
        self: the `GptOssExperts` module (weights `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]` and biases).
        hidden_states: `[T, H]` router inputs.
        top_k_index: `[T, k]` expert of each (token, slot); values `>= num_experts` are EP sentinels and are
            skipped.
        top_k_weights: `[T, k]` routing weights (the router's top-k softmax).

    Returns:
        `[T, H]` in the dtype of `hidden_states`.

    Per-module knobs (plain attributes, optional): `experts_chunk_rows` (pairs per chunk, default
    `DEFAULT_CHUNK_ROWS`) and `experts_recompute_gate_up` (save no `[S, 2I]` activation, recompute the up
    projection in the backward; default False).
    """
    _check_gptoss_experts(self)
    if (
        hidden_states.dim() != 2
        or top_k_index.shape != top_k_weights.shape
        or top_k_index.shape[0] != hidden_states.shape[0]
    ):
        raise ValueError(
            f"expected hidden_states [T, H], top_k_index and top_k_weights [T, k]; got {tuple(hidden_states.shape)}, "
            f"{tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
        )
    config = getattr(self, "config", None)
    alpha = float(getattr(self, "alpha", getattr(config, "swiglu_alpha", _DEFAULT_ALPHA)))
    limit = float(getattr(self, "limit", getattr(config, "swiglu_limit", _DEFAULT_LIMIT)))
    chunk_rows = int(getattr(self, "experts_chunk_rows", DEFAULT_CHUNK_ROWS))
    recompute = bool(getattr(self, "experts_recompute_gate_up", False))

    weights = (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias)
    # Like transformers' grouped_mm: compute in the weights' dtype (autocast can hand us fp32 activations).
    x = hidden_states.to(self.gate_up_proj.dtype).contiguous()

    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or top_k_weights.requires_grad or any(p.requires_grad for p in weights)
    )
    # Everything runs in the weights' dtype on purpose: autocast must not recast the chunk matmuls.
    with torch.autocast(device_type=x.device.type, enabled=False):
        if needs_grad:
            out, _ = _experts_op(x, top_k_index, top_k_weights, *weights, alpha, limit, chunk_rows, not recompute)
        else:
            plan = _plan_routing(top_k_index, self.num_experts, chunk_rows, _use_sync_free_plan(x))
            out, _ = _experts_forward(x, _sorted_weights(top_k_weights, plan), plan, *weights, alpha, limit, False)
    return out.to(hidden_states.dtype)
