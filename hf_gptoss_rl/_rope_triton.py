"""Triton kernel for GPT-OSS's rotary position embedding (`hf_gptoss_rl.fused_layers.apply_fused_gptoss_rope`).

GPT-OSS rotates the two halves of each head (not interleaved pairs), with `cos, sin [B, S, D/2]` shared by all heads:

    y1 = x1 cos - x2 sin          x = [x1 | x2],  y = [y1 | y2]
    y2 = x2 cos + x1 sin

The backward is the inverse rotation, i.e. the same kernel with `sin -> -sin`:

    dx1 = dy1 cos + dy2 sin,      dx2 = dy2 cos - dy1 sin

Stock transformers runs this as four multiplies, an add, a subtract and a `cat` (seven passes, each rounded to
bf16); here one program rotates a `[BLOCK_S tokens, BLOCK_H heads, D/2]` tile in fp32 and rounds once, reading x
with its strides (the projections' `[B, S, H, D]` memory seen as `[B, H, S, D]`) and writing the output in that same
memory order, so the attention kernel's `transpose(1, 2)` afterwards is contiguous and needs no copy.
Runs on CPU tensors under TRITON_INTERPRET=1, which is how CI tests it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotate_half_pairs"]

# Tiles of 16 tokens x 16 heads on a GPU; under the interpreter (numpy per block) small tiles keep CPU tests fast.
_CUDA_CONFIG = dict(BLOCK_S=16, BLOCK_H=16, num_warps=4)
_INTERPRET_CONFIG = dict(BLOCK_S=4, BLOCK_H=4, num_warps=1)


def _config(t: torch.Tensor) -> dict:
    return dict(_CUDA_CONFIG if t.is_cuda else _INTERPRET_CONFIG)


@triton.jit
def _rope_kernel(
    X,
    Cos,
    Sin,
    Out,
    S,
    H,
    stride_xb,
    stride_xh,
    stride_xs,
    stride_ob,
    stride_oh,
    stride_os,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_sb,
    stride_ss,
    stride_sd,
    HALF: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INVERSE: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    s_ok = offs_s < S
    cs_mask = s_ok[:, None]
    cos = tl.load(
        Cos + b * stride_cb + offs_s[:, None].to(tl.int64) * stride_cs + offs_d[None, :] * stride_cd,
        mask=cs_mask,
        other=0.0,
    ).to(tl.float32)
    sin = tl.load(
        Sin + b * stride_sb + offs_s[:, None].to(tl.int64) * stride_ss + offs_d[None, :] * stride_sd,
        mask=cs_mask,
        other=0.0,
    ).to(tl.float32)
    if INVERSE:
        sin = -sin
    cos = cos[:, None, :]  # [BLOCK_S, 1, HALF]: the same angles for every head
    sin = sin[:, None, :]
    mask = s_ok[:, None, None] & (offs_h < H)[None, :, None]
    x_off = (
        b * stride_xb
        + offs_s[:, None, None].to(tl.int64) * stride_xs
        + offs_h[None, :, None].to(tl.int64) * stride_xh
        + offs_d[None, None, :]
    )
    o_off = (
        b * stride_ob
        + offs_s[:, None, None].to(tl.int64) * stride_os
        + offs_h[None, :, None].to(tl.int64) * stride_oh
        + offs_d[None, None, :]
    )
    x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + o_off, (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(Out + o_off + HALF, (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate `x [B, H, S, D]` (any strides, unit stride on D) by `cos, sin [B or 1, S, D/2]` (any strides: some
    transformers versions build them as a transposed matmul); `inverse=True` rotates back (the backward).

    The result has x's shape, dtype and memory order (``torch.empty_like``)."""
    if x.dim() != 4 or x.stride(-1) != 1:
        raise ValueError(
            f"x must be [batch, heads, seq, head_dim] with a unit last stride, got {tuple(x.shape)} "
            f"strides {x.stride()}"
        )
    batch, heads, seq, head_dim = x.shape
    half = head_dim // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[1:] != (seq, half) or t.shape[0] not in (1, batch):
            raise ValueError(f"{name} must be [batch or 1, {seq}, {half}] for x {tuple(x.shape)}, got {tuple(t.shape)}")
    if head_dim % 2 or half & (half - 1):
        raise ValueError(f"head_dim must be twice a power of two, got {head_dim}")
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    config = _config(x)
    grid = (triton.cdiv(seq, config["BLOCK_S"]), triton.cdiv(heads, config["BLOCK_H"]), batch)
    _rope_kernel[grid](
        x,
        cos,
        sin,
        out,
        seq,
        heads,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(1),
        cos.stride(2),
        sin.stride(0) if sin.shape[0] > 1 else 0,
        sin.stride(1),
        sin.stride(2),
        HALF=half,
        INVERSE=inverse,
        **config,
    )
    return out
