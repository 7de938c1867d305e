"""`hf_gptoss_rl.lora`: PEFT LoRA under bf16 autocast without the input casts that autocast undoes (CPU).

Stock PEFT and the patched layers must give bitwise the same loss and gradients, with gradient checkpointing, while
the patched ones run fewer casts; outside autocast the patch changes nothing.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

peft = pytest.importorskip("peft")
from transformers import GptOssForCausalLM  # noqa: E402

from hf_gptoss_rl.lora import fuse_lora_update, skip_autocast_undone_lora_casts  # noqa: E402
from hf_gptoss_rl.model_builders import tiny_gptoss_config  # noqa: E402

VOCAB = 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class CastCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[tuple] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name == "aten::_to_copy" and args[0].dim() >= 2:
            self.counts[(args[0].dtype, out.dtype)] += 1
        return out


def lora_model(dropout: float = 0.0):
    torch.manual_seed(0)
    model = GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB)).to(torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, init_lora_weights=False)
    model = peft.get_peft_model(model, config)  # adapters in float32 (autocast_adapter_dtype=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def step(model, autocast: bool, seed: int = 0):
    input_ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    counter = CastCounter()
    torch.manual_seed(seed)  # the same dropout masks for both models
    with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.counts


def test_adapters_are_float32_on_a_bf16_model():
    model = lora_model()
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast_bf16", "no_autocast"])
def test_bitwise_stock_results_with_fewer_casts_under_autocast(autocast):
    stock = lora_model()
    patched = copy.deepcopy(stock)
    assert skip_autocast_undone_lora_casts(patched) == 4 * 2  # q/k/v/o of 2 layers
    assert skip_autocast_undone_lora_casts(patched) == 4 * 2  # idempotent: no second wrapper
    stock_loss, stock_grads, stock_casts = step(stock, autocast)
    loss, grads, casts = step(patched, autocast)
    assert torch.equal(loss, stock_loss)
    assert grads.keys() == stock_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, stock_grads[name]), name
    up, down = (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)
    if autocast:
        # forward only (the counter sees the forward): per LoRA module, PEFT's bf16 -> fp32 input copy and
        # autocast's fp32 -> bf16 copy of it for lora_A are gone
        assert stock_casts[up] - casts[up] == 8 and stock_casts[down] - casts[down] == 8
    else:
        assert casts == stock_casts


def test_dropout_layers_keep_the_cast():
    """Dropout in float32 then rounded is not always dropout in bf16: such layers cast as stock PEFT does."""
    stock = lora_model(dropout=0.1)
    patched = copy.deepcopy(stock)
    skip_autocast_undone_lora_casts(patched)
    stock_loss, stock_grads, stock_casts = step(stock, autocast=True)
    loss, grads, casts = step(patched, autocast=True)
    assert casts == stock_casts
    assert torch.equal(loss, stock_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, stock_grads[name]), name


def test_no_lora_layers_is_a_no_op():
    model = GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB))
    assert skip_autocast_undone_lora_casts(model) == 0


# --------------------------------------------------------------------------------------------------------
# fuse_lora_update: the adapter update added by the B product's epilogue
# --------------------------------------------------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def fused_pair(dtype=torch.bfloat16, **lora_kwargs):
    stock = lora_model(**lora_kwargs)
    if dtype != torch.bfloat16:
        stock = stock.to(dtype)
        stock.base_model.model.set_experts_implementation("eager")  # grouped_mm has no float64
    fused = copy.deepcopy(stock)
    return stock, fused


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast_bf16", "no_autocast"])
def test_fused_update_matches_peft_in_float64(autocast):
    """The same math: in float64 (autocast off; under CPU autocast only the bf16 products would change) the fused
    layers give PEFT's loss and gradients to rounding."""
    stock, fused = fused_pair(torch.float64)
    assert fuse_lora_update(fused) == 4 * 2
    assert fuse_lora_update(fused) == 4 * 2  # idempotent
    stock_loss, stock_grads, _ = step(stock, autocast=False)
    counter = OpCounter()
    with counter:
        loss, grads, _ = step(fused, autocast=False)
    assert counter.counts["aten::addmm"] > 0
    torch.testing.assert_close(loss, stock_loss, rtol=1e-12, atol=0)
    assert grads.keys() == stock_grads.keys() and any("lora_B" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-9, atol=1e-12, msg=name)


def lora_linear(dtype=torch.bfloat16, in_features=256, out_features=384, r=16):
    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(in_features, out_features, dtype=dtype))
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # adapter updates of the size of the base output (PEFT's init gives ~1e-2)
            p.data.normal_(0, 0.2)
    return model


def lora_linear_step(model, x, grad, autocast):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.backward(grad.to(out.dtype))
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().double(), x.grad.double(), grads


