"""Liger's RMSNorm on GPT-OSS with GPT-OSS's rounding (`hf_gptoss_rl.fused_layers`).

On CPU: the helper refuses clearly. On a GPU: the patched model matches an fp32 eager reference as closely as the
stock bf16 model does, in logits and every gradient, and keeps the very same weight parameters.
"""

from __future__ import annotations

import pytest
import torch

from hf_gptoss_rl.fused_layers import apply_liger_gptoss_rms_norm, liger_available
from hf_gptoss_rl.model_builders import tiny_gptoss_config

pytestmark = pytest.mark.skipif(not liger_available(), reason="liger-kernel is not installed")
from transformers import GptOssForCausalLM  # noqa: E402

VOCAB = 512


def test_refuses_a_cpu_model():
    model = GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB))
    with pytest.raises(ValueError, match="CUDA tensors only"):
        apply_liger_gptoss_rms_norm(model)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def forward_backward(model, ids):
    logits = model(input_ids=ids).logits.float()
    loss = logits.logsumexp(-1).mean() - logits[..., 3].mean()
    loss.backward()
    return logits.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("frozen_norms", [False, True], ids=["trained_norms", "frozen_norms"])
def test_liger_rms_norm_matches_gptoss_on_gpu(frozen_norms):
    """Liger's kernels with GPT-OSS's rounding against the stock bf16 model's error (fp32 reference); with frozen
    norm weights (LoRA) the backward is the input-gradient kernel of `hf_gptoss_rl._rms_norm_triton`."""
    torch.manual_seed(0)
    config = tiny_gptoss_config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, num_hidden_layers=2,
    )  # fmt: skip
    base = GptOssForCausalLM(config)
    ids = torch.randint(0, VOCAB, (2, 150), device="cuda")

    def make(dtype):
        model = GptOssForCausalLM(config).to("cuda", dtype)
        model.load_state_dict(base.state_dict())
        for name, p in model.named_parameters():
            if frozen_norms and ("layernorm" in name or name.endswith("norm.weight")):
                p.requires_grad_(False)
        return model

    ref_logits, ref_grads = forward_backward(make(torch.float32), ids)
    stock_logits, stock_grads = forward_backward(make(torch.bfloat16), ids)
    model = make(torch.bfloat16)
    weights = {n: p for n, p in model.named_parameters() if "layernorm" in n or n.endswith("norm.weight")}
    apply_liger_gptoss_rms_norm(model)
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    norms = [m for m in model.modules() if isinstance(m, LigerRMSNorm)]
    assert len(norms) == 2 * config.num_hidden_layers + 1 and all(m.casting_mode == "gemma" for m in norms)
    assert all(dict(model.named_parameters())[n] is p for n, p in weights.items())  # same Parameter objects

    if frozen_norms:
        hidden = torch.randn(4, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        assert type(norms[0](hidden).grad_fn).__name__ == "_RMSNormFrozenWeightBackward"
    logits, grads = forward_backward(model, ids)
    assert rel_err(logits, ref_logits) <= max(1.1 * rel_err(stock_logits, ref_logits), 1e-3)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert rel_err(grads[name], ref) <= max(1.1 * rel_err(stock_grads[name], ref), 1e-3), name
