"""The fused GPT-OSS rotary embedding (`hf_gptoss_rl.fused_layers.apply_fused_gptoss_rope`, `_rope_triton`).

The Triton kernel runs in Triton's interpreter on CPU (TRITON_INTERPRET=1, set by the root conftest on machines
without CUDA) and compiled on a GPU. Checked against a float64 reference of GPT-OSS's own `_apply_rotary_emb`,
forward and backward, on the strided layout the projections produce; then a tiny GPT-OSS patched with it against
the unpatched model.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import GptOssForCausalLM
from transformers.models.gpt_oss import modeling_gpt_oss

from hf_gptoss_rl import fused_layers, set_backends
from hf_gptoss_rl.model_builders import tiny_gptoss_config

try:
    from hf_gptoss_rl import _rope_triton
except Exception:  # pragma: no cover - triton missing
    _rope_triton = None

TRITON_HERE = _rope_triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="needs triton (CUDA, or TRITON_INTERPRET=1 on CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def restore_rope(monkeypatch):
    """apply_fused_gptoss_rope swaps a module-level function: put the original back after the test."""
    monkeypatch.setattr(modeling_gpt_oss, "apply_rotary_pos_emb", modeling_gpt_oss.apply_rotary_pos_emb)
    if DEVICE == "cpu":
        set_backends(rope="triton")


def projected(batch, seq, heads, head_dim, dtype, seed):
    """q as GPT-OSS makes it: `proj(x).view(B, S, H, D).transpose(1, 2)` (a strided [B, H, S, D] view)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, heads, head_dim, generator=g).to(DEVICE, dtype).transpose(1, 2)


def angles(batch, seq, half, dtype, seed, transposed=False):
    """cos, sin [batch, seq, half]; `transposed`: built as the transpose of [batch, half, seq] (non-unit last
    stride), as transformers versions that compute the angles with `inv_freq @ position_ids` return them."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(batch, seq, half, generator=g, dtype=torch.float64) * 50
    cos, sin = theta.cos().to(DEVICE, dtype), theta.sin().to(DEVICE, dtype)
    if transposed:
        cos, sin = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (cos, sin))
    return cos, sin


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,cos_batch,seq,heads,head_dim,transposed",
    [(2, 2, 13, 5, 64, False), (1, 1, 7, 3, 16, True), (3, 1, 5, 17, 128, False)],
)
def test_kernel_matches_fp64_forward_and_backward(dtype, batch, cos_batch, seq, heads, head_dim, transposed):
    x = projected(batch, seq, heads, head_dim, dtype, seed=1).requires_grad_()
    cos, sin = angles(cos_batch, seq, head_dim // 2, dtype, seed=2, transposed=transposed)
    assert cos.stride(-1) != 1 if transposed and seq > 1 else True
    grad = projected(batch, seq, heads, head_dim, dtype, seed=3)

    out = fused_layers._FusedRotary.apply(x, cos, sin)
    out.backward(grad)
    assert out.shape == x.shape and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # the projections' memory order: no copy before the attention call

    x64 = x.detach().double().requires_grad_()
    ref = modeling_gpt_oss._apply_rotary_emb(x64, cos.double().unsqueeze(1), sin.double().unsqueeze(1))
    ref.backward(grad.double())
    # the stock path on the same inputs, in the same dtype: the fused kernel must be at least as accurate
    xs = x.detach().clone().requires_grad_()
    stock = modeling_gpt_oss._apply_rotary_emb(xs, cos.unsqueeze(1), sin.unsqueeze(1))
    stock.backward(grad)
    if dtype == torch.float32:
        assert rel_err(out, ref) < 1e-6 and rel_err(x.grad, x64.grad) < 1e-6
    else:
        # compiled, the fp32 result is rounded to nearest once; Triton's interpreter truncates fp32 -> bf16 (even with
        # fp_downcast_rounding="rtne", triton 3.9), which doubles the rounding error there
        slack = 1.05 if x.is_cuda else 2.0
        assert rel_err(out, ref) <= rel_err(stock, ref) * slack + 1e-7
        assert rel_err(x.grad, x64.grad) <= rel_err(xs.grad, x64.grad) * slack + 1e-7
        assert rel_err(out, ref) < (3e-3 if x.is_cuda else 6e-3)


@needs_triton
def test_kernel_rejects_bad_shapes():
    x = projected(1, 6, 2, 64, torch.float32, seed=0)
    cos, sin = angles(1, 6, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="cos must be"):
        _rope_triton.rotate_half_pairs(x, cos[:, :5], sin)
    with pytest.raises(ValueError, match="x must be"):
        _rope_triton.rotate_half_pairs(x[0], cos, sin)
    with pytest.raises(ValueError, match="head_dim"):
        _rope_triton.rotate_half_pairs(projected(1, 6, 2, 24, torch.float32, 0), *angles(1, 6, 12, torch.float32, 0))


@needs_triton
def test_patched_tiny_gptoss_matches_stock(restore_rope):
    torch.manual_seed(0)
    config = tiny_gptoss_config(vocab_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = GptOssForCausalLM(config).to(DEVICE)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 256, (2, 11), device=DEVICE)

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        (logits.float().logsumexp(-1).mean()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = run()
    original = modeling_gpt_oss.apply_rotary_pos_emb
    assert fused_layers.apply_fused_gptoss_rope(model) is model
    fused_layers.apply_fused_gptoss_rope(model)  # idempotent: wraps once
    assert modeling_gpt_oss.apply_rotary_pos_emb.hf_gptoss_rl_original is original

    # the angles as the transformers versions that build them with a transposed matmul (5.17) pass them
    rotary = model.model.rotary_emb
    real_rotary_forward = rotary.forward
    rotary.forward = lambda *a, **kw: tuple(
        t.transpose(1, 2).contiguous().transpose(1, 2) for t in real_rotary_forward(*a, **kw)
    )
    calls = []
    real_apply = fused_layers._FusedRotary.apply
    fused_layers._FusedRotary.apply = lambda *a: calls.append(1) or real_apply(*a)
    try:
        logits, grads = run()
    finally:
        fused_layers._FusedRotary.apply = real_apply
    assert len(calls) == 2 * config.num_hidden_layers  # q and k of every layer went through the kernel
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_dispatcher_falls_back_to_the_original(restore_rope):
    """Calls the kernel does not take (here: backend torch, a cos that needs a gradient) run the original."""
    set_backends(rope="torch")
    q = projected(1, 5, 2, 16, torch.float32, seed=4)
    k = projected(1, 5, 1, 16, torch.float32, seed=5)
    cos, sin = angles(1, 5, 8, torch.float32, seed=6)
    want = modeling_gpt_oss.apply_rotary_pos_emb(q, k, cos, sin)
    got = fused_layers.fused_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    set_backends(rope="triton")
    cos_g = cos.clone().requires_grad_()
    got = fused_layers.fused_rotary_pos_emb(q, k, cos_g, sin)
    assert got[0].grad_fn is not None and "Fused" not in type(got[0].grad_fn).__name__
    with pytest.raises(ValueError, match="backend rope must be auto, torch or triton, got 'bogus'"):
        set_backends(rope="bogus")


def test_refuses_a_model_without_gptoss_attention():
    with pytest.raises(ValueError, match="GptOssAttention"):
        fused_layers.apply_fused_gptoss_rope(torch.nn.Linear(2, 2))
