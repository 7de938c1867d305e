"""Selective activation checkpointing (`hf_gptoss_rl.checkpointing`) on a tiny GPT-OSS, on CPU.

Keeping the sink kernel's and the experts op's outputs must skip exactly those ops in the recompute and leave
every gradient bitwise equal to plain checkpointing.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_gptoss_rl  # noqa: F401  (registers the kernel id and the experts implementation)
from hf_gptoss_rl import checkpointing
from hf_gptoss_rl.attention import ATTN_IMPLEMENTATION
from hf_gptoss_rl.checkpointing import (
    experts_max_tokens_for_memory,
    kept_experts_bytes_per_token,
    selective_checkpoint_policy,
    selective_checkpointing_kwargs,
)
from hf_gptoss_rl.model_builders import tiny_gptoss_config

pytest.importorskip("kernels")
from transformers import GptOssForCausalLM  # noqa: E402

VOCAB = 96
NUM_LAYERS = 2


class OpCounter(TorchDispatchMode):
    """Counts the ops that actually run (an op SAC serves from its cache never reaches this outer mode)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.products: Counter[int] = Counter()  # matrix products run, by inner dimension

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.endswith("::fwd") and "sink_flash_attn3" in name:
            self.counts["attention"] += 1
        elif name == "hf_gptoss_rl::memory_efficient_experts":
            self.counts["experts"] += 1
        elif name in ("aten::addmm", "aten::mm"):
            inner = args[1].shape[-1] if name == "aten::addmm" else args[0].shape[-1]
            self.products[inner] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def state_dict():
    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB, num_hidden_layers=NUM_LAYERS))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks) * 2.0)
    return model.state_dict()


def run_step(state_dict, checkpoint_kwargs, lora_rank=None, counter=None, fused_lora=False):
    """One forward + backward (with LoRA adapters of `lora_rank` on q/k/v/o, as peft adds them, if given, their
    update fused into the products with `fused_lora`); returns (op counts, loss, {name: grad})."""
    model = GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB, num_hidden_layers=NUM_LAYERS))
    model.load_state_dict(state_dict)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.set_experts_implementation("memory_efficient")
    model.train()
    if checkpoint_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(2)
        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        for name, p in model.named_parameters():  # peft zero-initialises lora_B: make every adapter matter
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        if fused_lora:
            from hf_gptoss_rl.lora import fuse_lora_update

            assert fuse_lora_update(model) == 4 * NUM_LAYERS
    input_ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    counter = counter if counter is not None else OpCounter()
    with counter:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return counter.counts, loss.detach(), grads


