"""The input gradient of GPT-OSS's RMSNorm with a frozen weight (`hf_gptoss_rl._rms_norm_triton`), which
`apply_liger_gptoss_rms_norm` uses as the backward of the Liger RMSNorm when the weight does not train.

The Triton kernel runs in Triton's interpreter on CPU (TRITON_INTERPRET=1, set by the root conftest on machines
without CUDA) and compiled on a GPU; checked against autograd through a float64 GPT-OSS RMSNorm on fresh random
inputs. The GPU check of the whole module (Liger forward + this backward inside a model) is in
`tests/test_fused_layers.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    from hf_gptoss_rl._rms_norm_triton import rms_norm_input_grad
except Exception:  # pragma: no cover - triton missing
    rms_norm_input_grad = None

TRITON_HERE = rms_norm_input_grad is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
pytestmark = pytest.mark.skipif(not TRITON_HERE, reason="needs triton (CUDA, or TRITON_INTERPRET=1 on CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gptoss_rms_norm(x, weight, eps):
    """transformers' GptOssRMSNorm.forward (fp32 math, weight multiplied in fp32, one rounding)."""
    h = x.to(torch.float32) if x.dtype != torch.float64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    "dtype, shape, tol",
    [
        (torch.float32, (3, 17, 64), 1e-5),  # rows that do not fill a block of rows
        (torch.float32, (5, 2880), 1e-5),  # GPT-OSS's hidden size: a masked 4096-wide block
        (torch.bfloat16, (9, 2880), 5e-3),
    ],
)
def test_input_grad_matches_float64_autograd(dtype, shape, tol):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    eps = 1e-5
    x64 = x.double().requires_grad_()
    gptoss_rms_norm(x64, weight.double(), eps).backward(grad.double())
    dx = rms_norm_input_grad(x.to(DEVICE), weight.to(DEVICE), grad.to(DEVICE), eps)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert rel_err(dx.cpu(), x64.grad) <= tol
    if dtype == torch.bfloat16:  # no worse than autograd through the stock bf16 module (fp32 math, one rounding)
        xs = x.clone().requires_grad_()
        gptoss_rms_norm(xs, weight, eps).backward(grad)
        # compiled, the fp32 result is rounded to nearest once; Triton's interpreter truncates fp32 -> bf16, which
        # doubles the rounding error there (as in tests/test_fused_rope.py)
        slack = 1.1 if dx.is_cuda else 2.1
        assert rel_err(dx.cpu(), x64.grad) <= slack * rel_err(xs.grad, x64.grad)


def test_bad_shapes_are_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_input_grad(x, torch.ones(7), torch.randn(4, 8), 1e-5)
    with pytest.raises(ValueError, match="grad"):
        rms_norm_input_grad(x, torch.ones(8), torch.randn(4, 7), 1e-5)
