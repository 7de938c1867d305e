"""The whole patched stack on a CUDA GPU: a GPT-OSS with the sink kernel (Triton) and ``memory_efficient`` experts
matches the stock eager model in bf16, in logits and in every gradient, on padded batches, and decodes like it.

Skipped without CUDA (CI is CPU-only); run on a GPU with ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

import hf_gptoss_rl  # noqa: F401  (registers the kernel and the experts implementation)
from hf_gptoss_rl.model_builders import tiny_gptoss_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("kernels")
from transformers import GptOssForCausalLM  # noqa: E402

KERNEL = "hf-gptoss-rl/sink-flash-attn3"
VOCAB = 1024


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    """A GPT-OSS with real head_dim 64 and GQA 8:1 (the kernel's GPU tile shape), random sinks, sliding window 32."""
    torch.manual_seed(0)
    config = tiny_gptoss_config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=32,
        num_hidden_layers=2,
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks) * 2.0)
    path = tmp_path_factory.mktemp("gpu_gptoss")
    model.save_pretrained(path)
    return path


def load(path, attn: str, experts: str, dtype=torch.bfloat16) -> GptOssForCausalLM:
    return GptOssForCausalLM.from_pretrained(
        path, attn_implementation=attn, experts_implementation=experts, dtype=dtype
    ).cuda()


def padded_batch():
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 200), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :57] = 0  # left padding on the second row
    return ids, mask


def forward_backward(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    logits = out.logits.float()
    valid = mask.bool()
    loss = (logits.logsumexp(-1)[valid]).mean() - logits[..., 7][valid].mean()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits[valid].detach(), grads


def test_patched_stack_matches_eager_bf16(reference_model):
    ids, mask = padded_batch()
    # The fp32 eager model is the reference; bf16 eager shows the noise level bf16 itself allows.
    ref_logits, ref_grads = forward_backward(load(reference_model, "eager", "eager", torch.float32), ids, mask)
    eager_logits, eager_grads = forward_backward(load(reference_model, "eager", "eager"), ids, mask)
    ours_logits, ours_grads = forward_backward(load(reference_model, KERNEL, "memory_efficient"), ids, mask)

    assert rel_err(ours_logits, ref_logits) <= max(2 * rel_err(eager_logits, ref_logits), 1e-2)
    sink_names = [n for n in ref_grads if n.endswith("sinks")]
    assert sink_names and all(ours_grads[n].abs().sum() > 0 for n in sink_names)
    for name, ref in ref_grads.items():
        bound = max(2 * rel_err(eager_grads[name], ref), 2e-2)
        assert rel_err(ours_grads[name], ref) <= bound, name


def test_generate_matches_eager(reference_model):
    ids, mask = padded_batch()
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    eager = load(reference_model, "eager", "eager", torch.float32).generate(
        ids[:, :80], attention_mask=mask[:, :80], **kwargs
    )
    ours = load(reference_model, KERNEL, "memory_efficient", torch.float32).generate(
        ids[:, :80], attention_mask=mask[:, :80], **kwargs
    )
    assert torch.equal(eager, ours)
