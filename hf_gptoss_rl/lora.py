"""PEFT LoRA layers for training: no input copies that autocast undoes, and the adapter update in one product.

PEFT keeps LoRA adapters in float32 on a bf16 model (``get_peft_model``'s ``autocast_adapter_dtype=True``) and casts
each LoRA layer's input to the adapter's dtype before the adapter matmuls (``peft.tuners.lora.layer.Linear.forward``
calls ``BaseTunerLayer._cast_input_dtype``). Under bf16 autocast (``bf16=True``: accelerate wraps the forward in
``torch.autocast``) those matmuls run in bf16 anyway, so autocast casts the float32 copy straight back: two
``[tokens, in_features]`` copies per LoRA module and pass (four for q/k/v/o on GPT-OSS: ``[T, 2880]`` three times and
``[T, 4096]`` once per layer), in the forward, the checkpointed recompute and the backward, for values that are
bitwise the same as the input's.

:func:`skip_autocast_undone_lora_casts` keeps the input as it is exactly when autocast would cast it back (autocast
on for the input's device, in the input's dtype): the adapter matmuls see the same bf16 operands, so outputs and
gradients are bitwise those of stock PEFT (``tests/test_lora.py``). Outside autocast, or with an autocast dtype other
than the input's, PEFT casts as before. Layers whose result could depend on the cast are left alone: LoRA variants
(DoRA, ...) and a non-zero ``lora_dropout`` (dropout in float32 then rounded is not always dropout in bf16).

:func:`fuse_lora_update` computes a LoRA ``Linear`` layer as two matrix products instead of PEFT's five passes
over the layer's ``[tokens, out_features]`` output, and its input gradient as one. PEFT computes
``base_layer(x) + lora_B(lora_A(x)) * scaling``: the base product and ``lora_B`` each write the output's size, the
scaling reads and writes it, the sum reads two and writes one; in the backward the gradient is scaled once more
and autograd sums the base's and ``lora_A``'s input gradients (two more passes over ``[tokens, in_features]``). The
patched layers run one autograd function::

    a = x @ A.T
    update = torch.addmm(bias, a, B.T, alpha=scaling)        # bias + scaling * B A x (rank-r product)
    y = torch.addmm(update, x, W.T)                          # + W x
    backward:  dx = g @ W, then dx += scaling * (g @ B) @ A in place (one addmm_)

The output is rounded twice instead of four times and the input gradient once instead of three times (not bitwise
PEFT's). The layer's output is the output of its base product, which matters with selective checkpointing
(``hf_gptoss_rl.checkpointing``, ``"projections"``): it keeps that product's output (and ``a``), so the recompute
re-runs only the rank-r ``update`` product instead of the adapter's product, scale and sum. Applied to layers with
one active vanilla LoRA adapter over a plain ``nn.Linear`` (no hooks, no sharded or quantized weight) called as
``layer(x)``, whose ``lora_B`` has no bias and whose operands share a dtype (or that run under autocast); anything
else (a merged or disabled adapter, several active adapters, mixed-adapter batches, LoRA variants, dropout,
``lora_bias``, ``fan_in_fan_out``) runs PEFT's own forward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["fuse_lora_update", "skip_autocast_undone_lora_casts"]


def _autocast_undoes_cast(x: torch.Tensor, dtype: torch.dtype) -> bool:
    device = x.device.type
    return (
        x.dtype != dtype
        and x.is_floating_point()
        and torch.is_autocast_enabled(device)
        and torch.get_autocast_dtype(device) == x.dtype
    )


def _eligible(module: nn.Module) -> bool:
    """A vanilla LoRA layer: no LoRA variant, every adapter's dropout an identity (checked at each call: adapters
    can be added after the patch)."""
    if getattr(module, "lora_variant", None):
        return False
    dropouts = getattr(module, "lora_dropout", None)
    return isinstance(dropouts, nn.ModuleDict) and all(isinstance(d, nn.Identity) for d in dropouts.values())


def _cast_unless_autocast_undoes_it(module, original, x, dtype):
    if x is not None and _autocast_undoes_cast(x, dtype) and _eligible(module):
        return x
    return original(x, dtype)


def _patch_lora_layers(model: nn.Module, layer_class: str, method: str, flag: str, wrapper) -> int:
    """Wrap `method` of every PEFT LoRA layer of class `layer_class` in `model` as ``wrapper(module, original, ...)``
    (an instance attribute shadowing the class's method; `original` is the bound stock method), once per layer.
    Returns the number of such layers (0 when ``peft`` is not installed)."""
    try:
        from peft.tuners import lora
    except ImportError:
        return 0
    patched = 0
    for module in model.modules():
        if not isinstance(module, getattr(lora, layer_class)):
            continue
        if not getattr(module, flag, False):
            setattr(module, method, functools.partial(wrapper, module, getattr(module, method)))
            setattr(module, flag, True)
        patched += 1
    return patched


def skip_autocast_undone_lora_casts(model: nn.Module) -> int:
    """Make the LoRA layers of ``model`` skip the input cast that autocast would undo (see the module docstring);
    idempotent. Returns the number of LoRA layers patched (0 when ``peft`` is not installed or the model has no LoRA
    layer)."""
    return _patch_lora_layers(
        model, "LoraLayer", "_cast_input_dtype", "_hf_gptoss_rl_autocast_casts", _cast_unless_autocast_undoes_it
    )


def _plain_linear(layer: nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is ``F.linear`` on plain parameters: no hooks to run (FSDP2 sharding it on
    its own, ...), no DTensor or quantized weight."""
    return (
        type(layer) is nn.Linear
        and type(layer.weight) is nn.Parameter
        and (layer.bias is None or type(layer.bias) is nn.Parameter)
        and not (layer._forward_pre_hooks or layer._forward_hooks)
    )


def _fusable_adapter(module, name: str) -> bool:
    lora_b = module.lora_B[name]
    return (
        name not in getattr(module, "lora_variant", {})
        and isinstance(module.lora_dropout[name], nn.Identity)
        and _plain_linear(module.lora_A[name])  # its weight is read directly: no hook (ZeRO-3 gathers there) may wait
        and _plain_linear(lora_b)
        and lora_b.bias is None
        and isinstance(module.scaling[name], (int, float))
        and not getattr(module, "fan_in_fan_out", False)
    )


def _compute_dtype(x: torch.Tensor, *tensors: torch.Tensor | None) -> torch.dtype | None:
    """The dtype the layer's products run in: autocast's (for x of that dtype) or the one all operands share."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return dtype if x.dtype == dtype else None
    return x.dtype if all(t is None or t.dtype == x.dtype for t in tensors) else None


class _FusedLoraLinear(torch.autograd.Function):
    """y = x W^T + bias + scaling * (x A^T) B^T as two products; dx = g W + scaling * (g B) A as one (module
    docstring). Operands are cast to `dtype` up front, so the backward (which autocast does not cover) multiplies
    the same values as the forward; gradients of float32 adapters come back in float32 (autograd casts them)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, dtype):
        with torch.autocast(x.device.type, enabled=False):
            x, weight, lora_a, lora_b = (t.to(dtype) for t in (x, weight, lora_a, lora_b))
            a = torch.mm(x, lora_a.t())
            if bias is None:
                out = torch.addmm(torch.mm(a, lora_b.t()), x, weight.t(), beta=scaling)
            else:
                out = torch.addmm(torch.addmm(bias.to(dtype), a, lora_b.t(), alpha=scaling), x, weight.t())
        ctx.save_for_backward(x, a, weight, lora_a, lora_b)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x, a, weight, lora_a, lora_b = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        grad = grad.to(x.dtype)
        grad_a = torch.mm(grad, lora_b) * ctx.scaling  # [T, r]: dL/da
        dx = dw = dbias = d_lora_a = d_lora_b = None
        if need_x:
            dx = torch.mm(grad, weight).addmm_(grad_a, lora_a)
        if need_w:
            dw = torch.mm(grad.t(), x)
        if need_bias and ctx.has_bias:
            dbias = grad.sum(0)
        if need_a:
            d_lora_a = torch.mm(grad_a.t(), x)
        if need_b:
            d_lora_b = torch.mm(grad.t(), a).mul_(ctx.scaling)
        return dx, dw, dbias, d_lora_a, d_lora_b, None, None


