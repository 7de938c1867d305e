"""PEFT LoRA under autocast without the input copies that autocast undoes.

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
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["skip_autocast_undone_lora_casts"]


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


def skip_autocast_undone_lora_casts(model: nn.Module) -> int:
    """Make the LoRA layers of ``model`` skip the input cast that autocast would undo (see the module docstring);
    idempotent. Returns the number of LoRA layers patched (0 when ``peft`` is not installed or the model has no LoRA
    layer)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return 0
    patched = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        if not getattr(module, "_hf_gptoss_rl_autocast_casts", False):
            # an instance attribute shadows the class's method; `original` is the bound stock method
            module._cast_input_dtype = functools.partial(
                _cast_unless_autocast_undoes_it, module, module._cast_input_dtype
            )
            module._hf_gptoss_rl_autocast_casts = True
        patched += 1
    return patched
