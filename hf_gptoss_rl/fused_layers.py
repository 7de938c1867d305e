"""Liger-Kernel's fused RMSNorm on GPT-OSS, with GPT-OSS's own rounding.

Unfused, each of GPT-OSS's two RMSNorms per layer is half a dozen elementwise passes over a ``[tokens, 2880]`` fp32
tensor (cast, square, mean, scale, weight, cast back), run three times per checkpointed step (forward, recompute,
backward). Liger-Kernel (``pip install liger-kernel``) does it in one Triton kernel each way.

Why not ``use_liger_kernel=True`` (``liger_kernel.transformers.apply_liger_kernel_to_gpt_oss``)? It installs
``LigerRMSNorm`` with ``casting_mode="llama"``, which rounds the normalised activations to bf16 *before* the weight
multiply. GPT-OSS multiplies by the weight in fp32 and rounds once (``(self.weight * hidden_states).to(dtype)``),
and so do the inference engines that roll out the policy: a systematic rounding difference between training and
rollout is what this project exists to remove. ``casting_mode="gemma"`` with ``offset=0`` is GPT-OSS's math (on an
H200 its logits and gradients match the stock bf16 model's error against fp32 to 3 digits,
``tests/test_fused_layers.py``).

Liger's GPT-OSS RoPE kernel is deliberately not applied: in that same check it made several gradients 2-10x less
accurate than the stock bf16 model (router weights 0.10 vs 0.01 relative error).

:func:`apply_liger_gptoss_rms_norm` replaces every ``GptOssRMSNorm`` module by a
``LigerRMSNorm(casting_mode="gemma", offset=0.0)`` holding the *same* weight ``Parameter`` (optimizer state, PEFT and
state-dict names are unchanged). CUDA only (Liger's kernels do not run on CPU tensors).
"""

from __future__ import annotations

import importlib.util

from torch import nn

__all__ = ["apply_liger_gptoss_rms_norm", "liger_available"]


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def apply_liger_gptoss_rms_norm(model: nn.Module) -> nn.Module:
    """Swap GPT-OSS's RMSNorm modules for Liger's Triton RMSNorm with GPT-OSS's rounding; returns `model`.

    Works on a plain or PEFT-wrapped GPT-OSS model whose parameters live on a CUDA device. Idempotent.
    """
    if not liger_available():
        raise ImportError("apply_liger_gptoss_rms_norm needs liger-kernel: pip install liger-kernel")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cuda"}:
        raise ValueError(f"Liger's Triton kernels run on CUDA tensors only; the model's parameters are on {devices}")
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, GptOssRMSNorm)]
    if not targets and not any(isinstance(m, LigerRMSNorm) for m in model.modules()):
        raise ValueError("no GptOssRMSNorm module found: is this a GPT-OSS model?")
    for name, module in targets:
        # in_place=False: Liger's in-place backward overwrites the incoming gradient buffer
        fused = LigerRMSNorm(
            module.weight.shape[0], eps=module.variance_epsilon, offset=0.0, casting_mode="gemma", in_place=False
        )
        fused.weight = module.weight  # the same Parameter: nothing about the training state changes
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fused)
    return model
