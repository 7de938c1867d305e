"""Triton kernels for the memory-efficient GPT-OSS experts (`hf_gptoss_rl.experts`).

The matmuls run in `torch._grouped_mm`; these kernels fuse everything between and around them, so each
intermediate of a chunk is read and written once:

- `gate_forward`: adds the per-expert bias to the up-projection output (in place when the backward will reuse
  it) and applies GPT-OSS's clamped, interleaved gate:
      gate, up = pre[:, 0::2], pre[:, 1::2]
      h = (clamp(up, -limit, limit) + 1) * min(gate, limit) * sigmoid(alpha * min(gate, limit))
- `gate_backward`: from the saved (biased) pre-activation and g = dOut @ W_downᵀ (not yet weighted), writes
      dpre (interleaved), w * h (for the down-projection weight gradient) and rowsum(g * h) (the routing
      weight gradient without the down bias term), recomputing h instead of storing it.
- `gather_rows_sum`: out[t] = sum_k w[s] * (src[s] + bias[expert[s]]), s = position[t * top_k + k] (the
  sorted row of token t's k-th pair), in fp32 and in a fixed order: the combine over top-k and the
  input-gradient sum, one pass per call and no atomics (an fp32 atomic scatter-add of the chunks' rows took
  ~4x as long on an H200 and was not deterministic). `src` comes in parts, each chunk's matmul output as
  `torch._grouped_mm` returned it (rows [start_i, start_i + rows_i) of the sorted order): copying them into one
  buffer first cost a pass over `[S, H]` per chunk and direction.

Rows whose expert is outside [0, num_experts) (EP sentinels) are masked on the device: the gate kernels read
nothing of them (their input rows may be garbage, e.g. rows `torch._grouped_mm` left unwritten) and write
zeros, and the sum skips them. This lets a chunk hold sentinel rows without the host knowing where they
start.

All math is fp32; loads and stores use the tensors' dtypes. Kernels work on CPU tensors under
TRITON_INTERPRET=1 (set before this module is imported), which is how the CPU tests exercise them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _load_pairs(ptr, rows64, stride, col0, row_mask, n_inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Load pairs [col0, col0 + BLOCK_N) of an interleaved [R, 2I] tensor as one contiguous tile (wide loads);
    return the even (gate) and odd (up) columns, each [BLOCK_M, BLOCK_N]."""
    cols = 2 * col0 + tl.arange(0, 2 * BLOCK_N)
    mask = row_mask[:, None] & (cols < 2 * n_inter)[None, :]
    tile = tl.load(ptr + rows64[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    return tl.split(tl.reshape(tile, [BLOCK_M, BLOCK_N, 2]))


@triton.jit
def _store_pairs(ptr, rows64, stride, col0, row_mask, n_inter, even, odd, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store even/odd [BLOCK_M, BLOCK_N] tensors interleaved, as one contiguous [BLOCK_M, 2*BLOCK_N] tile."""
    cols = 2 * col0 + tl.arange(0, 2 * BLOCK_N)
    mask = row_mask[:, None] & (cols < 2 * n_inter)[None, :]
    tile = tl.reshape(tl.join(even, odd), [BLOCK_M, 2 * BLOCK_N])
    tl.store(ptr + rows64[:, None] * stride + cols[None, :], tile, mask=mask)


@triton.jit
def _gate_forward_kernel(
    pre_ptr,  # [R, 2I] up-projection output without bias
    pre_out_ptr,  # [R, 2I] receives pre + bias when STORE_PRE (may be pre_ptr itself: in place)
    bias_ptr,  # [E, 2I]
    expert_ptr,  # [R] global expert id of each row
    h_ptr,  # [R, I] gate output (unused when not WRITE_H)
    n_rows,
    n_inter,
    n_experts,
    stride_pre,
    stride_pre_out,
    stride_bias,
    stride_h,
    alpha,
    limit,
    STORE_PRE: tl.constexpr,
    WRITE_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # gate/up pair index in [0, I)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_inter)[None, :]
    expert = tl.load(expert_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    # Sentinel rows read nothing (garbage input, no bias row) and get finite zeros.
    valid = row_mask & (expert >= 0) & (expert < n_experts)
    expert = tl.where(valid, expert, 0)
    rows64 = rows.to(tl.int64)

    col0 = tl.program_id(1) * BLOCK_N
    gate, up = _load_pairs(pre_ptr, rows64, stride_pre, col0, valid, n_inter, BLOCK_M, BLOCK_N)
    gate_b, up_b = _load_pairs(bias_ptr, expert, stride_bias, col0, valid, n_inter, BLOCK_M, BLOCK_N)
    # Round to the storage dtype first so forward and backward see the same pre-activation.
    gate = (gate.to(tl.float32) + gate_b.to(tl.float32)).to(pre_ptr.dtype.element_ty)
    up = (up.to(tl.float32) + up_b.to(tl.float32)).to(pre_ptr.dtype.element_ty)
    if STORE_PRE:
        _store_pairs(pre_out_ptr, rows64, stride_pre_out, col0, row_mask, n_inter, gate, up, BLOCK_M, BLOCK_N)

    if WRITE_H:
        gate = tl.minimum(gate.to(tl.float32), limit)
        up = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
        h = tl.where(valid[:, None], (up + 1.0) * gate * _sigmoid(alpha * gate), 0.0)
        tl.store(h_ptr + rows64[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_backward_kernel(
    pre_ptr,  # [R, 2I] biased pre-activation
    g_ptr,  # [R, I] dOut[token] @ W_down[e]ᵀ
    w_ptr,  # [R] fp32 routing weight of each row
    expert_ptr,  # [R] global expert id of each row (when MASK_EXPERT)
    dpre_ptr,  # [R, 2I] out: gradient of the pre-activation (interleaved like pre)
    hw_ptr,  # [R, I] out: w * h (when WRITE_HW)
    dw_ptr,  # [n_col_blocks, R] fp32 out: partial rowsums of g * h per column block (when WRITE_DW)
    n_rows,
    n_inter,
    n_experts,
    stride_pre,
    stride_g,
    stride_dpre,
    stride_hw,
    alpha,
    limit,
    MASK_EXPERT: tl.constexpr,
    WRITE_HW: tl.constexpr,
    WRITE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_inter)[None, :]
    valid = row_mask
    if MASK_EXPERT:
        # Sentinel rows load zeros (their g is garbage), so every output of theirs is an exact zero.
        expert = tl.load(expert_ptr + rows, mask=row_mask, other=0)
        valid = row_mask & (expert >= 0) & (expert < n_experts)
    load_mask = valid[:, None] & (cols < n_inter)[None, :]
    rows64 = rows.to(tl.int64)
    w = tl.load(w_ptr + rows, mask=valid, other=0.0).to(tl.float32)

    col0 = tl.program_id(1) * BLOCK_N
    gate, up = _load_pairs(pre_ptr, rows64, stride_pre, col0, valid, n_inter, BLOCK_M, BLOCK_N)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    g = tl.load(g_ptr + rows64[:, None] * stride_g + cols[None, :], mask=load_mask, other=0.0).to(tl.float32)

    gate_c = tl.minimum(gate, limit)
    up_c = tl.minimum(tl.maximum(up, -limit), limit)
    sig = _sigmoid(alpha * gate_c)
    glu = gate_c * sig
    h = tl.where(valid[:, None], (up_c + 1.0) * glu, 0.0)
    if WRITE_DW:
        # Partial sums per column block, summed by the wrapper in a fixed order (deterministic, no atomics).
        tl.store(dw_ptr + tl.program_id(1) * n_rows + rows, tl.sum(g * h, axis=1), mask=row_mask)
    dh = g * w[:, None]
    # d/dgate [gate * sigmoid(alpha gate)] = sig + alpha * gate * sig * (1 - sig); clamp passes the
    # gradient where the input is inside the bounds (inclusive, as torch.clamp's backward does).
    d_gate = tl.where(gate <= limit, dh * (up_c + 1.0) * (sig + alpha * gate_c * sig * (1.0 - sig)), 0.0)
    d_up = tl.where((up >= -limit) & (up <= limit), dh * glu, 0.0)
    ty = dpre_ptr.dtype.element_ty
    _store_pairs(dpre_ptr, rows64, stride_dpre, col0, row_mask, n_inter, d_gate.to(ty), d_up.to(ty), BLOCK_M, BLOCK_N)
    if WRITE_HW:
        hw = (h * w[:, None]).to(hw_ptr.dtype.element_ty)
        tl.store(hw_ptr + rows64[:, None] * stride_hw + cols[None, :], hw, mask=mask)


@triton.jit
def _gather_rows_sum_kernel(
    out_ptr,  # [T, N] fp32
    src_parts,  # tuple of N_PARTS [rows_i, N] tensors: sorted rows [starts[i], starts[i] + rows_i), row stride stride_src
    starts,  # tuple of N_PARTS ints, increasing
    position_ptr,  # [T * TOP_K] sorted row of each (token, slot) pair
    w_ptr,  # [S] fp32 row scale, sorted order (when HAS_W)
    bias_ptr,  # [E, N] (when HAS_BIAS)
    expert_ptr,  # [S] expert of each sorted row
    n_tokens,
    n_cols,
    n_experts,
    stride_out,
    stride_src,
    stride_bias,
    N_PARTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_tokens
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # slots in order: the same sum on every run
        pos = tl.load(position_ptr + rows * TOP_K + k, mask=row_mask, other=0).to(tl.int64)
        expert = tl.load(expert_ptr + pos, mask=row_mask, other=-1).to(tl.int64)
        valid = row_mask & (expert >= 0) & (expert < n_experts)  # sentinel rows (garbage src) are skipped
        mask = valid[:, None] & col_mask[None, :]
        row_ptr = src_parts[0] + (pos - starts[0]) * stride_src  # the part holding sorted row `pos`
        for i in tl.static_range(1, N_PARTS):
            row_ptr = tl.where(pos >= starts[i], src_parts[i] + (pos - starts[i]) * stride_src, row_ptr)
        value = tl.load(row_ptr[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.where(valid, expert, 0)
            value += tl.load(bias_ptr + e[:, None] * stride_bias + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            value *= tl.load(w_ptr + pos, mask=valid, other=0.0).to(tl.float32)[:, None]
        acc += value
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])


def gate_forward(
    pre: torch.Tensor,
    bias: torch.Tensor,
    expert: torch.Tensor,
    alpha: float,
    limit: float,
    write_h: bool = True,
    store_pre: bool = True,
    pre_out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Return the gated activation `[R, I]` (or None); with `store_pre`, write `pre` + expert bias to `pre_out`
    (default: `pre` itself, in place). Rows whose expert is outside [0, bias.shape[0]) get zeros in both."""
    pre_out = pre if pre_out is None else pre_out
    n_rows, two_inter = pre.shape
    n_inter = two_inter // 2
    h = torch.empty(n_rows, n_inter, device=pre.device, dtype=pre.dtype) if write_h else pre
    if n_rows == 0:
        return h if write_h else None
    block_m, block_n = 32, 64
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_inter, block_n))
    _gate_forward_kernel[grid](
        pre, pre_out, bias, expert, h, n_rows, n_inter, bias.shape[0], pre.stride(0), pre_out.stride(0),
        bias.stride(0), h.stride(0), float(alpha), float(limit),
        STORE_PRE=store_pre, WRITE_H=write_h, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return h if write_h else None


def gate_backward(
    pre: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    alpha: float,
    limit: float,
    write_hw: bool,
    write_dw: bool,
    expert: torch.Tensor | None = None,
    num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Return (dpre `[R, 2I]`, w*h `[R, I]` or None, rowsum(g*h) `[R]` fp32 or None). With `expert`, rows whose
    expert is outside [0, num_experts) get exact zeros in all three (`pre`, `g` of those rows are not read)."""
    if expert is not None and num_experts is None:
        raise ValueError("gate_backward: `expert` needs `num_experts`")
    n_rows, two_inter = pre.shape
    n_inter = two_inter // 2
    dpre = torch.empty_like(pre)
    hw = torch.empty(n_rows, n_inter, device=pre.device, dtype=pre.dtype) if write_hw else None
    if n_rows == 0:
        return dpre, hw, (torch.zeros(0, device=pre.device) if write_dw else None)
    # 8 warps on 32 x 64 tiles: 381 us against 431 us with 4 (H200, [32768, 5760] bf16, the fastest of 14 shapes)
    block_m, block_n, num_warps = 32, 64, 8
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_inter, block_n))
    dw_parts = torch.empty(grid[1], n_rows, device=pre.device, dtype=torch.float32) if write_dw else None
    _gate_backward_kernel[grid](
        pre, g, w, expert if expert is not None else w, dpre, hw if write_hw else dpre,
        dw_parts if write_dw else w, n_rows, n_inter, num_experts or 0,
        pre.stride(0), g.stride(0), dpre.stride(0), hw.stride(0) if write_hw else 0, float(alpha), float(limit),
        MASK_EXPERT=expert is not None, WRITE_HW=write_hw, WRITE_DW=write_dw, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )  # fmt: skip
    return dpre, hw, (dw_parts.sum(0) if write_dw else None)


def gather_rows_sum(
    parts: list[tuple[int, torch.Tensor]],
    n_cols: int,
    position: torch.Tensor,
    expert: torch.Tensor,
    num_experts: int,
    top_k: int,
    w: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 `[T, n_cols]` with out[t] = sum over k of w[s] * (src[s] + bias[expert[s]]), s = position[t * top_k + k],
    where `src` is given as `parts`: (start, rows) with `rows` `[R_i, n_cols]` holding sorted rows
    [start, start + R_i), starts increasing, rows sharing one row stride. Rows whose expert is outside
    [0, num_experts) are skipped and need no part (`position` has T * top_k entries)."""
    n_pairs = position.shape[0]
    if n_pairs % top_k:
        raise ValueError(f"gather_rows_sum: {n_pairs} pair positions for top_k={top_k}")
    n_tokens = n_pairs // top_k
    out = torch.empty(n_tokens, n_cols, device=position.device, dtype=torch.float32)
    if not parts:  # no valid row: every pair is a sentinel
        return out.zero_()
    if n_tokens == 0 or n_cols == 0:
        return out
    starts = tuple(int(start) for start, _ in parts)
    srcs = tuple(rows for _, rows in parts)
    stride = srcs[0].stride(0)
    if any(r.shape[1] != n_cols or r.stride(1) != 1 or (r.shape[0] > 1 and r.stride(0) != stride) for r in srcs):
        raise ValueError(
            "gather_rows_sum: every part must be [rows, n_cols] with unit column stride and one row stride"
        )
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"gather_rows_sum: part starts must increase, got {starts}")
    block_m, block_n = 32, 128
    grid = (triton.cdiv(n_tokens, block_m), triton.cdiv(n_cols, block_n))
    _gather_rows_sum_kernel[grid](
        out, srcs, starts, position, w if w is not None else out, bias if bias is not None else out, expert,
        n_tokens, n_cols, num_experts, out.stride(0), stride, bias.stride(0) if bias is not None else 0,
        N_PARTS=len(srcs), TOP_K=top_k, HAS_W=w is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n,
    )  # fmt: skip
    return out
