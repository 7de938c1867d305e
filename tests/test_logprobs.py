"""hf_gptoss_rl.logprobs: chunked per-token log-probs / entropies against a float64 full-logits reference."""

import pytest
import torch

from hf_gptoss_rl.logprobs import causal_lm_token_logprobs, chunked_logprobs
from hf_gptoss_rl.testing import tiny_gptoss_config


def _reference(hidden, weight, bias, targets, temperature):
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logps = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 64])
def test_values_and_gradients_match_fp64(temperature, with_bias, chunk_size):
    torch.manual_seed(0)
    n, h, v = 37, 24, 301
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.3).requires_grad_()
    bias = (torch.randn(v) * 0.1).requires_grad_() if with_bias else None
    targets = torch.randint(0, v, (n,))
    g_lp, g_h = torch.randn(n), torch.randn(n)

    logps, entropy = chunked_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size)
    ((logps * g_lp).sum() + (entropy * g_h).sum()).backward()
    grads = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])

    leaves = [x.detach().double().requires_grad_() for x in [hidden, weight] + ([bias] if with_bias else [])]
    ref_lp, ref_h = _reference(leaves[0], leaves[1], leaves[2] if with_bias else None, targets, temperature)
    ((ref_lp * g_lp.double()).sum() + (ref_h * g_h.double()).sum()).backward()

    torch.testing.assert_close(logps.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), rtol=1e-5, atol=1e-5)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got.double(), leaf.grad, rtol=1e-4, atol=1e-5)


def test_no_full_vocab_tensor_is_kept_for_backward():
    """Autograd must not save any [N, vocab] tensor: only the inputs and [N] statistics."""
    torch.manual_seed(0)
    n, h, v = 256, 16, 4096
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logps, _ = chunked_logprobs(hidden, weight, torch.randint(0, v, (n,)), chunk_size=32)
    assert saved and max(saved) <= max(n * h, v * h)
    assert all(s < n * v for s in saved)
    logps.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_bad_inputs_raise():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="targets must lie"):
        chunked_logprobs(hidden, weight, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, torch.tensor([0, 1, 2, 3]), temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_logprobs(hidden, weight, torch.tensor([0, 1, 2]))


def test_causal_lm_matches_model_logits_tiny_gptoss():
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config(vocab_size=512)).eval()
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 512, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on row 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
        ref = torch.log_softmax(logits[:, -6:-1] / 0.8, -1).gather(-1, ids[:, -5:].unsqueeze(-1)).squeeze(-1)
        got, ent = causal_lm_token_logprobs(model, ids, mask, logits_to_keep=5, temperature=0.8, chunk_size=4)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    assert got.shape == ent.shape == (2, 5)


@pytest.mark.parametrize("which", ["logps", "entropy"])
def test_gradient_of_one_output_only(which):
    torch.manual_seed(1)
    hidden = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (9,))
    fn = lambda h, w: chunked_logprobs(h, w, targets, temperature=1.3, chunk_size=4)[0 if which == "logps" else 1]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight))
