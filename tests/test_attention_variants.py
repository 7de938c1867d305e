"""`hf_gptoss_rl.attention_variants`' `sink_kernel_span` route (the project's kernel on the valid tokens of a TRL
batch, packed into one varlen call per layer; the learning run's kernel arm without `kernels`) against the per-span
loop it replaced and against GPT-OSS eager attention with sinks, on batches that are left- and right-padded at once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_gptoss_rl import attention_variants

# [left pad | valid | right pad] per row; row 3 is empty (all pad), row 4 unpadded
SPANS = [(3, 10), (0, 7), (2, 12), (0, 0), (0, 14)]
SEQLEN = 14


def _mask(spans=SPANS, seqlen=SEQLEN) -> torch.Tensor:
    mask = torch.zeros(len(spans), seqlen, dtype=torch.long)
    for b, (start, end) in enumerate(spans):
        mask[b, start:end] = 1
    return mask


def _per_span_reference(module, query, key, value, mask, scaling, sliding_window, s_aux):
    """The replaced implementation: `flash_attn_func` once per row, on that row's valid span."""
    from hf_gptoss_rl.attention import import_kernel_sources

    kernel = import_kernel_sources()
    window = (sliding_window - 1, sliding_window - 1) if sliding_window is not None else (-1, -1)
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().flatten()
        if idx.numel() == 0:
            continue
        span = slice(idx[0].item(), idx[-1].item() + 1)
        out[b, span] = kernel.flash_attn_func(
            *(t[b : b + 1, :, span].transpose(1, 2) for t in (query, key, value)),
            softmax_scale=scaling, causal=True, window_size=window, s_aux=s_aux,
        )[0]  # fmt: skip
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("sliding_window", [None, 4])
def test_varlen_route_matches_per_span_kernel(backend, sliding_window, monkeypatch):
    """Outputs (zeros at pads) and q/k/v/sink gradients equal the per-span loop's; GQA, fp32."""
    if backend == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1 from the start")
    attention_variants.register_span_kernel_attention()
    # the route and the reference reach the kernel through import_kernel_sources: there, with the backend passed to
    # every call (the kernel reads SINK_FLASH_ATTN3_BACKEND once, at import; the root conftest set it to "torch")
    from hf_gptoss_rl import attention as hf_attention

    kernel, used = hf_attention.import_kernel_sources(), []

    def on(name):
        return lambda *args, **kwargs: used.append(name) or getattr(kernel, name)(*args, **kwargs, backend=backend)

    on_backend = SimpleNamespace(
        flash_attn_func=on("flash_attn_func"), flash_attn_varlen_func=on("flash_attn_varlen_func")
    )
    monkeypatch.setattr(hf_attention, "import_kernel_sources", lambda: on_backend)
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim = len(SPANS), 4, 2, 16
    leaves = [torch.randn(batch, h, SEQLEN, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
    sinks = torch.randn(heads, generator=g)
    mask = _mask()
    grad_out = torch.randn(batch, SEQLEN, heads, dim, generator=g)

    def run(fn):
        q, k, v = (t.clone().requires_grad_() for t in leaves)
        s = sinks.clone().requires_grad_()
        out = fn(q, k, v, s)
        (out * grad_out).sum().backward()
        return out.detach(), [t.grad for t in (q, k, v, s)]

    scaling = dim**-0.5
    new, new_grads = run(lambda q, k, v, s: attention_variants.varlen_sink_kernel_attention(
        None, q, k, v, mask, scaling=scaling, sliding_window=sliding_window, s_aux=s)[0])  # fmt: skip
    ref, ref_grads = run(lambda q, k, v, s: _per_span_reference(None, q, k, v, mask, scaling, sliding_window, s))
    pads = ~mask.bool()
    assert torch.all(new[pads] == 0)
    torch.testing.assert_close(new, ref, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkvs", new_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"grad {name}")
    assert set(used) == {"flash_attn_func", "flash_attn_varlen_func"}  # both ran on the backend under test
    # pad positions get no gradient at all (nothing leaks into the projections through pad tokens)
    for t in new_grads[:3]:
        assert torch.all(t.transpose(1, 2)[pads] == 0)


def test_varlen_route_matches_eager_gptoss():
    """A tiny GPT-OSS (sliding + full layer) on a left+right padded batch: logits at valid positions and every
    parameter gradient match eager attention with sinks (fp32, the kernel's PyTorch path)."""
    pytest.importorskip("transformers")
    from transformers import GptOssForCausalLM

    from hf_gptoss_rl.model_builders import tiny_gptoss_config

    name = attention_variants.register_span_kernel_attention()
    torch.manual_seed(0)
    config = tiny_gptoss_config(vocab_size=128, sliding_window=4)
    config._attn_implementation = "eager"
    config.use_cache = False
    assert config.layer_types[0] == "sliding_attention" and "full_attention" in config.layer_types
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("sinks"):
                param.normal_(1.0, 1.5)
    mask = _mask()
    input_ids = torch.randint(0, 128, mask.shape, generator=torch.Generator().manual_seed(1))
    valid = mask.bool()

    def run(attn):
        model.set_attn_implementation(attn)
        model.zero_grad()
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        logits[valid].logsumexp(-1).sum().backward()  # a loss on valid positions only
        return logits.detach()[valid], {n: p.grad.clone() for n, p in model.named_parameters()}

    eager_logits, eager_grads = run("eager")
    kernel_logits, kernel_grads = run(name)
    torch.testing.assert_close(kernel_logits, eager_logits, atol=2e-5, rtol=2e-5)
    for pname, grad in eager_grads.items():
        torch.testing.assert_close(kernel_grads[pname], grad, atol=2e-5, rtol=2e-4, msg=pname)
    assert kernel_grads["model.layers.0.self_attn.sinks"].abs().sum() > 0


def test_varlen_route_refuses_holes_and_packs_once_per_mask():
    attention_variants.register_span_kernel_attention()
    q = torch.randn(1, 4, 6, 16)
    k = v = torch.randn(1, 2, 6, 16)
    holey = torch.tensor([[1, 1, 0, 1, 1, 0]])
    with pytest.raises(ValueError, match="contiguous"):
        attention_variants.varlen_sink_kernel_attention(None, q, k, v, holey, scaling=0.25, s_aux=torch.zeros(4))
    # one packing (one host sync) per mask: transformers gives the same mask, or views of one tensor, to every layer
    base = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    first = attention_variants._varlen_packing(base)
    assert (
        attention_variants._varlen_packing(base[:, -6:]) is first and attention_variants._varlen_packing(base) is first
    )
    indices, cu_seqlens, longest = first
    assert indices.tolist() == [1, 2, 3, 4, 6, 7, 8] and cu_seqlens.tolist() == [0, 4, 7] and longest == 4
    base[1, 3] = 1  # in place: a new version, a new packing
    assert attention_variants._varlen_packing(base)[1].tolist() == [0, 4, 8]
