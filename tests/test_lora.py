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

from hf_gptoss_rl.lora import skip_autocast_undone_lora_casts  # noqa: E402
from hf_gptoss_rl.testing import tiny_gptoss_config  # noqa: E402

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
