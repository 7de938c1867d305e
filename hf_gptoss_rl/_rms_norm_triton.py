"""Triton kernel for the input gradient of GPT-OSS's RMSNorm with a frozen weight
(`hf_gptoss_rl.fused_layers.apply_liger_gptoss_rms_norm`).

GPT-OSS's RMSNorm in fp32, rounded once (``casting_mode="gemma"``, ``offset=0`` in Liger's terms)::

    r = 1 / sqrt(mean(x^2) + eps),   x_hat = x r,   y = w x_hat

and its input gradient, with dyw = dy * w::

    dx = r * (dyw - x_hat * mean(dyw * x_hat))

When the weight is frozen (LoRA on the attention projections) nothing else is needed: no weight-gradient partial sums,
and ``r`` is recomputed from the ``x`` row that is read anyway instead of being saved. One program takes `BLOCK_M`
whole rows (`BLOCK_N` >= the row length), so every row is read once and written once. Runs on CPU tensors under
TRITON_INTERPRET=1, which is how CI tests it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm_input_grad"]


@triton.jit
def _rms_norm_dx_kernel(
    X,
    W,
    DY,
    DX,
    n_rows,
    n_cols,
    stride_x,
    stride_dy,
    stride_dx,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    x_hat = x * rstd[:, None]
    dyw = dy * w[None, :]
    mean_dot = tl.sum(dyw * x_hat, axis=1) / n_cols
    dx = (dyw - x_hat * mean_dot[:, None]) * rstd[:, None]
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


def rms_norm_input_grad(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float) -> torch.Tensor:
    """dL/dx of ``(weight * x / sqrt(mean(x^2, -1) + eps))`` (fp32 math) for `grad` = dL/dy, in x's dtype and shape."""
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,) or grad.shape != x.shape:
        raise ValueError(
            f"rms_norm_input_grad: x {tuple(x.shape)}, weight {tuple(weight.shape)}, grad {tuple(grad.shape)}"
        )
    x2 = x.reshape(-1, n_cols)
    dy = grad.reshape(-1, n_cols)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if dx.numel() == 0:
        return dx.view(x.shape)
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, min(4, 8192 // block_n))  # ~8k fp32 values per array per program
    grid = (triton.cdiv(x2.shape[0], block_m),)
    _rms_norm_dx_kernel[grid](
        x2, weight, dy, dx, x2.shape[0], n_cols, x2.stride(0), dy.stride(0), dx.stride(0), float(eps),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8 if block_n >= 2048 else 4,
    )  # fmt: skip
    return dx.view(x.shape)
