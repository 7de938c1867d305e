"""Triton kernels for the chunked log-probs (`hf_gptoss_rl.logprobs`): one pass over a chunk's logits each way.

The LM-head matmuls stay in cuBLAS; these kernels fuse the elementwise work on one chunk's float32 logits
`x [C, V]` (V = 201,088 for GPT-OSS), which PyTorch ops spread over ~8 full passes (bias, temperature, logsumexp,
exp, p*z, sum in the forward; exp, shift, two scalings, the target term, temperature and the cast in the backward).
One program owns one row and streams it in `BLOCK_V` tiles.

Math, with `z = (x + b) / T`, `p = softmax(z)`, target `t`, upstream gradients `g_lp`, `g_H`:

    forward   (online over tiles, one read):   lse = m + log(sum exp(z - m)),  H = lse - sum(p z),  log p_t = z_t - lse
              the running sums s = sum exp(z - m) and u = sum exp(z - m) z are rescaled by exp(m_old - m_new)
              whenever the running max m grows, as in flash attention.
    backward  (one read, one write):           dL/dx = (p (-g_lp - g_H (z - (lse - H))) + onehot(t) g_lp) / T

All math is fp32. The backward writes the gradient in the dtype the following matmul wants (the head's dtype
when only the hidden states need it, fp32 when the head's weight or bias is trained), in place over the logits
when that dtype is fp32. Kernels run on CPU tensors under TRITON_INTERPRET=1, which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["grad_logits", "row_stats"]

# Tiles per row: wide enough that each thread issues 16-byte loads, small enough to keep 4+ programs per SM.
_CUDA_CONFIG = dict(BLOCK_V=4096, num_warps=8)
_INTERPRET_BLOCK_V = 256


def _config(t: torch.Tensor, vocab: int) -> dict:
    if t.is_cuda:
        return dict(_CUDA_CONFIG)
    return dict(BLOCK_V=min(_INTERPRET_BLOCK_V, triton.next_power_of_2(vocab)), num_warps=1)


@triton.jit
def _scaled_logits(row_base, Bias, offs, ok, inv_temp, HAS_BIAS: tl.constexpr):
    """One tile of `z = (x + b) / T` in fp32 (0 past the vocabulary)."""
    x = tl.load(row_base + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        x += tl.load(Bias + offs, mask=ok, other=0.0).to(tl.float32)
    return x * inv_temp


@triton.jit
def _row_stats_kernel(
    Logits, Bias, Targets, Lse, Logp, Entropy, V, stride_row, inv_temp, HAS_BIAS: tl.constexpr, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0)
    base = Logits + row.to(tl.int64) * stride_row
    offs0 = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running max of z
    s = 0.0  # running sum exp(z - m)
    u = 0.0  # running sum exp(z - m) * z
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        ok = offs < V
        z = _scaled_logits(base, Bias, offs, ok, inv_temp, HAS_BIAS)
        z_max = tl.max(tl.where(ok, z, float("-inf")), axis=0)
        m_new = tl.maximum(m, z_max)  # finite from the first tile on (offs 0 < V)
        alpha = tl.exp(m - m_new)  # exp(-inf) = 0 on the first tile
        e = tl.where(ok, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        u = u * alpha + tl.sum(e * z, axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(Targets + row)
    x_t = tl.load(base + target)
    if HAS_BIAS:
        x_t += tl.load(Bias + target).to(tl.float32)
    tl.store(Lse + row, lse)
    tl.store(Logp + row, x_t * inv_temp - lse)
    tl.store(Entropy + row, lse - u / s)


@triton.jit
def _grad_logits_kernel(
    Logits,
    Bias,
    Targets,
    Lse,
    Entropy,
    GradLogp,
    GradEntropy,
    Grad,
    V,
    stride_row,
    stride_grad_row,
    inv_temp,
    HAS_BIAS: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    base = Logits + row.to(tl.int64) * stride_row
    grad_base = Grad + row.to(tl.int64) * stride_grad_row
    offs0 = tl.arange(0, BLOCK_V)
    lse = tl.load(Lse + row)
    target = tl.load(Targets + row)
    g_lp = 0.0
    if HAS_GRAD_LOGP:
        g_lp = tl.load(GradLogp + row).to(tl.float32)
    g_h = 0.0
    mean_z = 0.0
    if HAS_GRAD_ENTROPY:
        g_h = tl.load(GradEntropy + row).to(tl.float32)
        mean_z = lse - tl.load(Entropy + row)  # E_p[z] = lse - H
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        ok = offs < V
        z = _scaled_logits(base, Bias, offs, ok, inv_temp, HAS_BIAS)
        p = tl.exp(z - lse)
        g = -p * (g_lp + g_h * (z - mean_z))
        if HAS_GRAD_LOGP:
            g = tl.where(offs == target, g + g_lp, g)
        tl.store(grad_base + offs, (g * inv_temp).to(Grad.dtype.element_ty), mask=ok)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype != torch.float32:
        raise ValueError(
            f"logits must be a float32 [rows, vocab] tensor with unit column stride, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [rows] for logits {tuple(logits.shape)}")


def row_stats(logits: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, inv_temperature: float):
    """`(lse, log p_target, entropy)`, each float32 `[rows]`, of `z = (logits + bias) * inv_temperature`."""
    _check(logits, targets)
    rows, vocab = logits.shape
    lse, logp, entropy = (torch.empty(rows, device=logits.device, dtype=torch.float32) for _ in range(3))
    if rows:
        _row_stats_kernel[(rows,)](
            logits,
            bias if bias is not None else logits,
            targets.contiguous(),
            lse,
            logp,
            entropy,
            vocab,
            logits.stride(0),
            float(inv_temperature),
            HAS_BIAS=bias is not None,
            **_config(logits, vocab),
        )
    return lse, logp, entropy


def grad_logits(
    logits, bias, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """d loss / d logits `[rows, vocab]` in `out_dtype` (written over `logits` when that is float32).

    `grad_logp` / `grad_entropy` are the upstream gradients `[rows]` of the log-probs and entropies (None = 0)."""
    _check(logits, targets)
    rows, vocab = logits.shape
    out = logits if out_dtype == torch.float32 else torch.empty_like(logits, dtype=out_dtype)
    if grad_logp is None and grad_entropy is None:
        return out.zero_()
    if rows:
        _grad_logits_kernel[(rows,)](
            logits,
            bias if bias is not None else logits,
            targets.contiguous(),
            lse.contiguous(),
            entropy.contiguous(),
            grad_logp.contiguous() if grad_logp is not None else lse,
            grad_entropy.contiguous() if grad_entropy is not None else lse,
            out,
            vocab,
            logits.stride(0),
            out.stride(0),
            float(inv_temperature),
            HAS_BIAS=bias is not None,
            HAS_GRAD_LOGP=grad_logp is not None,
            HAS_GRAD_ENTROPY=grad_entropy is not None,
            **_config(logits, vocab),
        )
    return out