@pytest.mark.parametrize(
    "save, expected",
    [
        ((), {"attention": 2 * NUM_LAYERS, "experts": 2 * NUM_LAYERS}),
        (("attention",), {"attention": NUM_LAYERS, "experts": 2 * NUM_LAYERS}),
        ("attention,experts", {"attention": NUM_LAYERS, "experts": NUM_LAYERS}),
        (("experts",), {"attention": 2 * NUM_LAYERS, "experts": NUM_LAYERS}),
    ],
)
def test_saved_ops_skip_the_recompute_and_gradients_are_bitwise_equal(state_dict, save, expected):
    plain_counts, plain_loss, plain_grads = run_step(state_dict, {"use_reentrant": False})
    assert dict(plain_counts) == {"attention": 2 * NUM_LAYERS, "experts": 2 * NUM_LAYERS}  # forward + recompute

    counts, loss, grads = run_step(state_dict, selective_checkpointing_kwargs(save))
    assert dict(counts) == expected
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    assert any("sinks" in name for name in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def test_selective_checkpointing_matches_no_checkpointing(state_dict):
    _, ref_loss, ref_grads = run_step(state_dict, None)
    counts, loss, grads = run_step(state_dict, selective_checkpointing_kwargs(("attention", "experts")))
    assert dict(counts) == {"attention": NUM_LAYERS, "experts": NUM_LAYERS}
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("fused_lora", [False, True], ids=["peft_lora", "fused_lora"])
def test_projections_keep_the_compute_bound_products(state_dict, monkeypatch, fused_lora):
    """``"projections"`` keeps q/k/v/o and the router's products (inner dimension >= the bound: the tiny model's
    hidden size here) and recomputes LoRA's rank-r ``lora_B`` products (with `fuse_lora_update`, the rank-r update
    products); gradients, LoRA's included, stay bitwise those of plain checkpointing."""
    monkeypatch.setattr(checkpointing, "PROJECTION_MIN_INNER_DIM", 64)
    config = tiny_gptoss_config(vocab_size=VOCAB, num_hidden_layers=NUM_LAYERS)
    assert config.hidden_size == config.num_attention_heads * config.head_dim == 64
    rank = 4
    plain = OpCounter()
    _, plain_loss, plain_grads = run_step(
        state_dict, {"use_reentrant": False}, lora_rank=rank, counter=plain, fused_lora=fused_lora
    )
    kept = OpCounter()
    counts, loss, grads = run_step(
        state_dict,
        selective_checkpointing_kwargs(("attention", "experts", "projections")),
        lora_rank=rank,
        counter=kept,
        fused_lora=fused_lora,
    )
    assert dict(counts) == {"attention": NUM_LAYERS, "experts": NUM_LAYERS}
    # per layer, the recompute skips q, k, v, o (base and lora_A: 8 products of inner dimension 64) and the router
    assert plain.products[64] - kept.products[64] == 9 * NUM_LAYERS
    assert plain.products[rank] == kept.products[rank] > 0  # lora_B products: recomputed, as in plain checkpointing
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and any("lora_A" in name for name in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


@pytest.mark.parametrize("max_tokens, experts_runs", [(42, NUM_LAYERS), (41, 2 * NUM_LAYERS), (0, 2 * NUM_LAYERS)])
def test_experts_max_tokens_bounds_what_is_kept(state_dict, max_tokens, experts_runs):
    """A micro-batch of 2 x 21 = 42 tokens keeps the experts outputs up to a bound of 42 tokens and recomputes them
    below it; attention is kept either way and the gradients stay bitwise those of plain checkpointing."""
    _, plain_loss, plain_grads = run_step(state_dict, {"use_reentrant": False})
    kwargs = selective_checkpointing_kwargs(("attention", "experts"), experts_max_tokens=max_tokens)
    counts, loss, grads = run_step(state_dict, kwargs)
    assert dict(counts) == {"attention": NUM_LAYERS, "experts": experts_runs}
    assert torch.equal(loss, plain_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def test_experts_max_tokens_for_memory_on_gpt_oss_20b():
    """The memory rule on gpt-oss-20b's shapes: 51,840 bytes per token and layer in bf16 (output [2880] + biased
    up-projection [4, 5760]); half of what 39 GiB of weights leave on a 140 GiB GPU keeps 32k-token micro-batches'
    experts outputs (38 GiB over 24 layers) and not 64k ones (76 GiB)."""
    from transformers import GptOssConfig

    config = GptOssConfig(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4
    )
    assert kept_experts_bytes_per_token(config) == 51_840
    assert kept_experts_bytes_per_token(config, dtype_bytes=4) == 103_680
    free = (140 - 39) * 2**30
    tokens = experts_max_tokens_for_memory(config, free)
    assert tokens == int(0.5 * free) // (51_840 * 24)
    assert 32_768 < tokens < 65_536
    assert experts_max_tokens_for_memory(config, free, fraction=1.0) == free // (51_840 * 24)
    assert experts_max_tokens_for_memory(config, -1) == 0  # weights larger than the GPU: keep nothing
    with pytest.raises(ValueError, match="fraction"):
        experts_max_tokens_for_memory(config, free, fraction=0)


def test_bad_arguments_are_refused():
    for bad in (-1, 1.5, True, "32k"):
        with pytest.raises(ValueError, match="experts_max_tokens"):
            selective_checkpoint_policy(("experts",), experts_max_tokens=bad)
    with pytest.raises(ValueError, match="unknown checkpoint save target"):
        selective_checkpoint_policy(("attention", "mlp"))
    with pytest.raises(ValueError, match="use_reentrant=False"):
        selective_checkpointing_kwargs(("attention",), use_reentrant=True)
    with pytest.raises(ValueError, match="context_fn"):
        selective_checkpointing_kwargs(("attention",), context_fn=lambda: None)
