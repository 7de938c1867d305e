"""hf_gptoss_rl.logprobs: chunked per-token log-probs / entropies against a float64 full-logits reference."""

import os

import pytest
import torch

from hf_gptoss_rl import set_backends
from hf_gptoss_rl.logprobs import causal_lm_token_logprobs, chunked_logprobs
from hf_gptoss_rl.model_builders import tiny_gptoss_config


def _reference(hidden, weight, bias, targets, temperature):
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logps = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Both paths of the chunk math: PyTorch ops, and the fused Triton kernels (Triton's interpreter on CPU)."""
    if request.param == "triton":
        from hf_gptoss_rl import logprobs

        if logprobs._logprobs_triton is None:
            pytest.skip("triton is not importable")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 before triton is imported")
    set_backends(logprobs=request.param)
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 64])
@pytest.mark.parametrize("frozen_head", [False, True])  # frozen: the hidden-state gradient comes from the forward
def test_values_and_gradients_match_fp64(temperature, with_bias, chunk_size, frozen_head, backend):
    torch.manual_seed(0)
    n, h, v = 37, 24, 301
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.3).requires_grad_(not frozen_head)
    bias = (torch.randn(v) * 0.1).requires_grad_(not frozen_head) if with_bias else None
    targets = torch.randint(0, v, (n,))
    g_lp, g_h = torch.randn(n), torch.randn(n)

    logps, entropy = chunked_logprobs(
        hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size
    )
    ((logps * g_lp).sum() + (entropy * g_h).sum()).backward()
    grads = [hidden.grad] + ([] if frozen_head else [weight.grad] + ([bias.grad] if with_bias else []))

    leaves = [x.detach().double().requires_grad_() for x in [hidden, weight] + ([bias] if with_bias else [])]
    ref_lp, ref_h = _reference(leaves[0], leaves[1], leaves[2] if with_bias else None, targets, temperature)
    ((ref_lp * g_lp.double()).sum() + (ref_h * g_h.double()).sum()).backward()

    torch.testing.assert_close(logps.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), rtol=1e-5, atol=1e-5)
    assert len(grads) == (1 if frozen_head else 2 + with_bias)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got.double(), leaf.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_frozen_head_backward_skips_the_head_unless_the_entropy_needs_it(entropy_grad, backend, monkeypatch):
    """With a frozen head, the forward runs the vocabulary products (the logits and d log p / d hidden) and the
    backward none -- two passes over the head instead of three; an entropy gradient adds the recomputing pass.
    Under no_grad the forward runs only the logits."""
    from hf_gptoss_rl import logprobs

    products = []
    real_mm = logprobs._mm_fp32
    monkeypatch.setattr(logprobs, "_mm_fp32", lambda a, b: products.append(a.shape) or real_mm(a, b))
    torch.manual_seed(0)
    n, h, v, chunk = 10, 8, 64, 4
    hidden = torch.randn(n, h, requires_grad=True)
    weight, targets = torch.randn(v, h), torch.randint(0, v, (n,))
    chunks = -(-n // chunk)
    with torch.no_grad():
        chunked_logprobs(hidden, weight, targets, chunk_size=chunk)
    assert len(products) == chunks  # the logits only
    products.clear()
    logps, entropy = chunked_logprobs(hidden, weight, targets, chunk_size=chunk)
    assert len(products) == 2 * chunks
    products.clear()
    (logps.sum() + (entropy.sum() if entropy_grad else 0)).backward()
    assert len(products) == (2 * chunks if entropy_grad else 0)
    products.clear()
    # hidden_grad_in_forward=False: the forward runs the logits only, the backward recomputes them as for a
    # trained head (what a loss that differentiates the entropy wants); the same gradient
    grad = hidden.grad.clone()
    hidden.grad = None
    logps, entropy = chunked_logprobs(hidden, weight, targets, chunk_size=chunk, hidden_grad_in_forward=False)
    assert len(products) == chunks
    (logps.sum() + (entropy.sum() if entropy_grad else 0)).backward()
    assert len(products) == 3 * chunks
    torch.testing.assert_close(hidden.grad, grad, rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("grads", ["logps", "entropy", "both", "none"])
@pytest.mark.parametrize("frozen_head", [True, False])
def test_fused_kernels_match_torch_path(grads, frozen_head, monkeypatch):
    """The fused Triton kernels against the PyTorch ops on the same fp32 inputs: a vocabulary that is not a multiple
    of the tile, large logits (|z| ~ 40: the online max must rescale), a frozen head (bf16-style gradient in the
    head's dtype) and a trained head (fp32 logit gradients for the weight and bias)."""
    from hf_gptoss_rl import logprobs

    if logprobs._logprobs_triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1 (CPU tensors; the CUDA run is in test_gpu_integration.py)")
    torch.manual_seed(3)
    n, h, v = 11, 16, 700
    hidden0 = torch.randn(n, h) * 3
    weight0 = torch.randn(v, h)
    bias0 = torch.randn(v)
    targets = torch.randint(0, v, (n,))
    targets[0] = v - 1  # last column: inside the masked tail of the last tile
    g_lp, g_h = torch.randn(n), torch.randn(n)
    results = {}
    for name in ("torch", "triton", "fp64"):
        set_backends(logprobs="torch" if name == "fp64" else name)
        dtype = torch.float64 if name == "fp64" else torch.float32
        hidden = hidden0.to(dtype, copy=True).requires_grad_()
        weight = weight0.to(dtype, copy=True).requires_grad_(not frozen_head)
        bias = bias0.to(dtype, copy=True).requires_grad_(not frozen_head)
        logps, entropy = chunked_logprobs(hidden, weight, targets, bias=bias, temperature=0.9, chunk_size=4)
        loss = {
            "logps": (logps * g_lp).sum(),
            "entropy": (entropy * g_h).sum(),
            "both": (logps * g_lp).sum() + (entropy * g_h).sum(),
            "none": 0 * logps.sum(),
        }[grads]
        loss.backward()
        results[name] = [logps, entropy, hidden.grad] + ([] if frozen_head else [weight.grad, bias.grad])
    assert torch.isfinite(results["triton"][2]).all()
    # the fused kernels must be as accurate as the PyTorch ops (both against float64): with |z| ~ 40 the entropy
    # lse - E[z] cancels, and the fused online sums are measurably the more accurate of the two
    for got, ops, exact in zip(results["triton"], results["torch"], results["fp64"]):
        err_fused = (got.double() - exact).abs().max().item()
        err_ops = (ops.double() - exact).abs().max().item()
        assert err_fused <= 2 * err_ops + 2e-5 * max(1.0, exact.abs().max().item()), (err_fused, err_ops)


def test_fused_kernel_bad_logits_raise():
    from hf_gptoss_rl import logprobs

    if logprobs._logprobs_triton is None:
        pytest.skip("triton is not importable")
    with pytest.raises(ValueError, match="float32"):
        logprobs._logprobs_triton.row_stats(
            torch.zeros(2, 8, dtype=torch.float64), None, torch.zeros(2, dtype=torch.long), 1.0
        )
    with pytest.raises(ValueError, match="targets"):
        logprobs._logprobs_triton.row_stats(torch.zeros(2, 8), None, torch.zeros(3, dtype=torch.long), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("grads", ["both", "logps"])  # logps: the hidden-state gradient computed in the forward
def test_fused_kernels_cuda_gptoss_head_match_fp64(grads, monkeypatch):
    """On CUDA, the fused kernels (the default there) with GPT-OSS's head shape (vocab 201,088, hidden 2880, bf16,
    frozen): log-probs, entropies and the hidden-state gradient against float64, no worse than the PyTorch ops."""
    torch.manual_seed(0)
    n, h, v = 96, 2880, 201_088
    hidden0 = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") * 0.05).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device="cuda")
    g_lp, g_h = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    results = {}
    for name in ("torch", "triton", "fp64"):
        set_backends(logprobs="torch" if name == "fp64" else name)
        hidden = hidden0.to(torch.float64 if name == "fp64" else torch.bfloat16, copy=True).requires_grad_()
        w = weight.double() if name == "fp64" else weight
        logps, entropy = chunked_logprobs(hidden, w, targets, temperature=0.7, chunk_size=32)
        ((logps * g_lp).sum() + ((entropy * g_h).sum() if grads == "both" else 0)).backward()
        results[name] = [logps, entropy, hidden.grad]
        del w
    for got, ops, exact in zip(results["triton"], results["torch"], results["fp64"]):
        err_fused = ((got.double() - exact).norm() / exact.norm()).item()
        err_ops = ((ops.double() - exact).norm() / exact.norm()).item()
        assert err_fused <= 1.2 * err_ops + 1e-6, (err_fused, err_ops)