def _fused_lora_forward(module, original, x, *args, **kwargs):
    if args or kwargs or module.disable_adapters or module.merged or not isinstance(x, torch.Tensor):
        return original(x, *args, **kwargs)
    base = module.base_layer
    adapters = [name for name in module.active_adapters if name in module.lora_A]
    if len(adapters) != 1 or not _plain_linear(base) or not _fusable_adapter(module, adapters[0]):
        return original(x, *args, **kwargs)
    name = adapters[0]
    lora_a, lora_b = module.lora_A[name].weight, module.lora_B[name].weight
    dtype = _compute_dtype(x, base.weight, base.bias, lora_a, lora_b)
    if dtype is None:
        return original(x, *args, **kwargs)  # PEFT's dtype promotion (e.g. float32 adapters on a bf16 model)
    module._check_forward_args(x)
    rows = x.reshape(-1, x.shape[-1])
    out = _FusedLoraLinear.apply(rows, base.weight, base.bias, lora_a, lora_b, module.scaling[name], dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def fuse_lora_update(model: nn.Module) -> int:
    """Make the LoRA ``Linear`` layers of ``model`` run as one autograd function of two products where they can
    (see the module docstring); idempotent. Returns the number of LoRA ``Linear`` layers patched (0 without
    ``peft`` or LoRA)."""
    return _patch_lora_layers(model, "Linear", "forward", "_hf_gptoss_rl_fused_update", _fused_lora_forward)