def test_fused_update_under_autocast_is_as_accurate_as_peft():
    """Under bf16 autocast the fused sum is rounded once (PEFT rounds the product, the scaled product and the sum):
    output and gradients of x, A and B at least as close to float64 as PEFT's."""
    stock = lora_linear()
    fused = copy.deepcopy(stock)
    reference = copy.deepcopy(stock).to(torch.float64)
    for model in (stock, fused):
        skip_autocast_undone_lora_casts(model)
    assert fuse_lora_update(fused) == 1
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=gen).to(torch.bfloat16)
    grad = torch.randn(512, 384, generator=gen)
    ref_out, ref_dx, ref_grads = lora_linear_step(reference, x.double(), grad.double(), autocast=False)
    stock_out, stock_dx, stock_grads = lora_linear_step(stock, x, grad, autocast=True)
    out, dx, grads = lora_linear_step(fused, x, grad, autocast=True)

    def err(a, b):
        return float((a - b).norm() / b.norm())

    assert err(out, ref_out) <= err(stock_out, ref_out)
    assert err(out, ref_out) < 5e-3
    assert err(dx, ref_dx) <= 1.1 * err(stock_dx, ref_dx)
    assert sorted(grads) == sorted(stock_grads) and len(grads) == 2  # lora_A, lora_B (the base is frozen)
    for name in grads:
        assert err(grads[name], ref_grads[name]) <= 1.1 * err(stock_grads[name], ref_grads[name]) + 1e-3, name


def test_fused_update_runs_fewer_passes_in_the_model():
    """On the GPT-OSS model under autocast: per LoRA module PEFT's scale and add are gone from the forward, and the
    loss stays within bf16 rounding of PEFT's."""
    stock = lora_model()
    fused = copy.deepcopy(stock)
    for model in (stock, fused):
        skip_autocast_undone_lora_casts(model)
    fuse_lora_update(fused)

    def run(model):
        counter = OpCounter()
        input_ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
        with counter, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss.detach(), counter.counts

    stock_loss, stock_ops = run(stock)
    loss, ops = run(fused)
    torch.testing.assert_close(loss, stock_loss, rtol=2e-2, atol=0)
    assert stock_ops["aten::mul"] - ops["aten::mul"] == 8
    assert stock_ops["aten::add"] - ops["aten::add"] == 8
    assert stock_ops["aten::mm"] - ops["aten::mm"] == 8  # lora_B's product is the addmm now
    assert ops["aten::addmm"] - stock_ops["aten::addmm"] == 8


@pytest.mark.parametrize(
    "case", ["dropout", "lora_bias", "dora", "merged", "disabled", "bf16_no_autocast_fp32_adapters", "hooked_lora_a"]
)
def test_fused_update_falls_back_to_peft(case):
    """Layers the fused product does not cover run PEFT's own forward: bitwise PEFT's results."""
    kwargs = {"dropout": 0.1} if case == "dropout" else {}
    stock = lora_model(**kwargs)
    if case in ("lora_bias", "dora"):
        torch.manual_seed(0)
        base = GptOssForCausalLM(tiny_gptoss_config(vocab_size=VOCAB)).to(torch.bfloat16)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
            lora_bias=case == "lora_bias", use_dora=case == "dora",
        )  # fmt: skip
        stock = peft.get_peft_model(base, config)
        stock.train()
    fused = copy.deepcopy(stock)
    fuse_lora_update(fused)
    if case == "merged":
        for model in (stock, fused):
            model.merge_adapter()
    if case == "disabled":
        for model in (stock, fused):
            model.base_model.disable_adapter_layers()
    if case == "hooked_lora_a":  # e.g. DeepSpeed ZeRO-3 gathering the adapter's weight in a pre-forward hook
        for model in (stock, fused):
            for name, module in model.named_modules():
                if name.endswith("lora_A.default"):
                    module.register_forward_pre_hook(lambda mod, args: None)
    autocast = case != "bf16_no_autocast_fp32_adapters"  # bf16 base output + fp32 adapters: PEFT's dtype promotion
    counter, stock_counter = OpCounter(), OpCounter()
    with counter:
        loss, grads, _ = step(fused, autocast=autocast)
    with stock_counter:
        stock_loss, stock_grads, _ = step(stock, autocast=autocast)
    assert counter.counts == stock_counter.counts  # the very ops of PEFT's forward and backward ran
    assert torch.equal(loss, stock_loss)
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, stock_grads[name]), name


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_fused_lora_function_gradcheck(with_bias):
    """The fused layer's hand-written backward against finite differences, every input trainable (float64)."""
    from hf_gptoss_rl.lora import _FusedLoraLinear

    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(7, 5, generator=gen), torch.randn(6, 5, generator=gen)
    bias = torch.randn(6, generator=gen) if with_bias else None
    lora_a, lora_b = torch.randn(3, 5, generator=gen), torch.randn(6, 3, generator=gen)
    inputs = [t.double().requires_grad_() if t is not None else None for t in (x, weight, bias, lora_a, lora_b)]

    def fn(x, weight, bias, lora_a, lora_b):
        return _FusedLoraLinear.apply(x, weight, bias, lora_a, lora_b, 0.75, torch.float64)

    assert torch.autograd.gradcheck(fn, tuple(inputs))
    ref = inputs[0] @ inputs[1].t() + 0.75 * (inputs[0] @ inputs[3].t()) @ inputs[4].t()
    if with_bias:
        ref = ref + inputs[2]
    torch.testing.assert_close(fn(*inputs), ref)
